"""What an adversarial audit of exactness and bad input found, one
regression test each: a multi-turn conversation on mlx-lm's bounded and
quantized KV caches, logits processors over a reused prompt cache, and a
grammar llguidance's lexer cannot follow. References: mlx-lm's own
``stream_generate`` on its own prompt cache, float32."""

import numpy as np
import pytest
import tiny
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from tiny import prompt_of

import dflash_mlx
from dflash_mlx.errors import ArgumentError


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory):
    """Heads of 64: mlx's quantization groups divide them."""
    root = tmp_path_factory.mktemp("audit_wide")
    pair = tiny.Pair(root, dict(tiny.QWEN3, head_dim=64))
    return pair, dflash_mlx.load_draft(pair.make_draft(root / "d", block_size=8), pair.model)


def turns_of_a_conversation():
    base = prompt_of(8)
    return [base * 2 + base[:3], np.random.default_rng(3).integers(0, 256, 5).tolist(), base[:6]]


def both_conversations(pair, draft, turns, max_tokens, make_cache_kw, call_kw, processors=None):
    """mlx-lm's tokens per turn (eos dropped) on its own prompt cache, and ours."""
    lm_cache = mlx_lm_make_prompt_cache(pair.model, **{k: v for k, v in make_cache_kw.items() if k == "max_kv_size"})
    cache = dflash_mlx.make_prompt_cache(pair.model, draft, **make_cache_kw)
    want, got = [], []
    for t in turns:
        lm = [r.token for r in mlx_lm_stream_generate(pair.model, pair.tokenizer, t, max_tokens=max_tokens, prompt_cache=lm_cache,
                                                      logits_processors=processors() if processors else None, **call_kw)]
        want.append([x for x in lm if x not in pair.tokenizer.eos_token_ids])
        got.append([x for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, t, max_tokens=max_tokens, prompt_cache=cache,
                                                         logits_processors=processors() if processors else None) for x in r.tokens])
    return want, got


def test_turns_on_a_bounded_cache_are_mlx_lms(wide_qwen3):
    """mlx-lm ran the last turn's last token alone; a new turn's prompt must
    not be fed in one chunk with it: on a full RotatingKVCache a chunk keeps
    max_kv_size - 1 older positions, so the prompt would see one more."""
    pair, draft = wide_qwen3
    want, got = both_conversations(pair, draft, turns_of_a_conversation(), 12, dict(max_kv_size=20), {})
    assert got == want


def test_processors_on_a_reused_cache_see_what_mlx_lms_see(wide_qwen3):
    """mlx-lm's stream_generate on a reused prompt cache starts its
    processors' history at the new turn's prompt: the previous answer's last
    token is not penalised in the next turn."""
    pair, draft = wide_qwen3
    setting = dict(logit_bias={97: 3.0}, repetition_penalty=1.5, repetition_context_size=5, presence_penalty=0.5, frequency_penalty=0.4)
    want, got = both_conversations(pair, draft, turns_of_a_conversation(), 2, {}, {}, lambda: make_logits_processors(**setting))
    assert want[1][0] == want[0][-1]  # (the case: the next turn starts with the token the last one ended with)
    assert got == want


def test_a_grammar_llguidance_cannot_follow_is_refused_before_any_work(qwen3_pair, tmp_path):
    """llguidance takes a{1000000} as valid, then its lexer gives up on the
    first token (LexerTooComplex): one clear error before any forward, not a
    ValueError about the loop mid-answer (a 500 from the server)."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    form = {"type": "regex", "pattern": "a{1000000}"}
    with pytest.raises(ArgumentError, match="llguidance cannot follow this grammar.*too complex"):
        next(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, prompt_of(5), max_tokens=4, response_format=form, prompt_cache=cache))
    assert cache.offset == 0
    with pytest.raises(ArgumentError, match="too complex"):
        dflash_mlx.BatchGenerator(pair.model, draft, tokenizer=pair.tokenizer).insert([prompt_of(5)], 4, response_format=form)
    ok = [t for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, prompt_of(5), max_tokens=4,
                                                response_format={"type": "regex", "pattern": "a{1000}"}) for t in r.tokens]
    assert pair.tokenizer.decode(ok) == "aaaa"  # a long repetition llguidance can follow is still held


def test_generation_tokens_count_the_eos_as_mlx_lms_do(qwen3_pair, tmp_path):
    """mlx-lm's stream_generate counts the eos it stops at in its last
    response's ``generation_tokens`` (and so in ``generation_tps``); an
    answer cut at ``max_tokens`` counts ``max_tokens``."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompt = prompt_of(6)
    free = pair.reference(prompt, 12)
    k = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # the answer stops at its (k+1)th token
    eos, ends = [free[k]], []
    for limit in (12, k + 1, k):
        want = tiny.reference_responses(pair.model, pair.tokenizer, prompt, limit, eos)[-1]
        with tiny.eos_set(pair.tokenizer, eos):
            got = list(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, prompt, max_tokens=limit))[-1]
        assert (got.generation_tokens, got.finish_reason) == (want.generation_tokens, want.finish_reason)
        ends.append((want.generation_tokens, want.finish_reason))
    assert ends == [(k + 1, "stop"), (k + 1, "stop"), (k, "length")]
    with tiny.eos_set(pair.tokenizer, eos):  # batch_generate's per-request record counts alike
        result = dflash_mlx.batch_generate(pair.model, draft, pair.tokenizer, [prompt, prompt], max_tokens=[12, k])
    assert [s["generation_tokens"] for s in result.stats] == [k + 1, k] and result.finish_reasons == ["stop", "length"]
