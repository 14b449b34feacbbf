"""What an adversarial audit of multi-turn use, prompt caches, sampling and
Gemma-4's logprobs found: one test per finding. References: mlx-lm's own
decode (``stream_generate``/``generate_step``) on its own prompt cache,
float32; for sampling, the target's processed distribution (a PIT)."""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from test_disk_cache import serving
from tiny import PROMPT, eos_set, prompt_of, reference_responses, small_pair

import dflash_mlx
from dflash_mlx.cache import load_prompt_cache, save_prompt_cache
from dflash_mlx.targets import adapter_for


def ring_everywhere(model, size):
    """mlx-lm's caches with every full-attention KVCache a RotatingKVCache(size, keep=4):
    what DFlash's max_kv_size makes (docs/mlx-lm.md: mlx-lm 0.32.2 ignores it for
    models with their own make_cache)."""
    return [RotatingKVCache(size, keep=4) if type(c) is KVCache else c for c in mlx_lm_make_prompt_cache(model)]


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4_text"])
def test_a_conversation_saved_between_turns_with_eos_trees_and_rings(make_pair, tmp_path, family):
    """Four turns on one cache: eos ending some, max_tokens=1 ending one, a
    tree on one, the cache saved to disk and loaded back between turns, the
    target's full-attention caches bounded (max_kv_size): each turn
    mlx-lm's on its own cache."""
    pair = make_pair(family)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4, taps=[0, 1]), pair.model)
    base = prompt_of(8)
    turns = [base * 3, base[:5], np.random.default_rng(5).integers(0, 256, 3).tolist(), base[2:7]]
    budgets = [dict(max_tokens=10), dict(max_tokens=1), dict(max_tokens=12, tree_budget=6), dict(max_tokens=9, block_size=3)]
    eos = [reference_responses(pair.model, pair.tokenizer, turns[0], 8, eos_ids=[], prompt_cache=ring_everywhere(pair.model, 24))[5].token]
    lm_cache, cache = ring_everywhere(pair.model, 24), dflash_mlx.make_prompt_cache(pair.model, draft, max_kv_size=24)
    want, got = [], []
    with eos_set(pair.tokenizer, eos):
        for i, (t, kw) in enumerate(zip(turns, budgets)):
            want.append([r.token for r in reference_responses(pair.model, pair.tokenizer, t, kw["max_tokens"], eos, prompt_cache=lm_cache)])
            got.append([x for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, t, prompt_cache=cache, **kw) for x in r.tokens])
            save_prompt_cache(str(tmp_path / f"{i}.safetensors"), cache)
            cache = load_prompt_cache(str(tmp_path / f"{i}.safetensors"), draft)
    assert got == [[x for x in w if x not in eos] for w in want]
    assert any(w[-1:] == eos for w in want)  # (the case: a turn ended on eos, which mlx-lm ran)


PENALISED = dict(logit_bias={3: 1.5}, repetition_penalty=2.0, repetition_context_size=4, presence_penalty=0.5, frequency_penalty=1.0)


def pit_distance(model, runs, setting, processors):
    """:func:`tiny.pit_check` of each run's turn-2 tokens given the whole
    conversation, the processors seeing the turn's own prompt first
    (mlx-lm's history on a reused cache): (KS distance, its bound)."""
    return tiny.pit_check(model, runs, setting, np.random.default_rng(0), logits_processors=processors)[:2]


def test_sampling_with_penalties_on_a_reused_cache_follows_the_target(tmp_path):
    """A second turn sampled on the first turn's cache (top-p, min-p and
    penalties; copy drafts on: the prompt repeats) follows the target's
    processed distribution given the whole conversation."""
    small = small_pair(tmp_path, tiny.QWEN3)
    setting, second = dict(temperature=0.8, top_p=0.9, min_p=0.05), [2, 9, 4, 4, 2, 9]
    runs = []
    for seed in range(6):
        mx.random.seed(seed)
        cache = dflash_mlx.make_prompt_cache(small.model, small.draft)
        out = [[t for r in dflash_mlx.stream_generate(small.model, small.draft, small.tokenizer, p, max_tokens=m, prompt_cache=cache, block_size=4,
                                                      logits_processors=make_logits_processors(**PENALISED), **setting) for t in r.tokens]
               for p, m in ((PROMPT, 20), (second, 60))]
        runs.append((PROMPT + out[0] + second, second, out[1]))
    ks, bound = pit_distance(small.model, runs, setting, lambda: make_logits_processors(**PENALISED))
    assert ks < bound
    assert pit_distance(small.model, runs, setting, lambda: [])[0] > bound  # the check can fail: no processors


def test_gemma4_verify_blocks_are_mlx_lms_own_block_forward(make_pair, tmp_path):
    """Where our logprobs leave mlx-lm's one-token steps, mlx-lm's own model
    does too: our verify block (the window ring wrapped: prompt 12 > window
    8) is mlx-lm's forward of the same block on its own cache, bit for bit.
    What differs from the steps is float32 summation order: a one-token step
    attends over the RotatingKVCache in storage (rotated) order, a block
    (mlx-lm's concat path) in time order; with OpenBLAS, also gemm against
    gemv in the attention's products. Both inside mlx-lm; up to about 1e-4
    in logprobs."""
    pair = make_pair("gemma4_text")
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4, taps=[0, 1]), pair.model)
    prompt = prompt_of(12, 1)
    ref = [(t, lp) for (t, lp), _ in zip(mlx_lm_generate_step(mx.array(prompt), pair.model), range(30))]
    for kw in (dict(block_size=4), dict(tree_budget=6)):
        got = [(t, lp) for (t, lp, *_), _ in zip(dflash_mlx.generate_step(prompt, pair.model, draft, logprobs=True, **kw), range(30))]
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert max(float(mx.abs(a - b).max()) for (_, a), (_, b) in zip(ref, got)) < 1e-4, kw
    target, block = adapter_for(pair.model), mx.array([[t for t, _ in ref[:4]]])
    ours, lm = target.make_cache(), mlx_lm_make_prompt_cache(pair.model)
    target.forward(mx.array([prompt]), ours)
    pair.model(mx.array([prompt]), cache=lm)
    assert mx.array_equal(target.forward(block, ours)[0], pair.model(block, cache=lm))


def test_the_disk_tier_restores_a_bounded_cache_after_a_restart(make_pair, tmp_path):
    """--max-kv-size with --prompt-cache-dir: a restarted server serves the
    conversation from disk, as it does without KV settings."""
    pair = make_pair("qwen3")
    draft_dir = pair.make_draft(tmp_path / "d", block_size=4, taps=[0, 2])
    served = (pair, draft_dir, dflash_mlx.load_draft(draft_dir, pair.model))
    first = prompt_of(40, seed=1)
    flags = ("--prompt-cache-dir", str(tmp_path / "c"), "--max-kv-size", "64")
    with serving(served, *flags) as (post, _):
        post(first)
    held = first + [r.token for r in reference_responses(pair.model, pair.tokenizer, first, 6)]
    with serving(served, *flags) as (post, _):
        text, cached = post(held + prompt_of(5, seed=2))
    assert text == "".join(r.text for r in reference_responses(pair.model, pair.tokenizer, held + prompt_of(5, seed=2), 6, max_kv_size=64))
    assert cached >= len(held) - 1
