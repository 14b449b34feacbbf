"""Interrupted writes: a converter or a trainer's checkpoint killed (SIGKILL)
at random points leaves the destination as it was before or as the
completed new write, never half-written or missing.

One writer process (tests/kill_writer.py) imports the package once and forks
a child per run that writes in a loop; the test kills the child after a
seeded random delay and checks the destination.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx.convert import convert

RUNS = int(os.environ.get("DFLASH_KILL_RUNS", "20"))
SEED = 29


class Writer:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "kill_writer.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )

    def run(self, *words, kill_after=None):
        """Start a child on ``words``; kill it after ``kill_after`` seconds
        (None: let it finish)."""
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        if kill_after is not None:
            time.sleep(kill_after)
            os.kill(pid, signal.SIGKILL)
        assert self.proc.stdout.readline().strip() == "reaped"

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def writer():
    w = Writer()
    yield w
    w.close()


def delays(n, longest):
    rng = random.Random(SEED)
    return [rng.uniform(0, longest) for _ in range(n)]


def test_killed_conversions_leave_the_previous_or_the_new_drafter(qwen3_pair, tmp_path, writer):
    src = qwen3_pair.make_draft(tmp_path / "src", block_size=4)
    dst = tmp_path / "dst"
    convert(str(src), str(dst), dtype="float16")
    outcomes = {"float16": 0, "float32": 0}
    for delay in delays(RUNS, 0.5):
        writer.run("convert", src, dst, kill_after=delay)
        draft = dflash_mlx.load_draft(dst)  # complete: every tensor, the right shapes
        dtypes = {str(v.dtype).split(".")[-1] for _, v in tree_flatten(draft.parameters())}
        assert len(dtypes) == 1, dtypes  # one conversion's files, not two mixed
        outcomes[dtypes.pop()] += 1
    stale = [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst.")]
    assert len(stale) <= 1  # the last kill's; each run removed the ones before
    print(f"{RUNS} kills (seed {SEED}): {outcomes}")


def test_killed_training_checkpoints_leave_the_previous_or_the_new_one(qwen3_pair, tmp_path, writer):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(qwen3_pair.draft_config(block_size=4)))
    out = tmp_path / "run"
    writer.run("once", "train", config, out)
    steps = []
    for delay in delays(RUNS, 0.5):
        writer.run("train", config, out, kill_after=delay)
        state = json.loads((out / "training_state" / "training_state.json").read_text())
        weights = mx.load(str(out / "model.safetensors"))
        saved = mx.load(str(out / "training_state" / "training_state.safetensors"))
        step = state["step"]
        assert mx.all(weights["fc.weight"] == step).item() and mx.all(saved["model.fc.weight"] == step).item()
        dflash_mlx.load_draft(out)
        steps.append(step)
        assert len([p for p in tmp_path.iterdir() if p.name.startswith(".run.")]) <= 1
    print(f"{RUNS} kills (seed {SEED}): checkpoint steps found {steps}")
