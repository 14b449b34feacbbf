"""How much a drafter guesses right when it fills fewer masks than it was
trained on: why the adaptive loop always drafts the whole block and chooses
only how much of it to verify.

    python examples/mask_block_length.py                        # the bundled pair
    python examples/mask_block_length.py --model smollm2 --max-tokens 256 --num-prompts 3

For each length ``b`` the held-out prompts are decoded greedily with a fixed
block of ``b`` (so the drafter fills ``b - 1`` masks), and the mean number of
drafted tokens accepted per cycle is printed beside what the first ``b - 1``
slots of the trained block would give (``min(accepted, b - 1)`` over the
cycles of the trained block's run). A drafter whose early slots did not
depend on how many masks follow would give the same two figures.
"""

import argparse

import numpy as np

from dflash_mlx.benchmark import run_dflash
from dflash_mlx.pair import DEFAULT_TARGET, benchmark_prompts, load_pair


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target (a pair name, or a path; default: the bundled pair)")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[12, 8, 4])
    args = p.parse_args(argv)

    model_path = args.model or str(DEFAULT_TARGET)
    model, tokenizer, draft, _ = load_pair(model_path, args.draft_model)
    prompts = benchmark_prompts(model_path, tokenizer)[: args.num_prompts]
    trained = draft.block_size

    def accepted(block):
        # every cycle but each generation's last, which is cut to the tokens left
        runs = [run_dflash(model, draft, tokenizer, p, args.max_tokens, block) for p in prompts]
        return np.array([a for r in runs for a in r["accepted"][:-1]])

    full = accepted(trained)
    print(f"{len(prompts)} prompts, {args.max_tokens} new tokens, drafter trained on blocks of {trained}")
    print(f"block {trained:2d}: {full.mean():.2f} drafted tokens accepted per cycle")
    for b in args.lengths:
        print(f"block {b:2d}: {accepted(b).mean():.2f}, against {np.minimum(full, b - 1).mean():.2f} "
              f"from the first {b - 1} slots of the block of {trained}")


if __name__ == "__main__":
    main()
