"""Target adapters against mlx-lm's own forward, rollback against fresh decoding,
and the errors raised before any generation."""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import dflash_mlx
from dflash_mlx.targets import SUPPORTED_MODEL_TYPES, TargetError, adapter_for
from dflash_mlx.targets.hybrid import HybridTarget

QWEN3_5_MOE = dict(
    tiny.QWEN3_5,
    model_type="qwen3_5_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)


def _multimodal(base):
    """Qwen3.5 checkpoints nest the text model under text_config."""
    text = {k: v for k, v in base.items() if k not in ("model_type", "architectures")}
    text["model_type"] = base["model_type"] + "_text"
    return {"model_type": base["model_type"], "architectures": base["architectures"],
            "text_config": text, "vision_config": {"depth": 1}}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for name, base in [
        ("qwen3", tiny.QWEN3),
        ("qwen3_5", tiny.QWEN3_5),
        ("qwen3_5_moe", QWEN3_5_MOE),
        ("llama", tiny.LLAMA),
    ]:
        out[name] = load(str(tiny.make_target(root / name, base)))[0]
    mm = _multimodal(tiny.QWEN3_5)
    path = root / "qwen3_5_mm"
    tiny.write_tokenizer(path)
    # write through the flat builder, then nest the config as real checkpoints do
    tiny.make_target(path, tiny.QWEN3_5)
    mm["text_config"]["vocab_size"] = json.loads((path / "config.json").read_text())["vocab_size"]
    (path / "config.json").write_text(json.dumps(mm))
    out["qwen3_5_multimodal"] = load(str(path))[0]
    return out


def make_adapter(model, recurrence):
    if isinstance(adapter_for(model), HybridTarget):
        return HybridTarget(model, recurrence=recurrence)
    return adapter_for(model)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_5_moe", "llama", "qwen3_5_multimodal"])
@pytest.mark.parametrize("recurrence", ["sequential", "chunked"])
def test_adapter_forward_equals_mlx_lm_forward(targets, name, recurrence):
    """Bit-equal with mlx-lm's own recurrence; the WY-form chunked recurrence
    (the CPU default) agrees to float32 rounding."""
    model = targets[name]
    adapter = make_adapter(model, recurrence)
    rng = np.random.default_rng(0)
    ours, theirs = adapter.make_cache(), make_prompt_cache(model)
    for n in (11, 1, 5, 1, 16):  # prefill, decode, verify-sized, decode, block
        tokens = mx.array(rng.integers(0, 256, (1, n)))
        want = model(tokens, cache=theirs)
        got, taps = adapter.forward(tokens, ours, taps=[0, 1])
        if recurrence == "sequential" or not isinstance(adapter, HybridTarget):
            assert mx.array_equal(got, want), f"{name}: adapter drifted from mlx-lm's forward"
        else:
            assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), f"{name}: chunked recurrence drifted"
        assert taps.shape == (1, n, 2 * adapter.hidden_size)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_5_moe", "llama"])
@pytest.mark.parametrize("keep", [0, 1, 3, 7, 8])
@pytest.mark.parametrize("recurrence", ["sequential", "chunked"])
def test_rollback_equals_decoding_only_the_kept_tokens(targets, name, keep, recurrence):
    model = targets[name]
    adapter = make_adapter(model, recurrence)
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
    assert mx.allclose(a, b, atol=1e-5, rtol=1e-5)
    for ca, cb in zip(rolled, fresh):
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
    for i in linear:
        assert mx.array_equal(a[i][0], b[i][0]) and mx.array_equal(a[i][1], b[i][1])


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
        assert bool(adapter._compiled_layers) == compile_layers
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
    st = path / "model.safetensors"
    if damage == "no-config":
        (path / "config.json").unlink()
    elif damage == "bad-json":
        (path / "config.json").write_text("{")
    elif damage == "no-weights":
        st.unlink()
    elif damage == "truncated":
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    elif damage in ("missing-tensor", "extra-tensor", "wrong-shape"):
        w = mx.load(str(st))
        if damage == "missing-tensor":
            w.pop("norm.weight")
        elif damage == "extra-tensor":
            w["layers.0.self_attn.rotary.inv_freq"] = mx.zeros((4,))
        else:
            w["fc.weight"] = mx.zeros((64, 100))
        mx.save_safetensors(str(st), w)
    elif damage == "wrong-arch":
        cfg = json.loads((path / "config.json").read_text())
        cfg["architectures"] = ["Qwen3ForCausalLM"]
        (path / "config.json").write_text(json.dumps(cfg))
    elif damage == "nowhere":
        path = tmp_path / "does" / "not" / "exist"
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
