"""What building a better SmolLM2 drafter costs on this machine, lever by
lever: the target's tap pass over a training row (and where a layer's time
goes), the target's batched answers (and what a decode step's attention over
their KV cache costs), one drafter training step, and what a deeper drafter
costs each verify cycle.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/cpu_build_costs.py                      # before: every lever off
    python examples/cpu_build_costs.py --fast-target --approximate-softmax --draft-vocab 8192 --check 16

The levers: ``--fast-target`` (the data stages' approximate softmax / SiLU,
``dflash_mlx.targets.approximate``, its causal attention in blocks of
``--query-chunk`` queries), ``--batch`` (answers at once),
``--tap-batch`` (rows per tap pass), ``--approximate-softmax`` (the
training step's softmax and logsumexp), ``--draft-vocab`` (the drafter head over
K ids), ``--loss-slots`` / ``--anchors`` (positions the head and loss see),
``--layers`` (``--depths``: the drafter depths whose cycle cost is priced). ``--check N`` compares N greedy answers of the target as the
data stages run it with mlx-lm's exact ones and says how many differ and
where. Rows and requests come from the recipe's run state when it exists,
else random tokens and the recipe's seeded requests (a new machine).

Prints seconds (the medians of ``--repeats`` timed calls after one untimed
one), tokens per second, and the first differing answer positions.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm import batch_generate, load

from dflash_mlx import train as T
from dflash_mlx.models.dflash import DFlashConfig, DFlashDraftModel, default_target_layer_ids, draft_config_for_target
from dflash_mlx.pair import prepare_target
from dflash_mlx.targets import adapter_for
from dflash_mlx.ops import fast_math
from dflash_mlx.targets.approximate import QUERY_CHUNK, ApproxAttention, approximate

WORK = Path("~/.cache/dflash_mlx/smollm2").expanduser()
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TAPS = [1, 8, 14, 20, 27]  # the recipe's
BLOCK = 16


def target_path(args) -> str:
    return args.model or str(prepare_target("smollm2"))


def seconds(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def taps_of(adapter) -> list:
    """The recipe's taps, or a spread of five for a smaller target (``--model``)."""
    return TAPS if adapter.num_layers == 30 else default_target_layer_ids(adapter.num_layers, 5)


def training_rows(args, vocab: int) -> np.ndarray:
    path = Path(args.rows).expanduser()
    if path.exists():
        return np.array(np.load(path, mmap_mode="r")[: args.tap_batch])
    print(f"({path} not found: random tokens)")
    return np.random.default_rng(0).integers(0, vocab, (args.tap_batch, args.seq_len)).astype(np.int32)


def training_requests(args) -> list:
    path = Path(args.requests).expanduser()
    if path.exists():
        return json.loads(path.read_text())["train"]
    sys.path.insert(0, str(RECIPES))
    import smollm2_requests

    return smollm2_requests.requests(0)


def chat_prompts(tokenizer, requests) -> list:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": r["request"]}], add_generation_prompt=True)
        for r in requests
    ]


def answers(model, tokenizer, prompts, batch: int, max_tokens: int) -> list:
    return batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True,
                          completion_batch_size=batch, prefill_batch_size=batch).token_ids  # fmt: skip


def tap_pass(model, args, rows):
    adapter = adapter_for(model)
    tokens = mx.array(rows)
    dt = seconds(lambda: T.target_pass(adapter, tokens, taps_of(adapter))[0], args.repeats)
    labelled = seconds(lambda: T.target_pass(adapter, tokens, taps_of(adapter)), args.repeats)
    print(f"tap pass, {rows.shape[0]} row(s) of {rows.shape[1]} tokens: {dt:.2f} s "
          f"({dt / rows.shape[0]:.2f} s a row, {rows.size / dt:.0f} tokens/s); with the target's greedy "
          f"labels (--no-data-labels) {labelled / rows.shape[0]:.2f} s a row")  # fmt: skip
    cfg, layer, L = model.args, model.model.layers[0], rows.shape[1]
    h = mx.random.normal((1, L, cfg.hidden_size))
    H, D = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    q, k, v = (mx.random.normal((1, n, L, D)) for n in (H, cfg.num_key_value_heads, cfg.num_key_value_heads))
    scores = mx.random.normal((1, H, L, L))
    a, b = mx.random.normal((L, cfg.hidden_size)), mx.random.normal((cfg.hidden_size, cfg.intermediate_size))
    flops = 2 * L * cfg.hidden_size * cfg.intermediate_size
    if isinstance(layer.self_attn, ApproxAttention):
        core, softmax = (lambda: layer.self_attn.cpu_attention(q, k, v, "causal")), fast_math.softmax_approx
    else:
        core = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")  # noqa: E731
        softmax = lambda s: mx.softmax(s, axis=-1)  # noqa: E731
    print(f"  one layer: {seconds(lambda: layer(h, mask='causal', cache=None), args.repeats):.3f} s, "
          f"its attention {seconds(lambda: layer.self_attn(h, mask='causal', cache=None), args.repeats):.3f} s "
          f"(scores to outputs {seconds(core, args.repeats):.3f} s; the softmax it uses, over all {H}x{L}x{L} "
          f"scores, {seconds(lambda: softmax(scores), args.repeats):.3f} s), MLP {seconds(lambda: layer.mlp(h), args.repeats):.3f} s, "
          f"matmuls at {flops / seconds(lambda: a @ b, 10) / 1e9:.0f} GFLOP/s")  # fmt: skip


def distillation(model, tokenizer, args, prompts):
    for batch in args.batch:
        tic = time.perf_counter()
        out = answers(model, tokenizer, prompts[-batch:], batch, args.answer_tokens)
        n = sum(len(t) for t in out)
        print(f"batch_generate, {batch} training requests x {args.answer_tokens} tokens: "
              f"{n / (time.perf_counter() - tic):.0f} answer tokens/s")  # fmt: skip
        decode_attention(model, batch, args.repeats)


def decode_attention(model, batch: int, repeats: int):
    """What a decode step's attention costs at ``batch`` answers over
    contexts of 128-768 positions: each step reads every layer's whole
    float32 KV cache, so its rate in GB/s and the answer tokens/s it
    allows (attention alone) follow the memory system, not the arithmetic."""
    cfg = model.args
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    q = mx.random.normal((batch, H, 1, D))
    for context in (128, 256, 512, 768):
        k, v = mx.random.normal((batch, Hkv, context, D)), mx.random.normal((batch, Hkv, context, D))
        dt = seconds(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5), max(repeats, 10))
        step = dt * cfg.num_hidden_layers
        print(f"  decode attention, batch {batch}, {context} positions: {dt * 1e3:.2f} ms a layer, its KV cache read at "
              f"{(k.nbytes + v.nbytes) / dt / 1e9:.1f} GB/s; {step * 1e3:.0f} ms a step, at most {batch / step:.0f} "
              f"answer tokens/s from attention alone")  # fmt: skip


def drafter_depths(model, args, prompts):
    """A deeper drafter's cost in the loop: its forward (one block, over the
    context of a few chat prompts, about 300 positions) at each of
    ``--depths`` layers, plus a 16-row verify (the median of the verifies
    timed beside them), and the tokens per cycle each depth must commit,
    as a multiple of ``--layers``' own, to be as fast at block 16."""
    from dflash_mlx.benchmark import time_forwards

    adapter, context = adapter_for(model), []
    for prompt in prompts:
        context += prompt
        if len(context) >= 300:
            break
    drafting, verify = {}, []
    for layers in sorted({*args.depths, args.layers}):
        cfg = draft_config_for_target(adapter.args, num_layers=layers, block_size=BLOCK, target_layer_ids=taps_of(adapter),
                                      mask_token_id=0)  # fmt: skip
        draft = DFlashDraftModel(DFlashConfig.from_hf(cfg))
        draft.bind(model)
        ms = time_forwards(model, draft, mx.array(context), BLOCK, repeats=max(args.repeats, 10))
        drafting[layers] = ms["drafter"]
        verify.append(ms[f"target_{BLOCK}"])
    verify = statistics.median(verify)
    for layers, ms in drafting.items():
        print(f"drafter of {layers} layers over {len(context)} positions: {ms:.1f} ms a block; a cycle at block {BLOCK} "
              f"(with a {verify:.1f} ms verify) {ms + verify:.1f} ms: it must commit "
              f"{(ms + verify) / (drafting[args.layers] + verify):.2f}x the tokens per cycle of {args.layers} layers")  # fmt: skip


def check_answers(model, tokenizer, args, prompts):
    """How many of the data stages' greedy answers differ from mlx-lm's, and where."""
    exact, _ = load(target_path(args))
    prompts = prompts[: args.check]
    fast = answers(model, tokenizer, prompts, len(prompts), args.answer_tokens)
    ref = answers(exact, tokenizer, prompts, len(prompts), args.answer_tokens)
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
             for a, b in zip(fast, ref)]  # fmt: skip
    differ = [f for f in first if f is not None]
    print(f"greedy answers as the data stages make them against mlx-lm's: {len(differ)} of {len(prompts)} differ"
          + (f", first at answer positions {sorted(differ)}" if differ else ""))  # fmt: skip


def training_step(model, args):
    """One drafter step at the recipe's shapes (taps cached): forward, loss,
    backward and the AdamW update, with random taps and anchors."""
    adapter = adapter_for(model)
    vocab = adapter.vocab_size
    cfg = draft_config_for_target(adapter.args, num_layers=args.layers, block_size=BLOCK, target_layer_ids=taps_of(adapter),
                                  mask_token_id=0)  # fmt: skip
    if args.draft_vocab:
        cfg["dflash_config"]["draft_vocab"] = list(range(args.draft_vocab))  # which ids does not change the cost
    draft = DFlashDraftModel(DFlashConfig.from_hf(cfg))
    draft.bind(model)
    rng = np.random.default_rng(0)
    b, S, n = args.train_batch, args.seq_len, args.anchors
    tokens = mx.array(rng.integers(0, vocab, (b, S)), mx.int32)
    taps = mx.random.normal((b, S, len(taps_of(adapter)) * adapter.hidden_size))
    anchors = mx.array(np.sort(np.stack([rng.choice(S - BLOCK, n, replace=False) + 1 for _ in range(b)])), mx.int32)
    slots = args.loss_slots or BLOCK - 1
    weights = T.slot_weights(BLOCK, BLOCK / 2)[:slots]
    blocks, positions = T.make_blocks(tokens, anchors, BLOCK, 0)
    labels = T.slot_labels(tokens, None, anchors, BLOCK)[..., :slots]
    labels = T.draft_labels(labels, cfg["dflash_config"].get("draft_vocab"), vocab)
    mask = T.context_mask(anchors, S)
    optimizer = optim.AdamW(learning_rate=1e-4)
    value_and_grad = nn.value_and_grad(draft, T.drafter_loss)

    def step():
        (loss, _), grads = value_and_grad(draft, adapter.embed, taps, blocks, positions, mask, labels, weights,
                                          args.approximate_softmax)  # fmt: skip
        optimizer.update(draft, grads)
        return loss, draft.parameters(), optimizer.state

    print(f"drafter training step, batch {b}, {n} anchors a row, {slots} loss slots, "
          f"{args.draft_vocab or vocab} head ids, {args.layers} layers, "
          f"{'approximate' if args.approximate_softmax else 'exact'} softmax: {seconds(step, args.repeats):.2f} s")  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target directory (default: the smollm2 pair's)")
    p.add_argument("--rows", default=str(WORK / "rows-1024-s19.npy"), help="the recipe's packed training rows")
    p.add_argument("--requests", default=str(WORK / "requests.json"), help="the recipe's requests")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=1024, help="row length where no rows file exists")
    p.add_argument("--fast-target", action="store_true", help="the data stages' approximate target")
    p.add_argument("--query-chunk", type=int, default=QUERY_CHUNK,
                   help="with --fast-target: queries per block of causal attention (0: the whole square)")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64], help="requests answered at once")
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--tap-batch", type=int, default=1, help="rows per tap pass")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--loss-slots", type=int, default=None)
    p.add_argument("--draft-vocab", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--approximate-softmax", action="store_true", help="the training step's approximate softmax / logsumexp")
    p.add_argument("--check", type=int, default=0, help="compare N greedy answers with mlx-lm's exact ones")
    p.add_argument("--depths", type=int, nargs="+", default=[2, 3, 4, 5], help="drafter layers the depth stage prices")
    p.add_argument("--only", nargs="+", choices=("taps", "distill", "train", "depth"),
                   default=("taps", "distill", "train", "depth"))
    args = p.parse_args()
    model, tokenizer = load(target_path(args))
    if args.fast_target:
        approximate(model, query_chunk=args.query_chunk)
    print(f"levers: {json.dumps({k: v for k, v in vars(args).items() if k not in ('rows', 'requests')})}")
    prompts = chat_prompts(tokenizer, training_requests(args)[-max(args.batch + [args.check]):])
    if "taps" in args.only:
        tap_pass(model, args, training_rows(args, adapter_for(model).vocab_size))
    if "distill" in args.only:
        distillation(model, tokenizer, args, prompts)
    if args.check:
        check_answers(model, tokenizer, args, prompts)
    if "train" in args.only:
        training_step(model, args)
    if "depth" in args.only:
        drafter_depths(model, args, prompts)


if __name__ == "__main__":
    main()
