#!/usr/bin/env python
"""Build the bundled default (target, drafter) pair of dflash_mlx from scratch.

The project ships a tiny model pair so that tests, examples and benchmarks run
offline. This recipe makes that pair reproducible: every stage is seeded and
reads only the Python standard library of the running interpreter. Each stage
is one module of ``recipes/default_pair/``:

  data       list stdlib ``.py`` files, split train/held-out by file, write the
             held-out prompt set into the pair directory
  tokenizer  train a byte-level BPE tokenizer (with a ``<|mask|>`` token)
  target     train a tiny Qwen3.5 (hybrid GatedDeltaNet + attention) target
  drafter    train the DFlash drafter with ``mlx-dflash train`` on the target's
             own continuations of train-split prompts: from scratch on a first
             set of prompts, then (``--init-from``) on those plus fresh ones

Example::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python recipes/build_default_pair.py --stage all
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_pair.common import DEFAULT_WORK, PAIR_DIR  # noqa: E402
from default_pair.data import stage_data  # noqa: E402
from default_pair.drafter import stage_drafter  # noqa: E402
from default_pair.target import stage_target  # noqa: E402
from default_pair.tokenizer import stage_tokenizer  # noqa: E402
from stages import add_training_arguments, chosen_stages, stage_parser  # noqa: E402

STAGES = {
    "data": stage_data,
    "tokenizer": stage_tokenizer,
    "target": stage_target,
    "drafter": stage_drafter,
}


def main(argv=None) -> None:
    ap = stage_parser(__doc__.split("\n")[0], STAGES, DEFAULT_WORK)
    ap.add_argument("--n-prompts", type=int, default=24)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--pair-dir", default=str(PAIR_DIR), help="where the prompts and the drafter go")
    ap.add_argument("--out-dir", default=None, help="target output dir (default: PAIR_DIR/target)")
    # Small batches, many steps: per-token cost is flat in batch size on CPU,
    # and at this tiny budget more updates beat less noisy ones (measured).
    add_training_arguments(ap, "the target", steps=1200, seq_len=128, batch_size=4, lr=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--adam-beta2", type=float, default=0.999)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="mx.compile the train step (measured: no faster on CPU)")
    ap.add_argument("--max-train-minutes", type=float, default=60.0,
                    help="stop early (and say so in the card) if training runs past this; "
                    "the shipped target took 19.7 min, so the default cap leaves slower "
                    "machines room to reproduce all of its steps")
    ap.add_argument("--chunked-gdn", action=argparse.BooleanOptionalAction, default=True,
                    help="train with the chunked (matmul) GatedDeltaNet recurrence")
    ap.add_argument("--drafter-prompts", type=int, default=1024,
                    help="train-split prompts the target continues for the drafter's data")
    ap.add_argument("--drafter-steps", type=int, default=4800)
    ap.add_argument("--drafter-lr", type=float, default=1.5e-3)
    ap.add_argument("--drafter-extra-prompts", type=int, default=2048,
                    help="phase 2: further train-split prompts continued and added to the data")
    ap.add_argument("--drafter-extra-steps", type=int, default=2400,
                    help="phase 2: steps continuing from phase 1's drafter (0: no phase 2)")
    ap.add_argument("--drafter-extra-lr", type=float, default=1e-3)
    ap.add_argument("--drafter-resume", action="store_true",
                    help="continue an interrupted drafter run (same data, same arguments)")
    args = ap.parse_args(argv)
    args.out_dir = args.out_dir or str(Path(args.pair_dir) / "target")
    # --drafter-resume only continues an interrupted run: the result is the same
    # as the command without it, which is the one the card records.
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--drafter-resume"]
    args.command = "python recipes/build_default_pair.py " + " ".join(given)

    for name in chosen_stages(STAGES, args.stage):
        print(f"== stage {name}")
        STAGES[name](args)


if __name__ == "__main__":
    main()
