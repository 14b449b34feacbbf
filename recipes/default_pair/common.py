"""Paths, constants and small helpers shared by the default-pair stages."""

import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAIR_DIR = REPO / "dflash_mlx" / "default_pair"
DEFAULT_WORK = REPO / "runs" / "default_pair"

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def read_split(work: Path, name: str) -> list[str]:
    path = work / f"{name}.txt"
    if not path.exists():
        sys.exit(f"{path} missing: run --stage data first")
    return [l for l in path.read_text().splitlines() if l]


# The bundled drafter: as wide as the target (z-lab's layout), block 16, taps
# spread over the target's 6 layers. Rows are a training prompt (cut to at most
# DRAFTER_MAX_PROMPT tokens) plus the target's greedy continuation.
DRAFTER_LAYERS = 2
DRAFTER_BLOCK = 16
DRAFTER_TAPS = "1,2,4,5"
DRAFTER_ROW = 256
DRAFTER_MAX_PROMPT = 128
DRAFTER_BATCH = 4  # rows per step: more, smaller updates won at equal wall time (measured)
DRAFTER_ANCHORS = 32  # blocks per row
