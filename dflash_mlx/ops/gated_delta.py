"""Chunked (WY-form) gated delta rule: a whole verify block in a few matmuls.

mlx-lm runs the GatedDeltaNet recurrence token by token unless a Metal kernel
is available. Verifying a 16-token block that way costs 16 sequential steps
per layer, which on backends without the fused kernel (the CPU, CUDA today)
decides the speedup. Within a chunk the recurrence

    S_t = g_t S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - g_t S_{t-1} k_t)

unrolls to ``S_t = G_t S_0 + sum_{i<=t} (G_t / G_i) u_i k_i^T`` with
``G_t = prod_{i<=t} g_i``, so the deltas ``u`` solve one unit lower-triangular
system ``(I + A) U = beta (V - G S_0 K)``. ``(I + A)^-1`` is the finite series
of the nilpotent ``-A``, evaluated by repeated squaring (differentiable, all
matmuls). The state after any prefix n follows from the same ``U``, which is
what rollback needs: no second pass over the block.
"""

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

import mlx.nn as nn

from .threads import compiled


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g, the same quantity mlx-lm exponentiates in ``compute_g``.

    Kept in log space so cumulative decays over a chunk cannot underflow.
    """
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A: prod_j (I + (-A)^(2^j))."""
    n = A.shape[-1]
    eye = mx.eye(n, dtype=A.dtype)
    power = -A
    inverse = eye + power
    for _ in range(max(0, math.ceil(math.log2(n)) - 1)):
        power = power @ power
        inverse = inverse @ (eye + power)
    return inverse


def _wy_chunk(q, k, v, log_g, beta, state):
    """y, the deltas u and the cumulative log decay L of one chunk."""
    T = k.shape[2]
    L = mx.cumsum(log_g, axis=-1)
    lower = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    rel = L[..., :, None] - L[..., None, :]
    decay = mx.exp(mx.where(lower, rel, -mx.inf))  # G_t / G_i, i <= t
    G = mx.exp(L)[..., None]
    kk = k @ k.swapaxes(-1, -2)
    A = mx.where(lower & ~mx.eye(T, dtype=mx.bool_), beta[..., None] * decay * kk, 0)
    rhs = beta[..., None] * (v - G * (k @ state.swapaxes(-1, -2)))
    u = _unit_lower_inverse(A) @ rhs  # [B, H, T, Dv]
    qk = mx.where(lower, q @ k.swapaxes(-1, -2), 0)
    y = G * (q @ state.swapaxes(-1, -2)) + (decay * qk) @ u
    return y, u, L


# Fusing the chunk's ~30 small ops saves per-op dispatch on the CPU (see
# BENCHMARKS.md); the result is bit-identical to the uncompiled graph.
_wy_chunk_compiled = compiled(_wy_chunk)


@dataclass
class DeltaChunk:
    """One chunk solved in WY form: ``state_after(n)`` gives S after n tokens.

    u: deltas [B, H, T, Dv]; L: cumulative log decay [B, H, T]; k: keys
    [B, H, T, Dk]; state: S before the chunk [B, H, Dv, Dk] (float32).
    """

    u: mx.array
    L: mx.array
    k: mx.array
    state: mx.array

    def state_after(self, n: int) -> mx.array:
        if n == 0:
            return self.state
        last = self.L[..., n - 1 : n]
        w = mx.exp(last - self.L[..., :n])[..., None]  # [B, H, n, 1]
        delta = (self.u[:, :, :n] * w).swapaxes(-1, -2) @ self.k[:, :, :n]
        return mx.exp(last)[..., None] * self.state + delta


def state_after_rows(chunk: "DeltaChunk", n: mx.array) -> mx.array:
    """:meth:`DeltaChunk.state_after` with a count per batch row (``n``:
    ``[B]``, each at least 1): every row's state after its own first
    ``n[b]`` tokens, in one weighted sum (the tokens past them weigh 0)."""
    T = chunk.L.shape[-1]
    last = mx.take_along_axis(chunk.L, mx.broadcast_to((n - 1)[:, None, None], (*chunk.L.shape[:2], 1)), axis=-1)
    kept = (mx.arange(T)[None, :] < n[:, None])[:, None, :]  # [B, 1, T]
    w = mx.where(kept, mx.exp(last - chunk.L), 0.0)[..., None]
    delta = (chunk.u * w).swapaxes(-1, -2) @ chunk.k
    return mx.exp(last)[..., None] * chunk.state + delta


def solve_chunk(q, k, v, log_g, beta, state, compiled: bool = False):
    """(y, DeltaChunk) of one chunk; q, k: [B, H, T, Dk], v: [B, H, T, Dv],
    log_g, beta: [B, H, T], state: [B, H, Dv, Dk] (float32)."""
    y, u, L = (_wy_chunk_compiled if compiled else _wy_chunk)(q, k, v, log_g, beta, state)
    return y, DeltaChunk(u, L, k, state)


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    chunk_size: int = 16,
    compiled: bool = False,
):
    """Gated delta rule over a sequence, mlx-lm's layout and contract.

    q, k: [B, T, Hk, Dk] (normalised as mlx-lm's ``normalize_qk`` does);
    v: [B, T, Hv, Dv]; log_g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk].
    Returns (y [B, T, Hv, Dv], final state, last chunk's ``DeltaChunk``).
    ``compiled`` fuses each chunk with ``mx.compile`` (worth it for the fixed
    shapes of verify blocks; each new shape compiles once).
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, axis=-2)
        k = mx.repeat(k, Hv // Hk, axis=-2)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    q, k, v = (x.transpose(0, 2, 1, 3).astype(mx.float32) for x in (q, k, v))
    log_g = log_g.transpose(0, 2, 1).astype(mx.float32)
    beta = beta.transpose(0, 2, 1).astype(mx.float32)
    ys = []
    chunk = None
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        y, chunk = solve_chunk(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], log_g[:, :, s:e], beta[:, :, s:e], state, compiled
        )
        ys.append(y)
        state = chunk.state_after(e - s)
    y = mx.concatenate(ys, axis=2).transpose(0, 2, 1, 3)
    return y, state, chunk
