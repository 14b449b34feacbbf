"""A target's caches for a batch of requests whose rows accept different
numbers of tokens every cycle.

mlx-lm's ``BatchKVCache`` keeps one write index for every row and trims
every row by the same count, so a batch verified there can only keep what
every row accepted (or shift each row's whole cache every cycle). Here each
row keeps its own length (:class:`Rows`): a verify of ``S`` tokens writes
row ``b``'s keys at its own slots ``end_b .. end_b + S - 1`` (one scatter),
every query sees only its row's slots up to its own position, and a
rollback just sets each row's length to what it kept. The rejected slots
stay behind as garbage the mask hides and the next cycle overwrites: no
row pays for another's rejections, and no cache is copied per cycle.

A row's slot ``t`` holds position ``t + shift_b``: 0 for a full-attention
layer; for a sliding-window layer, the positions its rotating cache had
already evicted when the row joined, plus the leading slots every row's
window has passed since (dropped now and then to bound the memory). RoPE
is applied at each row's own positions (``offset``, an array: mlx-lm's
attention layers pass it to ``mx.fast.rope``, which takes one offset per
batch row, as they do for ``BatchKVCache``).

GatedDeltaNet layers keep mlx-lm's ``ArraysCache`` (one state per row);
their per-row rollback is the hybrid adapter's. Rows join from, and leave
as, the single-request caches the rest of the project uses (``KVCache``,
``RotatingKVCache``, ``ArraysCache``), so a request's prompt cache is the
same object before, during and after its time in a batch.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..errors import ArgumentError
from ..ops.padded import stack_padded
from .attention import hold_in_time_order
from .base import TargetCache

STEP = 256  # slots a buffer grows by, and leading slots dropped at a time


class Rows:
    """The positions of a batch's rows, shared by every layer's cache:
    ``pos[b]`` is the position of row ``b``'s next token. A forward of ``S``
    tokens reads them (every layer at the same positions); the rollback that
    follows moves each row on by the tokens it kept (:meth:`advance`)."""

    def __init__(self, pos: Sequence[int]):
        self.pos = [int(p) for p in pos]
        self._offset = None

    @property
    def offset(self) -> mx.array:
        if self._offset is None:
            self._offset = mx.array(self.pos, dtype=mx.int32)
        return self._offset

    def advance(self, kept: Sequence[int]) -> None:
        self.pos = [p + int(k) for p, k in zip(self.pos, kept)]
        self._offset = None

    def take(self, keep: Sequence[int]) -> None:
        self.pos = [self.pos[i] for i in keep]
        self._offset = None

    def __len__(self) -> int:
        return len(self.pos)


class RaggedKVCache:
    """One attention layer's keys and values for a batch of rows of their
    own lengths (see the module docstring); mlx-lm's cache protocol where a
    layer uses it (``offset``, ``update_and_fetch``, ``make_mask``)."""

    def __init__(self, rows: Rows, keys, values, shift: Sequence[int], window: Optional[int] = None):
        self.rows = rows
        self.keys, self.values = keys, values  # [B, H, slots, D] (None: no row holds any yet)
        self.shift = [int(s) for s in shift]
        self.window = window  # a rotating layer's size (None: full attention)

    @property
    def offset(self) -> mx.array:
        return self.rows.offset

    def ends(self) -> List[int]:
        """Each row's next write slot."""
        return [p - s for p, s in zip(self.rows.pos, self.shift)]

    def update_and_fetch(self, keys, values):
        B, H, S, _ = keys.shape
        ends = self.ends()
        need = max(ends) + S
        if self.keys is None:
            slots = -(-need // STEP) * STEP
            self.keys = mx.zeros((B, H, slots, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((B, H, slots, values.shape[3]), values.dtype)
        elif need > self.keys.shape[2]:
            grow = -(-(need - self.keys.shape[2]) // STEP) * STEP
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)
        at = (mx.array(ends, dtype=mx.int32)[:, None] + mx.arange(S, dtype=mx.int32))[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values, axis=2)
        return self.keys[..., :need, :], self.values[..., :need, :]

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False, **kwargs):
        """``[B, 1, N, slots]``: query ``j`` of row ``b`` sees that row's
        slots up to its own, and only the last ``window_size`` of them."""
        ends = mx.array(self.ends(), dtype=mx.int32)
        slots = mx.arange(max(self.ends()) + N, dtype=mx.int32)
        query = ends[:, None, None] + mx.arange(N, dtype=mx.int32)[None, :, None]  # [B, N, 1]
        mask = slots[None, None, :] <= query
        if window_size is not None:
            mask = mask & (query - slots[None, None, :] < window_size)
        return mask[:, None]

    def drop_passed(self) -> None:
        """Drop the leading slots every row's window has passed (a sliding
        layer's memory stays bounded by its window, as a rotating cache's)."""
        if self.window is None:
            return
        dead = min(self.ends()) - self.window
        if dead >= STEP:
            dead -= dead % STEP
            self.keys, self.values = self.keys[..., dead:, :], self.values[..., dead:, :]
            self.shift = [s + dead for s in self.shift]

    def take(self, keep: Sequence[int]) -> None:
        if self.keys is not None:
            idx = mx.array(list(keep), dtype=mx.int32)
            self.keys, self.values = self.keys[idx], self.values[idx]
        self.shift = [self.shift[i] for i in keep]

    def row(self, b: int):
        """Row ``b`` as the single-request cache it joined as."""
        end, pos = self.ends()[b], self.rows.pos[b]
        if self.window is None:
            cache = KVCache()
            cache.keys = mx.contiguous(self.keys[b : b + 1, :, :end])
            cache.values = mx.contiguous(self.values[b : b + 1, :, :end])
            cache.offset = end
            return cache
        held = min(end, self.window)
        keys = mx.contiguous(self.keys[b : b + 1, :, end - held : end])
        values = mx.contiguous(self.values[b : b + 1, :, end - held : end])
        cache = RotatingKVCache(max_size=self.window, keep=0)
        hold_in_time_order(cache, keys, values, pos, 0, self.window)
        return cache

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def check_joinable(caches) -> None:
    """Refuse, before any work, a request whose target caches (one per
    layer) cannot join a batch: a batch's rows share one cache per layer,
    and a cache quantizing at its own position (kv_bits) cannot."""
    kv = getattr(caches, "kv", None)
    if kv is not None and kv.bits is not None:
        raise ArgumentError(
            "a prompt cache made with kv_bits cannot join a batch (its rows would quantize at different "
            "positions): decode it alone (stream_generate, or a BatchGenerator with completion_batch_size=1), or batch "
            "caches made without kv_bits"
        )
    for c in caches:
        if isinstance(c, RotatingKVCache) and c.keep:
            raise ArgumentError(
                "a prompt cache made with max_kv_size (rotating caches that keep their first tokens) cannot join "
                "a batch: decode it alone (stream_generate, or a BatchGenerator with completion_batch_size=1), or batch "
                "caches made without max_kv_size"
            )
        if not isinstance(c, (KVCache, RotatingKVCache, ArraysCache, RaggedKVCache)):
            raise ArgumentError(
                f"a {type(c).__name__} cannot join a batch (quantized KV caches are not batched): "
                "decode this prompt cache alone (stream_generate), or batch a cache made by make_prompt_cache"
            )


def in_time_order(cache: RotatingKVCache):
    """A rotating cache's held keys and values, oldest first."""
    keys, values, offset, keep, max_size, idx = cache.state
    if keys is None:
        return None, None
    if idx == keys.shape[2]:
        return keys, values
    if idx < offset:
        order = lambda v: mx.concatenate([v[..., idx:, :], v[..., :idx, :]], axis=2)  # noqa: E731
        return order(keys), order(values)
    return keys[..., :idx, :], values[..., :idx, :]


def held_rows(cache, position: int):
    """A single request's attention cache as ``[((keys, values), shift)]``:
    its held keys and values ``[1, H, n, D]`` in time order (None: empty),
    and the positions before them it no longer holds."""
    if isinstance(cache, RaggedKVCache):
        return [
            ((None, None) if cache.keys is None else (cache.keys[b : b + 1, :, :end], cache.values[b : b + 1, :, :end]), shift)
            for b, (end, shift) in enumerate(zip(cache.ends(), cache.shift))
        ]
    check_joinable([cache])
    if isinstance(cache, RotatingKVCache):
        k, v = in_time_order(cache)
    else:
        k, v = (None, None) if cache.keys is None else (cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])
    return [((k, v), position - (0 if k is None else k.shape[2]))]


def join_layer(rows: Rows, caches: Sequence, sizes: Sequence[int]):
    """One layer's caches of several requests (or batches of ``sizes``
    rows) as one batch cache, their rows in order."""
    if isinstance(caches[0], ArraysCache):
        return join_arrays(caches)
    window = next((c.window if isinstance(c, RaggedKVCache) else c.max_size for c in caches
                   if isinstance(c, (RaggedKVCache, RotatingKVCache))), None)
    held, at = [], 0
    for c, n in zip(caches, sizes):
        held += held_rows(c, rows.pos[at])
        at += n
    keys, values = stack_padded([h for h, _ in held], STEP)
    return RaggedKVCache(rows, keys, values, [s for _, s in held], window)


def join_arrays(caches: Sequence[ArraysCache]) -> ArraysCache:
    """Recurrent states (mlx-lm's ``ArraysCache``, one or more rows each) stacked."""
    out = ArraysCache(len(caches[0].cache))
    for e in range(len(out.cache)):
        like = next((c[e] for c in caches if c[e] is not None), None)
        if like is None:  # (requests before their first forward)
            continue
        out[e] = mx.concatenate(
            [c[e] if c[e] is not None else mx.zeros((c.batch_size, *like.shape[1:]), like.dtype) for c in caches]
        )
    return out


class BatchCache(TargetCache):
    """A batch's per-layer target caches and the rows' positions they share."""

    rows: Rows
    batched = True

    @classmethod
    def join(cls, parts: Sequence[TargetCache], positions: Sequence[int]) -> "BatchCache":
        """Requests' caches (single-request ``TargetCache``s, or batches),
        their rows in order; ``positions``: every row's next position."""
        rows = Rows(positions)
        sizes = [len(p.rows) if isinstance(p, BatchCache) else 1 for p in parts]
        batch = cls(join_layer(rows, layer, sizes) for layer in zip(*parts))
        batch.rows = rows
        return batch

    def take(self, keep: Sequence[int]) -> None:
        """Keep only the rows ``keep``, in that order."""
        keep = list(keep)
        for c in self:
            if isinstance(c, ArraysCache):
                c.filter(mx.array(keep, dtype=mx.int32))
            else:
                c.take(keep)
        self.rows.take(keep)

    def row(self, b: int) -> TargetCache:
        """Row ``b`` as a single request's target cache."""
        return TargetCache(c.extract(b) if isinstance(c, ArraysCache) else c.row(b) for c in self)

    def advance(self, kept: Sequence[int]) -> None:
        """After a verify forward: each row keeps its first ``kept[b]``
        tokens (attention slots past them are garbage the mask hides)."""
        self.rows.advance(kept)
        for c in self:
            if isinstance(c, RaggedKVCache):
                c.drop_passed()
