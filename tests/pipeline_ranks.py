"""Run by tests/test_pipeline.py on every rank under ``mlx.launch``:

    pipeline_ranks.py SPEC.json OUT_DIR

Each rank checks its pipelined target against the whole model it also loads
(bit-identical logits and taps after every rollback length), generates with
the pipelined pair, and provokes load failures on one rank at a time; it
writes what it saw to OUT_DIR/rank<r>.json for the test to compare.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from dflash_mlx.generate import stream_generate
from dflash_mlx.pipeline import PipelineError, load_pipelined_pair, load_slice, pipeline_group
from dflash_mlx.targets import TargetError, adapter_for
from dflash_mlx.targets.pipeline import PipelineTarget

mx.set_default_device(mx.cpu)


def same(a, b) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b).item())


def check_adapter(target_dir, group, block=5):
    """Per rollback length: prompt, verify block, rollback, one more token;
    logits and taps of every forward equal the unsplit adapter's."""
    sliced, _ = load_slice(target_dir, group)
    piped = PipelineTarget(sliced, group)
    whole = adapter_for(load(target_dir)[0])
    taps = list(range(piped.num_layers))
    prompt = mx.array([[3 + (7 * i) % 200 for i in range(11)]])
    block_tokens = mx.array([[5 + 13 * i for i in range(block)]])
    results = []
    for keep in range(block + 1):
        caches = [piped.make_cache(), whole.make_cache()]
        steps = [(prompt, False), (block_tokens, True), (mx.array([[9]]), False)]
        ok = True
        for tokens, record in steps:
            (l1, t1), (l2, t2) = [
                a.forward(tokens, c, taps=taps, record=record) for a, c in zip((piped, whole), caches)
            ]
            # Both compared every time: the forwards' collectives must run on every rank.
            ok = all([same(l1, l2), same(t1, t2)]) and ok
            if record:
                piped.rollback(caches[0], keep)
                whole.rollback(caches[1], keep)
        results.append(ok)
    return {"local_layers": [piped.start, piped.end], "identical": results}


def agreed(target_dir, group):
    """What each rank gets when every rank offers its own values."""
    sliced, _ = load_slice(target_dir, group)
    return PipelineTarget(sliced, group).agreed([group.rank() + 0.5, 2.0 * group.rank()])


def run_pair(target_dir, draft_dir, group, seed, **kwargs):
    model, tokenizer, draft = load_pipelined_pair(target_dir, draft_dir, group, seed)
    tokens, accepted, blocks = [], [], []
    for r in stream_generate(model, draft, tokenizer, "def fib(n):", **kwargs):
        tokens += r.tokens
        accepted.append(r.accepted)
        blocks.append(r.block_size)
    return {"tokens": tokens, "accepted": accepted, "blocks": blocks}


def expect_failure(group, target_dir, draft_dir):
    try:
        load_pipelined_pair(target_dir, draft_dir, group)
    except PipelineError as e:
        return str(e)
    return None


def expect_divergence(group, target_dir, drafts):
    """Each rank with its own drafter: their blocks differ, which the first
    rollback must refuse on every rank."""
    model, tokenizer, draft = load_pipelined_pair(target_dir, drafts[group.rank()], group)
    try:
        for _ in stream_generate(model, draft, tokenizer, "def fib(n):", max_tokens=20, block_size=4):
            pass
    except TargetError as e:
        return str(e)
    return None


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    group = pipeline_group()
    rank = group.rank()
    result = {"adapter": {name: check_adapter(path, group) for name, path in spec["adapters"].items()}}
    result["agreed"] = agreed(spec["adapters"]["qwen3_5"], group)
    for name, run in spec["runs"].items():
        result[name] = run_pair(run["target"], run["draft"], group, run.get("seed"), **run["kwargs"])
    # A failure on one rank only: the shard of its layers, then its drafter.
    good_t, good_d = spec["adapters"]["qwen3_5"], spec["runs"]["sampled"]["draft"]
    result["failures"] = [
        expect_failure(group, spec["partial"], good_d),
        expect_failure(group, good_t, str(out / "missing") if rank == 0 else good_d),
    ]
    result["diverged"] = expect_divergence(group, good_t, spec["diverged_drafts"])
    # Every rank is still in step after the failures.
    result["after"] = mx.distributed.all_sum(mx.array(rank + 1), group=group).item()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
