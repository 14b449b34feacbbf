"""Multi-turn decoding on a prompt cache equals mlx-lm's, turn after turn."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache
from tiny import ScriptedDrafter, dflash_tokens, reference_responses

import dflash_mlx
from dflash_mlx.cache import load_prompt_cache, save_prompt_cache


def mlx_lm_conversation(model, tokenizer, turns, max_tokens, eos=None):
    """mlx-lm's tokens per turn on its own prompt cache (eos included, as it
    yields it), and the cache's final offset."""
    cache = mlx_lm_make_prompt_cache(model)
    outs = [
        [r.token for r in reference_responses(model, tokenizer, prompt, max_tokens, eos, prompt_cache=cache)]
        for prompt in turns
    ]
    offset = next(c.offset for c in cache if hasattr(c, "offset"))
    return outs, offset


def dflash_conversation(model, draft, tokenizer, turns, max_tokens, eos=None, cache=None, **kw):
    cache = dflash_mlx.make_prompt_cache(model, draft) if cache is None else cache
    outs = [
        dflash_tokens(model, draft, tokenizer, prompt, eos, max_tokens=max_tokens, prompt_cache=cache, **kw)[1]
        for prompt in turns
    ]
    return outs, cache


def tokens_of(responses):
    return [t for r in responses for t in r.tokens]


def without_eos(tokens, tokenizer, eos=None):
    stop = set(eos) if eos is not None else set(tokenizer.eos_token_ids)
    return [t for t in tokens if t not in stop]


def random_turns(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "llama", "gemma4_text", "gpt_oss", "qwen3_next", "kimi_k25"])
@pytest.mark.parametrize("lengths", [(11, 7, 5), (30, 1, 1)])
def test_three_turns_equal_mlx_lm(make_pair, tmp_path, family, lengths):
    """Gemma-4's and gpt-oss's sliding windows (8) wrap within the first turn."""
    pair = make_pair(family)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4, taps=[0, 2]), pair.model)
    turns = random_turns(lengths)
    want, offset = mlx_lm_conversation(pair.model, pair.tokenizer, turns, 10)
    got, cache = dflash_conversation(pair.model, draft, pair.tokenizer, turns, 10)
    for w, g in zip(want, got):
        assert tokens_of(g) == without_eos(w, pair.tokenizer)
    # mlx-lm's cache holds every prompt and every yielded token, eos included
    assert cache.offset == offset == sum(lengths) + sum(len(w) for w in want)
    assert cache.tokens == [t for p, w in zip(turns, want) for t in p + w]


def test_offset_after_ten_tokens_is_prompt_plus_ten(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompt = random_turns([11])[0]
    _, offset = mlx_lm_conversation(pair.model, pair.tokenizer, [prompt], 10, eos=[])
    _, cache = dflash_conversation(pair.model, draft, pair.tokenizer, [prompt], 10, eos=[])
    assert cache.offset == offset == 21
    # the last token is committed but not yet run by the target
    assert cache.pending == cache.tokens[-1:]


class ConversationDrafter(ScriptedDrafter):
    """:class:`ScriptedDrafter` over a whole conversation, known in advance:
    a new turn's prompt reaches the drafter only as context positions, so it
    finds its place by counting them, and checks the anchor there."""

    def __init__(self, sequence, block_size, vocab):
        super().__init__(sequence + [0] * block_size, [], block_size, [block_size], vocab)

    def make_cache(self, window=None, sink=0):  # a test double keeps its whole context
        return {"seen": 0}

    def propose(self, block, context, cache, slots=None):
        if cache["seen"] == 0 and context.shape[1] == 1:  # calibrate's probe (see tiny.committed_sequence)
            return mx.zeros((1, block.shape[1] - 1), dtype=mx.int32)[:, :slots]
        cache["seen"] += context.shape[1]
        seq = self.reference[: cache["seen"]] + [int(block[0, 0].item())]
        assert seq[-1] == self.reference[len(seq) - 1], "the anchor is not the conversation's next token"
        return mx.array([self.draft(seq, block.shape[1] - 1)])[:, :slots]


def oracle(pair, turns, max_tokens, block_size, eos=None):
    """A drafter proposing mlx-lm's own continuation (every block accepted)."""
    want, _ = mlx_lm_conversation(pair.model, pair.tokenizer, turns, max_tokens, eos)
    sequence = [t for p, w in zip(turns, want) for t in p + w]
    return ConversationDrafter(sequence, block_size, pair.vocab), want


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_eos_inside_a_drafted_block_then_next_turn(request, family):
    pair = request.getfixturevalue(f"{family}_pair")
    turns = random_turns([12, 6, 3], seed=4)
    plain, _ = mlx_lm_conversation(pair.model, pair.tokenizer, turns, 40, eos=[])
    eos = [plain[0][6]]
    draft, want = oracle(pair, turns, 40, 8, eos)
    assert want[0][-1] == eos[0] and len(want[0]) < 40
    got, cache = dflash_conversation(pair.model, draft, pair.tokenizer, turns, 40, eos=eos, block_size=8)
    assert got[0][-1].finish_reason == "stop"
    assert any(r.accepted > len(r.tokens) - 1 for r in got[0])  # eos came from the draft
    for w, g in zip(want, got):
        assert tokens_of(g) == without_eos(w, pair.tokenizer, eos)
    assert cache.tokens == [t for p, w in zip(turns, want) for t in p + w]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("max_tokens", [5, 13])
def test_max_tokens_mid_block_then_next_turn(request, family, max_tokens):
    pair = request.getfixturevalue(f"{family}_pair")
    turns = random_turns([9, 4, 1], seed=7)
    draft, want = oracle(pair, turns, max_tokens, 16, eos=[])
    got, cache = dflash_conversation(pair.model, draft, pair.tokenizer, turns, max_tokens, eos=[], block_size=16)
    for w, g in zip(want, got):
        assert tokens_of(g) == w and g[-1].finish_reason == "length"
    assert cache.offset == sum(map(len, turns)) + len(turns) * max_tokens


def test_trim_continues_like_a_shorter_conversation(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    first, second = random_turns([20, 6], seed=2)
    _, cache = dflash_conversation(pair.model, draft, pair.tokenizer, [first], 12, eos=[])
    assert cache.is_trimmable()
    assert cache.trim(15) == 15  # into the prompt: target and drafter rewind
    prefix = cache.tokens[:]
    assert prefix == first[:17]
    want, _ = mlx_lm_conversation(pair.model, pair.tokenizer, [prefix + second], 10, eos=[])
    got, _ = dflash_conversation(pair.model, draft, pair.tokenizer, [second], 10, eos=[], cache=cache)
    assert tokens_of(got[0]) == want[0]
    # mlx-lm's LRU prompt cache can hold it: nbytes, trim and deepcopy work
    lru = LRUPromptCache(max_size=2)
    lru.insert_cache("pair", cache.tokens, [cache])
    hit, rest = lru.fetch_nearest_cache("pair", cache.tokens[:-3] + [7])
    assert rest == [7] and hit[0].offset == len(cache.tokens) - 3 and lru.nbytes == cache.nbytes > 0


def test_hybrid_cache_is_not_trimmable(qwen3_5_pair, tmp_path):
    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    assert not cache.is_trimmable()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_save_and_load_continue_the_conversation(request, tmp_path, family):
    pair = request.getfixturevalue(f"{family}_pair")
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    turns = random_turns([15, 5], seed=9)
    want, _ = mlx_lm_conversation(pair.model, pair.tokenizer, turns, 12, eos=[])
    _, cache = dflash_conversation(pair.model, draft, pair.tokenizer, turns[:1], 12, eos=[])
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, {"note": "turn 1"})
    loaded, meta = load_prompt_cache(path, draft, return_metadata=True)
    assert meta == {"note": "turn 1"} and loaded.tokens == cache.tokens and loaded.nbytes == cache.nbytes
    got, _ = dflash_conversation(pair.model, draft, pair.tokenizer, turns[1:], 12, eos=[], cache=loaded)
    assert tokens_of(got[0]) == want[1]


def test_empty_prompt_needs_a_pending_token(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    with pytest.raises(ValueError, match="prompt is empty"):
        list(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, [], prompt_cache=cache))


def test_second_turn_starts_fast_on_the_bundled_pair():
    """Turn 2 prefills only its own tokens: its time to first token is a
    small fraction of a 1,500-token turn 1's (mlx-lm: about 0.02)."""
    from dflash_mlx.benchmark import second_turn_ttft
    from dflash_mlx.pair import DEFAULT_DRAFT, DEFAULT_TARGET, default_prompts

    model, tokenizer = dflash_mlx.load(str(DEFAULT_TARGET))
    draft = dflash_mlx.load_draft(DEFAULT_DRAFT, model)
    t = second_turn_ttft(model, draft, tokenizer, default_prompts(), 1500)
    print(t)
    assert t["turn2_over_turn1"] < 0.25
