"""What do a target's sliding-window caches cost per verify cycle? Whether a
rollback-friendly cache layout would pay (see dflash_mlx/targets/attention.py).

    python examples/sliding_window_cost.py --model TARGET --context 4096 --block-size 16

mlx-lm's ``RotatingKVCache`` takes a verify block through its concat path:
each verify copies the last ``window - 1`` rows and the block into a new
buffer, in every sliding layer (the rollback then only slices). This times, at
a context past the window, (1) a verify forward of the block and the rollback
to one accepted token, as the generation loop runs them, and (2) those copies
alone, at the same shapes and dtype. (2) over (1) bounds what a layout that
appends in place, compacting now and then, could save per cycle.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.targets import adapter_for  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return 1e3 * statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="target with sliding-window layers: local path or Hugging Face id")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens before the timed cycles")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    model, _ = dflash_mlx.load(args.model)
    target = adapter_for(model)
    cache = target.make_cache()
    rotating = [c for c in cache if isinstance(c, RotatingKVCache)]
    if not rotating:
        print(f"error: {args.model} has no sliding-window caches", file=sys.stderr)
        return 1
    prompt = mx.random.randint(0, target.vocab_size, (1, args.context))
    target.forward(prompt, cache, last_logits_only=True, record=False)
    mx.eval([c.state for c in cache])
    block = mx.ones((1, args.block_size), mx.int32)

    def cycle():
        logits, taps = target.forward(block, cache)
        mx.eval(logits, taps, [c.state for c in cache])
        target.rollback(cache, 1)
        mx.eval([c.state for c in cache])

    whole = median_ms(cycle, args.repeats)
    kept = [(rows, c.max_size - 1) for c in rotating for rows in c.state[:2]]
    new = [mx.zeros((*rows.shape[:2], args.block_size, rows.shape[3]), rows.dtype) for rows, _ in kept]
    mx.eval(new)

    def copies():
        mx.eval([mx.concatenate([rows[..., -w:, :], n], axis=2) for (rows, w), n in zip(kept, new)])

    copy = median_ms(copies, args.repeats)
    print(f"{len(rotating)} sliding caches of window {rotating[0].max_size}, context {args.context}, block {args.block_size}")
    print(f"verify + rollback      {whole:8.2f} ms")
    print(f"sliding-cache copies   {copy:8.2f} ms ({100 * copy / whole:.1f}% of the cycle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
