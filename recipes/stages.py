"""The command line the staged recipes share, so its flags are spelled and
meant alike in each: ``--stage`` (one stage, or ``all`` of them in order),
``--work-dir``, ``--seed`` and the main training run's flags."""

import argparse


def stage_parser(description: str, stages, work_dir) -> argparse.ArgumentParser:
    """A recipe's parser with ``--stage`` (one of ``stages``, or ``all``),
    ``--work-dir`` and the ``--seed`` every stage draws from."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--stage", choices=[*stages, "all"], default="all")
    p.add_argument("--work-dir", default=str(work_dir))
    p.add_argument("--seed", type=int, default=0, help="seed of every stage")
    return p


def chosen_stages(stages, stage: str) -> list:
    """The stages ``--stage`` names: every one in order for ``all``."""
    return list(stages) if stage == "all" else [stage]


def add_training_arguments(p: argparse.ArgumentParser, model: str, *, steps, seq_len, batch_size, lr) -> None:
    """The flags of the recipe's main training run (that of ``model``), with
    the recipe's defaults."""
    p.add_argument("--steps", type=int, default=steps, help=f"{model}'s training steps")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per training row")
    p.add_argument("--batch-size", type=int, default=batch_size, help="rows per step")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
