"""What building a better SmolLM2 drafter costs on this machine: the target's
forward over a training row (and where a layer's time goes), the target's
batched answers, and the drafter's LM head and loss at one training step's
size.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/cpu_build_costs.py            # needs the recipe's requests.json and rows file

Prints seconds (the medians of ``--repeats`` timed calls after one untimed
one). A training step itself is timed by ``mlx-dflash train`` (its progress
bar); BENCHMARKS.md gives that command.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import batch_generate, load

from dflash_mlx.pair import prepare_target

WORK = Path("~/.cache/dflash_mlx/smollm2").expanduser()


def seconds(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=str(WORK / "rows-1024-s19.npy"), help="the recipe's packed training rows")
    p.add_argument("--requests", default=str(WORK / "requests.json"), help="the recipe's requests")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model, tokenizer = load(str(prepare_target("smollm2")))
    row = mx.array(np.array(np.load(args.rows, mmap_mode="r")[:1]))
    print(f"target forward, one {row.shape[1]}-token row: {seconds(lambda: model(row), args.repeats):.2f} s")

    cfg = model.args
    layer, attn = model.model.layers[0], model.model.layers[0].self_attn
    h = mx.random.normal((1, row.shape[1], cfg.hidden_size))
    scores = mx.random.normal((1, attn.n_heads, row.shape[1], row.shape[1]))
    a, b = mx.random.normal((row.shape[1], cfg.hidden_size)), mx.random.normal((cfg.hidden_size, cfg.intermediate_size))
    flops = 2 * row.shape[1] * cfg.hidden_size * cfg.intermediate_size
    print(f"  one layer: {seconds(lambda: layer(h, mask='causal', cache=None), args.repeats):.3f} s, "
          f"its attention {seconds(lambda: attn(h, mask='causal', cache=None), args.repeats):.3f} s, "
          f"a softmax over its scores {seconds(lambda: mx.softmax(scores, axis=-1), args.repeats):.3f} s, "
          f"matmuls at {flops / seconds(lambda: a @ b, 10) / 1e9:.0f} GFLOP/s")

    requests = json.loads(Path(args.requests).read_text())["train"]
    for batch in (32, 64):
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": r["request"]}], add_generation_prompt=True)
            for r in requests[-batch:]
        ]
        tic = time.perf_counter()
        out = batch_generate(model, tokenizer, prompts, max_tokens=128, return_token_ids=True,
                             completion_batch_size=batch, prefill_batch_size=batch)
        n = sum(len(t) for t in out.token_ids)
        print(f"batch_generate, {batch} training requests x 128 tokens: {n / (time.perf_counter() - tic):.0f} tokens/s")

    # A drafter training step at batch 8, 16 anchors, block 16: 8 x 16 x 15 drafted positions.
    positions, vocab = 8 * 16 * 15, cfg.vocab_size
    hidden, head = mx.random.normal((positions, cfg.hidden_size)), mx.random.normal((vocab, cfg.hidden_size)) * 0.02
    labels = mx.random.randint(0, vocab, (positions,))
    step = mx.value_and_grad(lambda x, w: nn.losses.cross_entropy(x @ w.T, labels).mean(), argnums=(0, 1))
    logits = hidden @ head.T
    print(f"LM head + cross-entropy at {positions} positions, forward and backward: "
          f"{seconds(lambda: step(hidden, head), args.repeats):.2f} s; of which a logsumexp "
          f"{seconds(lambda: mx.logsumexp(logits, axis=-1), args.repeats):.2f} s, the head's matmul "
          f"{seconds(lambda: hidden @ head.T, args.repeats):.2f} s")


if __name__ == "__main__":
    main()
