"""The copy index proposes what followed the longest, most recent earlier
occurrence of the context's suffix (checked against a brute-force search),
grows by a constant number of table operations per token whatever the
context's length, follows a copy being accepted, and travels with a prompt
cache; copied tokens are accepted exactly (a point-mass proposal)."""

import copy
import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import tv, tv_bound

from dflash_mlx.cache import PromptCache
from dflash_mlx.copy_source import BULK, CopyIndex, index_for
from dflash_mlx.errors import ArgumentError
from dflash_mlx.sampling import accept_point_mass, speculative_accept
from dflash_mlx.targets.base import TargetCache


def brute_match(tokens, max_ngram, min_match):
    """(end, n): the most recent earlier end of the longest suffix of
    ``tokens`` (n from ``max_ngram`` down to ``min_match``), by scanning."""
    last = len(tokens) - 1
    for n in range(min(max_ngram, last), min_match - 1, -1):
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tokens[last - n + 1 :]:
                return end, n
    return -1, 0


streams = st.lists(st.integers(0, 3), min_size=1, max_size=120)


@settings(max_examples=60, deadline=None)
@given(streams, st.integers(1, 6), st.integers(1, 3))
def test_match_is_the_longest_most_recent(tokens, max_ngram, min_match):
    min_match = min(min_match, max_ngram)
    for length in range(1, len(tokens) + 1):
        fresh = CopyIndex(tokens[:length], max_ngram=max_ngram, min_match=min_match)
        assert fresh.match() == brute_match(tokens[:length], max_ngram, min_match)


@settings(max_examples=60, deadline=None)
@given(streams, st.integers(2, 6))
def test_followed_match_is_still_a_longest_one(tokens, max_ngram):
    """Committing token by token, the index may keep following its copy: its
    match is then a true occurrence, as long as the longest (up to max_ngram);
    without one of 2 tokens, at most a 1-token resync near a broken copy."""
    index = CopyIndex(tokens[:1], max_ngram=max_ngram)
    for length in range(2, len(tokens) + 1):
        index.extend(tokens[length - 1 : length])
        end, n = index.match()
        longest = brute_match(tokens[:length], max_ngram, 2)[1]
        assert min(n, max_ngram) == longest if longest else n in (0, 1)
        if n:
            assert end < length - 1 and tokens[end - n + 1 : end + 1] == tokens[length - n : length]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=3 * BULK), st.randoms(use_true_random=False))
def test_incremental_equals_rebuild(tokens, rng):
    """Any split of the tokens into extends (scalar and numpy-hashed) builds
    the same table, in the same order, as one build."""
    whole = CopyIndex(tokens)
    parts, at = CopyIndex(), 0
    while at < len(tokens):
        step = rng.choice([1, 2, 5, BULK, BULK + 7])
        parts.extend(tokens[at : at + step])
        at += step
    assert list(parts.table.items()) == list(whole.table.items())
    assert parts.suffix == whole.suffix and parts.tokens == whole.tokens


def test_a_copy_is_followed_across_cycles():
    """The answer copies a source whose 4-gram recurs later with another
    continuation: the index keeps to the source it is copying, where a
    fresh lookup jumps to the most recent occurrence."""
    source = [10, 11, 12, 1, 2, 3, 4, 50, 51, 52, 53]
    prompt = source + [99] + [1, 2, 3, 4, 60, 61, 62] + [98]
    index = CopyIndex(prompt + source[:2], max_ngram=4)
    proposals = []
    for at in range(2, 8, 2):
        proposals.append(index.propose(3))
        index.extend(source[at : at + 2])  # the first two proposed tokens accepted
    assert proposals == [[12, 1, 2], [2, 3, 4], [4, 50, 51]]
    assert index.propose(3) == [51, 52, 53] and index.match_length == 8
    assert CopyIndex(prompt + source[:7], max_ngram=4).propose(3) == [60, 61, 62]


def test_an_edit_resyncs_the_copy():
    """The answer replaces a token of its source: once the token after it is
    committed, the copy goes on from the source (no 2-token match exists)."""
    source = list(range(100, 140))
    index = CopyIndex([1] + source + [2] + source[:10], max_ngram=4)
    assert index.propose(3) == source[10:13] and not index.resyncing()
    index.extend([7])  # the edit: 7 for source[10]
    assert index.propose(3) == [] and index.resyncing()  # (the next token may take the copy up again)
    index.extend([source[11]])
    assert index.propose(3) == source[12:15] and index.match_length == 1
    index.extend(source[12:20] + [8, 9, 10, 11, 12, 13, 14, 15, 16, 17])  # far from the source: no resync
    assert index.propose(3) == [] and not index.resyncing()


def test_a_single_token_match_is_proposed_near_a_broken_copy_first():
    """A lone token proposes what followed its most recent occurrence; after
    an edit, its occurrence where the broken copy would be now is preferred
    to a more recent one elsewhere (the answer picking up its source)."""
    assert CopyIndex([5, 1, 2, 9, 3, 7, 5]).propose(2) == [1, 2]
    assert CopyIndex([5, 1, 2, 9, 3, 7, 5], min_match=2).propose(2) == []
    source = list(range(100, 140))
    index = CopyIndex([1] + source + [2, source[12], 50, 51] + source[:10], max_ngram=4)
    assert index.propose(3) == source[10:13]
    index.extend([7, 8, source[12]])  # the edit: 7 8 for source[10:12]; source[12] recurs later, after "2"
    assert index.propose(3) == source[13:16] and index.match_length == 1
    assert CopyIndex(list(index.tokens), max_ngram=4).propose(3) == [50, 51, 100]  # (without the copy: the most recent)


def test_proposals_past_the_end_repeat_and_after_drafted_tokens():
    assert CopyIndex([5, 6, 5, 6, 5]).propose(5) == [6, 5, 6, 5, 6]
    index = CopyIndex([7, 1, 2, 3, 4, 5, 6, 8, 1, 2])
    assert index.propose(2, after=[3, 4]) == [5, 6]  # the copy, continued past a drafted block
    assert index.propose(2, after=[9, 9]) == []  # no earlier "2 9 9"
    assert index.propose(2) == [3, 4]  # after= is not committed


def test_nothing_is_proposed_without_a_match():
    assert CopyIndex(list(range(50))).propose(8) == []
    assert CopyIndex([1, 2, 9, 1, 2]).propose(4, after=[]) == [9, 1, 2, 9]
    assert CopyIndex([1, 2, 9, 1, 2], min_match=3).propose(4) == []
    assert CopyIndex([]).propose(4) == [] and CopyIndex([3]).propose(4) == []
    assert CopyIndex([1, 2, 1, 2]).propose(0) == []
    with pytest.raises(ArgumentError, match="min_match"):
        CopyIndex(max_ngram=2, min_match=3)


class CountingDict(dict):
    """A dict that counts reads (``get``) and writes (``[]=``)."""

    reads = writes = 0

    def get(self, key, default=None):
        self.reads += 1
        return super().get(key, default)

    def __setitem__(self, key, value):
        self.writes += 1
        super().__setitem__(key, value)


def code_stream(length: int, seed: int = 0):
    """Tokens like an edited file repeated: a block recurring with changes."""
    rng = random.Random(seed)
    block = [rng.randrange(500) for _ in range(300)]
    out = []
    while len(out) < length:
        edited = list(block)
        edited[rng.randrange(len(block))] = rng.randrange(500)
        out += edited
    return out[:length]


def test_cost_per_token_does_not_grow_with_the_context():
    """Committing 40 tokens costs the same table writes at 1K and 32K tokens
    of context, and a proposal at most one read per n-gram length: no scan."""
    for length in (1024, 32768):
        tokens = code_stream(length + 40)
        index = CopyIndex(tokens[:length])
        index.table = CountingDict(index.table)
        for at in range(length, length + 40, 4):
            index.propose(8)
            index.extend(tokens[at : at + 4])
        lengths = index.max_ngram - index.min_match + 1
        assert index.table.writes == 40 * lengths and index.table.reads <= 10 * lengths
        assert len(index.table) <= lengths * len(index)


def test_index_follows_the_prompt_cache():
    """Built on first use from the cache's tokens, extended as they grow,
    rebuilt when the cache is trimmed, copied with it."""

    class Cache:
        def __init__(self, tokens):
            self.tokens, self.copy_index = list(tokens), None

    cache = Cache([1, 2, 3, 4, 1, 2])
    index = index_for(cache)
    assert cache.copy_index is index and index.propose(2) == [3, 4]
    cache.tokens += [3, 4, 7, 1, 2, 3]
    assert index_for(cache) is index and index.tokens == cache.tokens and index.propose(2) == [4, 7]
    index.truncate(4)  # what PromptCache.trim does
    del cache.tokens[4:]
    cache.tokens += [9, 1, 2]
    assert list(index_for(cache).table.items()) == list(CopyIndex(cache.tokens).table.items())
    forked = copy.deepcopy(cache)
    forked.tokens += [3]
    assert index_for(forked).tokens == cache.tokens + [3] and len(index_for(cache)) == len(cache.tokens)
    cache.tokens[-1] = 5  # tokens replaced behind the index's back: rebuilt
    assert index_for(cache).tokens == cache.tokens and index_for(cache) is not index


def test_prompt_cache_trim_truncates_its_index():
    cache = PromptCache(TargetCache(), [])
    cache.tokens = [1, 2, 3, 1, 2, 3]
    cache.pending = list(cache.tokens)  # not run by a target: a trim only cuts tokens
    assert index_for(cache).propose(1) == [1]
    assert cache.trim(2) == 2 and cache.copy_index.tokens == [1, 2, 3, 1]
    assert copy.deepcopy(cache).copy_index.table == cache.copy_index.table


# ---------------------------------------------------------------------------
# Copied tokens are accepted exactly: a point-mass proposal


def random_rows(key, shape, v):
    """Probability rows, some with zeros (a truncated sampler's)."""
    k1, k2 = mx.random.split(key)
    logits = mx.random.normal(shape + (v,), key=k1) * 2
    cut = (mx.random.uniform(shape=shape + (v,), key=k2) < 0.3) & (logits < logits.max(axis=-1, keepdims=True))
    return mx.softmax(mx.where(cut, -mx.inf, logits), axis=-1)


@pytest.mark.parametrize("n,batch", [(1, ()), (4, ()), (5, (3,)), (3, (2, 2))])
def test_point_mass_equals_one_hot_q(n, batch):
    """Same key, same outcome as speculative_accept with explicit one-hot rows
    (and with the first drafted tokens' q given, the rest point masses)."""
    v = 11
    for seed in range(30):
        key = mx.random.key(seed)
        p = random_rows(key, batch + (n + 1,), v)
        tokens = mx.random.categorical(mx.log(p[..., :n, :] + 0.05), key=mx.random.key(1000 + seed))
        if seed % 3 == 0:  # a proposal the target is sure of
            p = mx.concatenate([mx.eye(v)[tokens], p[..., n:, :]], axis=-2)
        one_hot = mx.eye(v)[tokens]
        want = speculative_accept(tokens, p, one_hot, key=mx.random.key(seed))
        got = accept_point_mass(tokens, p, key=mx.random.key(seed))
        assert all(mx.array_equal(a, b).item() for a, b in zip(want, got))
        q = random_rows(mx.random.key(2000 + seed), batch + (n,), v)
        m = seed % (n + 1)
        mixed = mx.concatenate([q[..., :m, :], one_hot[..., m:, :]], axis=-2)
        want = speculative_accept(tokens, p, mixed, key=mx.random.key(seed))
        got = speculative_accept(tokens, p, q[..., :m, :], key=mx.random.key(seed))
        assert all(mx.array_equal(a, b).item() for a, b in zip(want, got))


def test_point_mass_acceptance_follows_the_target():
    """The first committed token is distributed as p[0]; given the first
    copied token was kept, the next is distributed as p[1]."""
    v, draws = 6, 40000
    p = mx.array([[0.1, 0.3, 0.0, 0.25, 0.15, 0.2], [0.4, 0.05, 0.05, 0.2, 0.2, 0.1], [1 / 6] * 6])
    tokens = mx.broadcast_to(mx.array([3, 1]), (draws, 2))
    mx.random.seed(3)
    accepted, nxt = accept_point_mass(tokens, mx.broadcast_to(p, (draws, 3, v)))
    accepted, nxt = np.array(accepted), np.array(nxt)
    first = np.where(accepted > 0, 3, nxt)
    exact = np.array(p[0])
    assert tv(first, exact) < tv_bound(exact, draws)
    kept = accepted > 0
    second = np.where(accepted[kept] > 1, 1, nxt[kept])
    exact = np.array(p[1])
    assert tv(second, exact) < tv_bound(exact, int(kept.sum()))


def test_the_bench_runs_the_edit_set(tmp_path):
    """``--prompt-set edit``: the set's requests as chat turns where the
    tokenizer has a template, as they are where it has none; not with --prompts."""
    import json

    from dflash_mlx import benchmark
    from dflash_mlx.pair import PROMPT_SETS, benchmark_prompts

    requests = json.loads(PROMPT_SETS["edit"].read_text())
    assert len(requests) >= 12 and all(isinstance(r, str) and r for r in requests)

    class Chat:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return f"<user>{messages[0]['content']}</user>"

    assert benchmark_prompts("any", object(), "edit") == requests
    assert benchmark_prompts("any", Chat(), "edit") == [f"<user>{r}</user>" for r in requests]
    prompts = tmp_path / "p.json"
    prompts.write_text('["a"]')
    with pytest.raises(ArgumentError, match="--prompt-set"):
        benchmark.main(["--prompts", str(prompts), "--prompt-set", "edit"])
