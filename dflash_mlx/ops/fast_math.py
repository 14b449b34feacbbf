"""Fused CPU versions of MLX's exp / sigmoid / silu: exact for the target,
approximate for the drafter.

MLX's CPU backend evaluates ``exp`` (and so ``sigmoid``, ``silu``,
``softmax``) with a degree-6 polynomial built from fused multiply-adds. On
x86 builds those are ``std::fma`` library calls, one element at a time:
about 20 ns per element, 15-20x the cost of an add. A 16-token verify or a
drafter forward pays that on every activation and attention score, a
1-token step hardly at all.

Exact (``silu``, ``swiglu``; used in the target's verify forward): the same
polynomial inside one ``mx.compile`` kernel, each fused multiply-add emulated
exactly (the float32 product is exact in float64; adding in float64 and
rounding once to float32 gives the fma result, a double rounding could
differ in theory). :func:`available` checks a probe against MLX's ops before
the path is used, the tests some 10^7 inputs: results equal MLX's bit for
bit, so the verify computes the very logits mlx-lm would.

Approximate (``softmax_approx``, ``swiglu_approx``; used by the drafter only,
whose numerics decide how many tokens are accepted, never which are emitted):
relative error below 1e-4, cheaper still, and shapeless.

Only float32 on the CPU takes these paths: Metal's ``exp`` is already fast,
and other dtypes round differently.
"""

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .threads import compiled

_LOG2E = 1.442695  # the float32 constant MLX multiplies by
# MLX's (Cephes) coefficients for 2**f on [-0.5, 0.5], highest degree first.
_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)


def _exp(x: mx.array) -> mx.array:
    """MLX's CPU float32 exp, traced into the enclosing compiled kernel."""
    t = x * mx.array(_LOG2E, mx.float32)
    ipart = mx.floor(t + 0.5)
    frac = (t - ipart).astype(mx.float64)
    p = mx.array(_POLY[0], mx.float32)
    for c in _POLY[1:]:
        # fma(p, frac, c): exact float64 product, one rounding to float32.
        p = (p.astype(mx.float64) * frac + mx.array(c, mx.float32).astype(mx.float64)).astype(
            mx.float32
        )
    # Clamping keeps the integer in range; those inputs are overwritten below.
    scale = ((mx.clip(ipart, -127, 128).astype(mx.int32) + 127) << 23).view(mx.float32)
    out = scale * p
    out = mx.where(x > 88.0, mx.array(float("inf"), mx.float32), out)
    out = mx.where(x < -88.0, mx.array(0.0, mx.float32), out)
    return mx.where(mx.isnan(x), x, out)


def _sigmoid(x):
    y = 1.0 / (1.0 + _exp(mx.abs(x)))
    return mx.where(x < 0, y, 1.0 - y)


def _with_gradient_of(fused, reference):
    """``fused``, differentiated as ``reference`` (whose values it equals):
    ``view`` has no VJP, and a target trained through its adapter needs one."""
    f = mx.custom_function(fused)

    @f.vjp
    def _vjp(primals, cotangent, _):
        args = list(primals) if isinstance(primals, (tuple, list)) else [primals]
        grads = mx.vjp(reference, args, [cotangent])[1]
        return tuple(grads) if len(args) > 1 else grads[0]

    return f


# Compiled per input shape (``view`` rules out shapeless compilation): the
# shapes that matter repeat every cycle, so each is traced once.
exp = _with_gradient_of(compiled(_exp), mx.exp)
sigmoid = _with_gradient_of(compiled(_sigmoid), mx.sigmoid)
silu = _with_gradient_of(compiled(lambda x: x * _sigmoid(x)), nn.silu)
swiglu = _with_gradient_of(compiled(lambda gate, x: gate * _sigmoid(gate) * x), lambda gate, x: nn.silu(gate) * x)


def available(device=None) -> bool:
    """Whether the fused functions equal MLX's ops bit for bit on ``device``
    (default: the current default device).

    False off the CPU (MLX's own kernels are fast there, and a GPU refuses
    the float64 the emulation needs) and if any probe input differs on the
    CPU, so a different MLX build or compiler falls back to the ops. The
    answer depends on the device, so it is never carried from one to another.
    """
    device = mx.default_device() if device is None else device
    kind = device if isinstance(device, mx.DeviceType) else device.type
    return kind == mx.DeviceType.cpu and _exact_on_cpu()


@lru_cache(maxsize=None)
def _exact_on_cpu() -> bool:
    """The probe, run once per process on the CPU."""
    with mx.stream(mx.cpu):
        probe = mx.concatenate(
            [
                mx.linspace(-100.0, 100.0, 1 << 16),
                mx.random.normal((1 << 16,), key=mx.random.key(0)) * 8.0,
                mx.array([0.0, -0.0, 88.0, -88.0, 1e-30, -1e-30, float("inf"), -float("inf")]),
            ]
        )
        checks = [
            (exp(probe), mx.exp(probe)),
            (sigmoid(probe), mx.sigmoid(probe)),
            (silu(probe), nn.silu(probe)),
        ]
        return all(mx.array_equal(a, b, equal_nan=True).item() for a, b in checks)


def use_for(x: mx.array) -> bool:
    """Take the fused path for ``x`` (``[B, S, ...]``): float32, on a CPU
    where it is exact, over more than one token. A one-token step computes
    few activations, so the emulation's float64 work costs more than the
    library calls it replaces."""
    return x.dtype == mx.float32 and x.ndim > 1 and x.shape[1] > 1 and available()


# Approximate versions: no ``view``, so they compile shapeless and a softmax
# over a growing context traces once.
_SQUARINGS = 8


def _exp_nonpositive(x):
    """exp(x) for x <= 0 as (Taylor exp(x / 256))^256; relative error < 1e-4."""
    y = mx.maximum(x, -87.0) * (1.0 / 2**_SQUARINGS)
    p = 1 + y * (1 + y * (1 / 2 + y * (1 / 6 + y * (1 / 24 + y * (1 / 120 + y * (1 / 720))))))
    for _ in range(_SQUARINGS):
        p = p * p
    return p


@compiled(shapeless=True)
def softmax_approx(scores):
    e = _exp_nonpositive(scores - mx.max(scores, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


@compiled(shapeless=True)
def exp_below(scores, top):
    """exp(scores - top), for ``top`` at least every score (a row maximum):
    softmax numerators with the normalisation left to the caller."""
    return _exp_nonpositive(scores - top)


@compiled(shapeless=True)
def exp_below_where(scores, top, keep):
    """:func:`exp_below` where ``keep``, 0 elsewhere (``top`` bounds only the kept scores)."""
    return mx.where(keep, _exp_nonpositive(mx.minimum(scores - top, 0.0)), 0.0)


@compiled(shapeless=True)
def swiglu_approx(gate, x):
    e = _exp_nonpositive(-mx.abs(gate))
    return gate * mx.where(gate >= 0, 1 / (1 + e), e / (1 + e)) * x


def approx_for(x: mx.array) -> bool:
    """Take the approximate path for ``x``: float32 on the CPU."""
    return x.dtype == mx.float32 and mx.default_device() == mx.cpu


# Differentiable versions for training the drafter: the approximate forward
# with the analytic VJP of the exact function, evaluated at its output.
softmax_trainable = mx.custom_function(softmax_approx)


@softmax_trainable.vjp
def _softmax_vjp(scores, cotangent, probs):
    return probs * (cotangent - (cotangent * probs).sum(-1, keepdims=True))


exp_below_where_trainable = mx.custom_function(exp_below_where)


@exp_below_where_trainable.vjp
def _exp_below_where_vjp(primals, cotangent, e):
    """``top`` varies along the scores' other axes only (a row maximum):
    its gradient sums the last axis."""
    _, top, keep = primals
    grad = cotangent * e
    return grad, -grad.sum(axis=-1, keepdims=True).reshape(top.shape), mx.zeros_like(keep)


@compiled(shapeless=True)
def logsumexp_approx(x):
    """logsumexp over the last axis with the approximate exp."""
    m = mx.max(x, axis=-1, keepdims=True)
    return (m + mx.log(mx.sum(_exp_nonpositive(x - m), axis=-1, keepdims=True))).squeeze(-1)


logsumexp_trainable = mx.custom_function(logsumexp_approx)


@logsumexp_trainable.vjp
def _logsumexp_vjp(x, cotangent, _):
    return softmax_approx(x) * cotangent[..., None]


def cross_entropy_approx(logits: mx.array, labels: mx.array) -> mx.array:
    """Cross-entropy per position with the approximate ``logsumexp``."""
    picked = mx.take_along_axis(logits, labels[..., None], axis=-1).squeeze(-1)
    return logsumexp_trainable(logits) - picked
