"""A writer for tests/test_kill.py, killed at random points.

Imports the package once, then for each command on stdin forks a child that
writes the named thing in a loop until it is killed, and reports the child's
pid and, once reaped, "reaped". Forked before any MLX work in this process,
so each child starts clean and fast.

    convert SRC DST       convert the drafter SRC to DST (--force), float16
                          and float32 in turn
    train CONFIG OUT      write training checkpoints of a tiny drafter to OUT,
                          step 1, 2, ..., every weight and the step agreeing
    once train CONFIG OUT write one checkpoint (step 0) and exit
"""

import json
import os
import sys

import mlx.core as mx  # noqa: F401  (imported before forking)
import mlx.optimizers as optim

from dflash_mlx.convert import convert
from dflash_mlx.models.dflash import DFlashConfig, DFlashDraftModel
from dflash_mlx.train import write_checkpoint


def checkpoints(config_path, out, steps):
    config = json.loads(open(config_path).read())
    draft = DFlashDraftModel(DFlashConfig.from_hf(config))
    optimizer = optim.AdamW(learning_rate=1e-3)
    optimizer.init(draft.trainable_parameters())
    for step in steps:
        draft.update({"fc": {"weight": mx.full(draft.fc.weight.shape, float(step))}})
        state = {"step": step, "history": [], "train_seconds": 0.0, "run": {}}
        write_checkpoint(out, config, draft, optimizer, state, mx.float32)


def child(words):
    if words[0] == "convert":
        for i in range(10**9):
            convert(words[1], words[2], dtype=("float16", "float32")[i % 2], force=True)
    elif words[0] == "train":
        checkpoints(words[1], words[2], range(1, 10**9))
    elif words[:2] == ["once", "train"]:
        checkpoints(words[2], words[3], [0])


def main():
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stdout answers the test
            child(line.split())
            sys.exit(0)  # the child never goes back to reading commands
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


if __name__ == "__main__":
    main()
