"""The prompt cache's state, not only the text it leads to.

Greedy output stays exact even when the drafter's context is wrong (the
target repairs every bad draft; only speed suffers), so output tests cannot
see such bugs. These tests compare the state itself: after a generation, a
trim, a save and load, a server prefix hit or a server snapshot, the target's
caches, the drafter's context and the pending tap rows equal those of a fresh
prefill of the same tokens.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, LRUPromptCache
from tiny import dflash_tokens

import dflash_mlx
from dflash_mlx.cache import bound_target, load_prompt_cache, make_prompt_cache, save_prompt_cache
from dflash_mlx.prefill import feed

# Rounding only: the same positions run in chunks of other sizes (prefill
# against verify blocks) sum their float32 dot products in another order.
TOL = dict(rtol=1e-4, atol=1e-4)


def close(got, want, what):
    if not isinstance(want, mx.array):
        assert got == want, what
        return
    assert got.shape == want.shape, f"{what}: shape {got.shape}, a fresh prefill gives {want.shape}"
    np.testing.assert_allclose(np.array(got), np.array(want), err_msg=what, **TOL)


def held(c):
    """What an mlx-lm cache holds: a KV cache's buffers up to its offset
    (its state is the whole buffer), any other cache's state."""
    if isinstance(c, KVCache):
        return [] if c.keys is None else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return c.state


def assert_like_fresh_prefill(cache, model, draft):
    """``cache`` holds what a fresh prefill of ``cache.tokens`` holds: the
    target has run the tokens before the pending ones, the drafter has
    injected a prefix of them, and the pending tap rows are exactly the rest."""
    seen = len(cache.tokens) - len(cache.pending)
    assert cache.pending == cache.tokens[seen:]
    assert {c.offset for c in cache.target if hasattr(c, "offset")} <= {seen}
    injected = {c.offset for c in cache.draft}
    assert len(injected) == 1, f"drafter layers disagree on their context length: {injected}"
    injected = injected.pop()
    lag = 0 if cache.target_hidden is None else cache.target_hidden.shape[1]
    assert injected + lag == seen, (
        f"the drafter injected {injected} positions and {lag} tap rows are pending, "
        f"but the target ran {seen}"
    )
    fresh = make_prompt_cache(model, draft)
    feed(bound_target(model, draft), fresh, cache.tokens[:seen] + [0])  # runs all but the 0
    rows = fresh.target_hidden
    for i, (got, want) in enumerate(zip(cache.target, fresh.target)):
        for (_, a), (_, b) in zip(tree_flatten(held(got)), tree_flatten(held(want)), strict=True):
            close(a, b, f"target cache {i}")
    if lag:
        close(cache.target_hidden, rows[:, injected:], "pending tap rows")
    context = draft.make_cache(cache.draft_window, cache.draft_sink)
    if injected:  # inject the fresh rows the drafter has seen, as a cycle does
        draft(mx.array([[draft.mask_token_id]]), rows[:, :injected], context)
    for i, (got, want) in enumerate(zip(cache.draft, context)):
        assert got.meta_state == want.meta_state, f"drafter layer {i}"
        for a, b in zip(got.state, want.state):
            close(a, b, f"drafter context, layer {i}")


def conversation(pair, tmp_path, prompt_len=20, max_tokens=12, **kw):
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    prompt = np.random.default_rng(2).integers(0, 256, size=prompt_len).tolist()
    cache = make_prompt_cache(pair.model, draft)
    dflash_tokens(pair.model, draft, pair.tokenizer, prompt, [], max_tokens=max_tokens, prompt_cache=cache, **kw)
    return draft, cache


@pytest.mark.parametrize("family, block_size", [("qwen3", 4), ("qwen3_5", 4), ("qwen3_5", 1)])
def test_generation_leaves_a_fresh_prefills_state(request, tmp_path, family, block_size):
    """Block 1: plain steps run ahead, each committed before its token is read."""
    pair = request.getfixturevalue(f"{family}_pair")
    draft, cache = conversation(pair, tmp_path, block_size=block_size)
    assert cache.target_hidden is not None  # the last cycle's rows wait for the next draft
    assert_like_fresh_prefill(cache, pair.model, draft)


def test_trim_at_every_depth_leaves_a_fresh_prefills_state(qwen3_pair, tmp_path):
    """Trims that drop only the pending token, part of the pending tap rows,
    all of them, and injected drafter context."""
    draft, cache = conversation(qwen3_pair, tmp_path, block_size=4)
    lag = cache.target_hidden.shape[1]
    depths = sorted({0, 1, 2, lag, lag + 1, lag + 2, 7, 13, 25, len(cache.tokens) - 1})
    for n in depths:
        trimmed = copy.deepcopy(cache)
        assert trimmed.trim(n) == n
        assert_like_fresh_prefill(trimmed, qwen3_pair.model, draft)


def test_save_and_load_restore_the_state(qwen3_pair, tmp_path):
    draft, cache = conversation(qwen3_pair, tmp_path, block_size=4)
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"), draft)
    assert loaded.tokens == cache.tokens
    assert_like_fresh_prefill(loaded, qwen3_pair.model, draft)


def test_a_server_prefix_hit_restores_the_state(qwen3_pair, tmp_path):
    """mlx-lm's LRU prompt cache, as the server uses it: a longer cached
    conversation is copied and trimmed to the common prefix."""
    draft, cache = conversation(qwen3_pair, tmp_path, block_size=4)
    lru = LRUPromptCache(max_size=2)
    lru.insert_cache("pair", list(cache.tokens), [cache])
    for keep in (len(cache.tokens) - 2, 18, 9):
        hit, rest = lru.fetch_nearest_cache("pair", cache.tokens[:keep] + [7, 7])
        assert rest == [7, 7] and hit[0].tokens == cache.tokens[:keep]
        assert_like_fresh_prefill(hit[0], qwen3_pair.model, draft)


def test_server_snapshots_hold_a_fresh_prefills_state(qwen3_5_pair, tmp_path):
    """A hybrid cache cannot trim: the server snapshots it at message ends."""
    from dflash_mlx.server import make_generator, setup_arg_parser

    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    args = setup_arg_parser().parse_args(["--model", str(pair.path)])
    generator = make_generator(args, pair.model, pair.tokenizer, draft, "d")
    try:
        tokens = np.random.default_rng(5).integers(0, 256, size=30).tolist()
        cache = make_prompt_cache(pair.model, draft)
        assert generator.snapshot(cache, tokens, 0, [9, 21], None) == 30
        for end in (9, 21, 30):
            hit, rest = generator.prompt_cache.fetch_nearest_cache(generator.key, tokens[:end] + [1])
            assert rest == [1] and hit[0].tokens == tokens[:end]
            assert_like_fresh_prefill(hit[0], pair.model, draft)
    finally:
        generator.stop_and_join()
