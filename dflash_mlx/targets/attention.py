"""Attention caches of a target: per-layer masks and exact rollback, sliding
windows included.

mlx-lm's ``RotatingKVCache.trim`` only moves counters, and its
``is_trimmable`` turns False once the window has wrapped, so
``trim_prompt_cache`` then silently trims nothing. A verify block of S > 1
tokens goes through the cache's concat path, which keeps the last
``window - 1`` rows before the block and appends the block's S rows in time
order: every row a kept prefix needs is still there, so a rollback cuts the
rejected rows off the end (as z-lab's ``dflash`` 0.1.0 does; a bare
``trim`` would leave them behind, and a one-token step would then evict live
rows instead). The buffer stays in time order, which both of mlx-lm's update
paths accept.

A draft tree (:mod:`dflash_mlx.tree`) is verified in one forward too: its
rows go through the same concat path, each row seeing the context and its
own ancestors (:func:`tree_masks`) at position context + depth
(:class:`TreeRope`). Rolling back to the walked path first moves that
path's rows to the front of the block (a gather, :func:`keep_rows`), then
cuts the rest off as for a chain.
"""

from contextlib import contextmanager
from typing import List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache


def sliding_window(cache) -> Optional[int]:
    """The window of the layer ``cache`` belongs to (None: full attention):
    a rotating cache's size, or a batch's ragged cache's (:mod:`.rows`)."""
    if isinstance(cache, RotatingKVCache):
        return cache.max_size
    return getattr(cache, "window", None)


def ring_keep(cache) -> int:
    """The first positions a rotating cache never evicts (mlx-lm's ``keep``; 0 for any other cache)."""
    return cache.keep if isinstance(cache, RotatingKVCache) else 0


def ring_mask(n: int, cache: RotatingKVCache) -> mx.array:
    """``[n, context + n]`` bool: what ``n`` one-token steps would see of
    a rotating cache that keeps its first ``keep`` positions: those, and
    the newest ``max_size - keep`` up to each step's own (mlx-lm's mask
    for a block slides the whole window over the kept positions)."""
    held = context_rows(cache)
    rows = held + mx.arange(n)[:, None]
    cols = mx.arange(held + n)[None]
    return (cols <= rows) & ((cols < cache.keep) | (rows - cols < cache.max_size - cache.keep))


def layer_masks(h: mx.array, caches: Sequence, windows: Sequence[Optional[int]], return_array: bool = False, decode: bool = False) -> List:
    """One attention mask per layer, built from the first cache with that
    layer's window (``None``: full attention), as mlx-lm's models build them
    (``return_array``: as arrays, never mlx-lm's "causal" shorthand).
    ``decode``: the block stands for one-token steps, so a rotating cache
    that keeps its first positions is masked as those steps see it
    (:func:`ring_mask`)."""
    built = {}
    keys = [(w, ring_keep(c)) for c, w in zip(caches, windows)]
    for c, key in zip(caches, keys):
        if key not in built:
            if decode and key[1] and h.shape[1] > 1:
                built[key] = ring_mask(h.shape[1], c)
            else:
                built[key] = create_attention_mask(h, c, window_size=key[0], return_array=return_array)
    return [built[k] for k in keys]


def rewind_rotating(cache: RotatingKVCache, length: int, keep: int) -> None:
    """Keep the first ``keep`` of the ``length`` tokens the last forward added."""
    drop = length - keep
    if length == 1:
        # The one-token ring write overwrote the oldest slot, a row no query
        # from this position on can see: moving the counters back is exact.
        cache.trim(drop)
        return
    keys, values, offset, sink, max_size, idx = cache.state
    rows = idx - drop  # the concat path leaves rows in time order, idx == rows
    hold_in_time_order(cache, keys[..., :rows, :], values[..., :rows, :], offset - drop, sink, max_size)


def hold_in_time_order(cache: RotatingKVCache, keys, values, offset: int, sink: int, max_size: int) -> None:
    """Set ``cache`` to hold ``keys``/``values`` (oldest first, the newest
    at position ``offset - 1``), as both of mlx-lm's update paths read them."""
    rows = keys.shape[2]
    if rows < max_size <= offset:
        # window - 1 rows after a wrap are all a next query needs; mlx-lm's
        # one-token path expects a full ring, so put back one placeholder row
        # right after the ``sink`` rows it keeps, which either update path
        # evicts first.
        keys, values = [mx.concatenate([v[..., : sink + 1, :], v[..., sink:, :]], axis=2) for v in (keys, values)]
        rows += 1
    cache.state = (keys, values, offset, sink, max_size, rows)


Keep = Union[int, Sequence[int]]


def kept_rows(keep: Keep) -> List[int]:
    """A rollback's ``keep`` as rows of the last forward: a count keeps the
    first rows (a chain's accepted prefix), a list keeps those rows (a
    tree's walked path, in increasing order)."""
    return list(range(keep)) if isinstance(keep, int) else [int(r) for r in keep]


def keep_rows(cache, length: int, rows: Sequence[int]) -> None:
    """Move ``rows`` of the last forward's ``length`` rows to the front of
    them, in order (their keys and values only: positions were applied
    before caching); the rows after them are then cut off as a chain's."""
    quantized = isinstance(cache, QuantizedKVCache)  # keys and values: (data, scales, biases) each
    arrays = [*cache.keys, *cache.values] if quantized else [cache.keys, cache.values]
    start = (cache.offset if isinstance(cache, (KVCache, QuantizedKVCache)) else arrays[0].shape[2]) - length
    idx = mx.array(np.asarray(rows, dtype=np.int32) + start)
    end = start + len(rows)
    for a in arrays:
        a[..., start:end, :] = a[..., idx, :]


def rewind_caches(caches: Sequence, length: int, keep: Keep) -> None:
    """Roll every attention cache back to ``keep`` (see :func:`kept_rows`)
    of the last forward's ``length`` rows."""
    rows = kept_rows(keep)
    if length - len(rows) <= 0:
        return
    gather = rows != list(range(len(rows)))
    for c in caches:
        if gather:
            keep_rows(c, length, rows)
        if isinstance(c, RotatingKVCache):
            rewind_rotating(c, length, len(rows))
        else:
            c.trim(length - len(rows))


def context_rows(cache) -> int:
    """Keys of the context the next multi-row forward on ``cache`` attends
    to: all of a full cache; at most ``window - 1`` of a sliding one (what
    its concat path keeps in front of a block, in time order)."""
    if not isinstance(cache, RotatingKVCache):
        return cache.offset
    keys, _, offset, _, max_size, idx = cache.state
    if keys is None:
        return 0
    held = keys.shape[2] if idx == keys.shape[2] or idx < offset else idx
    return min(held, max_size - 1)


def tree_mask(tree, context: int, window: Optional[int], keep: int = 0) -> mx.array:
    """``[rows, context + rows]`` bool: each tree row sees the ``context``
    keys before the block (the most recent last) and its own ancestors,
    only those less than ``window - keep`` positions back (``None``: all)
    and the first ``keep`` context keys (see :func:`ring_mask`)."""
    depths = np.asarray(tree.depths)
    seen = tree.ancestors()
    if window is None:  # built on the device: the context may be long
        return mx.concatenate([mx.ones((tree.rows, context), dtype=mx.bool_), mx.array(seen)], axis=1)
    back = context - np.arange(context)[None, :] + depths[:, None]  # distance to each context key
    seen = seen & (depths[:, None] - depths[None, :] < window - keep)
    return mx.array(np.concatenate([(back < window - keep) | (np.arange(context)[None, :] < keep), seen], axis=1))


def tree_masks(tree, caches: Sequence, windows: Sequence[Optional[int]]) -> List[mx.array]:
    """:func:`tree_mask` per layer, from the first cache with that layer's window."""
    built = {}
    keys = [(w, ring_keep(c)) for c, w in zip(caches, windows)]
    for c, key in zip(caches, keys):
        if key not in built:
            built[key] = tree_mask(tree, context_rows(c), *key)
    return [built[k] for k in keys]


class TreeRope(nn.Module):
    """A layer's rope at explicit positions, one per row: the rows become
    the batch of ``mx.fast.rope``, which takes one offset per batch entry
    (bit-identical to the row at that offset alone). The attention's own
    offset argument is ignored."""

    def __init__(self, rope, positions: mx.array):
        super().__init__()
        self.rope = rope
        self.positions = positions

    def __call__(self, x, offset=0):
        return self.rope(x.swapaxes(0, 2), offset=self.positions).swapaxes(0, 2)


@contextmanager
def tree_positions(attentions: Sequence[nn.Module], positions: np.ndarray):
    """For one forward's graph, each of these attention modules (this
    model instance's, never the class) rotates its rows at ``positions``."""
    positions = mx.array(positions)
    saved = [a.rope for a in attentions]
    try:
        for a, rope in zip(attentions, saved):
            a.rope = TreeRope(rope, positions)
        yield
    finally:
        for a, rope in zip(attentions, saved):
            a.rope = rope
