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
"""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import RotatingKVCache


def layer_masks(h: mx.array, caches: Sequence, windows: Sequence[Optional[int]]) -> List:
    """One attention mask per layer, built from the first cache with that
    layer's window (``None``: full attention), as mlx-lm's models build them."""
    built = {}
    for c, window in zip(caches, windows):
        if window not in built:
            built[window] = create_attention_mask(h, c, window_size=window)
    return [built[w] for w in windows]


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
    keys, values = keys[..., :rows, :], values[..., :rows, :]
    offset -= drop
    if rows < max_size <= offset:
        # keep == 0 after a wrap leaves window - 1 rows, all a next query
        # needs; mlx-lm's one-token path expects a full ring, so put back one
        # placeholder row in front, which either update path evicts first.
        keys = mx.concatenate([keys[..., :1, :], keys], axis=2)
        values = mx.concatenate([values[..., :1, :], values], axis=2)
        rows += 1
    cache.state = (keys, values, offset, sink, max_size, rows)


def rewind_caches(caches: Sequence, length: int, keep: int) -> None:
    """Roll every attention cache back to ``keep`` of the last forward's
    ``length`` tokens."""
    if length - keep <= 0:
        return
    for c in caches:
        if isinstance(c, RotatingKVCache):
            rewind_rotating(c, length, keep)
        else:
            c.trim(length - keep)
