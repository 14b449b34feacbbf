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

import sys

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx.defaults import DEFAULT_BLOCK_SIZE
from dflash_mlx.errors import ArgumentError
from dflash_mlx.targets import adapter_for
from dflash_mlx.timing import median_ms


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="target with sliding-window layers: local path or Hugging Face id")
    p.add_argument("--context", type=cli.positive_int, default=4096, help="prompt tokens before the timed cycles")
    p.add_argument("--block-size", type=cli.positive_int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--repeats", type=cli.positive_int, default=20)
    args = p.parse_args(argv)
    model, _ = dflash_mlx.load(args.model)
    target = adapter_for(model)
    cache = target.make_cache()
    rotating = [c for c in cache if isinstance(c, RotatingKVCache)]
    if not rotating:
        raise ArgumentError(f"{args.model} has no sliding-window caches")
    prompt = mx.random.randint(0, target.vocab_size, (1, args.context))
    target.forward(prompt, cache, last_logits_only=True, record=False)
    mx.eval([c.state for c in cache])
    block = mx.ones((1, args.block_size), mx.int32)

    def cycle():
        logits, taps = target.forward(block, cache)
        mx.eval(logits, taps, [c.state for c in cache])
        target.rollback(cache, 1)
        mx.eval([c.state for c in cache])

    whole = median_ms(cycle, repeats=args.repeats)
    kept = [(rows, c.max_size - 1) for c in rotating for rows in c.state[:2]]
    new = [mx.zeros((*rows.shape[:2], args.block_size, rows.shape[3]), rows.dtype) for rows, _ in kept]
    mx.eval(new)

    def copies():
        mx.eval([mx.concatenate([rows[..., -w:, :], n], axis=2) for (rows, w), n in zip(kept, new)])

    copy = median_ms(copies, repeats=args.repeats)
    print(f"{len(rotating)} sliding caches of window {rotating[0].max_size}, context {args.context}, block {args.block_size}")
    print(f"verify + rollback      {whole:8.2f} ms")
    print(f"sliding-cache copies   {copy:8.2f} ms ({100 * copy / whole:.1f}% of the cycle)")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
