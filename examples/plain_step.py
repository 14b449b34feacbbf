"""The loop's plain step against mlx-lm's own decode: ``block_size=1`` (no
draft, the target's forward and the sampler each cycle) and mlx-lm's greedy
``stream_generate`` on the same target, alternating in one process over
``--repeats`` rounds, every run's tokens checked against mlx-lm's. Reported:
medians, best against best (``best_ratio``) and the median of each round's
own ratio (``paired_ratio``): a millisecond step on a shared machine moves
by tens of percent from run to run, so one run's ratio says little.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/plain_step.py --json plain_step.json
    python examples/plain_step.py --pairs default --max-tokens 32 --repeats 1   # a quick check
    python examples/plain_step.py --switching                # what a switch costs
    python examples/plain_step.py --lockstep 32              # both decoders in turns of 32 tokens

Pairs: ``default`` (the bundled pair), ``smollm2`` (prepared on first use;
``--slow-repeats`` rounds, it decodes slowly on a CPU), and tiny random
``qwen3``, ``llama`` and ``qwen3_5`` targets (written by
:mod:`dflash_mlx.random_pair`, the first seed whose target writes every
token before an eos).

``--switching`` measures instead what a switch between drafting and plain
cycles costs on the bundled pair: a scripted sizer alternates runs of
``--run`` drafting cycles (the trained block) and as many plain steps; each
cycle's seconds (the loop's own timing, from one host read to the next)
give each kind's steady cost and what a whole run costs beyond as many
steady cycles (:func:`switching`).
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from never_slower import alternate, compare

import dflash_mlx
from dflash_mlx.adaptive import BlockSizer
from dflash_mlx.benchmark import compile_block_lengths, dflash_tokens, lockstep, mlx_lm_tokens, run_autoregressive, run_dflash
from dflash_mlx.generate import build_prompt, encode_prompt
from dflash_mlx.defaults import DEFAULT_TARGET
from dflash_mlx.pair import default_prompt, load_pair
from dflash_mlx.random_pair import FAMILIES, write_random_pair

RANDOM_PROMPT = "def f(x):"
WARM_TOKENS = 256


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
    """An untimed run of each (of ``WARM_TOKENS`` at most: SmolLM2's
    2,048 take minutes), then ``repeats`` rounds of mlx-lm and the plain
    step in turn (:func:`never_slower.alternate`)."""
    compile_block_lengths(draft, encode_prompt(tokenizer, prompt), 1)
    runners = {
        "mlx_lm": lambda: run_autoregressive(model, tokenizer, prompt, max_tokens),
        "plain": lambda: run_dflash(model, draft, tokenizer, prompt, max_tokens, 1),
    }
    warm = min(max_tokens, WARM_TOKENS)

    def warm_up():
        run_autoregressive(model, tokenizer, prompt, warm)
        run_dflash(model, draft, tokenizer, prompt, warm, 1)

    out = alternate(runners, repeats, warm_up)
    out["ratio"] = out["plain_tps"] / out["mlx_lm_tps"]
    return out


def plain_lockstep(model, draft, tokenizer, prompt, max_tokens: int, chunk: int, repeats: int, warm_s: float = 0) -> dict:
    """mlx-lm's decode and the plain step in
    :func:`~dflash_mlx.benchmark.lockstep` turns of ``chunk`` tokens,
    ``repeats`` generations each, after untimed ones for ``warm_s`` seconds
    at least (the first row a process times reads low without them:
    BENCHMARKS.md, "The plain step against mlx-lm's decode")."""
    compile_block_lengths(draft, encode_prompt(tokenizer, prompt), 1)
    streams = {
        "mlx_lm": lambda: mlx_lm_tokens(model, tokenizer, prompt, max_tokens),
        "plain": lambda: dflash_tokens(model, draft, tokenizer, prompt, max_tokens, block_size=1),
    }
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        lockstep(streams, max_tokens, chunk, repeats=0)
    out = {**compare(lockstep(streams, max_tokens, chunk, repeats)), "chunk": chunk}
    out["ratio"] = out["plain_tps"] / out["mlx_lm_tps"]
    return out


class Alternating(BlockSizer):
    """A block sizer (see :class:`dflash_mlx.adaptive.BlockSizer`) that
    alternates ``run`` cycles at ``block`` and ``run`` plain steps, and
    keeps each cycle's seconds."""

    def __init__(self, block: int, run: int):
        super().__init__(block, None, fixed=True)
        self.block, self.run = block, run
        self.count = 0
        self.cycles = []  # (block, seconds)

    def choose(self, remaining):
        choice = self.block if (self.count // self.run) % 2 == 0 else 1
        self.count += 1
        return min(choice, remaining)

    def observe(self, block, accepted, seconds, walk=None, context=None, **rows):
        self.cycles.append((block, seconds))


def runs_of(cycles):
    """``cycles`` cut into runs of one kind: [(plain?, [seconds, ...]), ...]."""
    out = []
    for block, seconds in cycles:
        plain = block == 1
        if out and out[-1][0] == plain:
            out[-1][1].append(seconds)
        else:
            out.append((plain, [seconds]))
    return out


def switching(repeats: int, max_tokens: int, run: int, model_path=DEFAULT_TARGET) -> dict:
    """What a switch costs on a pair (the bundled one, or a pair name such as
    ``smollm2``, on its first held-out prompt), pooled over ``repeats``
    generations after an untimed one. A run's first and last cycles carry
    the switch (a plain step queues the next one before its host read, so
    a run's first plain step also waits for its second and its last one
    for nothing): the steady cost of a kind is the median of the cycles
    inside its runs, and a run's extra is its seconds less as many steady
    cycles. Medians in ms, runs of each kind counted."""
    model, tokenizer, draft, _ = load_pair(model_path)
    prompt = build_prompt(tokenizer, default_prompt(model_path))
    compile_block_lengths(draft, encode_prompt(tokenizer, prompt), draft.block_size)
    runs = []
    for i in range(repeats + 1):
        sizer = Alternating(draft.block_size, run)
        for _ in dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens, sizer=sizer):
            pass
        if i:
            runs += runs_of(sizer.cycles)[1:-1]  # whole runs only
    out = {}
    for plain, kind in ((True, "plain"), (False, "draft")):
        mine = [seconds for p, seconds in runs if p == plain and len(seconds) > 2]
        steady = statistics.median(x for seconds in mine for x in seconds[1:-1])
        out[f"{kind}_steady_ms"] = 1e3 * steady
        out[f"{kind}_first_ms"] = 1e3 * statistics.median(seconds[0] for seconds in mine)
        out[f"{kind}_run_extra_ms"] = 1e3 * statistics.median(sum(seconds) - len(seconds) * steady for seconds in mine)
        out[f"{kind}_runs"] = len(mine)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", nargs="+", default=["default", "smollm2", "qwen3", "llama", "qwen3_5"])
    p.add_argument("--max-tokens", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--repeats", type=int, default=8, help="timed rounds (the bundled pair and tiny targets)")
    p.add_argument("--slow-repeats", type=int, default=2, help="timed rounds for smollm2")
    p.add_argument("--switching", action="store_true", help="measure what a switch between drafting and plain cycles costs")
    p.add_argument("--run", type=int, default=8, help="with --switching: cycles of each kind in a row")
    p.add_argument("--lockstep", type=int, default=0, metavar="CHUNK",
                   help="advance the two decoders in turns of CHUNK tokens within one generation each (see lockstep)")
    p.add_argument("--warm-seconds", type=float, default=30,
                   help="with --lockstep: untimed generations before the first row, for at least this long")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.switching:
        results = switching(args.repeats, args.max_tokens[0], args.run)
        for kind in ("plain", "draft"):
            print(f"{kind} cycles: steady {results[f'{kind}_steady_ms']:.2f} ms, first of a run "
                  f"{results[f'{kind}_first_ms']:.2f} ms; a run costs {results[f'{kind}_run_extra_ms']:+.2f} ms "
                  f"more than as many steady cycles (median of {results[f'{kind}_runs']} runs)")
    else:
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.pairs:
                for max_tokens in args.max_tokens:
                    if name in FAMILIES:
                        model, draft, tokenizer = random_pair(Path(tmp), name, max_tokens)
                        prompt = RANDOM_PROMPT
                    else:
                        named = None if name == "default" else name
                        model, tokenizer, draft, _ = load_pair(named or DEFAULT_TARGET)
                        prompt = build_prompt(tokenizer, default_prompt(named))
                    repeats = args.slow_repeats if name == "smollm2" else args.repeats
                    if args.lockstep:
                        warm_s = 0 if results else args.warm_seconds
                        r = plain_lockstep(model, draft, tokenizer, prompt, max_tokens, args.lockstep, repeats, warm_s)
                        results[f"{name}@{max_tokens}"] = r
                        print(f"{name:8s} {max_tokens:5d} tokens, {repeats} lockstep generations: mlx-lm "
                              f"{r['mlx_lm_tps']:7.1f} tok/s, plain step {r['plain_tps']:7.1f} tok/s (medians); "
                              f"paired {r['plain_paired_ratio']:.2f}x; identical: {r['identical']}", flush=True)
                        continue
                    r = measure(model, draft, tokenizer, prompt, max_tokens, repeats)
                    results[f"{name}@{max_tokens}"] = r
                    print(f"{name:8s} {max_tokens:5d} tokens, {repeats} rounds: mlx-lm {r['mlx_lm_tps']:7.1f} tok/s, "
                          f"plain step {r['plain_tps']:7.1f} tok/s (medians); best {r['plain_best_ratio']:.2f}x, "
                          f"paired {r['plain_paired_ratio']:.2f}x; identical: {r['identical']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
