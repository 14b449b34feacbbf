"""``mlx-dflash <command> [args]``: one entry point, mlx-lm style.

Each command is also ``python -m dflash_mlx.<command>``. Every command runs
through :func:`run`, so an error the user can fix ends as one ``error: ...``
line on stderr and exit code 1, never a traceback.
"""

import argparse
import importlib
import sys
from typing import Callable, Optional, Sequence

from .defaults import DEFAULT_DRAFT_SINK, DEFAULT_DRAFT_WINDOW, DEFAULT_PREFILL_STEP_SIZE, DEFAULT_TARGET
from .errors import DFlashError

COMMANDS = {
    "generate": ("dflash_mlx.generate", "stream text from a target with a DFlash drafter"),
    "chat": ("dflash_mlx.chat", "interactive chat with a target + drafter"),
    "server": ("dflash_mlx.server", "OpenAI-compatible HTTP server (chat/completions, prompt cache)"),
    "convert": ("dflash_mlx.convert", "convert drafters (and targets) to MLX, with dtype/quantization"),
    "train": ("dflash_mlx.train", "train a DFlash drafter for a target"),
    "bench": ("dflash_mlx.benchmark", "DFlash vs autoregressive speed on the same target"),
    "doctor": ("dflash_mlx.doctor", "check this machine (BLAS, kernels, memory) and a pair: does DFlash help here?"),
}

# What a command reports as a one-line error: the package's own errors, and
# the ValueError / FileNotFoundError with which mlx, mlx-lm and
# huggingface_hub reject bad input (unknown model types, unreadable files).
USER_ERRORS = (DFlashError, ValueError, FileNotFoundError)


def print_error(message) -> None:
    print(f"error: {message}", file=sys.stderr)


def run(main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Run a command's ``main(argv)``; a user error becomes one line and exit code 1."""
    try:
        return main(argv)
    except USER_ERRORS as e:
        print_error(e)
        return 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose bad flags and values end like every other user error:
    one ``error: ...`` line and exit code 1 (argparse prints the usage and exits 2)."""

    def error(self, message):
        print_error(message)
        sys.exit(1)


def int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type`` for counts that must be at least 1 (tokens, block size, step size)."""
    return int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse ``type`` for counts that may be 0 (a tree budget: 0 = none; the draft sink)."""
    return int_at_least(text, 0)


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--draft-model``, as every command that loads a pair spells them."""
    parser.add_argument("--model", default=str(DEFAULT_TARGET), help="target: local path or Hugging Face id (default: the bundled pair)")
    parser.add_argument("--draft-model", default=None, help="DFlash/DFlash2 drafter: local path or Hugging Face id (default: the bundled pair's for the default --model, z-lab's published drafter for a target it has one for)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's sampling flags; 0 turns each one off (greedy at ``--temp 0``)."""
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (0 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (0 = off)")


def add_block_size_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=positive_int, default=None, help="fix the verify width (default: adaptive, chosen each cycle up to the drafter's trained block size; 1 = plain decoding)")


def add_tree_budget_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tree-budget", type=non_negative_int, default=None,
        help="draft-tree nodes verified per cycle (default: chosen each cycle from measured cost; 0 = chains only; "
        "see docs/ddtree.md)",
    )


def add_copy_drafts_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--copy-drafts", action=argparse.BooleanOptionalAction, default=True,
        help="let cycles verify spans copied from the context where that is faster (default: on; "
        "--no-copy-drafts: the drafter's blocks only)",
    )


def add_prefill_step_size_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-step-size", type=positive_int, default=DEFAULT_PREFILL_STEP_SIZE, help="prompt tokens per prefill forward")


def add_draft_window_arguments(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """``--draft-window`` and ``--draft-sink`` (``several``: windows to compare, ``bench``)."""
    parser.add_argument(
        "--draft-window", type=non_negative_int, default=None, nargs="+" if several else None,
        help="the drafter's full-attention layers read only the last W context positions (and the first "
        f"--draft-sink); rows outside are never projected or kept (default {DEFAULT_DRAFT_WINDOW}; 0: the whole "
        "context; see docs/long-prompts.md)",
    )
    parser.add_argument(
        "--draft-sink", type=non_negative_int, default=None,
        help=f"with a draft window: the first S context positions the drafter always reads (default {DEFAULT_DRAFT_SINK})",
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mlx-dflash {" + ",".join(COMMANDS) + "} [args]\n")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:10s} {help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mlx-dflash: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return run(module.main, rest)


if __name__ == "__main__":
    sys.exit(main())
