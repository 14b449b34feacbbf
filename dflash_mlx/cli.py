"""``mlx-dflash <command> [args]``: one entry point, mlx-lm style.

Each command is also ``python -m dflash_mlx.<command>``. Every command runs
through :func:`run`, so an error the user can fix ends as one ``error: ...``
line on stderr and exit code 1, never a traceback.
"""

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from . import controls
from .defaults import DEFAULT_DRAFT_SINK, DEFAULT_DRAFT_WINDOW, DEFAULT_PREFILL_STEP_SIZE, DEFAULT_TARGET
from .errors import ArgumentError, DFlashError
from .targets import kv

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
    parser.add_argument("--temp", type=temperature, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=checked(lambda v: controls.finite(v, "--top-p", 0.0, 1.0), float), default=0.0, help="nucleus sampling threshold (0 = off)")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="sample from the k most likely tokens (0 = off)")
    parser.add_argument("--min-p", type=checked(lambda v: controls.finite(v, "--min-p", 0.0, 1.0), float), default=0.0, help="drop tokens below min-p x the top probability (0 = off)")


# The seeds mx.random.seed takes.
MAX_SEED = 2**64 - 1


def seed(text: str) -> int:
    """argparse ``type`` for ``--seed``: what ``mx.random.seed`` takes (0 to 2**64 - 1)."""
    value = int_at_least(text, 0)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SEED}, got {value}")
    return value


def temperature(text: str) -> float:
    """argparse ``type`` for ``--temp``: a finite number, at least 0."""
    return checked(lambda v: controls.finite(v, "--temp", 0.0), float)(text)


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


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json-schema``, ``--regex`` and ``--grammar``: the answer held to one
    (see docs/structured.md); :func:`response_format` reads them."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", default=None, help="answer JSON valid against the JSON schema in FILE")
    group.add_argument("--regex", metavar="PATTERN", default=None, help="answer text matching the regular expression PATTERN")
    group.add_argument("--grammar", metavar="FILE", default=None, help="answer text in the Lark grammar in FILE (llguidance's Lark syntax)")


def response_format(args) -> Optional[dict]:
    """The response format ``--json-schema`` / ``--regex`` / ``--grammar`` ask
    for (None: free text), checked: an unreadable file, a schema that is not
    JSON or a grammar llguidance refuses is an error before any work."""
    from .structured import grammar_of  # (llguidance loads only for a command that asks)

    if args.regex is not None:
        form = {"type": "regex", "pattern": args.regex}
    elif args.json_schema is not None or args.grammar is not None:
        path = args.json_schema or args.grammar
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ArgumentError(f"cannot read {path}: {e}") from None
        if not text.strip():
            raise ArgumentError(f"{path} is empty: write the {'Lark grammar' if args.grammar is not None else 'JSON schema'} there")
        if args.grammar is not None:
            form = {"type": "grammar", "lark": text}
        else:
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise ArgumentError(f"--json-schema {path} is not JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ArgumentError(f"--json-schema {path} holds a JSON {type(schema).__name__}, not a schema: write one JSON object, e.g. {{\"type\": \"object\"}}")
            form = {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": schema, "strict": True}}
    else:
        return None
    grammar_of(form)
    return form
def checked(check: Callable, kind: Callable = int) -> Callable[[str], object]:
    """argparse ``type``: ``kind(text)`` passed to ``check``, whose
    :class:`ArgumentError` becomes argparse's (one ``error:`` line, exit 1)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        try:
            check(value)
        except ArgumentError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def template_config(text: str, flag: str = "--chat-template-config") -> dict:
    """argparse ``type`` for ``--chat-template-config`` (the server's ``--chat-template-args``: ``flag``)."""
    try:
        return controls.template_config(text, flag)
    except ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's loader flags: LoRA adapters on the target, remote code."""
    parser.add_argument("--adapter-path", type=str, default=None, help="LoRA adapters (mlx_lm.lora's folder) applied to the target; the drafter stays the target's, output stays exact")
    parser.add_argument("--trust-remote-code", action="store_true", help="let the tokenizer run code from its repository (mlx-lm's flag)")


def add_xtc_arguments(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's XTC and min-p flags, its defaults."""
    parser.add_argument("--xtc-probability", type=checked(lambda v: controls.check_sampling(xtc_probability=v), float), default=0.0, help="probability of XTC sampling at each token (0 = off)")
    parser.add_argument("--xtc-threshold", type=checked(lambda v: controls.check_sampling(xtc_threshold=v), float), default=controls.DEFAULT_XTC_THRESHOLD, help="with XTC: tokens above this probability are excluded, the least likely of them kept")
    parser.add_argument("--min-tokens-to-keep", type=checked(lambda v: controls.check_sampling(min_tokens_to_keep=v)), default=controls.DEFAULT_MIN_TOKENS_TO_KEEP, help="tokens min-p never removes")


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's KV-cache flags: a quantized cache, a rotating one."""
    parser.add_argument("--kv-bits", type=checked(lambda v: controls.check_kv_cache(kv_bits=v)), default=None, help=f"quantize the target's KV cache to this many bits ({', '.join(map(str, kv.KV_BITS))}; default: not quantized)")
    parser.add_argument("--kv-group-size", type=checked(lambda v: controls.check_kv_cache(kv_group_size=v)), default=kv.DEFAULT_KV_GROUP_SIZE, help="group size of the KV cache's quantization")
    parser.add_argument("--quantized-kv-start", type=checked(lambda v: controls.check_kv_cache(quantized_kv_start=v)), default=kv.DEFAULT_QUANTIZED_KV_START, help="with --kv-bits: quantize once the cache holds this many tokens")
    parser.add_argument("--max-kv-size", type=checked(lambda v: controls.check_kv_cache(max_kv_size=v)), default=None, help="keep at most this many tokens in the target's KV cache (a rotating cache; default: no limit)")


def add_template_arguments(parser: argparse.ArgumentParser) -> None:
    """``--chat-template-config`` and ``--extra-eos-token``, as mlx_lm.generate spells them."""
    parser.add_argument("--chat-template-config", type=template_config, default=None, help="JSON object of extra variables for the chat template, e.g. '{\"enable_thinking\": false}'")
    parser.add_argument("--extra-eos-token", type=str, default=(), nargs="+", help="more tokens that end the generation")


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """``generate``'s prompt flags from mlx_lm.generate: a prefilled answer, a saved prompt cache."""
    parser.add_argument("--prefill-response", default=None, help="the start of the assistant's answer; the model continues it")
    parser.add_argument("--prompt-cache-file", type=str, default=None, help="a prompt cache saved with dflash_mlx.save_prompt_cache; the prompt is what follows it")
    parser.add_argument("--use-default-chat-template", action="store_true", help="use the tokenizer's default template when it has none")


def generation_keywords(args: argparse.Namespace, tokenizer) -> dict:
    """The control keywords for ``stream_generate`` from a command's parsed
    flags (those it lacks take mlx-lm's defaults): only those that change
    something, so plain decoding passes none."""
    given = {k: getattr(args, k) for k in ("xtc_probability", "xtc_threshold", "min_tokens_to_keep", "kv_bits", "kv_group_size", "quantized_kv_start", "max_kv_size") if hasattr(args, k)}
    return controls.control_keywords(tokenizer, **given)


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
