"""A target instance rewired for the build's data stages: attention and MLP
through the approximate fused exp of :mod:`..ops.fast_math`.

Distillation and the tap pass need the target's answers and tap states to
training precision, not bit for bit: on an x86 CPU MLX's softmax and SiLU
spend most of a layer's time in per-element ``exp`` library calls, which
``softmax_approx`` / ``swiglu_approx`` replace (relative error below 1e-4).
Greedy answers may then part from mlx-lm's at a near tie; the verify never
uses this (it keeps the exact path), so decoding output is unchanged.

:func:`approximate` swaps, per instance, each layer's ``self_attn`` and
``mlp`` for modules holding the same projections under the same names (the
parameter tree, and so loading and saving, are unchanged). Off the CPU, or in
another dtype, they compute what the originals do.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..ops import fast_math
from .base import TargetError

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
NORMS = ("q_norm", "k_norm")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def masked_scores(scores: mx.array, mask, q_len: int, k_len: int) -> mx.array:
    """``scores`` [..., L, S] with ``mask`` (mlx-lm's: None, ``"causal"``, a
    boolean or an additive array) applied. A hidden score becomes the
    lowest float, not -inf, so a row hidden entirely (left padding in a
    batch) stays finite."""
    if mask is None:
        return scores
    if isinstance(mask, str):
        offset = k_len - q_len
        mask = mx.arange(offset, offset + q_len)[:, None] >= mx.arange(k_len)[None]
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return scores + mask.astype(scores.dtype)


# Queries per block of the causal path: the scores above the diagonal are
# never computed, and only each block's diagonal square is masked.
QUERY_CHUNK = 64


def rows_of_groups(q: mx.array) -> mx.array:
    """[..., G, L, D] -> [..., G*L, D]: a KV head's query heads as rows of one
    matmul against its keys (broadcasting the keys over G would copy them
    once per query head)."""
    *lead, G, L, D = q.shape
    return q.reshape(*lead, G * L, D)


def causal_chunks(q: mx.array, k: mx.array, v: mx.array, chunk: int) -> mx.array:
    """Causal attention of scaled queries ``q`` [..., G, L, D] (G query heads
    per KV head) over keys and values [..., S, D] (the last L are the
    queries' own positions), ``chunk`` queries at a time; [..., G, L, D].
    Each block attends to the keys before it unmasked and to its own square
    under the causal rule, one softmax over both, each part's numerators
    multiplied into the values before one division by their common sum (as
    FlashAttention combines key blocks, Dao et al. 2022, arXiv 2205.14135),
    so no [L, S] score, mask or probability array is ever built."""
    *lead, G, L, D = q.shape
    S = k.shape[-2]
    outs = []
    for i0 in range(0, L, chunk):
        i1 = min(L, i0 + chunk)
        C, a, b = i1 - i0, S - L + i0, S - L + i1  # the block's own keys are a..b-1
        qc = rows_of_groups(q[..., i0:i1, :])
        own = (qc @ k[..., a:b, :].swapaxes(-1, -2)).reshape(*lead, G, C, C)
        keep = mx.arange(C)[:, None] >= mx.arange(C)[None]
        top = mx.max(mx.where(keep, own, mx.array(mx.finfo(own.dtype).min, own.dtype)), axis=-1, keepdims=True)
        if a:
            before = (qc @ k[..., :a, :].swapaxes(-1, -2)).reshape(*lead, G, C, a)
            top = mx.maximum(top, mx.max(before, axis=-1, keepdims=True))
        e = fast_math.exp_below_where(own, top, keep)
        total, out = e.sum(-1, keepdims=True), rows_of_groups(e) @ v[..., a:b, :]
        if a:
            e = fast_math.exp_below(before, top)
            total, out = total + e.sum(-1, keepdims=True), out + rows_of_groups(e) @ v[..., :a, :]
        outs.append(out.reshape(*lead, G, C, D) / total)
    return mx.concatenate(outs, axis=-2)


class ApproxAttention(nn.Module):
    """mlx-lm's llama / qwen attention (optional per-head q/k norms) with
    the softmax computed by ``fast_math.softmax_approx`` on the CPU."""

    def __init__(self, attn: nn.Module, query_chunk: int = QUERY_CHUNK):
        super().__init__()
        for name in ATTENTION_PARTS + tuple(n for n in NORMS if hasattr(attn, n)):
            setattr(self, name, getattr(attn, name))
        self.n_heads, self.n_kv_heads, self.scale = attn.n_heads, attn.n_kv_heads, attn.scale
        self.query_chunk = query_chunk

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (t.reshape(B, L, n, -1) for t, n in ((q, self.n_heads), (k, self.n_kv_heads), (v, self.n_kv_heads)))
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        offset = 0 if cache is None else cache.offset
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if fast_math.approx_for(q):
            out = self.cpu_attention(q, k, v, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def cpu_attention(self, q, k, v, mask):
        B, H, L, D = q.shape
        S = k.shape[2]
        G = H // self.n_kv_heads
        groups = (q * self.scale).reshape(B, self.n_kv_heads, G, L, D)
        if isinstance(mask, str) and self.query_chunk and L > self.query_chunk:
            return causal_chunks(groups, k, v, self.query_chunk).reshape(B, H, L, D)
        scores = (rows_of_groups(groups) @ k.swapaxes(-1, -2)).reshape(B, self.n_kv_heads, G, L, S)
        if isinstance(mask, mx.array) and mask.ndim == 4:  # [B or 1, 1 or H, L, S]: per KV-head groups
            mask = mask.reshape(mask.shape[0], -1, 1, L, S) if mask.shape[1] == 1 else mask.reshape(
                mask.shape[0], self.n_kv_heads, H // self.n_kv_heads, L, S
            )
        scores = masked_scores(scores, mask, L, S)
        return (rows_of_groups(fast_math.softmax_approx(scores)) @ v).reshape(B, H, L, D)


class ApproxMLP(nn.Module):
    """A gated SiLU MLP with ``fast_math.swiglu_approx`` on the CPU."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        for name in MLP_PARTS:
            setattr(self, name, getattr(mlp, name))

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if fast_math.approx_for(x):
            return self.down_proj(fast_math.swiglu_approx(gate, up))
        return self.down_proj(nn.silu(gate) * up)


def approximate(model: nn.Module, backbone: Optional[nn.Module] = None, query_chunk: int = QUERY_CHUNK) -> nn.Module:
    """Rewire ``model``'s layers (those of ``backbone``, default the model's
    ``model``) to :class:`ApproxAttention` / :class:`ApproxMLP`, in place;
    returns ``model``. ``query_chunk``: queries per block of a causal
    forward (:func:`causal_chunks`; 0 scores the whole square at once). Raises :class:`TargetError` for a layer of another
    shape (e.g. a hybrid or MoE layer) before changing anything."""
    layers = (backbone or getattr(getattr(model, "language_model", model), "model")).layers
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or not all(hasattr(attn, n) for n in ATTENTION_PARTS + ("n_heads", "n_kv_heads", "scale")):
            raise TargetError(f"layer {i} has no llama-style attention: approximate data stages support llama/qwen2/qwen3 targets")
        if mlp is None or not all(hasattr(mlp, n) for n in MLP_PARTS):
            raise TargetError(f"layer {i} has no gated MLP (MoE?): approximate data stages support dense llama/qwen targets")
    for layer in layers:
        layer.self_attn = ApproxAttention(layer.self_attn, query_chunk)
        layer.mlp = ApproxMLP(layer.mlp)
    return model
