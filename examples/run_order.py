"""Does a run's place in the bench's order move its speed? Two identical
DFlash configurations (fixed block) alternate with mlx-lm's greedy decode,
once with the same one always right after mlx-lm's run, once taking turns.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/run_order.py                 # the bundled pair, 12 prompts x 3 rounds

Identical configurations should give the same speedup. Where the first one
after mlx-lm's run is slowed, only the fixed order shows a gap; that is why
``mlx-dflash bench`` rotates its DFlash configurations.
"""

import argparse

from dflash_mlx.benchmark import pooled_tps, run_autoregressive, run_dflash
from dflash_mlx.pair import DEFAULT_TARGET, benchmark_prompts, load_pair


def speedups(model, tokenizer, draft, prompts, max_tokens, rounds, rotate):
    runs = {"mlx-lm": [], "a": [], "b": []}
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            runs["mlx-lm"].append(run_autoregressive(model, tokenizer, prompt, max_tokens))
            order = ["a", "b"] if not rotate or (r * len(prompts) + i) % 2 == 0 else ["b", "a"]
            for name in order:
                runs[name].append(run_dflash(model, draft, tokenizer, prompt, max_tokens, draft.block_size))
    base = pooled_tps(runs["mlx-lm"])
    return pooled_tps(runs["a"]) / base, pooled_tps(runs["b"]) / base


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    model, tokenizer, draft, _ = load_pair(str(DEFAULT_TARGET))
    prompts = benchmark_prompts(str(DEFAULT_TARGET), tokenizer)[: args.num_prompts]
    run_autoregressive(model, tokenizer, prompts[0], 16)  # warm-up
    run_dflash(model, draft, tokenizer, prompts[0], 16, draft.block_size)
    for rotate in (False, True):
        a, b = speedups(model, tokenizer, draft, prompts, args.max_tokens, args.rounds, rotate)
        label = "taking turns " if rotate else "'a' always first"
        print(f"{label}: a {a:.3f}x, b {b:.3f}x mlx-lm (b / a = {b / a:.3f})")


if __name__ == "__main__":
    main()
