"""Qwen3.5 / Qwen3.6 hybrid targets (GatedDeltaNet + full attention).

A GatedDeltaNet layer's conv window and recurrent state cannot be trimmed.
During a verify forward we keep, per layer, the state before the block (MLX
arrays are immutable, so holding a reference is a free snapshot), the conv
input and the per-token (q, k, v, a, b). Rolling back to ``keep`` tokens then
re-runs only the recurrence for those tokens, with the same mlx-lm function
the forward used, so the state is bit-identical to a token-by-token decode;
the layer's projections (the weight reads decode time is made of) never run
again. A fully accepted block needs no replay at all.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from ..ops.gated_delta import DeltaChunk, chunked_gated_delta, log_decay
from .base import TargetAdapter


def has_fused_recurrence() -> bool:
    """Whether mlx-lm will run the recurrence as its Metal kernel."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


@dataclass
class DeltaRecord:
    """What a GatedDeltaNet layer needs to rewind one verify forward."""

    conv_input: mx.array  # [B, K-1+S, conv_dim]
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state: Optional[mx.array]  # recurrent state before the forward
    chunk: Optional[DeltaChunk] = None  # set when the WY form ran the block


def gated_delta_forward(gdn, x, mask, cache, record: bool, chunked: bool = False):
    """mlx-lm's ``GatedDeltaNet.__call__`` for one instance, plus a record.

    Written against the module's own weights and mlx-lm's own helpers
    (``normalize_qk``, ``gated_delta_update``); the adapter test compares the
    whole target with the model's forward to catch any upstream change.
    """
    B, S, _ = x.shape
    qkv = gdn.in_proj_qkv(x)
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b = gdn.in_proj_b(x)
    a = gdn.in_proj_a(x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(gdn.conv_kernel_size - 1) :, :])
    conv_out = nn.silu(gdn.conv1d(conv_input))
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
        # it); 64-token chunks for a prompt.
        out, state, chunk = chunked_gated_delta(
            q, k, v, log_decay(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b), state0,
            chunk_size=S if record else 64, compiled=record,
        )
        out = out.astype(q.dtype)
    else:
        out, state = gated_delta_update(
            q, k, v, a, b, gdn.A_log, gdn.dt_bias, state0, mask, use_kernel=not gdn.training
        )
    cache[1] = state
    cache.advance(S)
    rec = DeltaRecord(conv_input, q, k, v, a, b, state0, chunk) if record else None
    out = gdn.norm(out, z)
    return gdn.out_proj(out.reshape(B, S, -1)), rec


def rewind_gated_delta(gdn, cache, rec: DeltaRecord, keep: int) -> None:
    """Set ``cache`` to the state after the first ``keep`` tokens of ``rec``."""
    n_keep = gdn.conv_kernel_size - 1
    cache[0] = mx.contiguous(rec.conv_input[:, keep : keep + n_keep, :])
    if keep == 0:
        state = rec.state
    elif rec.chunk is not None:
        state = rec.chunk.state_after(keep)
    else:
        _, state = gated_delta_update(
            rec.q[:, :keep],
            rec.k[:, :keep],
            rec.v[:, :keep],
            rec.a[:, :keep],
            rec.b[:, :keep],
            gdn.A_log,
            gdn.dt_bias,
            rec.state,
            None,
            use_kernel=not gdn.training,
        )
    cache[1] = state


class HybridTarget(TargetAdapter):
    """qwen3_5 / qwen3_5_moe, text-only or the multimodal wrapper.

    ``recurrence`` picks how multi-token forwards run the GatedDeltaNet
    recurrence: "chunked" (WY form, a few matmuls), "sequential" (mlx-lm's
    own path, token by token or its Metal kernel) or "auto" (chunked unless
    mlx-lm has its fused kernel here).
    """

    def __init__(self, model, recurrence: str = "auto"):
        text = getattr(model, "language_model", model)
        super().__init__(model, text, text.model)
        if recurrence not in ("auto", "chunked", "sequential"):
            raise ValueError("recurrence must be 'auto', 'chunked' or 'sequential'")
        self.chunked = recurrence == "chunked" or (recurrence == "auto" and not has_fused_recurrence())
        self._records = {}
        self._last_len = 0

    def forward(self, tokens, cache, *, taps=None, last_logits_only=False, record=True):
        taps = self.tap_ids if taps is None else taps
        bb = self.backbone
        h = bb.embed_tokens(tokens)
        fa_mask = create_attention_mask(h, cache[bb.fa_idx])
        ssm_mask = create_ssm_mask(h, cache[bb.ssm_idx])
        self._records = {}
        captured = {}
        for i, (layer, c) in enumerate(zip(bb.layers, cache)):
            if layer.is_linear:
                r, rec = gated_delta_forward(
                    layer.linear_attn, layer.input_layernorm(h), ssm_mask, c, record, self.chunked
                )
                if rec is not None:
                    self._records[i] = rec
                h = h + r
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h, fa_mask, c)
            captured[i] = h
        self._last_len = tokens.shape[1]
        return self._finish(h, [captured[t] for t in taps], last_logits_only)

    def rollback(self, cache, keep):
        drop = self._last_len - keep
        if drop <= 0:
            return
        for i, (layer, c) in enumerate(zip(self.backbone.layers, cache)):
            if layer.is_linear:
                rewind_gated_delta(layer.linear_attn, c, self._records[i], keep)
            else:
                c.trim(drop)
        self._records = {}
        self._last_len = keep
