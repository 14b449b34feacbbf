"""The loop's plain step against mlx-lm's own decode: ``block_size=1`` (no
draft, the target's forward and the sampler each cycle) and mlx-lm's greedy
``stream_generate`` on the same target, alternating in one process, medians
over ``--repeats`` rounds, every run's tokens checked against mlx-lm's.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/plain_step.py --json plain_step.json
    python examples/plain_step.py --pairs default --max-tokens 32 --repeats 1   # a quick check

Pairs: ``default`` (the bundled pair), ``smollm2`` (prepared on first use),
and tiny random ``qwen3`` and ``llama`` targets (written by
:mod:`dflash_mlx.random_pair`, the first seed whose target writes every
token before an eos).
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import dflash_mlx
from dflash_mlx.benchmark import compile_block_lengths, run_autoregressive, run_dflash
from dflash_mlx.generate import build_prompt, encode_prompt
from dflash_mlx.defaults import DEFAULT_TARGET
from dflash_mlx.pair import default_prompt, load_pair
from dflash_mlx.random_pair import write_random_pair

RANDOM_PROMPT = "def f(x):"


def random_pair(directory: Path, family: str, max_tokens: int):
    """(model, draft, tokenizer) of the first seed whose random target writes
    all ``max_tokens`` tokens before an eos."""
    for seed in range(16):
        target, draft = write_random_pair(directory / f"{family}{seed}", family, seed=seed)
        model, tokenizer = dflash_mlx.load(str(target))
        if len(run_autoregressive(model, tokenizer, RANDOM_PROMPT, max_tokens)["tokens"]) == max_tokens:
            return model, dflash_mlx.load_draft(str(draft), model), tokenizer
    raise SystemExit(f"no {family} seed writes {max_tokens} tokens before an eos")


def measure(model, draft, tokenizer, prompt, max_tokens: int, repeats: int) -> dict:
    """One untimed run of each, then ``repeats`` rounds of mlx-lm and the
    plain step in turn: their median tok/s and whether every plain run gave
    mlx-lm's tokens."""
    compile_block_lengths(draft, encode_prompt(tokenizer, prompt), 1)
    reference = run_autoregressive(model, tokenizer, prompt, max_tokens)["tokens"]
    identical = run_dflash(model, draft, tokenizer, prompt, max_tokens, 1)["tokens"] == reference
    ar, plain = [], []
    for _ in range(repeats):
        ar.append(run_autoregressive(model, tokenizer, prompt, max_tokens)["tps"])
        r = run_dflash(model, draft, tokenizer, prompt, max_tokens, 1)
        plain.append(r["tps"])
        identical &= r["tokens"] == reference
    ar_tps, plain_tps = statistics.median(ar), statistics.median(plain)
    return {"mlx_lm_tps": ar_tps, "plain_tps": plain_tps, "ratio": plain_tps / ar_tps,
            "identical": identical, "tokens": len(reference)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", nargs="+", default=["default", "smollm2", "qwen3", "llama"])
    p.add_argument("--max-tokens", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.pairs:
            for max_tokens in args.max_tokens:
                if name in ("qwen3", "llama"):
                    model, draft, tokenizer = random_pair(Path(tmp), name, max_tokens)
                    prompt = RANDOM_PROMPT
                else:
                    named = None if name == "default" else name
                    model, tokenizer, draft, _ = load_pair(named or DEFAULT_TARGET)
                    prompt = build_prompt(tokenizer, default_prompt(named))
                r = measure(model, draft, tokenizer, prompt, max_tokens, args.repeats)
                results[f"{name}@{max_tokens}"] = r
                print(f"{name:8s} {max_tokens:5d} tokens: mlx-lm {r['mlx_lm_tps']:7.1f} tok/s, plain step "
                      f"{r['plain_tps']:7.1f} tok/s, {r['ratio']:.2f}x, identical: {r['identical']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
