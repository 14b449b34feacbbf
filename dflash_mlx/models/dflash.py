"""DFlash block-diffusion drafter (z-lab ``DFlashDraftModel`` checkpoints).

A few Qwen3-style layers that draft a whole block in one forward pass. The
drafter owns no embedding or LM head: it borrows the target's (``bind``). The
target's tap hidden states are fused (``fc`` + ``hidden_norm``) and injected
into every layer as extra keys/values (KV injection); block slots attend to
that context and to each other (non-causal unless the config says otherwise).
"""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..defaults import DEFAULT_BLOCK_SIZE
from ..errors import CheckpointError
from ..ops import fast_math
from ..ops.padded import stack_padded
from ..sampling import processed_probs, sample

FULL, SLIDING = "full_attention", "sliding_attention"


class DraftConfigError(CheckpointError):
    """A drafter config.json that cannot be honoured."""


# The largest size a drafter dimension may have: MLX shapes are int32, and
# no published drafter comes near it.
MAX_DIM = 1 << 24
MAX_POSITIONS = (1 << 31) - 1


def whole(name: str, value, lo: Optional[int] = None, hi: int = MAX_DIM, error=None) -> int:
    """A config.json integer (from ``lo`` to ``hi`` when ``lo`` is given),
    refused with its name, as ``error`` (default DraftConfigError), when it
    is anything else."""
    error = error or DraftConfigError
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an integer, not {value!r}: fix config.json")
    if lo is not None and not lo <= value <= hi:
        raise error(f"{name} must be from {lo} to {hi}, not {value}: fix config.json")
    return value


def real(name: str, value, lo: Optional[float] = None, error=None) -> float:
    """A config.json number (finite; above ``lo`` when given), refused with its name."""
    error = error or DraftConfigError
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise error(f"{name} must be a finite number, not {value!r}: fix config.json")
    if lo is not None and value <= lo:
        raise error(f"{name} must be above {lo}, not {value}: fix config.json")
    return float(value)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """Tap layers when the config names none: one in the middle for a
    one-layer drafter, else evenly spaced from layer 1 to
    ``num_target_layers - 3`` (z-lab/dflash, ``build_target_layer_ids``)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return [int(round(start + i * step)) for i in range(num_draft_layers)]


def tap_layer_ids(tap_ids, num_target_layers: Optional[int], n_layers: int) -> List[int]:
    """The config's ``target_layer_ids``, checked, or the default ones."""
    if tap_ids is None:
        if num_target_layers is None:
            raise DraftConfigError(
                "drafter config.json names neither dflash_config.target_layer_ids "
                "nor num_target_layers, so the target taps are unknown"
            )
        return default_target_layer_ids(num_target_layers, n_layers)
    if not isinstance(tap_ids, list) or not tap_ids:
        raise DraftConfigError(f"target_layer_ids must be a non-empty list of layer indices, not {tap_ids!r}")
    return [whole("target_layer_ids", i, 0) for i in tap_ids]


def draft_rope(cfg: Dict[str, Any]) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, scaling config for ``initialize_rope`` or None).

    RoPE comes as ``rope_theta`` + ``rope_scaling`` or, in transformers 5
    exports, under ``rope_parameters``, which may be nested per layer type
    (``{"full_attention": {...}, "sliding_attention": {...}}``); a DFlash
    drafter applies one RoPE to all its layers.
    """
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if rope is not None and not isinstance(rope, dict):
        raise DraftConfigError(f"rope_parameters / rope_scaling must be an object, not {rope!r}: fix config.json")
    if rope and all(isinstance(v, dict) for v in rope.values()):
        kinds = list(rope.values())
        if any(k != kinds[0] for k in kinds):
            raise DraftConfigError(
                f"rope_parameters differ between layer types {sorted(rope)}; a DFlash "
                "drafter applies one RoPE to all its layers"
            )
        rope = kinds[0]
    rope_theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta", 10000.0)
    if rope is not None and (rope.get("rope_type") or rope.get("type")) in (None, "default"):
        rope = None  # plain RoPE: nothing for initialize_rope to scale
    return real("rope_theta", rope_theta, 0), rope


def draft_layer_types(cfg: Dict[str, Any], dflash: Dict[str, Any], n_layers: int):
    """(layer_types, sliding_window) from every variant published configs use."""
    sliding_window = cfg.get("sliding_window") or dflash.get("swa_window_size")
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise DraftConfigError(f"layer_types must be a list of layer type names, not {layer_types!r}")
    if not layer_types:
        use_swa = dflash.get("use_swa", cfg.get("use_sliding_window", False))
        layer_types = [SLIDING if use_swa and sliding_window else FULL] * n_layers
    elif dflash.get("use_swa") is False:
        layer_types = [FULL] * n_layers
    if len(layer_types) != n_layers:
        raise DraftConfigError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    unknown = set(layer_types) - {FULL, SLIDING}
    if unknown:
        raise DraftConfigError(f"unsupported layer_types {sorted(unknown)}")
    if SLIDING in layer_types and not sliding_window:
        raise DraftConfigError("sliding_attention layers need sliding_window")
    return layer_types, whole("sliding_window", sliding_window, 1) if sliding_window else None


def check_draft_vocab(ids, vocab_size: int) -> Optional[List[int]]:
    """``dflash_config.draft_vocab`` as a list of ints: distinct target ids,
    ascending, inside the vocabulary (None: the whole vocabulary)."""
    if ids is None:
        return None
    if not isinstance(ids, list):
        raise DraftConfigError(f"draft_vocab must be a list of target ids, not {type(ids).__name__}: fix config.json")
    ids = [whole("draft_vocab[]", i) for i in ids]
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise DraftConfigError(
            f"draft_vocab must be distinct ascending target ids in 0..{vocab_size - 1} "
            f"({len(ids)} given)"
        )
    return ids


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: List[int]
    mask_token_id: int
    block_size: int = DEFAULT_BLOCK_SIZE
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    num_target_layers: Optional[int] = None
    target_hidden_size: Optional[int] = None
    layer_types: List[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    architecture: str = "DFlashDraftModel"
    # DFlash2 fields; zero / neutral for DFlash1 checkpoints.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    # A draft vocabulary (FR-Spec, arXiv 2502.14856; EAGLE-3's d2t map): the
    # target ids the head scores, ascending; None scores the whole vocabulary.
    draft_vocab: Optional[List[int]] = None

    @classmethod
    def from_hf(cls, cfg: Dict[str, Any]) -> "DFlashConfig":
        """Parse every config variant found in published drafters; a value of
        the wrong type or range is refused, naming its field."""
        if not isinstance(cfg, dict):
            raise DraftConfigError("drafter config.json must hold a JSON object")
        dflash = cfg.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise DraftConfigError(f"dflash_config must be an object, not {dflash!r}")

        def pick(name, default=None):
            return dflash.get(name, cfg.get(name, default))

        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
            if k not in cfg
        ]
        if missing:
            raise DraftConfigError(f"drafter config.json lacks {', '.join(missing)}")
        hidden = whole("hidden_size", cfg["hidden_size"], 1)
        n_layers = whole("num_hidden_layers", cfg["num_hidden_layers"], 1)
        n_heads = whole("num_attention_heads", cfg["num_attention_heads"], 1)
        n_kv_heads = whole("num_key_value_heads", cfg.get("num_key_value_heads") or n_heads, 1)
        if n_heads % n_kv_heads:
            raise DraftConfigError(f"num_key_value_heads {n_kv_heads} does not divide num_attention_heads {n_heads}")
        head_dim = whole("head_dim", cfg.get("head_dim") or hidden // n_heads, 1)
        vocab = whole("vocab_size", cfg["vocab_size"], 1)

        num_target_layers = cfg.get("num_target_layers")
        if num_target_layers is not None:
            num_target_layers = whole("num_target_layers", num_target_layers, 1)
        tap_ids = tap_layer_ids(pick("target_layer_ids"), num_target_layers, n_layers)
        mask_id = pick("mask_token_id")
        if mask_id is None:
            raise DraftConfigError("drafter config.json lacks dflash_config.mask_token_id")
        if not 0 <= whole("mask_token_id", mask_id) < vocab:
            raise DraftConfigError(f"mask_token_id {mask_id} is outside the drafter vocabulary (vocab_size {vocab})")

        rope_theta, rope = draft_rope(cfg)
        layer_types, sliding_window = draft_layer_types(cfg, dflash, n_layers)

        is_causal = dflash.get("causal") if cfg.get("is_causal") is None else cfg["is_causal"]
        for name, flag in (("is_causal", is_causal), ("attention_bias", cfg.get("attention_bias", False))):
            if flag is not None and not isinstance(flag, bool):
                raise DraftConfigError(f"{name} must be true or false, not {flag!r}")

        archs = cfg.get("architectures") or ["DFlashDraftModel"]
        softcap = pick("final_logit_softcapping")
        target_hidden = cfg.get("target_hidden_size")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            head_dim=head_dim,
            intermediate_size=whole("intermediate_size", cfg["intermediate_size"], 1),
            vocab_size=vocab,
            target_layer_ids=tap_ids,
            mask_token_id=mask_id,
            block_size=whole("block_size", pick("block_size", DEFAULT_BLOCK_SIZE), 1),
            rms_norm_eps=real("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6), 0),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=whole("max_position_embeddings", cfg.get("max_position_embeddings") or 32768, 1, MAX_POSITIONS),
            attention_bias=cfg.get("attention_bias", False),
            num_target_layers=num_target_layers,
            target_hidden_size=None if target_hidden is None else whole("target_hidden_size", target_hidden, 1),
            layer_types=layer_types,
            sliding_window=sliding_window,
            is_causal=is_causal,
            architecture=archs[0] if isinstance(archs, list) and archs else archs,
            conv_kernel_size=whole("conv_kernel_size", pick("conv_kernel_size", 0) or 0, 0),
            conv_group_size=whole("conv_group_size", pick("conv_group_size", 0) or 0, 0),
            selector_rank=whole("selector_rank", pick("selector_rank", 0) or 0, 0),
            selector_top_k=whole("selector_top_k", pick("selector_top_k", 0) or 0, 0),
            input_embedding_scale=real("input_embedding_scale", pick("input_embedding_scale", 1.0) or 1.0),
            output_multiplier=real("output_multiplier", pick("output_multiplier", 1.0) or 1.0),
            final_logit_softcapping=real("final_logit_softcapping", softcap, 0) if softcap else None,
            draft_vocab=check_draft_vocab(pick("draft_vocab"), vocab),
        )

    @property
    def fc_input_size(self) -> int:
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)


class ContextCache:
    """Per-layer K/V of the injected target context, committed positions only.

    ``offset`` counts every context position ever injected (the absolute
    RoPE position of the next one). The cache keeps the first ``sink``
    positions and the last ``window`` (None: all of them) and projects only
    those: a position outside both is never read again, since new context
    only pushes it further out. A sliding layer keeps ``window - 1`` (its
    trained window less one: the anchor, the first block slot, sits one past
    the context) and no sink, which its mask would hide anyway.

    The rows held are the sink's, then the tail: the contiguous run of
    positions that ends at ``offset``. ``skipped`` is set by the prompt
    cache when it dropped pending tap states nothing would read: the
    positions ``(start, end)`` that the next injected context lacks.
    """

    step = 256

    def __init__(self, window: Optional[int] = None, sink: int = 0):
        self.window = window
        self.sink = sink if window is not None else 0
        self.keys = self.values = None
        self.offset = 0  # absolute positions injected so far
        self.size = 0  # rows held: sink rows first, then the tail
        self.sink_size = 0  # rows at positions 0..sink_size-1
        self.skipped: Optional[Tuple[int, int]] = None
        self.rows: Optional["ContextRows"] = None  # where its rows live while a batch drafts it
        self.row = 0  # its row there

    def positions(self) -> mx.array:
        """Absolute positions of the rows held, in their order."""
        tail = self.size - self.sink_size
        return mx.concatenate([mx.arange(self.sink_size), mx.arange(self.offset - tail, self.offset)])

    def inject(self, context: mx.array, project) -> None:
        """Take the next context rows ``[B, n, D]`` (all positions past
        ``offset``, less ``skipped``): ``project(rows, position)`` gives the
        K/V of the rows this cache keeps, at their absolute positions."""
        n = context.shape[1]
        start, end = self.skipped or (self.offset + n, self.offset + n)
        gap = end - start
        last = self.offset + n + gap  # one past the last position injected

        def rows(a, b):  # context rows of positions a..b-1, all on one side of the gap
            i = a - self.offset - (gap if a >= end else 0)
            return context[:, i : i + b - a]

        if self.offset < min(self.sink, last):
            self.append(*project(rows(self.offset, min(self.sink, last)), self.offset))
            self.sink_size = self.size
        first = max(self.offset, self.sink, last - self.window if self.window is not None else 0)
        if first < end and start < last:  # the tail cannot span dropped positions
            first = max(first, end)
        if first > self.offset:  # the tail restarts at first: nothing older is contiguous with it
            self.drop(self.size - self.sink_size)
        if first < last:
            self.append(*project(rows(first, last), first))
        self.offset, self.skipped = last, None
        if self.window is not None and self.size - self.sink_size > self.window:
            self.drop(self.size - self.sink_size - self.window)

    def context_positions(self, n: int) -> mx.array:
        """The absolute positions of the next ``n`` context rows :meth:`inject`
        takes (past ``offset``, less ``skipped``)."""
        start, end = self.skipped or (self.offset + n, self.offset + n)
        rows = mx.arange(self.offset, self.offset + n, dtype=mx.int32)
        return mx.where(rows >= start, rows + (end - start), rows)

    def context_index(self, position: int) -> int:
        """The row of the next context that holds ``position`` (see :meth:`context_positions`)."""
        start, end = self.skipped or (position + 1, position + 1)
        return position - self.offset - ((end - start) if position >= end else 0)

    def append(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        if self.rows is not None:
            self.rows.write(self.row, keys, values)
            self.size += n
            return
        if self.keys is None or self.size + n > self.keys.shape[2]:
            grow = ((self.size + n + self.step - 1) // self.step) * self.step
            shape = (*keys.shape[:2], grow, keys.shape[3])
            new_k = mx.zeros(shape, keys.dtype)
            new_v = mx.zeros((*shape[:3], values.shape[3]), values.dtype)
            if self.size:
                new_k[..., : self.size, :] = self.keys[..., : self.size, :]
                new_v[..., : self.size, :] = self.values[..., : self.size, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., self.size : self.size + n, :] = keys
        self.values[..., self.size : self.size + n, :] = values
        self.size += n

    def drop(self, n: int) -> None:
        """Evict the ``n`` oldest tail rows."""
        if n <= 0:
            return
        if self.rows is not None:
            self.rows.evict(self.row, n)
            self.size -= n
            return
        s = self.sink_size
        if s:
            self.keys = mx.concatenate([self.keys[..., :s, :], self.keys[..., s + n :, :]], axis=2)
            self.values = mx.concatenate([self.values[..., :s, :], self.values[..., s + n :, :]], axis=2)
        else:
            self.keys, self.values = self.keys[..., n:, :], self.values[..., n:, :]
        self.size -= n

    def fetch(self) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        if self.rows is not None:
            return self.rows.held_by(self.row)
        if self.keys is None:
            return None, None
        return self.keys[..., : self.size, :], self.values[..., : self.size, :]

    def unlink(self) -> None:
        """Take its rows back from the batch buffer they live in (if any)."""
        if self.rows is not None:
            self.rows.release(self.row)

    @property
    def state(self):
        return self.fetch()

    @state.setter
    def state(self, v):
        self.unlink()
        self.keys, self.values = v
        self.size = 0 if self.keys is None else self.keys.shape[2]

    @property
    def meta_state(self):
        return [self.window, self.sink, self.offset, self.sink_size]

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.sink, self.offset, self.sink_size = v

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.fetch() if a is not None)

    def is_trimmable(self) -> bool:
        """Always: trimming back past rows this cache evicted leaves the
        drafter's context without them (a weaker draft, never a different
        output: the target verifies every token)."""
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` injected positions (a prompt cache rewound);
        rows evicted before stay gone."""
        self.unlink()
        n = max(0, min(self.offset, n))
        self.offset -= n
        self.skipped = None
        tail = max(0, self.size - self.sink_size - n)
        self.sink_size = min(self.sink_size, self.offset)
        self.size = self.sink_size + tail
        if self.size == 0:
            self.keys = self.values = None
        return n


class ContextRows:
    """One drafter layer's context for a batch of requests, in one buffer
    ``[B, H, slots, D]``. Each request's :class:`ContextCache` still decides
    what it holds (its sink, its window, the positions it skips), but while
    linked here its rows live at its own slots of this buffer: its sink
    rows, then rows its window evicted (dead slots, reclaimed when the
    buffer grows), then its tail. A batched drafter forward reads every
    request's context where it stands, masked (:meth:`view`), rather than
    gathering and padding each one every cycle. A request takes its rows
    back when it is unlinked (:meth:`ContextCache.unlink`)."""

    step = ContextCache.step

    def __init__(self, caches: List[ContextCache]):
        self.caches: List[Optional[ContextCache]] = list(caches)
        self.dead = [0] * len(caches)
        self.keys = self.values = None
        held = [c.fetch() for c in caches]
        for b, c in enumerate(caches):
            c.keys = c.values = None
            c.rows, c.row = self, b
        self.rebuild(held)

    @classmethod
    def of(cls, caches: List[ContextCache]) -> "ContextRows":
        """The buffer one layer's ``caches`` (every request's, in batch
        order) live in: the one they are linked to, or a new one if the
        batch has changed since."""
        rows = caches[0].rows
        if rows is not None and len(rows.caches) == len(caches) and all(a is b for a, b in zip(rows.caches, caches)):
            return rows
        for c in caches:
            c.unlink()
        return cls(caches)

    def used(self, b: int) -> int:
        return self.caches[b].size + self.dead[b]

    def rebuild(self, held) -> None:
        """A buffer holding each row's ``held`` (keys, values), no dead slots."""
        keys, values = stack_padded(held, self.step)
        if keys is not None:
            self.keys, self.values = keys, values
            self.dead = [0] * len(held)

    def write(self, b: int, keys: mx.array, values: mx.array) -> None:
        """Row ``b`` appends ``keys``/``values`` ``[1, H, n, D]`` after its tail."""
        n = keys.shape[2]
        if self.keys is None:
            slots = -(-n // self.step) * self.step
            self.keys = mx.zeros((len(self.caches), keys.shape[1], slots, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((len(self.caches), values.shape[1], slots, values.shape[3]), values.dtype)
        elif self.used(b) + n > self.keys.shape[2]:
            self.rebuild([self.held_by(i) if c is not None else (None, None) for i, c in enumerate(self.caches)])
            if self.used(b) + n > self.keys.shape[2]:
                grow = -(-(self.used(b) + n - self.keys.shape[2]) // self.step) * self.step
                pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
                self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)
        at = self.used(b)
        self.keys[b : b + 1, :, at : at + n] = keys
        self.values[b : b + 1, :, at : at + n] = values

    def evict(self, b: int, n: int) -> None:
        """Row ``b``'s ``n`` oldest tail rows are dead."""
        self.dead[b] += n

    def held_by(self, b: int) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """Row ``b``'s rows, as its own cache holds them: sink, then tail."""
        c = self.caches[b]
        if self.keys is None or c.size == 0:
            return None, None
        tail = slice(c.sink_size + self.dead[b], self.used(b))
        if not c.sink_size:
            return self.keys[b : b + 1, :, tail], self.values[b : b + 1, :, tail]
        return (
            mx.concatenate([self.keys[b : b + 1, :, : c.sink_size], self.keys[b : b + 1, :, tail]], axis=2),
            mx.concatenate([self.values[b : b + 1, :, : c.sink_size], self.values[b : b + 1, :, tail]], axis=2),
        )

    def release(self, b: int) -> None:
        """Row ``b``'s cache takes its rows back; this buffer no longer serves it."""
        c = self.caches[b]
        k, v = self.held_by(b)
        c.rows = None
        c.keys, c.values = (None, None) if k is None else (mx.contiguous(k), mx.contiguous(v))
        self.caches[b] = None

    def view(self):
        """``(keys, values, seen, positions)``: every row's slots so far
        ``[B, H, W, D]``, which of them it holds ``[B, W]`` and their
        absolute positions ``[B, W]`` (garbage where not held); all None
        when no row holds any."""
        width = max(self.used(b) for b in range(len(self.caches)))
        if self.keys is None or width == 0:
            return None, None, None, None
        sink = mx.array([c.sink_size for c in self.caches], dtype=mx.int32)[:, None]
        tail = mx.array([c.sink_size + d for c, d in zip(self.caches, self.dead)], dtype=mx.int32)[:, None]
        end = mx.array([self.used(b) for b in range(len(self.caches))], dtype=mx.int32)[:, None]
        first = mx.array([c.offset - (c.size - c.sink_size) for c in self.caches], dtype=mx.int32)[:, None]
        slot = mx.arange(width, dtype=mx.int32)[None]
        seen = (slot < sink) | ((slot >= tail) & (slot < end))
        positions = mx.where(slot < sink, slot, first + slot - tail)
        return self.keys[..., :width, :], self.values[..., :width, :], seen, positions


def visible_positions(
    queries: mx.array, keys: mx.array, *, is_causal: bool, sliding_window: Optional[int]
) -> Optional[mx.array]:
    """Whether a query at position ``queries`` sees a key at ``keys``
    (broadcast against each other); None when everything is visible.

    As z-lab/dflash's PyTorch drafter (``dflash/model.py``): causal keeps
    keys at or before the query; a sliding window hides keys at distance >=
    window (both directions when non-causal).
    """
    if not is_causal and sliding_window is None:
        return None
    visible = mx.array(True)
    if is_causal:
        visible = visible & (keys <= queries)
    if sliding_window is not None:
        visible = visible & (queries - keys < sliding_window)
        if not is_causal:
            visible = visible & (keys - queries < sliding_window)
    return visible


def draft_attention_mask(
    ctx_positions: mx.array,
    block_positions: mx.array,
    *,
    is_causal: bool,
    sliding_window: Optional[int],
) -> Optional[mx.array]:
    """Boolean [L, S+L] visibility of context + block keys for block queries
    (:func:`visible_positions`); None when everything is visible."""
    keys = mx.concatenate([ctx_positions, block_positions])[None, :]
    return visible_positions(block_positions[:, None], keys, is_causal=is_causal, sliding_window=sliding_window)


def masked_block(draft, anchor: int, size: int) -> mx.array:
    """A drafter's input ``[1, size]``: the anchor, then ``size - 1`` of
    its mask tokens."""
    return masked_blocks(draft, [anchor], size)


def masked_blocks(draft, anchors: List[int], size: int) -> mx.array:
    """:func:`masked_block` for a batch of requests: ``[len(anchors), size]``."""
    return mx.array([[anchor] + [draft.mask_token_id] * (size - 1) for anchor in anchors])


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        dim, hd = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.scale = hd**-0.5
        sliding = config.layer_types[layer_idx] == SLIDING
        self.sliding_window = config.sliding_window if sliding else None
        # z-lab/dflash (dflash/model.py) treats sliding layers as causal
        # unless the config says otherwise.
        self.is_causal = sliding if config.is_causal is None else config.is_causal
        self.sees_all = not self.is_causal and self.sliding_window is None
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)

    def project_kv(self, x: mx.array, rope, offset) -> Tuple[mx.array, mx.array]:
        """K/V of ``x`` at absolute positions ``offset..``: [B, H_kv, S, D];
        ``offset`` an array: one start per batch row, or (``B == 1``, ``S``
        entries) each row's own position."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, S, self.n_kv_heads, -1))
        v = self.v_proj(x).reshape(B, S, self.n_kv_heads, -1)
        if isinstance(offset, mx.array) and offset.size == S != B:  # a position per row: rows as rope's batch
            k = rope(k.transpose(1, 2, 0, 3), offset=offset).transpose(2, 1, 0, 3)
        else:
            k = rope(k.transpose(0, 2, 1, 3), offset=offset)
        return k, v.transpose(0, 2, 1, 3)

    def cpu_attention(self, q, k, v, seen: Optional[mx.array] = None):
        """Grouped-query attention with a fused approximate softmax: MLX's
        CPU softmax spends most of a drafter layer's attention in exp.
        ``seen`` ``[B, 1, 1, S]``: the keys each batch row may see (None: all)."""
        B, H, L, D = q.shape
        groups = (q * self.scale).reshape(B, self.n_kv_heads, H // self.n_kv_heads, L, D)
        scores = groups @ k[:, :, None].swapaxes(-1, -2)
        if seen is None:
            probs = fast_math.softmax_approx(scores)
        else:
            seen = seen[:, None]
            top = mx.max(mx.where(seen, scores, -mx.inf), axis=-1, keepdims=True)
            e = fast_math.exp_below_where(scores, top, seen)
            probs = e / mx.sum(e, axis=-1, keepdims=True)
        return (probs @ v[:, :, None]).reshape(B, H, L, D)

    def __call__(self, x, context, rope, cache: ContextCache) -> mx.array:
        L = x.shape[1]
        # Inject the new context first: the block starts right after it.
        if context.shape[1]:
            cache.inject(context, lambda rows, at: self.project_kv(rows, rope, at))
        block_start = cache.offset
        mask = None
        if not self.sees_all:
            mask = draft_attention_mask(
                cache.positions(),
                mx.arange(block_start, block_start + L),
                is_causal=self.is_causal,
                sliding_window=self.sliding_window,
            )
        return self.attend(x, block_start, rope, cache.fetch(), mask)

    def attend(self, x, starts, rope, context_kv, mask) -> mx.array:
        """The block ``x`` (its rows starting at ``starts``) attending to
        ``context_kv`` (keys and values, or Nones) and to itself, under
        ``mask`` (None: everything is visible)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1))
        q = rope(q.transpose(0, 2, 1, 3), offset=starts)
        k, v = self.project_kv(x, rope, starts)
        ctx_k, ctx_v = context_kv
        if ctx_k is not None:
            k, v = mx.concatenate([ctx_k, k], axis=2), mx.concatenate([ctx_v, v], axis=2)
        if self.sees_all and not self.training and fast_math.approx_for(q):
            out = self.cpu_attention(q, k, v, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def rows(self, x, contexts, rope, caches: List[ContextCache]) -> mx.array:
        """:meth:`__call__` for a batch of requests: row ``b`` of ``x``
        attends to its own context (``caches[b]``, after injecting
        ``contexts[b]``, None: nothing new) and its own block. Every row's
        new context is projected in one call, at its own positions, into
        the batch's one buffer (:class:`ContextRows`); what a row does not
        hold there is masked."""
        B, L, _ = x.shape
        shared = ContextRows.of(caches)
        new = [b for b, context in enumerate(contexts) if context is not None and context.shape[1]]
        if new:
            positions = mx.concatenate([caches[b].context_positions(contexts[b].shape[1]) for b in new])
            keys, values = self.project_kv(mx.concatenate([contexts[b] for b in new], axis=1), rope, positions)
            at = 0
            for b in new:
                n, cache = contexts[b].shape[1], caches[b]
                k_b, v_b = keys[..., at : at + n, :], values[..., at : at + n, :]
                index = cache.context_index  # the row of each position injected, as inject asks
                cache.inject(contexts[b], lambda rows, p: (k_b[..., index(p) : index(p) + rows.shape[1], :], v_b[..., index(p) : index(p) + rows.shape[1], :]))
                at += n
        starts = mx.array([c.offset for c in caches], dtype=mx.int32)
        ctx_k, ctx_v, seen, ctx_positions = shared.view()
        block = starts[:, None] + mx.arange(L, dtype=mx.int32)[None]  # [B, L] positions
        if ctx_k is not None:
            seen = mx.concatenate([seen, mx.ones((B, L), mx.bool_)], axis=1)
            key_positions = mx.concatenate([ctx_positions, block], axis=1)
        else:
            seen, key_positions = None, block
        mask = None if seen is None else seen[:, None, :]  # [B, 1, W + L]
        visible = visible_positions(block[:, :, None], key_positions[:, None, :], is_causal=self.is_causal, sliding_window=self.sliding_window)
        if visible is not None:
            mask = visible if mask is None else visible & mask
        return self.attend(x, starts, rope, (ctx_k, ctx_v), None if mask is None else mask[:, None])


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        if not self.training and fast_math.approx_for(x):
            return self.down_proj(fast_math.swiglu_approx(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = DraftMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, context, rope, cache):
        h = x + self.self_attn(self.input_layernorm(x), context, rope, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def rows(self, x, contexts, rope, caches):
        """:meth:`__call__` for a batch of requests (see :meth:`DraftAttention.rows`)."""
        h = x + self.self_attn.rows(self.input_layernorm(x), contexts, rope, caches)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """The drafter. Low-level contract (mirrors z-lab's MLX runtime)::

        draft.bind(target_model)
        cache = draft.make_cache()
        logits = draft(block_tokens, target_hidden, cache)   # [B, L, vocab]
        tokens = draft.propose(block_tokens, target_hidden, cache)  # slots 1..L-1
        tokens, q = draft.propose_with_probs(block_tokens, target_hidden, cache, temperature)

    ``target_hidden`` holds the concatenated tap states of the S context
    positions not yet injected; they are appended to ``cache`` (so call each
    context chunk once). Block K/V are never stored.
    """

    layer_class = DraftLayer

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.fc_input_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        # Borrowed from the target by bind(); kept out of the parameter tree
        # so saving or quantizing the drafter never touches them.
        self._target = None
        self._draft_head = None  # the target's head rows of the draft vocabulary
        self._vocab_ids = None  # the draft vocabulary's target ids, as an array

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def check_block_size(self, block_size: int) -> None:
        """Any block size works for DFlash (slots are independent of the
        block length); DFlash2 overrides this to warn off its trained size."""

    def bind(self, target_model) -> "DFlashDraftModel":
        """Share the target's embedding and LM head (not copied). Binding
        again to the model already bound keeps its adapter (and whatever the
        adapter compiled), so callers may bind before every use."""
        from ..targets import adapter_for

        bound = self._target
        if bound is None or (target_model is not bound and target_model is not bound.model):
            object.__setattr__(self, "_target", adapter_for(target_model, self.config))
            object.__setattr__(self, "_draft_head", None)
        return self

    @property
    def target(self):
        if self._target is None:
            raise RuntimeError("drafter is not bound: call draft.bind(target_model) first")
        return self._target

    def make_cache(self, window: Optional[int] = None, sink: int = 0) -> List[ContextCache]:
        """One context cache per layer. ``window``/``sink`` (the draft
        window) bound the full-attention layers' context; sliding layers keep
        their trained window (see :class:`ContextCache`)."""
        sliding = self.config.sliding_window
        return [
            ContextCache(sliding - 1) if t == SLIDING else ContextCache(window, sink) for t in self.config.layer_types
        ]

    def fuse(self, target_hidden: mx.array) -> mx.array:
        """Feature fusion: concatenated taps -> one drafter-width vector."""
        return self.hidden_norm(self.fc(target_hidden))

    def layer_inputs(self, block_tokens, target_hidden, embed=None) -> Tuple[mx.array, mx.array]:
        """(block slot states, fused context) that the first layer reads;
        ``embed`` defaults to the bound target's (training passes its own)."""
        h = self.embed_block(block_tokens, embed)
        return h, self.fuse(target_hidden.astype(h.dtype))

    def embed_block(self, block_tokens, embed=None) -> mx.array:
        """The block's slot states before the first layer."""
        h = (self.target.embed if embed is None else embed)(block_tokens)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        return h

    def hidden_states(self, block_tokens, target_hidden, cache) -> mx.array:
        """Final (normed) drafter states of every block slot."""
        h, context = self.layer_inputs(block_tokens, target_hidden)
        for layer, c in zip(self.layers, cache):
            h = layer(h, context, self.rope, c)
        return self.norm(h)

    def head_logits(self, hidden: mx.array) -> mx.array:
        """Logits over the draft vocabulary, ``[..., K]`` (the whole
        vocabulary when the config has none): what training's loss reads."""
        if self.config.draft_vocab is None:
            logits = self.target.lm_head(hidden)
        else:
            if self._draft_head is None:
                object.__setattr__(self, "_draft_head", self.target.lm_head_rows(self.config.draft_vocab))
            logits = self._draft_head(hidden)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def compute_logits(self, hidden: mx.array) -> mx.array:
        """Logits over the target vocabulary. With a draft vocabulary only its
        ids are scored and every other id is ``-inf``: greedy proposals are
        target ids, and a sampled slot's ``q`` is a proper distribution over
        target ids (zero outside), so speculative sampling stays exact."""
        logits = self.head_logits(hidden)
        ids = self.config.draft_vocab
        if ids is None:
            return logits
        full = mx.full((*logits.shape[:-1], self.config.vocab_size), -mx.inf, logits.dtype)
        index = mx.broadcast_to(mx.array(ids, mx.int32), logits.shape)
        return mx.put_along_axis(full, index, logits, axis=-1)

    def __call__(self, block_tokens, target_hidden, cache) -> mx.array:
        return self.compute_logits(self.hidden_states(block_tokens, target_hidden, cache))

    def rows_hidden(self, block_tokens, target_hidden: List[Optional[mx.array]], caches: List[List[ContextCache]], slots: int) -> mx.array:
        """Final states ``[B, slots, D]`` of every row's drafted slots, in one
        drafter forward: row ``b`` of ``block_tokens [B, L]`` reads its own
        context (``caches[b]``, fed ``target_hidden[b]``)."""
        h = self.embed_block(block_tokens)
        contexts = [None] * len(target_hidden)
        new = [b for b, t in enumerate(target_hidden) if t is not None]
        if new:  # every row's new context fused in one call
            fused = self.fuse(mx.concatenate([target_hidden[b] for b in new], axis=1).astype(h.dtype))
            at = 0
            for b in new:
                n = target_hidden[b].shape[1]
                contexts[b], at = fused[:, at : at + n], at + n
        for i, layer in enumerate(self.layers):
            h = layer.rows(h, contexts, self.rope, [c[i] for c in caches])
        return self.norm(h)[:, 1 : 1 + slots]

    def draft_rows(self, block_tokens, target_hidden: List[Optional[mx.array]], caches: List[List[ContextCache]], slots: int, samplings: List[Optional[dict]], keys=None):
        """One drafter forward for a batch of requests (:meth:`rows_hidden`).
        Returns the proposals ``[B, slots]`` and, per row, the ``q`` its
        tokens were sampled from (None: greedy; a row's ``samplings[b]``
        holds :func:`processed_probs`' settings, or None; ``keys[b]`` its
        random key, or None)."""
        hidden = self.rows_hidden(block_tokens, target_hidden, caches, slots)
        head = self.head_logits(hidden)
        best = mx.argmax(head, axis=-1)
        tokens = best if self.vocab_ids is None else self.vocab_ids[best]
        qs = [None] * len(samplings)
        if any(samplings):
            logits = self.compute_logits(hidden)
            rows = []
            for b, sampling in enumerate(samplings):
                if sampling is None:
                    rows.append(tokens[b])
                else:
                    qs[b] = processed_probs(logits[b], **sampling)
                    rows.append(sample(qs[b], None if keys is None else keys[b]))
            tokens = mx.stack(rows)
        return tokens, qs

    def slot_logits_rows(self, block_tokens, target_hidden: List[Optional[mx.array]], caches: List[List[ContextCache]], slots: int) -> mx.array:
        """:meth:`slot_logits` of every row ``[B, slots, V]``, in one drafter
        forward (:meth:`rows_hidden`)."""
        return self.compute_logits(self.rows_hidden(block_tokens, target_hidden, caches, slots))

    def slot_hidden(self, block_tokens, target_hidden, cache, slots: Optional[int] = None) -> mx.array:
        """Final states of the drafted slots 1..``slots`` (default all, L-1).
        The drafter reads the whole block whatever a cycle verifies; only
        the head is cut to the slots the cycle will use."""
        h = self.hidden_states(block_tokens, target_hidden, cache)
        return h[:, 1:] if slots is None else h[:, 1 : 1 + slots]

    def slot_logits(self, block_tokens, target_hidden, cache, slots: Optional[int] = None) -> mx.array:
        """Logits over the target vocabulary of the drafted slots 1..``slots``
        (the anchor's are never used)."""
        return self.compute_logits(self.slot_hidden(block_tokens, target_hidden, cache, slots))

    def slot_head_logits(self, block_tokens, target_hidden, cache, slots: Optional[int] = None) -> mx.array:
        """Logits over the draft vocabulary (:meth:`head_logits`) of the
        drafted slots 1..``slots``: what greedy proposals and draft trees
        rank. Column ``j`` is target id ``vocab_ids[j]`` (the id itself
        without a draft vocabulary)."""
        return self.head_logits(self.slot_hidden(block_tokens, target_hidden, cache, slots))

    @property
    def vocab_ids(self) -> Optional[mx.array]:
        """The target id of each head column (None: column ``j`` is id ``j``)."""
        if self.config.draft_vocab is None:
            return None
        if self._vocab_ids is None:
            object.__setattr__(self, "_vocab_ids", mx.array(self.config.draft_vocab, mx.int32))
        return self._vocab_ids

    def propose(self, block_tokens, target_hidden, cache, slots: Optional[int] = None) -> mx.array:
        """Greedy tokens for slots 1..``slots`` (default L-1): [B, slots]
        (sampling uses :meth:`propose_with_probs`). The argmax is taken over
        the draft vocabulary and mapped to target ids: the same token as the
        argmax over :meth:`compute_logits`, whose other ids are -inf."""
        best = mx.argmax(self.slot_head_logits(block_tokens, target_hidden, cache, slots), axis=-1)
        return best if self.vocab_ids is None else self.vocab_ids[best]

    def propose_with_probs(
        self,
        block_tokens,
        target_hidden,
        cache,
        temperature: float,
        top_p: float = 0.0,
        top_k: int = 0,
        min_p: float = 0.0,
        slots: Optional[int] = None,
        key=None,
    ) -> Tuple[mx.array, mx.array]:
        """Sampled tokens for slots 1..``slots`` (default L-1) and the
        distribution ``q`` they were drawn from, ``([B, slots], [B, slots,
        V])``: what speculative sampling needs to verify them. ``q`` is
        processed like the target's ``p``; ``key``: the request's own random
        key (None: ``mx.random``'s state). Drafters differ only in how they
        draw (:meth:`draw`).
        """
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        return self.draw(block_tokens, target_hidden, cache, sampling, slots, key)

    def draw(self, block_tokens, target_hidden, cache, sampling: dict, slots: Optional[int] = None, key=None) -> Tuple[mx.array, mx.array]:
        """:meth:`propose_with_probs` with ``sampling`` holding
        :func:`processed_probs`' settings: each slot independently."""
        q = processed_probs(self.slot_logits(block_tokens, target_hidden, cache, slots), **sampling)
        return sample(q, key), q


def draft_config_for_target(
    target_args,
    *,
    num_layers: int = 2,
    block_size: int = DEFAULT_BLOCK_SIZE,
    target_layer_ids: Optional[List[int]] = None,
    mask_token_id: int,
    intermediate_size: Optional[int] = None,
) -> dict:
    """A z-lab style drafter config.json sized to ``target_args`` (mlx-lm args),
    for training a new drafter."""
    hidden = int(target_args.hidden_size)
    n_target = int(target_args.num_hidden_layers)
    heads = int(target_args.num_attention_heads)
    taps = target_layer_ids or default_target_layer_ids(n_target, num_layers)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or int(target_args.intermediate_size),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(target_args, "num_key_value_heads", heads)),
        "head_dim": int(getattr(target_args, "head_dim", None) or hidden // heads),
        "vocab_size": int(target_args.vocab_size),
        "rms_norm_eps": float(target_args.rms_norm_eps),
        "rope_theta": 10000.0,
        "max_position_embeddings": int(getattr(target_args, "max_position_embeddings", 4096)),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": n_target,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": int(mask_token_id)},
    }
