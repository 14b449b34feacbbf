"""Greedy DFlash output must be token-identical to mlx-lm's own greedy decode."""

import mlx.core as mx
import pytest
from tiny import ScriptedDrafter, prompt_of

import dflash_mlx
from dflash_mlx.targets.hybrid import HybridTarget, has_fused_recurrence


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("prompt_len", [1, 300])
def test_every_acceptance_length_is_lossless(pair, block_size, prompt_len):
    prompt = prompt_of(prompt_len)
    max_tokens = 300
    ref = pair.reference(prompt, max_tokens + block_size)
    draft = ScriptedDrafter(ref, prompt, block_size, range(block_size), pair.vocab)
    got, responses = pair.dflash(draft, prompt, block_size=block_size, max_tokens=max_tokens)
    assert got == ref[:max_tokens]
    # every acceptance length 0..B-2 and the fully accepted block (B-1) happened
    assert {r.accepted for r in responses[1:]} >= set(range(block_size))


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_random_drafter_is_lossless(pair, tmp_path, block_size):
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=block_size), pair.model)
    prompt = prompt_of(37)
    ref = pair.reference(prompt, 60)
    got, responses = pair.dflash(draft, prompt, max_tokens=60)
    assert got == ref
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == 60


def test_block_size_one_is_plain_decoding(qwen3_5_pair, tmp_path):
    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompt = prompt_of(5)
    got, responses = pair.dflash(draft, prompt, block_size=1, max_tokens=40)
    assert got == pair.reference(prompt, 40)
    assert all(r.committed == 1 and r.accepted == 0 for r in responses)


@pytest.mark.parametrize("eos_at", [3, 10, 17])
def test_eos_inside_a_block(pair, eos_at):
    prompt = prompt_of(12)
    plain = pair.reference(prompt, 60)
    eos = plain[eos_at]
    first = plain.index(eos)  # the token may already occur earlier
    ref = pair.reference(prompt, 60, eos_ids=[eos])
    assert ref == plain[:first]
    draft = ScriptedDrafter(plain, prompt, 8, [7], pair.vocab)  # always full blocks
    got, responses = pair.dflash(draft, prompt, eos_ids=[eos], block_size=8, max_tokens=60)
    assert got == ref
    assert responses[-1].finish_reason == "stop"
    assert eos not in got


@pytest.mark.parametrize("max_tokens", [1, 2, 13, 29])
def test_max_tokens_mid_block(pair, max_tokens):
    prompt = prompt_of(9)
    ref = pair.reference(prompt, max_tokens + 16)
    draft = ScriptedDrafter(ref, prompt, 16, [15], pair.vocab)
    got, responses = pair.dflash(draft, prompt, block_size=16, max_tokens=max_tokens)
    assert got == ref[:max_tokens]
    assert responses[-1].finish_reason == "length"
    assert sum(len(r.tokens) for r in responses) == max_tokens


def test_prompt_forms_agree(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    text = "def add(a, b):\n    return"
    ids = pair.tokenizer.encode(text)
    outs = [
        pair.dflash(draft, p, max_tokens=20)[0]
        for p in (text, ids, mx.array(ids))
    ]
    assert outs[0] == outs[1] == outs[2] == pair.reference(ids, 20)
    whole = dflash_mlx.generate(pair.model, draft, pair.tokenizer, text, max_tokens=20)
    assert whole == pair.tokenizer.decode(outs[0])


def test_every_family_is_lossless(family_pair, device, ran, tmp_path):
    """Each family the README lists, the multimodal wrappers included, on
    each device: every acceptance length (so every rollback length), then a
    real drafter, against mlx-lm's own decode (float32)."""
    pair = family_pair
    prompt = prompt_of(20)
    ref = pair.reference(prompt, 40 + 8)
    scripted = ScriptedDrafter(ref, prompt, 8, range(8), pair.vocab)
    got, responses = pair.dflash(scripted, prompt, block_size=8, max_tokens=40, copy_drafts=False)  # (the drafter's blocks only)
    assert got == ref[:40]
    assert {r.accepted for r in responses[1:]} == set(range(8))
    if isinstance(scripted.target, HybridTarget) and not scripted.target.chunked and has_fused_recurrence():
        ran("fused recurrence")
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    assert pair.dflash(draft, prompt, max_tokens=40)[0] == ref[:40]


@pytest.mark.parametrize("step", [7, 64])
def test_chunked_prefill_feeds_the_drafter_every_prompt_position(pair, step):
    """A prompt prefilled in several chunks: lossless against mlx-lm's
    decode with the same chunking, and the drafter fed the taps of every
    prompt position (the scripted drafter checks the count and proposes from
    the position it implies, so a lost chunk shows as lost acceptance)."""
    prompt = prompt_of(150)
    ref = pair.reference(prompt, 48, prefill_step_size=step)
    draft = ScriptedDrafter(ref, prompt, 8, range(8), pair.vocab)
    got, responses = pair.dflash(draft, prompt, block_size=8, max_tokens=40, prefill_step_size=step)
    assert got == ref[:40]
    assert {r.accepted for r in responses[1:]} == set(range(8))


@pytest.mark.parametrize("block_size", [4, 16])
def test_sequential_recurrence_is_lossless(qwen3_5_pair, block_size, device, ran):
    """mlx-lm's own recurrence (its fused kernel on Metal) with bit-identical replay."""
    pair = qwen3_5_pair
    prompt = prompt_of(40)
    ref = pair.reference(prompt, 150 + block_size)
    draft = ScriptedDrafter(ref, prompt, block_size, range(block_size), pair.vocab)
    draft.bind(HybridTarget(pair.model, recurrence="sequential"))
    got, _ = pair.dflash(draft, prompt, block_size=block_size, max_tokens=150)
    assert got == ref[:150]
    if has_fused_recurrence():
        ran("fused recurrence")


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
    from dflash_mlx.sampling import accept_greedy

    accepted, token = accept_greedy(mx.array(draft_tokens, mx.int32), mx.array(target_tokens, mx.int32))
    assert (accepted.item(), token.item()) == want
    batched = accept_greedy(mx.array([draft_tokens] * 2, mx.int32), mx.array([target_tokens] * 2, mx.int32))
    assert [t.tolist() for t in batched] == [[want[0]] * 2, [want[1]] * 2]
