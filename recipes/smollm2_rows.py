"""Pack the self-distillation shards into training rows for ``mlx-dflash train``.

    python recipes/smollm2_rows.py --shards ~/.cache/dflash_mlx/smollm2/distill \\
        --seq-len 1024 --out ~/.cache/dflash_mlx/smollm2/rows-1024.npy

The conversations (chat-templated prompt + the target's answer, closed as
the chat template closes a turn when the answer stopped) follow each other in
the distillation's shard order (``--defer``) and are cut into rows of exactly ``--seq-len`` tokens,
as in language-model pre-training: a row may end one conversation and start
the next, which the target reads as a longer chat. The leftover shorter than
a row is dropped. Rows are a 2-D int32 ``.npy`` (each row one training
window, as ``--cache-target`` wants), written atomically, and beside them
``*-answers.npy``: booleans of the same shape, true on the tokens the target
wrote (``mlx-dflash train --answer-mask``: anchors inside answers only).
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from smollm2_distill import ordered_shards, parse_defer, read_answers, read_shard  # noqa: E402


def pack(shards, seq_len: int, end_ids=(), max_tokens=None):
    """(rows [n, seq_len] int32, answers [n, seq_len] bool, conversations
    read, conversations >= seq_len) of the ``shards`` files, in their order.

    An answer shorter than ``max_tokens`` stopped at the end-of-turn token,
    which the shards leave out (mlx-lm returns answers without it): ``end_ids``
    (the chat template's end of a turn) are put back after it, as answer tokens.
    """
    convs, marks = [], []
    end = np.asarray(end_ids, np.int32)
    for path in shards:
        rows, prompt_lens = read_shard(path)
        for row, n, answer in zip(rows, prompt_lens, read_answers(path)):
            stopped = max_tokens is not None and len(row) - n < max_tokens
            convs.append(np.concatenate([row, end]) if stopped else row)
            marks.append(np.concatenate([answer, np.ones(len(end), bool)]) if stopped else answer)
    stream = np.concatenate(convs) if convs else np.zeros(0, np.int32)
    marked = np.concatenate(marks) if marks else np.zeros(0, bool)
    n = len(stream) // seq_len
    rows = stream[: n * seq_len].reshape(n, seq_len).astype(np.int32)
    return rows, marked[: n * seq_len].reshape(n, seq_len), len(convs), sum(len(c) >= seq_len for c in convs)


def answers_path(rows: Path) -> Path:
    """The answer mask written beside a rows file."""
    return rows.with_name(rows.stem + "-answers.npy")


def save_atomically(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", required=True, help="directory of shard-*.npz from smollm2_distill.py")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-shards", type=int, default=None, help="use only the first N shards (a fixed data set while more are made)")
    p.add_argument("--defer", type=parse_defer, default=None, metavar="A:B",
                   help="the distillation's order: shards A..B-1 after all others")
    p.add_argument("--out", required=True, help="rows .npy to write")
    p.add_argument("--end-ids", default="", help="comma list: the tokens ending a turn, put back after answers that stopped")
    p.add_argument("--max-tokens", type=int, default=None, help="the distillation's answer cap (shorter answers stopped)")
    args = p.parse_args(argv)
    shards = ordered_shards(Path(args.shards).expanduser(), args.defer, args.max_shards)
    if not shards:
        raise SystemExit(f"error: no shard-*.npz in {args.shards}: run recipes/smollm2_distill.py first")
    end_ids = [int(t) for t in args.end_ids.split(",") if t]
    rows, answers, n_conv, n_long = pack(shards, args.seq_len, end_ids, args.max_tokens)
    out = Path(args.out).expanduser()
    save_atomically(answers_path(out), answers)
    save_atomically(out, rows)
    print(f"{n_conv} conversations ({n_long} of >= {args.seq_len} tokens) -> {rows.shape[0]} rows of {args.seq_len} -> {out}")


if __name__ == "__main__":
    main()
