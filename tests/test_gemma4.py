"""Gemma-4 targets and sliding-window targets in general (gpt-oss's, with
attention sinks, among them): the adapter against
mlx-lm's own forward, exact rollback of rotating caches after the window has
wrapped, greedy output identical to mlx-lm's, sampling exact, and z-lab's
Gemma drafter configs checked against targets of their shape."""

import itertools
import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_lm import load
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from tiny import PROMPT, TRUNCATED, V, ScriptedDrafter, pit_check, prompt_of, sampled_runs

import dflash_mlx
from dflash_mlx.loading import DraftLoadError
from dflash_mlx.models.dflash import DFlashConfig, DraftConfigError
from dflash_mlx.targets import TargetError, adapter_for
from dflash_mlx.targets.gemma4 import Gemma4Target

LLAMA_SWA = dict(tiny.LLAMA, layer_types=[tiny.SLIDING, tiny.FULL, tiny.SLIDING], sliding_window=8)

# Sliding-window targets: the Gemma-4 families of tiny.FAMILIES and two built
# here; their windows (base["sliding_window"]) are far shorter than the generations.
BUILDS = {"gemma4_moe": tiny.GEMMA4_MOE, "llama_swa": LLAMA_SWA}
NAMES = ["gemma4_text", "gemma4", "gemma4_moe", "gemma4_unified", "llama_swa", "gpt_oss"]


@pytest.fixture(scope="module")
def targets(make_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {name: tiny.Pair(root / name, BUILDS[name]) if name in BUILDS else make_pair(name) for name in NAMES}


def test_loaded_models_have_the_features_under_test(targets):
    text = targets["gemma4_text"].model
    assert len(text.make_cache()) == 4 < len(text.layers) == 6  # two KV-shared layers
    heads = {layer.layer_type: layer.self_attn.head_dim for layer in text.layers}
    assert heads == {tiny.SLIDING: 16, tiny.FULL: 32}
    assert text.model.embed_tokens_per_layer is not None and text.final_logit_softcapping == 30.0
    mm = targets["gemma4"].model
    assert type(mm).__module__.endswith(".gemma4") and mm.language_model.model.window_size == 16
    assert targets["gemma4_unified"].model.model_type == "gemma4_unified"
    assert targets["gemma4_moe"].model.layers[0].enable_moe
    kinds = [type(c) for c in targets["llama_swa"].model.make_cache()]
    assert kinds.count(RotatingKVCache) == 2


@pytest.mark.parametrize("name", NAMES)
def test_adapter_forward_equals_mlx_lm_forward(targets, name):
    """Bit-equal logits across several window wraps, one-token and block
    forwards mixed; the last layer's tap through the model's own norm, head
    and soft cap gives those logits (taps are the layers' hidden outputs)."""
    model = targets[name].model
    adapter = adapter_for(model)
    text = getattr(model, "language_model", model)
    rng = np.random.default_rng(0)
    ours, theirs = adapter.make_cache(), make_prompt_cache(model)
    last = adapter.num_layers - 1
    for n in (11, 1, 5, 1, 16, 3, 1, 9, 16, 1):
        tokens = mx.array(rng.integers(0, 256, (1, n)))
        want = model(tokens, cache=theirs)
        got, taps = adapter.forward(tokens, ours, taps=[0, last])
        assert mx.array_equal(got, want), f"{name}: adapter drifted from mlx-lm's forward"
        assert taps.shape == (1, n, 2 * adapter.hidden_size)
        again = adapter.lm_head(text.model.norm(taps[..., adapter.hidden_size :]))
        if isinstance(adapter, Gemma4Target):
            again = mx.tanh(again / 30.0) * 30.0
        assert mx.allclose(again, want, atol=1e-5)


def naive_rollback(cache, length, keep):
    """mlx-lm's trim on every cache: what the rotating-cache rollback replaces."""
    for c in cache:
        c.trim(length - keep)


# (block length, kept tokens) per step: every kept length, keep 0 after a wrap,
# one-token forwards (kept or dropped) right after rollbacks.
SCHEDULE = [(16, 3), (1, 1), (9, 9), (16, 1), (1, 1), (1, 0), (1, 1), (8, 0), (1, 1), (16, 16),
            (5, 2), (1, 1), (12, 7), (1, 1), (1, 1), (16, 0), (1, 1), (4, 4), (16, 11), (1, 1)]


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4_moe", "llama_swa", "gpt_oss"])
def test_rollback_is_exact_after_the_window_wraps(targets, name):
    """After each rollback, a one-token step on the rolled-back cache gives
    what mlx-lm's own token-by-token decode of the kept tokens gives. mlx-lm's
    trim, run on the same schedule, does not (the check has power)."""
    model = targets[name].model
    adapter = adapter_for(model)
    rng = np.random.default_rng(1)
    prompt = mx.array(rng.integers(0, 256, (1, 20)))  # past every window already
    errors = {}
    for rollback in ("adapter", "naive"):
        cache, ref = adapter.make_cache(), make_prompt_cache(model)
        adapter.forward(prompt, cache, record=False, taps=[])
        model(prompt, cache=ref)
        worst = 0.0
        for step, (length, keep) in enumerate(SCHEDULE):
            block = mx.array(np.random.default_rng(step).integers(0, 256, (1, length)))
            adapter.forward(block, cache, taps=[])
            if rollback == "adapter":
                adapter.rollback(cache, keep)
            else:
                naive_rollback(cache, length, keep)
            for t in range(keep):
                model(block[:, t : t + 1], cache=ref)
            probe = mx.array([[step + 3]])
            got, _ = adapter.forward(probe, cache, taps=[])
            want = model(probe, cache=ref)
            worst = max(worst, mx.abs(got - want).max().item())
        errors[rollback] = worst
    assert errors["adapter"] < 1e-4
    assert errors["naive"] > 1e-2


class OneTokenScriptedDrafter(ScriptedDrafter):
    """:class:`ScriptedDrafter` that every ``skip_every``-th cycle proposes
    nothing, so the target verifies the anchor alone, mostly right after a
    rollback (counted in ``lone_after_rollback`` once the window has wrapped).
    An odd number of full cycles between skips moves the planted mistake on,
    so power-of-two blocks do not always skip after a fully accepted block."""

    def __init__(self, *args, skip_every, window, **kw):
        super().__init__(*args, **kw)
        self.cycle = itertools.count(1)
        self.skip_every, self.window = skip_every, window
        self.proposed = None  # length of the last proposal
        self.lone_after_rollback = 0

    def propose(self, block, context, cache, slots=None):
        rolled_back = self.proposed is not None and context.shape[1] < self.proposed + 1
        if next(self.cycle) % self.skip_every == 0:
            seq = tiny.committed_sequence(self.prompt, block, context, cache, self.reference)
            cache["last"] = seq[-1:]
            self.lone_after_rollback += rolled_back and len(cache["tokens"]) > self.window
            self.proposed = 0
            return mx.zeros((1, 0), mx.int32)
        self.proposed = block.shape[1] - 1
        return super().propose(block, context, cache, slots)


GREEDY_CASES = [
    # (target, prompt length, block size): each block size, prompts of 1 to 300
    ("gemma4_text", 1, 16),
    ("gemma4_text", 300, 8),
    ("gemma4", 1, 4),
    ("gemma4", 57, 2),
    ("gemma4_moe", 300, 16),
    ("llama_swa", 1, 8),
    ("gpt_oss", 1, 16),
    ("gpt_oss", 300, 4),
]


@pytest.mark.parametrize("name, prompt_len, block_size", GREEDY_CASES)
def test_greedy_is_mlx_lm_greedy(targets, name, prompt_len, block_size):
    """200 new tokens; every acceptance length before and after the window
    wraps (where the window holds enough tokens for them all), one-token
    verify steps right after rollbacks."""
    t = targets[name]
    window = t.base["sliding_window"]
    prompt = prompt_of(prompt_len)
    max_tokens = 200
    ref = t.reference(prompt, max_tokens + block_size, eos_ids=[])  # never stops early
    draft = OneTokenScriptedDrafter(
        ref, prompt, block_size, range(block_size), t.vocab, skip_every=6, window=window
    )
    # (copies off: every acceptance length is the scripted drafter's)
    got, responses = t.dflash(draft, prompt, eos_ids=[], block_size=block_size, max_tokens=max_tokens, copy_drafts=False)
    assert got == ref[:max_tokens] and len(got) == max_tokens
    position = len(prompt) - 1  # cache offset when each cycle's verify starts
    before, after = set(), set()
    for previous, r in zip(responses, responses[1:]):
        position += len(previous.tokens)
        if position + block_size <= window:
            before.add(r.accepted)
        elif position >= window:
            after.add(r.accepted)
    assert after >= set(range(block_size))
    if len(prompt) + block_size * (block_size + 1) // 2 + block_size <= window:
        assert before >= set(range(block_size))
    assert draft.lone_after_rollback >= 3


@pytest.mark.parametrize("eos_at", [5, 30])
def test_eos_inside_a_block(targets, eos_at):
    t = targets["gemma4"]
    prompt = prompt_of(12)
    plain = t.reference(prompt, 60)
    eos = plain[eos_at]
    ref = t.reference(prompt, 60, eos_ids=[eos])
    assert ref == plain[: plain.index(eos)]
    draft = ScriptedDrafter(plain, prompt, 8, [7], t.vocab)  # always full blocks
    got, responses = t.dflash(draft, prompt, eos_ids=[eos], block_size=8, max_tokens=60)
    assert got == ref and responses[-1].finish_reason == "stop"


def zlab_like_draft_config(t, **kw):
    """A tiny drafter with z-lab's Gemma layer layout (4 sliding, causal
    within the block, + 1 full) and a window shorter than the generation."""
    return tiny.draft_config(
        t.base, t.vocab, layers=5, taps=[0, 2, 3], block_size=16, final_logit_softcapping=30.0,
        layer_types=[tiny.SLIDING] * 4 + [tiny.FULL], sliding_window=6, **kw,
    )


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4"])
def test_trained_shape_drafter_is_lossless(targets, tmp_path, name):
    t = targets[name]
    draft = dflash_mlx.load_draft(tiny.make_draft(tmp_path / "d", zlab_like_draft_config(t)), t.model)
    prompt = prompt_of(29)
    got, responses = t.dflash(draft, prompt, max_tokens=60)
    assert got == t.reference(prompt, 60)
    assert responses[-1].generation_tokens == 60


def test_drafter_gemma_glue_matches_float32_reference(targets, tmp_path):
    """Noise embedding = the target's scaled embedding x input_embedding_scale,
    the tied head, the soft cap, sliding layers causal in the block with
    window - 1 context rows, RoPE read from rope_parameters."""
    t = targets["gemma4_text"]
    rope = {"rope_theta": 1000000.0, "rope_type": "default"}
    cfg = zlab_like_draft_config(t, rope_parameters=rope, rope_theta=None)
    cfg["dflash_config"]["input_embedding_scale"] = 0.5
    draft = dflash_mlx.load_draft(tiny.make_draft(tmp_path / "d", cfg), t.model)
    assert draft.config.rope_theta == 1e6 and draft.config.input_embedding_scale == 0.5
    target = draft.target
    E = t.model.model.embed_tokens.weight
    ids = mx.array([[3, 200, 17]])
    assert mx.array_equal(target.embed(ids), E[ids] * 64**0.5)
    # The float32 reference (tiny.reference_logits) reads the embedding and head from
    # a target; give it the scaled table and the raw tied head.
    stand_in = SimpleNamespace(
        backbone=SimpleNamespace(embed_tokens=SimpleNamespace(weight=E * 64**0.5)),
        tied=False, text_model=SimpleNamespace(lm_head=SimpleNamespace(weight=E)),
    )
    got, want = tiny.drafter_and_reference_logits(draft, stand_in, t.vocab, (9, 3, 1), 7)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, np.tanh(w / 30.0) * 30.0, atol=1e-4, rtol=1e-4)


def test_gemma_target_samples_the_target(tmp_path):
    """The statistical check of test_sampling on a Gemma-4 target (window 8,
    wrapped many times), with a random DFlash drafter: rejection sampling."""
    path = tiny.make_gemma4_target(tmp_path / "target", tiny.GEMMA4_TEXT, seed=3, vocab_size=V)
    model, tokenizer = load(str(path))
    cfg = tiny.draft_config(tiny.GEMMA4_TEXT, V, block_size=4, final_logit_softcapping=30.0)
    draft = dflash_mlx.load_draft(str(tiny.make_draft(tmp_path / "draft", cfg, seed=1)), model)
    small = SimpleNamespace(model=model, tokenizer=tokenizer, draft=draft)
    tokens, accepted = sampled_runs(small, draft, 4, TRUNCATED, block_size=4)
    ks, bound, outside = pit_check(model, tokens, TRUNCATED, np.random.default_rng(0))
    assert outside == 0 and ks < bound
    assert min(accepted) == 0 and max(accepted) >= 2
    assert len(PROMPT) + len(tokens[0]) > 3 * tiny.GEMMA4_TEXT["sliding_window"]


# ---------------------------------------------------------------------------
# z-lab's published Gemma-4 drafters against targets of their shape

GEMMA_VOCAB = 262144
SHAPE_HIDDEN = 16


def shaped_target(root, name):
    """A target with the layer count, layer pattern and kinds of
    gemma-4-31B-it / gemma-4-26B-A4B-it (widths shrunk, vocabulary kept)."""
    n = {"gemma-4-31B-it": 60, "gemma-4-26B-A4B-it": 30}[name]
    text = dict(
        tiny.GEMMA4_TEXT, hidden_size=SHAPE_HIDDEN, intermediate_size=16, num_hidden_layers=n,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16,
        layer_types=([tiny.SLIDING] * 5 + [tiny.FULL]) * (n // 6), sliding_window=1024,
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=True,
        num_global_key_value_heads=1,
    )
    if name == "gemma-4-26B-A4B-it":
        text.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8)
    path = tiny.make_gemma4_target(root / name, tiny.gemma4_multimodal(text), vocab_size=GEMMA_VOCAB)
    return load(str(path))


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    root = tmp_path_factory.mktemp("shaped")
    return {name: shaped_target(root, name) for name in ("gemma-4-31B-it", "gemma-4-26B-A4B-it")}


@pytest.mark.parametrize("name", ["gemma-4-31B-it", "gemma-4-26B-A4B-it"])
def test_zlab_gemma_drafters_fit_targets_of_their_shape(shaped, tmp_path, name):
    cfg = tiny.zlab_gemma4_draft_config(name, SHAPE_HIDDEN, GEMMA_VOCAB)
    config = DFlashConfig.from_hf(cfg)
    assert config.layer_types == [tiny.SLIDING] * 4 + [tiny.FULL] and config.sliding_window == 2048
    assert config.final_logit_softcapping == 30.0 and config.mask_token_id == 4
    model, tokenizer = shaped[name]
    draft = dflash_mlx.load_draft(tiny.make_draft(tmp_path / "d", cfg), model)
    assert draft.target.embed_scale == SHAPE_HIDDEN**0.5
    assert [c.window for c in draft.make_cache()] == [2047] * 4 + [None]
    other = next(n for n in shaped if n != name)  # the other size's drafter: taps out of range or fewer layers
    with pytest.raises(TargetError, match="layers"):
        dflash_mlx.load_draft(tmp_path / "d", shaped[other][0])
    if name == "gemma-4-26B-A4B-it":  # the MoE target decodes exactly with it
        prompt = prompt_of(21)
        got, _ = tiny.dflash_tokens(model, draft, tokenizer, prompt, max_tokens=12)
        assert got == tiny.reference_tokens(model, tokenizer, prompt, 12)


def test_gemma_drafter_on_another_family_is_refused(qwen3_pair, tmp_path):
    cfg = tiny.zlab_gemma4_draft_config("gemma-4-26B-A4B-it", 64, GEMMA_VOCAB)
    path = tiny.make_draft(tmp_path / "d", cfg)
    with pytest.raises(TargetError, match=r"vocab_size 262144 != target vocabulary 258 \(qwen3 target\)"):
        dflash_mlx.load_draft(path, qwen3_pair.model)


def test_drafter_config_errors(targets, tmp_path):
    t = targets["gemma4_text"]
    base = tiny.draft_config(tiny.GEMMA4_TEXT, t.vocab)
    bad_mask = json.loads(json.dumps(base))
    bad_mask["dflash_config"]["mask_token_id"] = t.vocab
    with pytest.raises(DraftConfigError, match=f"mask_token_id {t.vocab} is outside"):
        DFlashConfig.from_hf(bad_mask)
    per_type = dict(base, rope_parameters={tiny.FULL: {"rope_theta": 1e6}, tiny.SLIDING: {"rope_theta": 1e4}})
    with pytest.raises(DraftConfigError, match="rope_parameters differ"):
        DFlashConfig.from_hf(per_type)
    same = dict(base, rope_theta=None, rope_parameters={k: {"rope_theta": 5e5} for k in (tiny.FULL, tiny.SLIDING)})
    assert DFlashConfig.from_hf(same).rope_theta == 5e5
    taps_past = tiny.make_draft(tmp_path / "taps", dict(base, dflash_config={"target_layer_ids": [1, 6], "mask_token_id": 4}))
    with pytest.raises(TargetError, match=r"layers \[6\], but the target has only 6"):
        dflash_mlx.load_draft(taps_past, t.model)
    wrong_depth = tiny.make_draft(tmp_path / "depth", dict(base, num_target_layers=12))
    with pytest.raises(TargetError, match="trained on a target of 12 layers"):
        dflash_mlx.load_draft(wrong_depth, t.model)
    (tmp_path / "mask").mkdir()
    (tmp_path / "mask" / "config.json").write_text(json.dumps(bad_mask))
    with pytest.raises(DraftLoadError, match="outside the drafter vocabulary"):
        dflash_mlx.load_draft(tmp_path / "mask", t.model)
