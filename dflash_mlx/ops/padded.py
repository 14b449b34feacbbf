"""Per-request rows ``[1, H, n, D]`` of different lengths held as one batch
buffer ``[B, H, slots, D]``: a batch's ragged target caches
(:mod:`dflash_mlx.targets.rows`) and its drafter contexts
(:class:`dflash_mlx.models.dflash.ContextRows`) both start from one."""

from typing import Optional, Sequence, Tuple

import mlx.core as mx


def stack_padded(held: Sequence[Tuple[Optional[mx.array], Optional[mx.array]]], step: int):
    """Each row's ``(keys, values)`` (None: it holds none) at slots
    ``0..n-1`` of new buffers with room for one more row, in multiples of
    ``step`` slots; ``(None, None)`` when no row holds any."""
    like = next(((k, v) for k, v in held if k is not None), None)
    if like is None:
        return None, None
    k0, v0 = like
    slots = -(-(max(0 if k is None else k.shape[2] for k, _ in held) + 1) // step) * step
    keys = mx.zeros((len(held), k0.shape[1], slots, k0.shape[3]), k0.dtype)
    values = mx.zeros((len(held), v0.shape[1], slots, v0.shape[3]), v0.dtype)
    for b, (k, v) in enumerate(held):
        if k is not None:
            keys[b : b + 1, :, : k.shape[2]] = k
            values[b : b + 1, :, : v.shape[2]] = v
    return keys, values
