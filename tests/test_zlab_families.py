"""The targets of z-lab's other published drafters: gpt-oss (sliding windows
with per-head attention sinks), Qwen3-Next (a GatedDeltaNet hybrid with
shared experts) and DeepSeek-V3 / Kimi-K2.5 (multi-head latent attention),
on tiny seeded models in their Hugging Face layout.

The adapters' forward, taps and rollback are checked against mlx-lm with
every other family (tests/test_targets.py), gpt-oss's window wraps with
Gemma's (tests/test_gemma4.py), trees and three-turn prompt caches with the
rest (tests/test_tree.py, tests/test_prompt_cache.py). Here: greedy output
is mlx-lm's over 200 tokens at blocks 16, 4 and changing blocks; sampling
is exact; a 4-bit copy made by mlx-lm is exact; drafters shaped as z-lab
publishes them load, bind, decode exactly and convert; misfits are refused.
"""

import json
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx_lm import load
from mlx_lm.models.cache import KVCache, RotatingKVCache
from test_adaptive import SCRIPT
from test_convert import run as convert
from tiny import TRUNCATED, V, ScriptedDrafter, ScriptedSizer, pit_check, prompt_of, sampled_runs

import dflash_mlx
from dflash_mlx.models.dflash import DFlashConfig
from dflash_mlx.targets import TargetError, adapter_for
from dflash_mlx.targets.hybrid import HybridTarget
from dflash_mlx.targets.mla import MLATarget

# Kimi-K2.5 runs DeepSeek-V3's text model: the loop is checked on the wrapper
# (both families' forward, taps, rollback and a random drafter run with every
# family's, in tests/test_targets.py and tests/test_lossless.py).
NEW = ["gpt_oss", "qwen3_next", "kimi_k25"]


def test_loaded_models_have_the_features_under_test(make_pair):
    gpt = make_pair("gpt_oss").model
    caches = gpt.make_cache()
    assert [type(c) for c in caches] == [RotatingKVCache, KVCache] * 2 and caches[0].max_size == 8
    layer = gpt.model.layers[0]
    assert layer.self_attn.sinks.shape == (4,) and mx.abs(layer.self_attn.sinks).min().item() > 0
    assert type(layer.self_attn.rope).__name__ == "YarnRoPE"
    assert type(layer.mlp.experts.activation).__name__ == "SwigluOAI"

    qwen = make_pair("qwen3_next").model
    assert [layer.is_linear for layer in qwen.layers] == [True, True, True, False]
    assert hasattr(qwen.layers[0].linear_attn, "in_proj_qkvz") and hasattr(qwen.layers[0].mlp, "shared_expert")
    assert isinstance(adapter_for(qwen), HybridTarget)

    for name in ("deepseek_v3", "kimi_k25"):
        model = make_pair(name).model
        adapter = adapter_for(model)
        assert isinstance(adapter, MLATarget)
        cache = adapter.make_cache()
        adapter.forward(mx.array([[1, 2, 3]]), cache, taps=[])
        # the compressed cache: one latent (kv_lora_rank) and one rope key (qk_rope_head_dim) per token
        c = cache[0]
        assert c.offset == 3 and c.keys.shape[-1] == 32 and c.values.shape[-1] == 8
        assert hasattr(model.layers[1].mlp, "shared_experts") and not hasattr(model.layers[0].mlp, "gate")
        assert type(model.layers[0].self_attn.rope).__name__ == "YarnRoPE"


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("block", [16, 4, "changing"])
def test_greedy_is_mlx_lm_greedy(make_pair, name, block):
    """200 new tokens, every acceptance length at blocks 16 and 4, and a
    block that changes cycle by cycle as the adaptive sizer changes it
    (plain one-token cycles among them)."""
    pair = make_pair(name)
    prompt = prompt_of(37)
    ref = pair.reference(prompt, 216, eos_ids=[])
    size = 16 if block == "changing" else block
    drafter = ScriptedDrafter(ref, prompt, size, range(size + (block == "changing")), pair.vocab)
    kw = dict(sizer=ScriptedSizer(SCRIPT)) if block == "changing" else dict(block_size=block)
    got, responses = pair.dflash(drafter, prompt, eos_ids=[], max_tokens=200, **kw)
    assert got == ref[:200]
    cycles = responses[1:]
    if block == "changing":
        assert {1, 2, 16} <= {r.block_size for r in cycles}
    else:
        assert {r.accepted for r in cycles} >= set(range(block))


@pytest.mark.parametrize("name", NEW)
def test_sampling_reproduces_the_target(tmp_path, name):
    """The statistical check of test_sampling (randomised PIT, DKW bound) on
    a 16-token-vocabulary target of each family, with a random DFlash
    drafter: rejection sampling, gpt-oss's window of 8 wrapped many times."""
    base = tiny.FAMILIES[name]
    model, tokenizer = load(str(tiny.make_hf_target(tmp_path / "target", base, seed=3, vocab_size=V)))
    cfg = tiny.draft_config(base.get("text_config", base), V, block_size=4)
    draft = dflash_mlx.load_draft(str(tiny.make_draft(tmp_path / "draft", cfg, seed=1)), model)
    small = SimpleNamespace(model=model, tokenizer=tokenizer)
    tokens, accepted = sampled_runs(small, draft, 4, TRUNCATED, block_size=4)
    ks, bound, outside = pit_check(model, tokens, TRUNCATED, np.random.default_rng(0))
    assert outside == 0 and ks < bound
    assert min(accepted) == 0 and max(accepted) >= 1


@pytest.mark.parametrize("name", NEW)
def test_a_4bit_copy_is_exact(make_pair, tmp_path, capsys, name):
    """mlx-lm's own 4-bit conversion of the target (through ``convert``):
    DFlash's greedy output on it is mlx-lm's greedy output on it."""
    pair = make_pair(name)
    dst = tmp_path / "target-4bit"
    rc, err = convert(capsys, "--hf-path", pair.path, "--mlx-path", dst, "-q", "--q-group-size", 32)
    assert rc == 0, err
    model, tokenizer = load(str(dst))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    prompt = prompt_of(21)
    ref = tiny.reference_tokens(model, tokenizer, prompt, 108, eos_ids=[])
    scripted = ScriptedDrafter(ref, prompt, 8, range(8), pair.vocab)
    got, responses = tiny.dflash_tokens(model, scripted, tokenizer, prompt, eos_ids=[], block_size=8, max_tokens=100)
    assert got == ref[:100] and {r.accepted for r in responses[1:]} == set(range(8))
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), model)
    got, _ = tiny.dflash_tokens(model, draft, tokenizer, prompt, eos_ids=[], max_tokens=40)
    assert got == ref[:40]


# ---------------------------------------------------------------------------
# z-lab's drafters, shaped as published, against targets of their shape

SHAPES = list(tiny.ZLAB_DRAFTERS)


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    root = tmp_path_factory.mktemp("zlab_shaped")
    return {name: tiny.zlab_shaped_target(root, name) for name in SHAPES}


@pytest.mark.parametrize("name", SHAPES)
def test_zlab_drafters_load_bind_and_decode_exactly(shaped, tmp_path, capsys, name):
    cfg = tiny.zlab_draft_config(name, tiny.SHAPE_HIDDEN)
    published = tiny.ZLAB_DRAFTERS[name][2]
    config = DFlashConfig.from_hf(cfg)
    assert config.target_layer_ids == published["dflash_config"]["target_layer_ids"]
    assert config.mask_token_id == published["dflash_config"]["mask_token_id"]
    assert config.block_size == published["block_size"] and config.num_hidden_layers == published["num_hidden_layers"]
    assert config.attention_bias == published["attention_bias"]
    assert config.rope_scaling == published.get("rope_scaling")
    model, tokenizer = shaped[name]
    path = tiny.make_draft(tmp_path / "d", cfg)
    draft = dflash_mlx.load_draft(path, model)
    assert draft.target.tap_ids == config.target_layer_ids
    prompt = prompt_of(19)
    want = tiny.reference_tokens(model, tokenizer, prompt, 24, eos_ids=[])
    got, _ = tiny.dflash_tokens(model, draft, tokenizer, prompt, eos_ids=[], max_tokens=24)
    assert got == want
    # The converter round-trips it: the same logits, the published fields kept.
    dst = tmp_path / "converted"
    rc, err = convert(capsys, "--hf-path", path, "--mlx-path", dst, "--dtype", "float32")
    assert rc == 0, err
    again = dflash_mlx.load_draft(dst, model)
    block = mx.array([[7] + [config.mask_token_id] * 3])
    hidden = mx.random.normal((1, 5, config.fc_input_size), key=mx.random.key(0))
    assert mx.array_equal(again(block, hidden, again.make_cache()), draft(block, hidden, draft.make_cache()))
    written = json.loads((dst / "config.json").read_text())
    assert all(written[k] == v for k, v in published.items() if k != "dtype")


def test_a_drafter_that_does_not_fit_is_one_error_naming_both(shaped, tmp_path):
    """Taps past the target's layers (a 36-layer target's taps on the 24
    layers of gpt-oss-20b's shape) and a drafter hidden size not the
    target's: each refused at load with the drafter's and the target's side."""
    model, _ = shaped["gpt-oss-20b"]
    cfg = tiny.zlab_draft_config("gpt-oss-20b", tiny.SHAPE_HIDDEN)
    deeper = dict(cfg, dflash_config=dict(cfg["dflash_config"], target_layer_ids=[1, 9, 17, 25, 33]))
    with pytest.raises(TargetError, match=r"taps target layers \[25, 33\], but the target has only 24 layers "
                                          r"\(0..23; a gpt_oss target\)"):
        dflash_mlx.load_draft(tiny.make_draft(tmp_path / "deep", deeper), model)
    wider = tiny.zlab_draft_config("gpt-oss-20b", 2 * tiny.SHAPE_HIDDEN)
    with pytest.raises(TargetError, match=r"fc expects 160 input features \(drafter hidden 32\), but 5 taps x "
                                          r"target hidden 16 = 80 \(gpt_oss target\)"):
        dflash_mlx.load_draft(tiny.make_draft(tmp_path / "wide", wider), model)
    kimi, _ = shaped["Kimi-K2.5"]
    with pytest.raises(TargetError, match=r"vocab_size 201088 != target vocabulary 163840 \(kimi_k25 target\)"):
        dflash_mlx.load_draft(tmp_path / "deep", kimi)
