"""The drafter against a straightforward float32 numpy forward of it
(tiny.reference_logits), and the config variants published checkpoints use."""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx.models.dflash import DFlashConfig, default_target_layer_ids, masked_block


VARIANTS = {
    "full": {},
    "sliding-causal-default": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "sliding-noncausal": dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=3, is_causal=False),
    "causal-flag": dict(is_causal=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafter_logits_match_float32_reference(qwen3_5_pair, tmp_path, variant):
    pair = qwen3_5_pair
    path = pair.make_draft(tmp_path / "d", **VARIANTS[variant])
    draft = dflash_mlx.load_draft(path, pair.model)
    got, want = tiny.drafter_and_reference_logits(draft, draft.target, pair.vocab, (7, 3, 1), 6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_propose_is_argmax_of_slots_after_anchor(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    ctx = mx.random.normal((1, 4, draft.config.fc_input_size))
    block = masked_block(draft, 5, 8)
    logits = draft(block, ctx, draft.make_cache())
    proposal = draft.propose(block, ctx, draft.make_cache())
    assert proposal.shape == (1, 7)
    assert proposal.tolist() == mx.argmax(logits[:, 1:], axis=-1).tolist()


def test_context_cache_holds_committed_positions_only(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    cache = draft.make_cache()
    n = draft.config.fc_input_size
    draft(mx.array([[1, 2, 3, 4]]), mx.zeros((1, 5, n)), cache)
    draft(mx.array([[1, 2, 3, 4]]), mx.zeros((1, 2, n)), cache)
    assert all(c.offset == 7 and c.fetch()[0].shape[2] == 7 for c in cache)


def test_sliding_cache_keeps_window(qwen3_pair, tmp_path):
    pair = qwen3_pair
    path = pair.make_draft(tmp_path / "d", layer_types=["sliding_attention"] * 2, sliding_window=4)
    draft = dflash_mlx.load_draft(path, pair.model)
    cache = draft.make_cache()
    draft(mx.array([[1, 2]]), mx.zeros((1, 9, draft.config.fc_input_size)), cache)
    assert all(c.offset == 9 and c.fetch()[0].shape[2] == 3 for c in cache)


def test_embedding_and_head_are_shared_not_copied(qwen3_5_pair, tmp_path):
    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    names = [k for k, _ in tree_flatten(draft.parameters())]
    assert not any("embed" in k or "lm_head" in k for k in names)
    assert draft.target.backbone.embed_tokens is pair.model.language_model.model.embed_tokens


def test_default_tap_ids():
    assert default_target_layer_ids(32, 1) == [16]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32, 8)[0] == 1 and default_target_layer_ids(32, 8)[-1] == 29


def _base_cfg():
    return tiny.draft_config(tiny.QWEN3, 258)


def test_config_variants():
    cfg = _base_cfg()
    nested = json.loads(json.dumps(cfg))
    nested.pop("block_size")
    nested["dflash_config"]["block_size"] = 10
    assert DFlashConfig.from_hf(nested).block_size == 10
    assert DFlashConfig.from_hf(cfg).block_size == 8

    rp = json.loads(json.dumps(cfg))
    rp.pop("rope_theta")
    rp["rope_parameters"] = {"rope_theta": 1e7, "rope_type": "default"}
    c = DFlashConfig.from_hf(rp)
    assert c.rope_theta == 1e7 and c.rope_scaling is None

    yarn = json.loads(json.dumps(cfg))
    yarn["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert DFlashConfig.from_hf(yarn).rope_scaling["rope_type"] == "yarn"

    swa = json.loads(json.dumps(cfg))
    swa["dflash_config"].update(use_swa=True, swa_window_size=64)
    c = DFlashConfig.from_hf(swa)
    assert c.layer_types == ["sliding_attention"] * 2 and c.sliding_window == 64

    causal = json.loads(json.dumps(cfg))
    causal["dflash_config"]["causal"] = True
    assert DFlashConfig.from_hf(causal).is_causal is True

    no_taps = json.loads(json.dumps(cfg))
    del no_taps["dflash_config"]["target_layer_ids"]
    assert DFlashConfig.from_hf(no_taps).target_layer_ids == default_target_layer_ids(4, 2)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_and_sharded_checkpoints_load(qwen3_pair, tmp_path, dtype):
    """A half-precision checkpoint computes in float32 (the target's float32
    embeddings and taps promote it): it equals a float32 drafter holding the
    same rounded weights to float32 rounding, and differs from the unrounded
    one by the weight rounding alone, a few units of the dtype's roundoff."""
    pair = qwen3_pair
    cfg = pair.draft_config()
    ref = dflash_mlx.load_draft(tiny.make_draft(tmp_path / "f32", cfg), pair.model)
    path = tiny.make_draft(tmp_path / "half", cfg, dtype=dtype, shards=3)
    half = dflash_mlx.load_draft(path, pair.model)
    same_weights = dflash_mlx.load_draft(path, pair.model, dtype=mx.float32)
    assert half.fc.weight.dtype == dtype
    ctx = mx.random.normal((1, 3, cfg["hidden_size"] * 2), key=mx.random.key(0))
    block = mx.array([[3, 4, 5, 6]])
    a, b, c = (d(block, ctx, d.make_cache()) for d in (ref, half, same_weights))
    assert tiny.scaled_error(b, c) < 64 * tiny.EPS[mx.float32]
    assert tiny.scaled_error(b, a) < 16 * tiny.EPS[dtype]


def test_alternative_tensor_names(qwen3_pair, tmp_path):
    pair = qwen3_pair
    cfg = pair.draft_config(layers=1, taps=[2])
    src = tiny.make_draft(tmp_path / "orig", cfg)
    weights = mx.load(str(src / "model.safetensors"))
    renamed = {}
    for k, v in weights.items():
        k = k.replace("layers.0.", "midlayer.").replace("fc.", "encoder.fc.")
        k = k.replace("hidden_norm.", "encoder.output_norm_enc.")
        renamed[k] = v
    alt = tmp_path / "alt"
    alt.mkdir()
    (alt / "config.json").write_text((src / "config.json").read_text())
    mx.save_safetensors(str(alt / "model.safetensors"), renamed)
    a = dflash_mlx.load_draft(src, pair.model)
    b = dflash_mlx.load_draft(alt, pair.model)
    ctx = mx.random.normal((1, 2, cfg["hidden_size"]))
    block = mx.array([[1, 2, 3]])
    assert mx.array_equal(a(block, ctx, a.make_cache()), b(block, ctx, b.make_cache()))
