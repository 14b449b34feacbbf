"""Hybrid targets (GatedDeltaNet + full attention): Qwen3.5 / Qwen3.6 and
Qwen3-Next (Qwen3-Coder-Next), whose GatedDeltaNet packs its projections
differently (:func:`projections`) but runs the same conv and recurrence.

A GatedDeltaNet layer's conv window and recurrent state cannot be trimmed.
During a verify forward we keep, per layer, the state before the block (MLX
arrays are immutable, so holding a reference is a free snapshot), the conv
input and what the recurrence needs for any prefix: the per-token
(q, k, v, a, b) when mlx-lm's recurrence ran (rollback re-runs it for the
kept tokens, bit-identical to a token-by-token decode), or the chunk's WY
deltas when the chunked form ran (the state after any prefix is one more
matmul). The layer's projections (the weight reads decode time is made of)
never run again, and a fully accepted block needs no replay at all.

A draft tree runs the recurrence parent-indexed (:func:`gated_delta_tree`):
level by level, each node's conv window and state taken from its parent's
path, mlx-lm's one-token update over a batch of the level's nodes. Every
node's states are kept, so rollback installs the walked leaf's.
"""

from dataclasses import dataclass
from functools import partial
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_ssm_mask
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextRMSNormGated

from ..errors import ArgumentError
from ..ops import fast_math
from ..ops.gated_delta import DeltaChunk, chunked_gated_delta, log_decay, state_after_rows
from ..ops.threads import compiled
from .attention import kept_rows, layer_masks, rewind_caches, sliding_window, tree_masks
from .base import TargetAdapter


# The WY form's chunk length for a prompt: its decays stay well within
# float32 range over a chunk this long, and its matrices small.
PROMPT_CHUNK = 64


def has_fused_recurrence() -> bool:
    """Whether mlx-lm will run the recurrence as its Metal kernel."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def silu(x):
    return fast_math.silu(x) if fast_math.use_for(x) else nn.silu(x)


def mlp_forward(mlp, x):
    """mlx-lm's dense MLP, its swiglu fused where that is bit-exact (see
    :mod:`..ops.fast_math`); any other block (MoE) runs as it is."""
    if isinstance(mlp, Qwen3NextMLP) and fast_math.use_for(x):
        return mlp.down_proj(fast_math.swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    return mlp(x)


def gated_norm(norm, x, gate):
    """mlx-lm's ``Qwen3NextRMSNormGated`` with the same fused swiglu."""
    if isinstance(norm, Qwen3NextRMSNormGated) and fast_math.use_for(x) and gate.dtype == mx.float32:
        return fast_math.swiglu(gate, mx.fast.rms_norm(x, norm.weight, norm.eps))
    return norm(x, gate)


@dataclass
class DeltaRecord:
    """What a GatedDeltaNet layer needs to rewind one verify forward."""

    conv_input: mx.array  # [B, K-1+S, conv_dim]
    state: Optional[mx.array]  # recurrent state before the forward
    chunk: Optional[DeltaChunk] = None  # set when the WY form ran the block
    # Per-token inputs of the recurrence, to replay it when there is no chunk.
    q: Optional[mx.array] = None
    k: Optional[mx.array] = None
    v: Optional[mx.array] = None
    a: Optional[mx.array] = None
    b: Optional[mx.array] = None


def projections(gdn, x):
    """A GatedDeltaNet layer's input projections of ``x``: the conv input
    (q, k, v side by side), the gate z ``[B, S, Hv, Dv]``, b and a ``[B, S,
    Hv]``. Qwen3.5 has one projection each; Qwen3-Next packs q, k, v, z and
    b, a into two, head-interleaved, unpacked by the module's own
    ``fix_query_key_value_ordering``."""
    B, S, _ = x.shape
    if hasattr(gdn, "in_proj_qkvz"):
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    return gdn.in_proj_qkv(x), z, gdn.in_proj_b(x), gdn.in_proj_a(x)


def gated_delta_forward(gdn, x, mask, cache, record: bool, chunked: bool = False):
    """mlx-lm's ``GatedDeltaNet.__call__`` for one instance, plus a record.

    Written against the module's own weights and mlx-lm's own helpers
    (``normalize_qk``, ``gated_delta_update``); the adapter test compares the
    whole target with the model's forward to catch any upstream change.
    """
    B, S, _ = x.shape
    qkv, z, b, a = projections(gdn, x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(gdn.conv_kernel_size - 1) :, :])
    conv_out = silu(gdn.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    state0 = cache[1]
    chunk = None
    if chunked and S > 1 and mask is None:
        # One chunk for a verify block (rollback reads any prefix state from
        # it); PROMPT_CHUNK-token chunks for a prompt.
        out, state, chunk = chunked_gated_delta(
            q, k, v, log_decay(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b), state0,
            chunk_size=S if record else PROMPT_CHUNK, compiled=record,
        )
        out = out.astype(q.dtype)
    else:
        out, state = gated_delta_update(
            q, k, v, a, b, gdn.A_log, gdn.dt_bias, state0, mask, use_kernel=not gdn.training
        )
    cache[1] = state
    cache.advance(S)
    rec = None
    if record:
        # Only a replay of mlx-lm's recurrence needs its per-token inputs;
        # a one-token forward is kept whole or not at all, so it never replays.
        per_token = (q, k, v, a, b) if chunk is None and S > 1 else ()
        rec = DeltaRecord(conv_input, state0, chunk, *per_token)
    out = gated_norm(gdn.norm, out, z)
    return gdn.out_proj(out.reshape(B, S, -1)), rec


class _SlotView:
    """A GatedDeltaNet cache's two slots as plain values, for a pure function."""

    def __init__(self, conv_state, state):
        self.slots = [conv_state, state]

    def __getitem__(self, i):
        return self.slots[i]

    def __setitem__(self, i, value):
        self.slots[i] = value

    def advance(self, n):
        pass


def linear_layer_block(layer, h, conv_state, state):
    """A whole GatedDeltaNet decoder layer over a verify block, as a pure
    function of its inputs: (h out, conv state, state, conv input, and the
    chunk's u, L, k for rollback). ``mx.compile`` fuses it (see
    :meth:`HybridTarget.forward`)."""
    view = _SlotView(conv_state, state)
    r, rec = gated_delta_forward(
        layer.linear_attn, layer.input_layernorm(h), None, view, record=True, chunked=True
    )
    h = h + r
    h = h + mlp_forward(layer.mlp, layer.post_attention_layernorm(h))
    c = rec.chunk
    return h, view[0], view[1], rec.conv_input, c.u, c.L, c.k


@dataclass
class TreeDeltaRecord:
    """What a GatedDeltaNet layer keeps of a tree verify: its caches before
    it, and each row's conv window and state after it (by depth level)."""

    conv_state: Optional[mx.array]
    state: Optional[mx.array]
    windows: mx.array  # [rows, K, conv_dim]: each row's conv input, itself last
    levels: List[mx.array]  # per depth: states [nodes at that depth, Hv, Dv, Dk]
    slot: List[int]  # per row: its index within its level


def conv_windows(parents: List[int], kernel: int) -> np.ndarray:
    """``[rows, kernel]`` indices into ``[conv state (kernel - 1 rows); tree
    rows]``: each row's conv input along its own path, itself last."""
    before = kernel - 1
    parent = [r - 1 for r in range(before)] + [before + p if p >= 0 else before - 1 for p in parents]
    out = np.zeros((len(parents), kernel), dtype=np.int32)
    for r in range(len(parents)):
        at = before + r
        for j in range(kernel - 1, -1, -1):
            out[r, j] = at
            at = max(parent[at], 0)  # only rows of the zero-padded start repeat
    return out


def gated_delta_tree(gdn, x, cache, tree) -> mx.array:
    """mlx-lm's ``GatedDeltaNet.__call__`` over a draft tree's rows: every
    projection row by row as usual; the conv over each row's own path and
    the recurrence level by level, each node continuing its parent's state.
    Leaves the cache's slots as they were before (rollback installs the
    walked leaf's, see :class:`TreeDeltaRecord`); returns the output and the record."""
    B, S, _ = x.shape
    qkv, z, b, a = projections(gdn, x)
    b, a = b[0], a[0]
    conv_state, state0 = cache[0], cache[1]
    if conv_state is None:
        conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    if state0 is None:
        state0 = mx.zeros((B, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), dtype=mx.float32)
    rows = mx.concatenate([conv_state, qkv], axis=1)[0]
    windows = rows[mx.array(conv_windows(tree.parents, gdn.conv_kernel_size))]  # [S, K, C]
    conv_out = silu(gdn.conv1d(windows))[:, -1]  # [S, C]
    q, k, v = [
        t.reshape(S, 1, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    levels, outs, order, slot = [], [], [], [0] * S
    for depth, level in enumerate(tree.levels()):
        for i, r in enumerate(level):
            slot[r] = i
        if depth == 0:
            before = state0
        else:
            before = levels[-1][mx.array([slot[tree.parents[r]] for r in level])]
        idx = mx.array(level)
        out, after = gated_delta_update(
            q[idx], k[idx], v[idx], a[idx][:, None], b[idx][:, None], gdn.A_log, gdn.dt_bias,
            before, None, use_kernel=not gdn.training,
        )
        levels.append(after)
        outs.append(out)
        order += level
    out = mx.concatenate(outs)[mx.array(np.argsort(order))].reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    rec = TreeDeltaRecord(cache[0], cache[1], windows, levels, slot)
    out = gated_norm(gdn.norm, out, z)
    return gdn.out_proj(out.reshape(B, S, -1)), rec


def rewind_tree(cache, rec: TreeDeltaRecord, tree, rows: List[int]) -> None:
    """Set ``cache`` to the state after the walked ``rows`` of a tree."""
    if not rows:
        cache[0], cache[1] = rec.conv_state, rec.state
        return
    leaf = rows[-1]
    cache[0] = rec.windows[leaf, 1:][None]
    cache[1] = rec.levels[tree.depths[leaf]][rec.slot[leaf]][None]


def rewind_gated_delta(gdn, cache, rec: DeltaRecord, keep) -> None:
    """Set ``cache`` to the state after the first ``keep`` tokens of ``rec``;
    ``keep`` a list: row ``b`` of a batch keeps its first ``keep[b]``."""
    n_keep = gdn.conv_kernel_size - 1
    length, whole = rec.conv_input.shape[1] - n_keep, cache[1]  # the forward's tokens, the state after all of them

    def state_after(n: int) -> mx.array:
        if n == 0:  # (a fresh cache's state is None: zeros)
            return mx.zeros_like(whole) if rec.state is None else rec.state
        if n == length:  # (a one-token forward keeps no per-token inputs)
            return whole
        if rec.chunk is not None:
            return rec.chunk.state_after(n)
        _, state = gated_delta_update(
            rec.q[:, :n], rec.k[:, :n], rec.v[:, :n], rec.a[:, :n], rec.b[:, :n],
            gdn.A_log, gdn.dt_bias, rec.state, None, use_kernel=not gdn.training,
        )
        return state

    if isinstance(keep, int):
        cache[0] = mx.contiguous(rec.conv_input[:, keep : keep + n_keep, :])
        cache[1] = state_after(keep)
        return
    kept = mx.array(list(keep), dtype=mx.int32)
    at = (kept[:, None] + mx.arange(n_keep, dtype=mx.int32))[..., None]  # [B, K-1, 1]
    cache[0] = mx.take_along_axis(rec.conv_input, at, axis=1)
    if rec.chunk is not None and min(keep) > 0:  # every row's own prefix in one go
        cache[1] = state_after_rows(rec.chunk, kept)
        return
    state = None
    for n in sorted(set(keep)):  # each distinct length once, for the whole batch
        after = state_after(n)
        state = after if state is None else mx.where((kept == n).reshape(-1, 1, 1, 1), after, state)
    cache[1] = state


class HybridTarget(TargetAdapter):
    """qwen3_5 / qwen3_5_moe, text-only or the multimodal wrapper, and qwen3_next.

    ``recurrence`` picks how multi-token forwards run the GatedDeltaNet
    recurrence: "chunked" (WY form, a few matmuls), "sequential" (mlx-lm's
    own path, token by token or its Metal kernel) or "auto" (chunked unless
    mlx-lm has its fused kernel here). ``compile_layers`` runs each dense
    GatedDeltaNet layer of a chunked verify block as one compiled function.
    """

    longest_ragged = PROMPT_CHUNK  # a recorded forward is one WY chunk (rollback reads its prefixes)

    def __init__(self, model, recurrence: str = "auto", compile_layers: bool = True):
        text = getattr(model, "language_model", model)
        super().__init__(model, text, text.model)
        if recurrence not in ("auto", "chunked", "sequential"):
            raise ArgumentError("recurrence must be 'auto', 'chunked' or 'sequential'")
        self.chunked = recurrence == "chunked" or (recurrence == "auto" and not has_fused_recurrence())
        self.compile_layers = compile_layers
        self.fused_layers = {}  # layer index -> its compiled verify-block forward

    @property
    def compiled_layers(self) -> int:
        """How many GatedDeltaNet layers have run as compiled functions so far."""
        return len(self.fused_layers)

    def _fused_linear_layer(self, i, layer, h, cache, records):
        """Verify-block forward of GatedDeltaNet layer ``i`` as one compiled
        function. A verify block has fixed shapes, so each layer traces once;
        fusing its many small ops saves per-op dispatch on the CPU (measured
        in BENCHMARKS.md), bit-identical to running them one by one (tested)."""
        fn = self.fused_layers.get(i)
        if fn is None:
            fn = self.fused_layers[i] = compiled(partial(linear_layer_block, layer), inputs=layer.state)
        state0 = cache[1]
        h, cache[0], cache[1], conv_input, u, L, k = fn(h, cache[0], state0)
        cache.advance(h.shape[1])
        records[i] = DeltaRecord(conv_input, state0, DeltaChunk(u, L, k, state0))
        return h

    def forward_block(self, tokens, cache, *, taps=None, last_logits_only=False, record=True, tree=None):
        if tree is not None:
            return self.tree_forward(tokens, cache, tree, taps, last_logits_only)
        taps = self.tap_ids if taps is None else taps
        bb = self.backbone
        h = bb.embed_tokens(tokens)
        fa = cache[bb.fa_idx]
        fa_mask = layer_masks(h, [fa], [sliding_window(fa)], decode=record)[0]
        ssm_mask = create_ssm_mask(h, cache[bb.ssm_idx])
        records = {}
        captured = {}
        fuse = self.compile_layers and record and self.chunked and tokens.shape[1] > 1 and ssm_mask is None
        for i, (layer, c) in enumerate(zip(bb.layers, cache)):
            if layer.is_linear and fuse and c[1] is not None and isinstance(layer.mlp, Qwen3NextMLP):
                h = self._fused_linear_layer(i, layer, h, c, records)
            else:
                if layer.is_linear:
                    r, rec = gated_delta_forward(
                        layer.linear_attn, layer.input_layernorm(h), ssm_mask, c, record, self.chunked
                    )
                    if rec is not None:
                        records[i] = rec
                else:
                    r = layer.self_attn(layer.input_layernorm(h), fa_mask, c)
                h = h + r
                h = h + mlp_forward(layer.mlp, layer.post_attention_layernorm(h))
            captured[i] = h
        if record:
            cache.undo = (tokens.shape[1], records)
        return self._finish(h, [captured[t] for t in taps], last_logits_only)

    def tree_forward(self, tokens, cache, tree, taps, last_logits_only):
        """:meth:`forward` over a draft tree (see :func:`gated_delta_tree`)."""
        taps = self.tap_ids if taps is None else taps
        bb = self.backbone
        h = bb.embed_tokens(tokens)
        fa = cache[bb.fa_idx]
        fa_mask = tree_masks(tree, [fa], [sliding_window(fa)])[0]
        records, captured = {}, {}
        with self.tree_scope(tree, cache):
            for i, (layer, c) in enumerate(zip(bb.layers, cache)):
                if layer.is_linear:
                    r, records[i] = gated_delta_tree(layer.linear_attn, layer.input_layernorm(h), c, tree)
                else:
                    r = layer.self_attn(layer.input_layernorm(h), fa_mask, c)
                h = h + r
                h = h + mlp_forward(layer.mlp, layer.post_attention_layernorm(h))
                captured[i] = h
        cache.undo = (tree, records)
        return self._finish(h, [captured[t] for t in taps], last_logits_only)

    def rewind(self, cache, keep):
        length, records = cache.undo
        cache.undo = None
        if not isinstance(length, int):  # a tree: keep its walked rows
            tree, rows = length, kept_rows(keep)
            for i, (layer, c) in enumerate(zip(self.backbone.layers, cache)):
                if layer.is_linear:
                    rewind_tree(c, records[i], tree, rows)
                else:
                    rewind_caches([c], tree.rows, rows)
            return
        drop = length - keep
        if drop <= 0:
            return
        for i, (layer, c) in enumerate(zip(self.backbone.layers, cache)):
            if layer.is_linear:
                rewind_gated_delta(layer.linear_attn, c, records[i], keep)
            else:
                rewind_caches([c], length, keep)

    def rollback_rows(self, cache, kept):
        length, records = cache.undo
        if any(k < length for k in kept):
            for i, layer in enumerate(self.backbone.layers):
                if layer.is_linear:
                    rewind_gated_delta(layer.linear_attn, cache[i], records[i], list(kept))
        super().rollback_rows(cache, kept)
