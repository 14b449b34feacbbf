"""Never slower than plain decoding: DFlash with its adaptive block size
against mlx-lm's greedy decode and against z-lab's reference MLX runtime, all
in one process, the decoders alternating over ``--repeats`` rounds: medians,
best against best, and the median of each round's own ratio (a millisecond
step on a shared machine moves by tens of percent from run to run, so one
run's ratio says little). With ``--lockstep CHUNK`` each round is instead one
generation of each decoder at a time, advanced in turns of CHUNK tokens
(:func:`dflash_mlx.benchmark.lockstep`), so that a slow spell of the machine
falls on all alike.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/never_slower.py --json never_slower.json
    python examples/never_slower.py --lockstep 32 --json never_slower.json   # decoders in turns of 32 tokens
    python examples/never_slower.py --repeats 1 --random-repeats 1 --random-tokens 32 \\
        --long-tokens 64 --num-prompts 2 --bench-tokens 16     # a quick end-to-end check

Scenarios, each with the bar it is held to:

1. ``never_agreeing``: tiny random qwen3 and qwen3_5 targets, each with a
   random drafter (written by :mod:`dflash_mlx.random_pair`, the first seed
   whose target writes all 256 new tokens before an eos): DFlash >= 0.95x
   mlx-lm.
2. ``long``: the bundled pair at 2048 new tokens on ``--long-prompts``
   prompts (:data:`WALK_PROMPT`, where the drafter's acceptance falls off
   after its first hundred cycles, then the held-out prompts): >= 0.95x
   mlx-lm on each.
3. ``bench``: the bundled pair at 128 new tokens on its held-out prompts
   (``mlx-dflash bench``): the adaptive speedup within 3% of the fixed
   trained block's, and >= 0.85 of the ideal.
4. ``zlab``: against z-lab's ``dflash`` 0.1.0 (``dflash.model_mlx.stream_generate``)
   on the never-agreeing qwen3 pair (>= 1.0x) and the bundled pair (>= 1.1x).
   On the bundled pair (a hybrid target) always in whole runs: z-lab's
   runtime records the inputs of every GatedDeltaNet layer that runs while
   its generation is under way, other targets' included, so it cannot take
   turns with another generation there.

z-lab's runtime is a pure-Python wheel, imported from its own directory and
never a dependency of this package::

    pip download --no-deps dflash==0.1.0
    pip install --no-deps --target ~/.cache/dflash_mlx/zlab dflash-0.1.0-py3-none-any.whl

It patches the target instance it is given, so it gets its own copy of each
target. Its drafter loader fetches through ``snapshot_download``; here that
name in its module is pointed at the local directory, so it loads offline.
Without the directory the scenario is skipped and says so. Greedy throughout;
every run's tokens are checked against mlx-lm's.
"""

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

import dflash_mlx
from dflash_mlx.benchmark import (
    benchmark, compile_block_lengths, dflash_tokens, lockstep, mlx_lm_tokens, run_autoregressive, run_dflash,
)
from dflash_mlx.generate import encode_prompt
from dflash_mlx.pair import DEFAULT_DRAFT, DEFAULT_TARGET, default_prompts
from dflash_mlx.random_pair import write_random_pair

ZLAB_DIR = Path.home() / ".cache" / "dflash_mlx" / "zlab"
# A long generation's first prompt: the bundled drafter commits about 4
# tokens per cycle for its first hundred cycles, then about 2.
WALK_PROMPT = "import os\n\ndef walk(path):\n"


def alternate(runners: Dict[str, Callable[[], dict]], repeats: int, warm_up: Optional[Callable[[], None]] = None) -> dict:
    """One untimed run of each (or ``warm_up``, where a whole run is too
    long to spend on warming), then ``repeats`` rounds of each in turn, the
    order rotating by one each round (a run right after mlx-lm's is slower
    on the CPU backend, BENCHMARKS.md "The bench's order", so no runner
    always takes that place); :func:`compare` of the runs."""
    if warm_up is None:
        for run in runners.values():
            run()
    else:
        warm_up()
    runs = {name: [] for name in runners}
    names = list(runners)
    for i in range(repeats):
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:
            runs[name].append(runners[name]())
    return compare(runs)


def compare(runs: Dict[str, List[dict]]) -> dict:
    """Decoders' runs (each with ``tps`` and ``tokens``; a round of each, in
    :func:`alternate` or :func:`~dflash_mlx.benchmark.lockstep`): per
    decoder its median and best tok/s (``NAME_tps``, ``NAME_best_tps``),
    and for each decoder after the first its ratio to the first both ways a
    noisy machine allows: best against best (``NAME_best_ratio``) and the
    median of the rounds' own ratios (``NAME_paired_ratio``: the two ran
    side by side, so a slow spell of the machine slows both); whether every
    run gave the first decoder's tokens, how many it gave, and the rounds."""
    first, *others = runs
    reference = runs[first][0]["tokens"]
    tps = {name: [r["tps"] for r in v] for name, v in runs.items()}
    out = {f"{name}_tps": statistics.median(v) for name, v in tps.items()}
    out.update({f"{name}_best_tps": max(v) for name, v in tps.items()})
    for name in others:
        out[f"{name}_best_ratio"] = max(tps[name]) / max(tps[first])
        out[f"{name}_paired_ratio"] = statistics.median(x / y for x, y in zip(tps[name], tps[first]))
    out["identical"] = all(r["tokens"] == reference for v in runs.values() for r in v)
    out["tokens"] = len(reference)
    out["rounds"] = len(tps[first])
    return out


def full_length_pair(directory: Path, family: str, prompt, max_tokens: int):
    """A random pair of ``family`` whose target writes all ``max_tokens``
    tokens before an eos (the first seed that does), so that the scenario
    measures that many tokens of decoding. Returns (target, drafter, seed)."""
    for seed in range(16):
        target, draft = write_random_pair(directory / f"seed{seed}", family, seed=seed)
        model, tokenizer = dflash_mlx.load(str(target))
        if len(run_autoregressive(model, tokenizer, prompt, max_tokens)["tokens"]) == max_tokens:
            return target, draft, seed
    raise SystemExit(f"error: no random {family} target among seeds 0-15 writes {max_tokens} tokens")


def load_zlab(zlab_dir: Path):
    """z-lab's MLX runtime module, loading drafters from local directories."""
    sys.path.insert(0, str(zlab_dir))
    from dflash import model_mlx

    model_mlx.snapshot_download = lambda repo_id, **_: repo_id  # a local dir: no download
    return model_mlx


def zlab_decoder(zlab, target_path: Path, draft_path: Path, prompt, max_tokens: int):
    """z-lab's stream_generate on its own target instance: a runner for
    :func:`alternate` and a token stream for :func:`~dflash_mlx.benchmark.lockstep`."""
    model, tokenizer = zlab.load(str(target_path))
    draft = zlab.load_draft(str(draft_path))

    def tokens(responses=None):
        for r in zlab.stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens):
            if responses is not None:
                responses.append(r)
            yield from (t for t in r.tokens if t not in tokenizer.eos_token_ids)

    def run():
        responses = []
        out = list(tokens(responses))
        return {"tokens": out[:max_tokens], "tps": responses[-1].generation_tps}

    return run, lambda: itertools.islice(tokens(), max_tokens)


def measure_pair(target_path: Path, draft_path: Path, prompt, max_tokens: int, repeats: int, chunk: int = 0, zlab=None) -> dict:
    """mlx-lm, DFlash (adaptive) and, given z-lab's module, z-lab's runtime
    on one prompt, in :func:`~dflash_mlx.benchmark.lockstep` turns of ``chunk`` tokens, or
    (``chunk`` 0) in whole runs in turn (:func:`alternate`); with DFlash's
    :func:`ratios`."""
    model, tokenizer = dflash_mlx.load(str(target_path))
    draft = dflash_mlx.load_draft(str(draft_path), model)
    # each block length's graphs compile once per process: not decoding speed
    compile_block_lengths(draft, encode_prompt(tokenizer, prompt), draft.block_size)
    if chunk:
        decoders = {
            "mlx_lm": lambda: mlx_lm_tokens(model, tokenizer, prompt, max_tokens),
            "dflash": lambda: dflash_tokens(model, draft, tokenizer, prompt, max_tokens),
        }
    else:
        decoders = {
            "mlx_lm": lambda: run_autoregressive(model, tokenizer, prompt, max_tokens),
            "dflash": lambda: run_dflash(model, draft, tokenizer, prompt, max_tokens, None),
        }
    if zlab is not None:
        run, stream = zlab_decoder(zlab, target_path, draft_path, prompt, max_tokens)
        decoders["zlab"] = stream if chunk else run
    if not chunk:
        return ratios(alternate(decoders, repeats))
    return ratios({**compare(lockstep(decoders, max_tokens, chunk, repeats)), "chunk": chunk})


def ratios(result: dict) -> dict:
    """DFlash's ratios: of the medians (``vs_mlx_lm``, ``vs_zlab``), best
    against best and paired (see :func:`alternate`)."""
    result["vs_mlx_lm"] = result["dflash_tps"] / result["mlx_lm_tps"]
    result["vs_mlx_lm_best"] = result["dflash_best_ratio"]
    result["vs_mlx_lm_paired"] = result["dflash_paired_ratio"]
    if "zlab_tps" in result:
        result["vs_zlab"] = result["dflash_tps"] / result["zlab_tps"]
        result["vs_zlab_best"] = result["dflash_best_tps"] / result["zlab_best_tps"]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, bundled pair and bench")
    p.add_argument("--random-repeats", type=int, default=16, help="timed rounds, never-agreeing pairs (cheap, and their steps are short enough for the machine's noise to swamp a few rounds)")
    p.add_argument("--random-tokens", type=int, default=256, help="new tokens, never-agreeing pairs")
    p.add_argument("--long-tokens", type=int, default=2048, help="new tokens, the bundled pair's long runs")
    p.add_argument("--long-prompts", type=int, default=3, help="prompts of the long runs: WALK_PROMPT, then held-out ones")
    p.add_argument("--bench-tokens", type=int, default=128, help="new tokens, the bundled pair's bench")
    p.add_argument("--num-prompts", type=int, default=None, help="bench prompts (default: all)")
    p.add_argument("--lockstep", type=int, default=0, metavar="CHUNK",
                   help="decoders compared one generation each at a time, in turns of CHUNK tokens (see lockstep); "
                        "0: whole runs in turn")
    p.add_argument("--zlab-dir", type=Path, default=ZLAB_DIR, help="where z-lab's dflash 0.1.0 is installed")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    zlab = load_zlab(args.zlab_dir) if (args.zlab_dir / "dflash" / "model_mlx.py").exists() else None
    prompt = default_prompts()[0]
    results = {"never_agreeing": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("qwen3", "qwen3_5"):
            target, draft, seed = full_length_pair(Path(tmp), family, prompt, args.random_tokens)
            with_zlab = zlab if family == "qwen3" else None
            result = measure_pair(target, draft, prompt, args.random_tokens, args.random_repeats, args.lockstep, with_zlab)
            results["never_agreeing"][family] = {"seed": seed, **result}
            print(family, "never agreeing:", json.dumps(results["never_agreeing"][family]), flush=True)
    results["long"] = []
    for long_prompt in ([WALK_PROMPT] + default_prompts())[: args.long_prompts]:
        result = measure_pair(DEFAULT_TARGET, DEFAULT_DRAFT, long_prompt, args.long_tokens, args.repeats, args.lockstep)
        results["long"].append({"prompt": long_prompt[:40], **result})
        print("bundled pair, long:", json.dumps(results["long"][-1]), flush=True)
    if zlab is not None:
        results["zlab_bundled"] = measure_pair(DEFAULT_TARGET, DEFAULT_DRAFT, prompt, args.bench_tokens, args.repeats, 0, zlab)
        print("bundled pair vs z-lab:", json.dumps(results["zlab_bundled"]), flush=True)
    else:
        results["zlab_skipped"] = f"z-lab's dflash 0.1.0 not found under {args.zlab_dir}"
        print(results["zlab_skipped"], file=sys.stderr)
    model, tokenizer = dflash_mlx.load(str(DEFAULT_TARGET))
    draft = dflash_mlx.load_draft(DEFAULT_DRAFT, model)
    prompts = default_prompts()[: args.num_prompts]
    report, _ = benchmark(model, draft, tokenizer, prompts, args.bench_tokens, None, max(1, args.repeats // 2))
    results["bench"] = {k: report[k] for k in ("speedup", "fixed_block_speedup", "fraction_of_ideal",
                                               "mean_tokens_per_cycle", "block_size_histogram", "outputs_identical")}
    results["bench"]["adaptive_vs_fixed"] = report["speedup"] / report["fixed_block_speedup"]
    print("bundled pair, bench:", json.dumps(results["bench"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
