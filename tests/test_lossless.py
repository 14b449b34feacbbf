"""Greedy DFlash output must be token-identical to mlx-lm's own greedy decode."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate as mlx_lm_stream_generate

import dflash_mlx
from dflash_mlx.targets import adapter_for


def reference_tokens(pair, prompt, max_tokens, eos_ids=None):
    """mlx-lm's greedy tokens (eos excluded, as both generators report)."""
    tok = pair.tokenizer
    saved = set(tok.eos_token_ids)
    if eos_ids is not None:
        tok.eos_token_ids = set(eos_ids)
    try:
        out = []
        for r in mlx_lm_stream_generate(pair.model, tok, prompt, max_tokens=max_tokens):
            if r.finish_reason == "stop":
                break
            out.append(r.token)
        return out
    finally:
        tok.eos_token_ids = saved


def dflash_tokens(pair, draft, prompt, eos_ids=None, **kw):
    tok = pair.tokenizer
    saved = set(tok.eos_token_ids)
    if eos_ids is not None:
        tok.eos_token_ids = set(eos_ids)
    try:
        responses = list(dflash_mlx.stream_generate(pair.model, draft, tok, prompt, **kw))
    finally:
        tok.eos_token_ids = saved
    return [t for r in responses for t in r.tokens], responses


class ScriptedDrafter:
    """Test double behind the drafter interface: proposes the target's true
    greedy continuation with a mistake planted at a chosen slot each cycle,
    so every acceptance length 0..B-1 (and full blocks) occurs."""

    mask_token_id = 0

    def __init__(self, reference, prompt_len, block_size, mistakes, vocab):
        self.reference = list(reference)
        self.prompt_len = prompt_len
        self.block_size = block_size
        self.mistakes = itertools.cycle(mistakes)
        self.vocab = vocab
        self._target = None
        self.planted = []

    def bind(self, model):
        self._target = adapter_for(model)
        self._target.tap_ids = [0]
        return self

    @property
    def target(self):
        return self._target

    def check_block_size(self, block_size):
        pass

    def make_cache(self):
        return [0]  # context positions seen so far

    def propose(self, block, context, cache):
        cache[0] += context.shape[1]
        at = cache[0] - self.prompt_len  # index of the anchor in the reference
        L = block.shape[1]
        truth = (self.reference[at + 1 : at + L] + [0] * L)[: L - 1]
        proposal = list(truth)
        slot = next(self.mistakes)
        if slot < L - 1:
            proposal[slot] = (proposal[slot] + 1) % self.vocab
        self.planted.append(min(slot, L - 1))
        return mx.array([proposal])


def prompt_of(pair, n, seed=0):
    rng = np.random.default_rng(seed + n)
    return rng.integers(0, 256, size=n).tolist()


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("prompt_len", [1, 300])
def test_every_acceptance_length_is_lossless(pair, block_size, prompt_len):
    prompt = prompt_of(pair, prompt_len)
    max_tokens = 300
    ref = reference_tokens(pair, prompt, max_tokens + block_size)
    draft = ScriptedDrafter(ref, len(prompt), block_size, range(block_size), pair.vocab)
    got, responses = dflash_tokens(pair, draft, prompt, block_size=block_size, max_tokens=max_tokens)
    assert got == ref[:max_tokens]
    # every acceptance length 0..B-2 and the fully accepted block (B-1) happened
    assert {r.accepted for r in responses[1:]} >= set(range(block_size))


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_random_drafter_is_lossless(pair, tmp_path, block_size):
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=block_size), pair.model)
    prompt = prompt_of(pair, 37)
    ref = reference_tokens(pair, prompt, 60)
    got, responses = dflash_tokens(pair, draft, prompt, max_tokens=60)
    assert got == ref
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == 60


def test_block_size_one_is_plain_decoding(qwen3_5_pair, tmp_path):
    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompt = prompt_of(pair, 5)
    got, responses = dflash_tokens(pair, draft, prompt, block_size=1, max_tokens=40)
    assert got == reference_tokens(pair, prompt, 40)
    assert all(r.committed == 1 and r.accepted == 0 for r in responses)


@pytest.mark.parametrize("eos_at", [3, 10, 17])
def test_eos_inside_a_block(pair, eos_at):
    prompt = prompt_of(pair, 12)
    plain = reference_tokens(pair, prompt, 60)
    eos = plain[eos_at]
    first = plain.index(eos)  # the token may already occur earlier
    ref = reference_tokens(pair, prompt, 60, eos_ids=[eos])
    assert ref == plain[:first]
    draft = ScriptedDrafter(plain, len(prompt), 8, [7], pair.vocab)  # always full blocks
    got, responses = dflash_tokens(pair, draft, prompt, eos_ids=[eos], block_size=8, max_tokens=60)
    assert got == ref
    assert responses[-1].finish_reason == "stop"
    assert eos not in got


@pytest.mark.parametrize("max_tokens", [1, 2, 13, 29])
def test_max_tokens_mid_block(pair, max_tokens):
    prompt = prompt_of(pair, 9)
    ref = reference_tokens(pair, prompt, max_tokens + 16)
    draft = ScriptedDrafter(ref, len(prompt), 16, [15], pair.vocab)
    got, responses = dflash_tokens(pair, draft, prompt, block_size=16, max_tokens=max_tokens)
    assert got == ref[:max_tokens]
    assert responses[-1].finish_reason == "length"
    assert sum(len(r.tokens) for r in responses) == max_tokens


def test_prompt_forms_agree(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    text = "def add(a, b):\n    return"
    ids = pair.tokenizer.encode(text)
    outs = [
        dflash_tokens(pair, draft, p, max_tokens=20)[0]
        for p in (text, ids, mx.array(ids))
    ]
    assert outs[0] == outs[1] == outs[2] == reference_tokens(pair, ids, 20)
    whole = dflash_mlx.generate(pair.model, draft, pair.tokenizer, text, max_tokens=20)
    assert whole == pair.tokenizer.decode(outs[0])


def test_llama_target_is_lossless(llama_pair, tmp_path):
    pair = llama_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", taps=[0, 2]), pair.model)
    prompt = prompt_of(pair, 20)
    ref = reference_tokens(pair, prompt, 50)
    scripted = ScriptedDrafter(ref + [0] * 16, len(prompt), 8, range(8), pair.vocab)
    assert dflash_tokens(pair, scripted, prompt, block_size=8, max_tokens=50)[0] == ref
    assert dflash_tokens(pair, draft, prompt, max_tokens=50)[0] == ref


@pytest.mark.parametrize("block_size", [4, 16])
def test_sequential_recurrence_is_lossless(qwen3_5_pair, block_size):
    """mlx-lm's own recurrence (what Metal runs) with bit-identical replay."""
    from dflash_mlx.targets.hybrid import HybridTarget

    pair = qwen3_5_pair
    prompt = prompt_of(pair, 40)
    ref = reference_tokens(pair, prompt, 150 + block_size)
    draft = ScriptedDrafter(ref, len(prompt), block_size, range(block_size), pair.vocab)
    draft._target = HybridTarget(pair.model, recurrence="sequential")
    draft._target.tap_ids = [0]
    got, _ = dflash_tokens(pair, draft, prompt, block_size=block_size, max_tokens=150)
    assert got == ref[:150]


@pytest.mark.parametrize(
    "draft_tokens, target_tokens, want",
    [
        ([5, 6, 7], [5, 6, 7, 8], (3, 8)),  # all accepted: the bonus token follows
        ([5, 6, 7], [4, 6, 7, 8], (0, 4)),  # first slot rejected
        ([5, 6, 7], [5, 9, 7, 8], (1, 9)),  # a later match does not count
        ([], [3], (0, 3)),  # the anchor alone
    ],
)
def test_greedy_acceptance_on_device(draft_tokens, target_tokens, want):
    from dflash_mlx.generate import accept_greedy

    accepted, token = accept_greedy(mx.array(draft_tokens, mx.int32), mx.array(target_tokens, mx.int32))
    assert (accepted.item(), token.item()) == want
    batched = accept_greedy(mx.array([draft_tokens] * 2, mx.int32), mx.array([target_tokens] * 2, mx.int32))
    assert [t.tolist() for t in batched] == [[want[0]] * 2, [want[1]] * 2]
