"""What splitting the target over ranks costs per verify cycle.

    python examples/pipeline_cost.py                                          # one process
    mlx.launch --backend ring -n 2 --python "$(which python)" examples/pipeline_cost.py   # two ranks

Runs greedy DFlash on the bundled pair (or --model/--draft-model) over the
first --prompts bundled prompts with each phase synced and timed
(``benchmark.phase_timings``: draft, verify, rollback, host) and prints, on rank 0, the
milliseconds per cycle of each phase. The committed tokens must be the same
either way; run both commands on the same machine and compare.
"""

import argparse

import mlx.core as mx

from dflash_mlx.benchmark import phase_timings
from dflash_mlx.pair import DEFAULT_TARGET, default_prompts, load_pair
from dflash_mlx.pipeline import load_pipelined_pair


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_TARGET))
    p.add_argument("--draft-model", default=None)
    p.add_argument("--prompts", type=int, default=4, help="how many bundled prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    group = mx.distributed.init()
    if group.size() > 1:
        model, tokenizer, draft = load_pipelined_pair(args.model, args.draft_model, group)
    else:
        model, tokenizer, draft, _ = load_pair(args.model, args.draft_model)
    prompts = default_prompts()[: args.prompts]
    # a fixed block, so that both runs verify the same blocks
    per_cycle = phase_timings(model, draft, tokenizer, prompts, args.max_tokens, draft.block_size)
    if group.rank() == 0:
        print(f"ranks {group.size()}: ms per cycle: " + ", ".join(f"{k} {v:.2f}" for k, v in per_cycle.items())
              + f", total {sum(per_cycle.values()):.2f}")

if __name__ == "__main__":
    main()
