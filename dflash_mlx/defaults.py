"""Defaults shared by the API and the CLIs, so a signature and its flag agree."""

from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import DEFAULT_PREFILL_STEP_SIZE

# The bundled default pair (target, drafter, held-out prompts): what
# `--model` means when the user names none (see pair.py).
PAIR_DIR = Path(__file__).parent / "default_pair"
DEFAULT_TARGET = PAIR_DIR / "target"
DEFAULT_DRAFT = PAIR_DIR / "draft"
DEFAULT_PROMPTS = PAIR_DIR / "prompts.json"
# Tokens generated when the caller names no limit (generate, chat, server).
DEFAULT_MAX_TOKENS = 256
# Tokens per prompt in `mlx-dflash bench`: long enough for steady-state cycles.
DEFAULT_BENCH_MAX_TOKENS = 128
# Timed runs per prompt and decoder in `mlx-dflash bench` (alternating).
DEFAULT_BENCH_REPEATS = 2
# Verify width of a drafter config that names none (z-lab's drafters use 16).
DEFAULT_BLOCK_SIZE = 16
# The widest verify block a generation accepts: blocks are meant to be about
# the drafter's trained size, and an absurd one would only exhaust memory.
MAX_BLOCK_SIZE = 256
# The draft window (`--draft-window`, `--draft-sink`): context positions a
# drafter's full-attention layers read, the last W and the first S; a window
# of 0 reads the whole context. The default keeps SmolLM2's tokens per cycle
# at long prompts within a few percent of the whole context's
# (docs/long-prompts.md has the measurement and its command).
DEFAULT_DRAFT_WINDOW = 1024
DEFAULT_DRAFT_SINK = 64
# The float types a checkpoint can be written in (convert --dtype, train --dtype).
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

__all__ = [
    "DEFAULT_BENCH_MAX_TOKENS",
    "DEFAULT_BENCH_REPEATS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DRAFT",
    "DEFAULT_DRAFT_SINK",
    "DEFAULT_DRAFT_WINDOW",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_PREFILL_STEP_SIZE",
    "DEFAULT_PROMPTS",
    "DEFAULT_TARGET",
    "DTYPES",
    "MAX_BLOCK_SIZE",
    "PAIR_DIR",
]
