"""Never slower, pipelined: DFlash (adaptive, and the fixed trained block)
against mlx-lm's greedy decode of the same target slices, the decoders
alternating, medians over ``--repeats`` rounds.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1
    python examples/pipeline_never_slower.py                                  # one process
    mlx.launch --backend ring -n 2 --env OPENBLAS_NUM_THREADS=1 --env LD_PRELOAD=$LD_PRELOAD \\
        --python "$(which python)" examples/pipeline_never_slower.py          # two ranks

Two pairs: a tiny random qwen3_5 target with a random drafter that never
agrees (``never_slower.py``'s, its first seed that writes all
``--random-tokens``), and the bundled pair at ``--bench-tokens`` on its first
``--prompts`` prompts. Pipelined, every rank takes rank 0's timings, so the
adaptive loop chooses alike on every rank. Rank 0 prints JSON: tok/s per
decoder, DFlash's ratios to mlx-lm, and whether every run gave mlx-lm's
tokens.
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import mlx.core as mx
from never_slower import alternate, full_length_pair

from dflash_mlx.benchmark import compile_block_lengths, run_autoregressive, run_dflash
from dflash_mlx.generate import encode_prompt
from dflash_mlx.pair import DEFAULT_DRAFT, DEFAULT_TARGET, default_prompts, load_pair
from dflash_mlx.pipeline import load_pipelined_pair


def load(target, draft_dir, group):
    """This process's (slice of the) target, its tokenizer and the drafter,
    its graphs compiled at the trained block."""
    if group.size() > 1:
        model, tokenizer, draft = load_pipelined_pair(str(target), str(draft_dir), group)
    else:
        model, tokenizer, draft, _ = load_pair(str(target), str(draft_dir))
    compile_block_lengths(draft, encode_prompt(tokenizer, default_prompts()[0]), draft.block_size)
    return model, tokenizer, draft


def runners(model, tokenizer, draft, prompt, max_tokens):
    """mlx-lm, DFlash adaptive and DFlash at the fixed trained block."""
    return {
        "mlx_lm": lambda: run_autoregressive(model, tokenizer, prompt, max_tokens),
        "adaptive": lambda: run_dflash(model, draft, tokenizer, prompt, max_tokens, None),
        "fixed": lambda: run_dflash(model, draft, tokenizer, prompt, max_tokens, draft.block_size),
    }


def summary(results):
    """Medians over prompts of each decoder's tok/s, and the ratios to mlx-lm."""
    out = {k: statistics.median(r[k] for r in results) for k in results[0] if k.endswith("_tps")}
    out["identical"] = all(r["identical"] for r in results)
    for name in ("adaptive", "fixed"):
        out[f"{name}_vs_mlx_lm"] = out[f"{name}_tps"] / out["mlx_lm_tps"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per prompt")
    p.add_argument("--random-tokens", type=int, default=256, help="new tokens, the never-agreeing pair")
    p.add_argument("--bench-tokens", type=int, default=128, help="new tokens, the bundled pair")
    p.add_argument("--prompts", type=int, default=4, help="bundled prompts")
    args = p.parse_args()
    group = mx.distributed.init()
    report = {"ranks": group.size()}
    with tempfile.TemporaryDirectory() as tmp:  # each rank writes its own copy (seeded, so the same)
        prompt = default_prompts()[0]
        target, draft, seed = full_length_pair(Path(tmp), "qwen3_5", prompt, args.random_tokens)
        pair = load(target, draft, group)
        result = alternate(runners(*pair, prompt, args.random_tokens), args.repeats)
        report["never_agreeing"] = {"seed": seed, **summary([result])}
    pair = load(DEFAULT_TARGET, DEFAULT_DRAFT, group)
    prompts = default_prompts()[: args.prompts]
    bench = [alternate(runners(*pair, prompt, args.bench_tokens), args.repeats) for prompt in prompts]
    report["bundled"] = summary(bench)
    if group.rank() == 0:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
