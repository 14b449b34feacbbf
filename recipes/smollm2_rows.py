"""Pack the self-distillation shards into training rows for ``mlx-dflash train``.

    python recipes/smollm2_rows.py --shards ~/.cache/dflash_mlx/smollm2/distill \\
        --seq-len 1024 --out ~/.cache/dflash_mlx/smollm2/rows-1024.npy

The conversations (chat-templated prompt + the target's answer) follow each
other in shard order and are cut into rows of exactly ``--seq-len`` tokens,
as in language-model pre-training: a row may end one conversation and start
the next, which the target reads as a longer chat. The leftover shorter than
a row is dropped. Rows are a 2-D int32 ``.npy`` (each row one training
window, as ``--cache-target`` wants), written atomically.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from smollm2_distill import read_shard  # noqa: E402


def pack(shards, seq_len: int, max_shards=None):
    """(rows [n, seq_len] int32, conversations read, conversations >= seq_len)."""
    convs = []
    for path in sorted(shards)[:max_shards]:
        convs.extend(read_shard(path)[0])
    stream = np.concatenate(convs) if convs else np.zeros(0, np.int32)
    n = len(stream) // seq_len
    rows = stream[: n * seq_len].reshape(n, seq_len).astype(np.int32)
    return rows, len(convs), sum(len(c) >= seq_len for c in convs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", required=True, help="directory of shard-*.npz from smollm2_distill.py")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-shards", type=int, default=None, help="use only the first N shards (a fixed data set while more are made)")
    p.add_argument("--out", required=True, help="rows .npy to write")
    args = p.parse_args(argv)
    shards = list(Path(args.shards).expanduser().glob("shard-*.npz"))
    if not shards:
        raise SystemExit(f"error: no shard-*.npz in {args.shards}: run recipes/smollm2_distill.py first")
    rows, n_conv, n_long = pack(shards, args.seq_len, args.max_shards)
    out = Path(args.out).expanduser()
    tmp = out.with_name(out.name + ".tmp.npy")
    np.save(tmp, rows)
    os.replace(tmp, out)
    print(f"{n_conv} conversations ({n_long} of >= {args.seq_len} tokens) -> {rows.shape[0]} rows of {args.seq_len} -> {out}")


if __name__ == "__main__":
    main()
