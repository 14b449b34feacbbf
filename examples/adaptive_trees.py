"""The adaptive loop with draft trees allowed (the default) against the
chain-only adaptive loop (``tree_budget=0``) and mlx-lm, on the bundled
pair's held-out prompts, greedy, one process, the two DFlash loops taking
turns right after mlx-lm; medians of tok/s, every output checked against
mlx-lm's.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/adaptive_trees.py
"""

import argparse
import statistics

from dflash_mlx.benchmark import compile_block_lengths, run_autoregressive, run_dflash
from dflash_mlx.defaults import DEFAULT_TARGET
from dflash_mlx.generate import build_prompt, encode_prompt
from dflash_mlx.pair import default_prompts, load_pair


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    model, tokenizer, draft, _ = load_pair(DEFAULT_TARGET)
    prompts = [encode_prompt(tokenizer, build_prompt(tokenizer, t)) for t in default_prompts()[: args.num_prompts]]
    compile_block_lengths(draft, prompts[0], draft.block_size)
    loops = {"chain-only adaptive": 0, "adaptive with trees": None}
    for prompt in prompts[:2]:  # warm-up
        run_autoregressive(model, tokenizer, prompt, 32)
        for budget in loops.values():
            run_dflash(model, draft, tokenizer, prompt, 32, None, tree_budget=budget)
    tps = {"mlx-lm": [], **{name: [] for name in loops}}
    per_cycle = {name: [] for name in loops}
    tree_cycles = 0
    for rep in range(args.repeats):
        for prompt in prompts:
            ar = run_autoregressive(model, tokenizer, prompt, args.max_tokens)
            tps["mlx-lm"].append(ar["tps"])
            for name in (list(loops) if rep % 2 == 0 else list(loops)[::-1]):
                r = run_dflash(model, draft, tokenizer, prompt, args.max_tokens, None, tree_budget=loops[name])
                if r["tokens"] != ar["tokens"]:
                    raise SystemExit(f"{name}: output differs from mlx-lm's")
                tps[name].append(r["tps"])
                per_cycle[name].append(sum(r["committed"]) / len(r["committed"]))
                tree_cycles += sum(1 for n in r["tree_sizes"] if n)
    ar = statistics.median(tps["mlx-lm"])
    print(f"mlx-lm: {ar:.0f} tok/s")
    for name in loops:
        print(f"{name}: {statistics.median(tps[name]):.0f} tok/s, {statistics.median(tps[name]) / ar:.2f}x mlx-lm, "
              f"{statistics.mean(per_cycle[name]):.2f} tokens per cycle")
    print(f"tree cycles chosen: {tree_cycles}; outputs identical to mlx-lm's")


if __name__ == "__main__":
    main()
