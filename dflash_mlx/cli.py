"""``mlx-dflash <command> [args]``: one entry point, mlx-lm style.

Each command is also ``python -m dflash_mlx.<command>``.
"""

import importlib
import sys

COMMANDS = {
    "generate": ("dflash_mlx.generate", "stream text from a target with a DFlash drafter"),
    "chat": ("dflash_mlx.chat", "interactive chat with a target + drafter"),
    "server": ("dflash_mlx.server", "OpenAI-compatible HTTP server (chat/completions, prompt cache)"),
    "convert": ("dflash_mlx.convert", "convert drafters (and targets) to MLX, with dtype/quantization"),
    "train": ("dflash_mlx.train", "train a DFlash drafter for a target"),
    "bench": ("dflash_mlx.benchmark", "DFlash vs autoregressive speed on the same target"),
}


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
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
