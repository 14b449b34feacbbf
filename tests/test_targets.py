"""Target adapters against mlx-lm's own forward, rollback against fresh decoding,
and the errors raised before any generation."""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

import dflash_mlx
from dflash_mlx.targets import SUPPORTED_MODEL_TYPES, TargetError, adapter_for, model_type_of
from dflash_mlx.targets.hybrid import HybridTarget, has_fused_recurrence

# Text models mlx-lm loads only inside their wrapper (no module of their
# own): the adapter tests run each on its wrapper's text model.
NESTED = {"gemma4_unified_text": "gemma4_unified"}
HYBRID = [name for name in tiny.FAMILIES if name.startswith(("qwen3_5", "qwen3_next"))]
# (family, recurrence): the recurrence choice exists for hybrid targets only
ADAPTERS = [
    (name, r) for name in [*tiny.FAMILIES, *NESTED] for r in (("sequential", "chunked") if name in HYBRID else ("-",))
]


@pytest.fixture(scope="module")
def targets(make_pair):
    models = {name: make_pair(name).model for name in tiny.FAMILIES}
    models.update({name: models[wrapper].language_model for name, wrapper in NESTED.items()})
    return models


def make_adapter(model, recurrence):
    if recurrence == "-":
        return adapter_for(model)
    return HybridTarget(model, recurrence=recurrence)


class LayerRecorder:
    """Stands in for one layer of a model instance: runs it, keeps its hidden
    output (element 0 of the tuple a Gemma-4 layer returns)."""

    def __init__(self, layer, outputs):
        self.layer, self.outputs = layer, outputs

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.outputs.append(out[0] if isinstance(out, tuple) else out)
        return out

    def __getattr__(self, name):
        return getattr(self.layer, name)


def mlx_lm_forward(model, layers, tokens, cache):
    """mlx-lm's own forward of ``model`` and the hidden state after each of
    its ``layers`` (the instance's list, its entries wrapped for the call)."""
    outputs, saved = [], list(layers)
    layers[:] = [LayerRecorder(layer, outputs) for layer in saved]
    try:
        logits = model(tokens, cache=cache)
    finally:
        layers[:] = saved
    return logits, outputs


def note_fused(adapter, ran):
    if isinstance(adapter, HybridTarget) and not adapter.chunked and has_fused_recurrence():
        ran("fused recurrence")


@pytest.mark.parametrize("name, recurrence", ADAPTERS)
def test_adapter_forward_and_taps_equal_mlx_lm(targets, name, recurrence, device, ran):
    """Logits and the taps of every layer, against mlx-lm's forward and its
    own per-layer hidden states: bit-equal with mlx-lm's recurrence (its
    fused kernel on Metal); the WY-form chunked recurrence (the CPU default)
    agrees to float32 rounding."""
    model = targets[name]
    adapter = make_adapter(model, recurrence)
    note_fused(adapter, ran)
    every_layer = list(range(adapter.num_layers))[::-1]  # any order, as asked
    rng = np.random.default_rng(0)
    ours, theirs = adapter.make_cache(), make_prompt_cache(model)
    for n in (11, 1, 5, 1, 16):  # prefill, decode, verify-sized, decode, block
        tokens = mx.array(rng.integers(0, 256, (1, n)))
        want, states = mlx_lm_forward(model, adapter.backbone.layers, tokens, theirs)
        got, taps = adapter.forward(tokens, ours, taps=every_layer)
        assert len(states) == adapter.num_layers
        want_taps = mx.concatenate(states[::-1], axis=-1)
        assert taps.shape == (1, n, adapter.num_layers * adapter.hidden_size)
        if recurrence == "chunked":
            assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), f"{name}: chunked recurrence drifted"
            assert mx.allclose(taps, want_taps, atol=1e-4, rtol=1e-4), f"{name}: taps differ from mlx-lm's"
        else:
            assert mx.array_equal(got, want), f"{name}: adapter drifted from mlx-lm's forward"
            assert mx.array_equal(taps, want_taps), f"{name}: taps differ from mlx-lm's hidden states"


@pytest.mark.parametrize("name, recurrence", ADAPTERS)
@pytest.mark.parametrize("keep", [0, 1, 3, 7, 8])
def test_rollback_equals_decoding_only_the_kept_tokens(targets, name, keep, recurrence, device, ran):
    model = targets[name]
    adapter = make_adapter(model, recurrence)
    note_fused(adapter, ran)
    rng = np.random.default_rng(keep)
    prompt = mx.array(rng.integers(0, 256, (1, 9)))
    block = mx.array(rng.integers(0, 256, (1, 8)))
    probe = mx.array([[7]])

    rolled, fresh = adapter.make_cache(), adapter.make_cache()
    adapter.forward(prompt, rolled, taps=[])
    adapter.forward(block, rolled, taps=[])
    adapter.rollback(rolled, keep)
    adapter.forward(prompt, fresh, taps=[], record=False)
    for t in range(keep):  # token by token, as plain decoding would
        adapter.forward(block[:, t : t + 1], fresh, taps=[], record=False)

    a, _ = adapter.forward(probe, rolled, taps=[])
    b, _ = adapter.forward(probe, fresh, taps=[])
    # Once a sliding window has wrapped, its rotating buffer holds the window
    # in another order after a rollback than after a fresh decode, so
    # attention sums in another order: float32 rounding, bounded as in
    # tests/test_gemma4.py (where mlx-lm's plain trim errs by over 1e-2).
    wrapped = any(isinstance(c, RotatingKVCache) and c.offset > c.max_size for c in rolled)
    tol = 1e-4 if wrapped else 1e-5
    assert mx.allclose(a, b, atol=tol, rtol=tol)
    for ca, cb in zip(rolled, fresh):
        if isinstance(ca, RotatingKVCache):  # its order is the buffer's: the probe compared the contents
            assert ca.offset == cb.offset
            continue
        if hasattr(ca, "offset"):  # attention: same length, same live keys/values
            assert ca.offset == cb.offset
            pairs = [(ca.keys[..., : ca.offset, :], cb.keys[..., : cb.offset, :]),
                     (ca.values[..., : ca.offset, :], cb.values[..., : cb.offset, :])]
        else:  # GatedDeltaNet: conv window and recurrent state
            pairs = [(ca[0], cb[0]), (ca[1], cb[1])]
        for sa, sb in pairs:
            assert mx.allclose(sa, sb, atol=1e-5), f"{name}: cache differs after rollback"


def test_gated_delta_state_after_rollback_is_bit_identical(targets):
    """With mlx-lm's recurrence, the replay is the verify's own computation."""
    model = targets["qwen3_5"]
    adapter = HybridTarget(model, recurrence="sequential")
    rng = np.random.default_rng(5)
    tokens = mx.array(rng.integers(0, 256, (1, 12)))
    a, b = adapter.make_cache(), adapter.make_cache()
    adapter.forward(tokens[:, :4], a, taps=[])
    adapter.forward(tokens[:, 4:], a, taps=[])
    adapter.rollback(a, 5)
    adapter.forward(tokens[:, :4], b, taps=[])
    adapter.forward(tokens[:, 4:9], b, taps=[])
    linear = [i for i, l in enumerate(adapter.backbone.layers) if l.is_linear]
    assert linear
    # The projections feeding the replay are bit-identical too wherever a
    # matmul's rows do not depend on how many rows there are (MLX's own BLAS;
    # OpenBLAS picks its kernels by shape, and then only rounding differs).
    proj = adapter.backbone.layers[linear[0]].linear_attn.in_proj_qkv
    x = mx.random.normal((1, 8, adapter.hidden_size), key=mx.random.key(0))
    rows_stable = mx.array_equal(proj(x)[:, :5], proj(x[:, :5])).item()
    for i in linear:
        for sa, sb in ((a[i][0], b[i][0]), (a[i][1], b[i][1])):
            assert mx.array_equal(sa, sb) if rows_stable else mx.allclose(sa, sb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep", [0, 5, 16])
def test_compiled_verify_layers_are_bit_identical(targets, keep):
    """The compiled GatedDeltaNet layers of a verify block (and the fused
    swiglu) compute exactly what the same ops compute one by one: logits,
    taps, the states rollback leaves, and what follows."""
    model = targets["qwen3_5"]
    rng = np.random.default_rng(keep)
    prompt = mx.array(rng.integers(0, 256, (1, 9)))
    block = mx.array(rng.integers(0, 256, (1, 16)))
    results = []
    for compile_layers in (True, False):
        adapter = HybridTarget(model, recurrence="chunked", compile_layers=compile_layers)
        cache = adapter.make_cache()
        adapter.forward(prompt, cache, taps=[], record=False)
        logits, taps = adapter.forward(block, cache, taps=[0, 1, 2])
        linear = sum(layer.is_linear for layer in adapter.backbone.layers)
        assert linear and adapter.compiled_layers == (linear if compile_layers else 0)
        adapter.rollback(cache, keep)
        after, _ = adapter.forward(block[:, :3], cache, taps=[])
        states = [s for _, s in tree_flatten([c.state for c in cache]) if s is not None]
        results.append([logits, taps, after, *states])
    for fused, plain in zip(*results):
        assert mx.array_equal(fused, plain)


def _write_draft(pair, tmp_path, **kw):
    return pair.make_draft(tmp_path / "d", **kw)


def test_vocab_mismatch_is_refused(qwen3_pair, tmp_path):
    cfg = qwen3_pair.draft_config()
    cfg["vocab_size"] = 300
    cfg["dflash_config"]["mask_token_id"] = 299
    path = tiny.make_draft(tmp_path / "d", cfg)
    with pytest.raises(TargetError, match="vocab_size 300"):
        dflash_mlx.load_draft(path, qwen3_pair.model)


def test_tap_out_of_range_is_refused(qwen3_pair, tmp_path):
    path = _write_draft(qwen3_pair, tmp_path, taps=[0, 9])
    with pytest.raises(TargetError, match=r"layers \[9\]"):
        dflash_mlx.load_draft(path, qwen3_pair.model)


def test_fc_width_mismatch_is_refused(qwen3_pair, tmp_path):
    cfg = qwen3_pair.draft_config()
    cfg["target_hidden_size"] = 32  # fc built for a narrower target
    path = tiny.make_draft(tmp_path / "d", cfg)
    with pytest.raises(TargetError, match="fc expects 64 input features"):
        dflash_mlx.load_draft(path, qwen3_pair.model)


def test_every_supported_family_has_a_tiny_target(targets):
    """So every adapter runs through the tests above, and every family but
    the nested text models through tests/test_lossless.py's end to end."""
    assert {model_type_of(model) for model in targets.values()} == set(SUPPORTED_MODEL_TYPES)


def test_unsupported_family_lists_supported(tmp_path, qwen3_pair):
    class Fake:
        model_type = "gpt2"

    with pytest.raises(TargetError) as e:
        adapter_for(Fake())
    for t in SUPPORTED_MODEL_TYPES:
        assert t in str(e.value)


def test_errors_come_before_generation(qwen3_pair, tmp_path):
    draft = dflash_mlx.load_draft(_write_draft(qwen3_pair, tmp_path, taps=[0, 3]))

    class Other:
        model_type = "phi3"

    with pytest.raises(TargetError):
        next(dflash_mlx.stream_generate(Other(), draft, qwen3_pair.tokenizer, "x"))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no-config", "no config.json"),
        ("bad-json", "not valid JSON"),
        ("no-weights", "no .safetensors"),
        ("truncated", "truncated or corrupt"),
        ("missing-tensor", "missing"),
        ("extra-tensor", "unexpected"),
        ("wrong-shape", "has shape"),
        ("wrong-arch", "not a DFlash drafter"),
        ("nowhere", "neither an existing directory"),
    ],
)
def test_bad_drafter_files(qwen3_pair, tmp_path, damage, message):
    path = _write_draft(qwen3_pair, tmp_path)
    if damage == "nowhere":
        path = tmp_path / "does" / "not" / "exist"
    else:
        tiny.damage(path, damage)
    with pytest.raises(ValueError, match=message):
        dflash_mlx.load_draft(path, qwen3_pair.model)


def test_missing_target_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an existing directory"):
        dflash_mlx.load(str(tmp_path / "nope" / "x" / "y"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        dflash_mlx.load(str(tmp_path))


def test_hub_ids_resolve_through_huggingface_hub_cache(qwen3_pair, tmp_path, monkeypatch):
    """A hub id is fetched with huggingface_hub; offline, its cache answers."""
    import shutil

    src = _write_draft(qwen3_pair, tmp_path)
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-dflash" / "snapshots" / ("0" * 40)
    shutil.copytree(src, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    draft = dflash_mlx.load_draft("someone/tiny-dflash", qwen3_pair.model)
    assert draft.config.block_size == 8
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        dflash_mlx.load_draft("someone/absent", qwen3_pair.model)
