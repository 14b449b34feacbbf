"""A target's KV caches as mlx-lm's generate makes them: quantized
(``kv_bits``, ``kv_group_size``, ``quantized_kv_start``) or bounded
(``max_kv_size``), exact under speculation.

Quantized: mlx-lm's ``generate_step`` runs the model, then converts every
``KVCache`` whose offset is at least ``quantized_kv_start`` to a
``QuantizedKVCache`` (``maybe_quantize_kv_cache``), after each prefill
chunk and after each one-token step. So a forward that starts at offset
``p > 0`` runs on quantized caches exactly when ``p >= quantized_kv_start``
(the call before it ended at ``p``), which is the check
:func:`quantize_due` makes before every forward. A verify block stands for
one-token steps: the part of it before ``quantized_kv_start`` runs on the
float caches, the rest on the quantized ones (:func:`forward_kv` splits it
there); a rollback into the float part puts the float caches back
(:class:`SplitUndo`). A prefill chunk (an unrecorded forward) is one mlx-lm
chunk and is not split, so the prefill must chunk as mlx-lm's
``prefill_step_size`` does for the same result. ``QuantizedKVCache.trim``
is exact (new rows overwrite the trimmed ones).

Bounded: every full-attention layer's ``KVCache`` becomes mlx-lm's
``RotatingKVCache(max_kv_size, keep=4)`` (what mlx-lm's
``make_prompt_cache`` makes for a model without its own ``make_cache``);
sliding windows keep their own caches. Rollback is the sliding windows'
(:mod:`.attention`); a verify block is masked as one-token steps see the
ring (the first ``keep`` positions and the newest ``max_kv_size - keep``).

What a decode loop does with them: make the prompt cache with the
settings (:func:`dflash_mlx.cache.prompt_cache_for` takes mlx-lm's
keywords), prefill in chunks of mlx-lm's ``prefill_step_size``, and
nothing more per cycle: the adapter's ``forward`` converts, splits and
records, its ``rollback`` undoes. A draft tree must not cross
``quantized_kv_start``: the loop caps its depth with
``TargetCache.rows_before_quantizing()`` (a crossing tree is refused).
"""

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from ..errors import ArgumentError, DFlashError

# What mx.quantize takes (mlx 0.31); mlx-lm passes kv_bits and kv_group_size through.
KV_BITS = (1, 2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
# mlx-lm's defaults (mlx_lm.generate.generate_step) and its rotating caches' sink.
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
ROTATING_KEEP = 4


def whole(value, name: str, least: int) -> int:
    """``value`` if it is a whole number of at least ``least``, else one clear error."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ArgumentError(f"{name} must be a whole number of at least {least}, not {value!r}")
    return value


@dataclass(frozen=True)
class KVSettings:
    """mlx-lm's cache settings, checked: ``bits`` None keeps the caches
    float; ``max_size`` None leaves them unbounded."""

    bits: Optional[int] = None
    group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_start: int = DEFAULT_QUANTIZED_KV_START
    max_size: Optional[int] = None

    def __post_init__(self):
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in KV_BITS):
            raise ArgumentError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (or None: no quantization), not {self.bits!r}")
        if isinstance(self.group_size, bool) or self.group_size not in KV_GROUP_SIZES:
            raise ArgumentError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, not {self.group_size!r}")
        whole(self.quantized_start, "quantized_kv_start", 0)
        if self.max_size is not None:
            whole(self.max_size, "max_kv_size", ROTATING_KEEP + 1)
        if self.bits is not None and self.max_size is not None:
            raise ArgumentError(
                "kv_bits and max_kv_size cannot be used together: mlx-lm has no quantized rotating cache "
                "(RotatingKVCache.to_quantized is not implemented); pass one of them"
            )

    @classmethod
    def of(cls, kv_bits=None, kv_group_size=None, quantized_kv_start=None, max_kv_size=None) -> Optional["KVSettings"]:
        """The settings from mlx-lm's keywords (None each: its default);
        None when they ask for mlx-lm's plain caches."""
        settings = cls(
            kv_bits,
            DEFAULT_KV_GROUP_SIZE if kv_group_size is None else kv_group_size,
            DEFAULT_QUANTIZED_KV_START if quantized_kv_start is None else quantized_kv_start,
            max_kv_size,
        )
        return None if settings == cls() else settings

    def as_json(self) -> list:
        return [self.bits, self.group_size, self.quantized_start, self.max_size]


def make_kv_caches(model, settings: Optional[KVSettings], head_dims: List[int]) -> list:
    """``model``'s per-layer mlx-lm caches under ``settings`` (None: mlx-lm's
    own); ``head_dims``: its attention layers' key/value widths, which the
    group size must divide. A model with sliding windows cannot quantize
    its caches (mlx-lm's rotating caches have no quantized form)."""
    caches = make_prompt_cache(model)
    if settings is None:
        return caches
    if settings.bits is not None:
        if any(isinstance(c, RotatingKVCache) for c in caches):
            raise ArgumentError(
                "kv_bits cannot quantize this target's sliding-window caches (mlx-lm's RotatingKVCache has no "
                "quantized form, and mlx-lm's generate fails on it too): leave kv_bits out for this model"
            )
        bad = next((d for d in head_dims if d % settings.group_size), None)
        if bad is not None:
            fits = [str(g) for g in KV_GROUP_SIZES if bad % g == 0]
            fix = f"pass kv_group_size={' or '.join(fits)}" if fits else "leave kv_bits out for this model"
            raise ArgumentError(f"kv_group_size {settings.group_size} does not divide this target's head size {bad}: {fix}")
    if settings.max_size is not None:
        caches = [RotatingKVCache(settings.max_size, keep=ROTATING_KEEP) if type(c) is KVCache else c for c in caches]
    return caches


def float_caches(cache) -> List[int]:
    """The layers whose ``KVCache`` a quantizing cache still holds float."""
    return [i for i, c in enumerate(cache) if type(c) is KVCache]


def quantize_due(cache) -> bool:
    """Convert ``cache``'s float ``KVCache`` layers to mlx-lm's
    ``QuantizedKVCache`` where mlx-lm's decode would have by now (their
    offset is past 0 and at least ``quantized_kv_start``); returns whether
    it did. Every forward of the adapter calls it first."""
    settings = cache.kv
    if settings is None or settings.bits is None:
        return False
    done = False
    for i in float_caches(cache):
        c = cache[i]
        if c.offset > 0 and c.offset >= settings.quantized_start:
            cache[i] = c.to_quantized(group_size=settings.group_size, bits=settings.bits)
            done = True
    return done


def rows_before_quantizing(cache) -> Optional[int]:
    """How many more positions run on float caches (None: no conversion
    is ahead; at least 1: the forward at offset 0 runs float, as mlx-lm's first)."""
    settings, floats = cache.kv, float_caches(cache)
    if settings is None or settings.bits is None or not floats:
        return None
    return max(settings.quantized_start - cache[floats[0]].offset, 1)


@dataclass
class SplitUndo:
    """A verify block run as two forwards, float then quantized: the
    float forward's record, its length, the float caches the conversion
    replaced (layer -> cache) and the quantized forward's record."""

    first: object
    length: int
    floats: dict
    second: object


def forward_kv(adapter, tokens, cache, *, taps=None, last_logits_only=False, record=True, tree=None):
    """The adapter's forward (``forward_block``) with its caches converted
    when due, and a recorded chain block that crosses
    ``quantized_kv_start`` split there (see the module docstring)."""
    quantize_due(cache)
    kw = dict(taps=taps, last_logits_only=last_logits_only, record=record, tree=tree)
    split = rows_before_quantizing(cache)
    span = tokens.shape[1] if tree is None else max(tree.depths) + 1  # positions the forward covers
    if not record or split is None or split >= span:
        return adapter.forward_block(tokens, cache, **kw)
    if tree is not None:
        # The tree's rows past quantized_kv_start would need their float
        # ancestors' keys quantized first.
        raise DFlashError(
            f"a draft tree crosses quantized_kv_start ({cache.kv.quantized_start}): build it at most "
            f"{split - 1} deep here (TargetCache.rows_before_quantizing), or verify a chain"
        )
    first_logits, first_taps = adapter.forward_block(tokens[:, :split], cache, **kw)
    first, floats = cache.undo, {i: cache[i] for i in float_caches(cache)}
    quantize_due(cache)
    logits, taps_out = adapter.forward_block(tokens[:, split:], cache, **kw)
    cache.undo = SplitUndo(first, split, floats, cache.undo)
    if not last_logits_only:
        logits = mx.concatenate([first_logits, logits], axis=1)
    if taps_out is not None:
        taps_out = mx.concatenate([first_taps, taps_out], axis=1)
    return logits, taps_out


def rollback_kv(adapter, cache, keep) -> None:
    """The adapter's rollback (``rewind``) of a forward :func:`forward_kv`
    may have split: keeping only float rows puts the float caches back."""
    undo = cache.undo
    if not isinstance(undo, SplitUndo):
        adapter.rewind(cache, keep)
        return
    cache.undo = undo.second
    if keep >= undo.length:
        adapter.rewind(cache, keep - undo.length)
        return
    adapter.rewind(cache, 0)
    for i, c in undo.floats.items():
        cache[i] = c
    cache.undo = undo.first
    adapter.rewind(cache, keep)


def kv_bytes(cache) -> int:
    """Bytes of the keys and values ``cache``'s attention layers hold
    (mlx-lm's ``nbytes``: a float cache's buffer, a quantized one's packed
    data, scales and biases), recurrent states left out."""
    return sum(c.nbytes for c in cache if isinstance(c, (KVCache, QuantizedKVCache, RotatingKVCache)))
