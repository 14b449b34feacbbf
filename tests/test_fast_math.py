"""The fused CPU exp / sigmoid / silu against MLX's own ops, bit for bit, and
the drafter's approximate softmax / swiglu against the exact ones."""

import platform

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

import dflash_mlx
from dflash_mlx.ops import fast_math

X86 = platform.machine().lower() in ("x86_64", "amd64")
# On x86 the emulation must be exact (a probe failure there is a test
# failure, below); another CPU whose exp the probe finds different runs the
# ops instead, and these checks have nothing to check.
needs_fused = pytest.mark.skipif(
    not X86 and not fast_math.available(mx.cpu), reason="the probe turned the fused path off on this CPU"
)


@pytest.mark.skipif(not X86, reason="x86 only: the CPU the fused path is written for")
def test_probe_passes_on_x86():
    assert fast_math.available(mx.cpu), "the fused exp no longer equals MLX's CPU exp: the verify lost its fast path"


def test_availability_is_per_device(device):
    """The CPU's answer is never carried to the GPU, which refuses float64."""
    cpu = fast_math.available(mx.cpu)
    assert fast_math.available(mx.gpu) is False
    assert fast_math.available() == (device == "cpu" and cpu)
    assert fast_math.use_for(mx.zeros((1, 2, 4))) == (device == "cpu" and cpu)


def _inputs():
    """~10^7 float32s: a dense sweep over exp's whole finite range, wide
    normals, and the edges (overflow / underflow thresholds, zeros, infinities)."""
    edges = [0.0, -0.0, 88.0, -88.0, 88.0001, -88.0001, 87.9999, 1e-30, -1e-30, 0.5, -0.5]
    edges += [float("inf"), -float("inf"), float("nan")]
    return mx.concatenate(
        [
            mx.linspace(-100.0, 100.0, 8_000_001),
            mx.random.normal((2_000_000,), key=mx.random.key(1)) * 6.0,
            mx.array(edges, mx.float32),
        ]
    )


def _assert_bitwise_equal(got, want):
    got, want = np.array(got), np.array(want)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{(~same).sum()} values differ, e.g. {got[~same][:3]} vs {want[~same][:3]}"


@needs_fused
@pytest.mark.parametrize(
    "ours, theirs",
    [(fast_math.exp, mx.exp), (fast_math.sigmoid, mx.sigmoid), (fast_math.silu, nn.silu)],
    ids=["exp", "sigmoid", "silu"],
)
def test_unary_functions_equal_mlx_bit_for_bit(ours, theirs):
    x = _inputs()
    _assert_bitwise_equal(ours(x), theirs(x))


@needs_fused
def test_swiglu_equals_mlx_lm_swiglu_bit_for_bit():
    gate = mx.random.normal((64, 16, 512), key=mx.random.key(2)) * 5.0
    up = mx.random.normal((64, 16, 512), key=mx.random.key(3))
    _assert_bitwise_equal(fast_math.swiglu(gate, up), mlx_lm_swiglu(gate, up))


def test_fused_paths_only_for_float32():
    for dtype in (mx.bfloat16, mx.float16):
        assert not fast_math.use_for(mx.zeros((1, 2, 4), dtype))
        assert not fast_math.approx_for(mx.zeros((2,), dtype))
    assert fast_math.use_for(mx.zeros((1, 2, 4), mx.float32)) == fast_math.available(mx.cpu)


def test_fused_exact_path_only_for_multi_token_blocks():
    """A one-token step keeps MLX's own ops: it computes few activations."""
    assert not fast_math.use_for(mx.zeros((1, 1, 4), mx.float32))
    assert not fast_math.use_for(mx.zeros((4,), mx.float32))


def test_approximate_softmax_and_swiglu_are_close():
    """The drafter's approximations: relative error well under 1e-4, and
    exp(-inf) (a fully masked-out score) is still 0 after normalising."""
    scores = mx.random.normal((2, 2, 16, 317), key=mx.random.key(4)) * 6.0
    want = mx.softmax(scores, axis=-1, precise=True)
    np.testing.assert_allclose(np.array(fast_math.softmax_approx(scores)), np.array(want), rtol=1e-4, atol=1e-7)
    edge = mx.array([[0.0, -mx.inf, -100.0, -87.0, -1e-3]])
    got = np.array(fast_math.softmax_approx(edge))
    np.testing.assert_allclose(got, np.array(mx.softmax(edge, axis=-1)), rtol=1e-4, atol=1e-30)
    gate = mx.concatenate([mx.linspace(-120.0, 120.0, 100_001), mx.array([0.0, -0.0])])
    up = mx.random.normal(gate.shape, key=mx.random.key(5))
    np.testing.assert_allclose(
        np.array(fast_math.swiglu_approx(gate, up)), np.array(nn.silu(gate) * up), rtol=1e-4, atol=1e-7
    )


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the approximate path is CPU-only")
def test_drafter_fused_inference_matches_plain_ops(qwen3_5_pair, tmp_path):
    """Loaded drafters (eval mode) take the approximate fused path on the CPU;
    training mode keeps the plain, differentiable ops. Same function, to 1e-4."""
    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    rng = np.random.default_rng(0)
    n_feat = draft.config.fc_input_size
    contexts = [mx.array(rng.standard_normal((1, s, n_feat)).astype(np.float32)) for s in (300, 4, 1)]
    blocks = [mx.array([rng.integers(0, pair.vocab, 16).tolist()]) for _ in contexts]

    def run(training):
        draft.train(training)
        cache = draft.make_cache()
        return [draft(b, c, cache) for b, c in zip(blocks, contexts)]

    fused, plain = run(False), run(True)
    draft.eval()
    for f, p in zip(fused, plain):
        np.testing.assert_allclose(np.array(f), np.array(p), atol=1e-4, rtol=1e-4)
