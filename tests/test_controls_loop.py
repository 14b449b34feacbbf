"""mlx-lm's controls through the decode loop itself (generate_step,
stream_generate, BatchGenerator), against mlx-lm's own decode with the same
controls: logits processors greedy (token for token, logprobs within 1e-4)
on each kind of target, draft trees, the bundled pair and batches of rows with
their own processors; sampled with penalties and XTC (the distribution
check of tests/test_sampling.py); KV caches; bad values refused before any
work. (The verify math alone: tests/test_processors.py.)"""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from tiny import ScriptedDrafter, pit_check, prompt_of, sampled_runs, small_pair

import dflash_mlx
from dflash_mlx.batch import BatchGenerator
from dflash_mlx.controls import penalty_processors
from dflash_mlx.errors import ArgumentError
from dflash_mlx.generate import generate_step
from dflash_mlx.pair import DEFAULT_DRAFT, DEFAULT_TARGET, default_prompts

SETTINGS = {
    "repetition": dict(repetition_penalty=1.5, repetition_context_size=6),
    "presence": dict(presence_penalty=0.8, presence_context_size=4),
    "frequency": dict(frequency_penalty=0.6, frequency_context_size=30),
    "bias": dict(logit_bias={17: 3.0, 99: -2.0, 200: 4.0}),
    "combined": dict(logit_bias={17: 2.0}, repetition_penalty=1.4, repetition_context_size=5, presence_penalty=0.5,
                     frequency_penalty=0.4),
}


def penalise_last(tokens, logits):
    """A processor make_logits_processors does not make: it reads the exact
    history (its last token and its length)."""
    return logits.at[:, tokens[-1:]].add(-2.0) + 0.01 * tokens.size


def made(name, vectorised=True, vocab=None):
    """The processors of a setting: ours (vectorised over a verify's rows)
    or mlx-lm's own callables (one call per row)."""
    if name == "custom":
        return [penalise_last]
    return penalty_processors(vocab, **SETTINGS[name]) if vectorised else make_logits_processors(**SETTINGS[name])


def steps(pair, draft, prompt, n, **kw):
    """generate_step's tokens and logprobs ``[n, V]``, eos excluded."""
    eos = set(pair.tokenizer.eos_token_ids)
    out = [(t, lp) for t, lp, *_ in generate_step(prompt, pair.model, draft, max_tokens=n, logprobs=True,
                                                  eos_token_ids=eos, **kw) if t not in eos]
    return [t for t, _ in out], mx.stack([lp for _, lp in out])


def check_against_mlx_lm(pair, name, block, vectorised=True, prompt=None, n=40):
    prompt = prompt or prompt_of(20)
    ref, ref_lps = pair.reference_steps(prompt, n, logits_processors=made(name, False))
    draft = ScriptedDrafter(ref, prompt, block, range(block), pair.vocab)  # every acceptance length
    got, lps = steps(pair, draft, prompt, n, block_size=block, logits_processors=made(name, vectorised, pair.vocab))
    assert got == ref
    assert mx.abs(lps - ref_lps).max().item() < 1e-4
    return ref


@pytest.mark.parametrize(
    "name, vectorised", [(n, v) for n in SETTINGS for v in (True, False)] + [("custom", False)], ids=str
)
def test_greedy_with_each_control_is_mlx_lms_decode(qwen3_pair, name, vectorised):
    """Ours (penalty_processors: all rows at once), mlx-lm's own callables and a custom one (one call per row)."""
    ref = check_against_mlx_lm(qwen3_pair, name, 8, vectorised)
    assert ref != qwen3_pair.reference(prompt_of(20), 40)  # the control changes the output


def test_greedy_with_penalties_on_each_kind_of_target(loop_family_pair):
    """Each kind of target's caches roll back under processors (tiny.LOOP_FAMILIES:
    plain KV, hybrids, windows, latent attention, wrappers)."""
    check_against_mlx_lm(loop_family_pair, "combined", 6, n=30)


def test_plain_steps_with_processors_run_ahead_of_their_reads(qwen3_pair):
    """Block 1 under processors: each plain step is processed with the last
    step's lazy token and queued before that token is read and committed to
    the prompt cache (as mlx-lm's generate_step runs ahead), and the tokens
    stay mlx-lm's."""
    prompt, n = prompt_of(20), 24
    ref = qwen3_pair.reference_steps(prompt, n, logits_processors=made("combined", False))[0]
    draft = ScriptedDrafter(ref, prompt, 1, [0], qwen3_pair.vocab)
    cache, early = dflash_mlx.make_prompt_cache(qwen3_pair.model, draft), []

    def spy(tokens, logits):
        early.append(tokens.size > len(cache.tokens))  # its history holds a token the cache has not committed
        return logits

    got = [t for t, *_ in generate_step(prompt, qwen3_pair.model, draft, max_tokens=n, block_size=1, prompt_cache=cache,
                                        logits_processors=made("combined", True, qwen3_pair.vocab) + [spy])]
    assert got == ref
    assert sum(early) >= n - 3


@pytest.mark.parametrize("name", ["combined", "custom"])
def test_draft_trees_with_processors_are_mlx_lms_decode(qwen3_pair, tmp_path, name):
    pair, prompt = qwen3_pair, prompt_of(20)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=8), pair.model)
    ref, ref_lps = pair.reference_steps(prompt, 40, logits_processors=made(name, False))
    got, responses = pair.dflash(draft, prompt, max_tokens=40, tree_budget=6, logits_processors=made(name, True, pair.vocab))
    assert got == ref
    assert all(r.tree_size == 6 for r in responses[1:] if r.block_size > 1) and responses[1].tree_size
    got, lps = steps(pair, draft, prompt, 40, tree_budget=6, logits_processors=made(name, True, pair.vocab))
    assert got == ref and mx.abs(lps - ref_lps).max().item() < 1e-4


@pytest.fixture(scope="module")
def bundled():
    model, tokenizer = dflash_mlx.load(str(DEFAULT_TARGET))
    return model, tokenizer, dflash_mlx.load_draft(DEFAULT_DRAFT, model)


def test_bundled_pair_with_penalties_is_mlx_lms_decode(bundled):
    """A trained drafter: long accepted runs and rollbacks inside blocks, under processors."""
    model, tokenizer, draft = bundled
    setting = dict(repetition_penalty=1.2, logit_bias={int(tokenizer.encode(" the")[0]): -5.0}, frequency_penalty=0.2)
    responses = []
    for prompt in default_prompts()[:2]:
        want = tiny.reference_tokens(model, tokenizer, prompt, 64, logits_processors=make_logits_processors(**setting))
        assert want != tiny.reference_tokens(model, tokenizer, prompt, 64)
        got, rs = tiny.dflash_tokens(model, draft, tokenizer, prompt, max_tokens=64, block_size=draft.block_size,
                                     logits_processors=penalty_processors(None, **setting))
        assert got == want
        responses.append(rs)
    assert tiny.tokens_per_cycle(*responses) > 1.4  # the drafter still accepts (an untrained one: ~1)
    assert any(0 < r.accepted < draft.block_size - 1 for rs in responses for r in rs[1:])  # rollbacks inside blocks


def test_batched_rows_each_with_their_own_processors(qwen3_pair, tmp_path):
    """Each row of a batch equals its lone run and mlx-lm's decode with its processors."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    prompts = [prompt_of(12, seed=s) for s in range(4)]
    names = ["repetition", None, "custom", "combined"]
    per_row = [made(n, True, pair.vocab) if n else [] for n in names]
    gen = BatchGenerator(pair.model, draft, block_size=4)
    uids = gen.insert(prompts, 30, logits_processors=per_row, logprobs=True)
    tokens, lps = {u: [] for u in uids}, {u: [] for u in uids}
    while gen.busy:
        for r in gen.next():
            tokens[r.uid] += r.tokens
            lps[r.uid] += r.logprobs
    gen.close()
    for u, prompt, name in zip(uids, prompts, names):
        ref, ref_lps = pair.reference_steps(prompt, 30, logits_processors=made(name, False) if name else None)
        assert tokens[u] == ref
        assert mx.abs(mx.stack(lps[u]) - ref_lps).max().item() < 1e-4
        lone = steps(pair, draft, prompt, 30, block_size=4, logits_processors=per_row[names.index(name)])[0]
        assert lone == ref


def test_batch_generate_takes_one_list_for_all_and_checks_each(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    prompts = [prompt_of(9, seed=s) for s in range(2)]
    result = dflash_mlx.batch_generate(pair.model, draft, pair.tokenizer, prompts, max_tokens=20,
                                       logits_processors=made("combined", True, pair.vocab))
    for prompt, got in zip(prompts, result.tokens):
        assert got == pair.reference(prompt, 20, logits_processors=made("combined", False))
    with pytest.raises(ArgumentError, match="logits_processors has 3 lists for 2 prompts"):
        BatchGenerator(pair.model, draft).insert(prompts, 5, logits_processors=[[], [], []])
    with pytest.raises(ArgumentError, match="xtc_threshold"):
        BatchGenerator(pair.model, draft).insert(prompts, 5, temperature=1.0, xtc_probability=0.5, xtc_threshold=[0.1, 0.9])


# ---------------------------------------------------------------------------
# Sampled: penalties and XTC, in distribution


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return small_pair(tmp_path_factory.mktemp("small_loop"), tiny.QWEN3)


PENALISED = dict(logit_bias={3: 1.5}, repetition_penalty=2.0, repetition_context_size=4, presence_penalty=0.5, frequency_penalty=1.0)


@pytest.mark.parametrize(
    "setting, acceptance",
    [
        (dict(temperature=1.0, top_p=0.95), "speculative"),
        (dict(temperature=1.0, top_p=0.95, xtc_probability=0.5, xtc_threshold=0.1), "speculative"),
        (dict(temperature=0.8, min_p=0.1, min_tokens_to_keep=3, xtc_probability=0.7, xtc_threshold=0.08), "speculative"),
        (dict(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.1), "exact-match"),
    ],
    ids=["penalties", "penalties+xtc", "min_p+keep+xtc", "exact-match+xtc"],
)
def test_sampled_with_penalties_and_xtc_follows_the_target(small, setting, acceptance):
    """Every committed token under the target's processed distribution given
    its own prefix (processors, then make_sampler's chain with XTC's mixture)."""
    tokens, accepted = sampled_runs(small, small.draft, 6, setting, acceptance=acceptance, block_size=4, copy_drafts=False,
                                    logits_processors=penalty_processors(None, **PENALISED))
    make = lambda: make_logits_processors(**PENALISED)  # noqa: E731
    ks, bound, outside = pit_check(small.model, tokens, setting, np.random.default_rng(0), logits_processors=make)
    assert outside == 0 and ks < bound
    assert min(accepted) == 0 and max(accepted) >= (2 if acceptance == "speculative" else 1)  # rejections and accepted drafts
    assert pit_check(small.model, tokens, setting, np.random.default_rng(0))[0] > bound  # the check can fail: no processors


def test_xtc_without_processors_follows_the_target(small):
    setting = dict(temperature=1.0, xtc_probability=0.6, xtc_threshold=0.1)
    tokens, _ = sampled_runs(small, small.draft, 5, setting, block_size=4)
    ks, bound, outside = pit_check(small.model, tokens, setting, np.random.default_rng(1))
    assert outside == 0 and ks < bound
    plain = dict(temperature=1.0)
    assert pit_check(small.model, tokens, plain, np.random.default_rng(1))[0] > bound  # the check can fail


# ---------------------------------------------------------------------------
# KV caches through the loop


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory):
    """Heads of 64: mlx's quantization groups divide them."""
    return tiny.Pair(tmp_path_factory.mktemp("wide_qwen3"), dict(tiny.QWEN3, head_dim=64))


@pytest.mark.parametrize("kv", [dict(kv_bits=8, quantized_kv_start=28), dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0),
                                dict(max_kv_size=24)], ids=str)
def test_kv_keywords_through_the_loop_are_mlx_lms_decode(wide_qwen3, tmp_path, kv):
    """generate_step's KV keywords make the prompt cache (tests/test_kv_caches.py: the caches themselves)."""
    pair, prompt, step = wide_qwen3, prompt_of(20), 16
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=8), pair.model)
    want = pair.reference(prompt, 40, prefill_step_size=step, **kv)
    assert want != pair.reference(prompt, 40, prefill_step_size=step)
    scripted = ScriptedDrafter(want, prompt, 8, range(8), pair.vocab)
    assert pair.dflash(scripted, prompt, max_tokens=40, block_size=8, prefill_step_size=step, **kv)[0] == want
    assert pair.dflash(draft, prompt, max_tokens=40, prefill_step_size=step, **kv)[0] == want
    assert pair.dflash(draft, prompt, max_tokens=40, tree_budget=6, prefill_step_size=step, **kv)[0] == want
    processors = dict(logits_processors=penalty_processors(None, **SETTINGS["combined"]))
    want = pair.reference(prompt, 40, prefill_step_size=step, logits_processors=made("combined", False), **kv)
    assert pair.dflash(draft, prompt, max_tokens=40, prefill_step_size=step, **processors, **kv)[0] == want


@pytest.mark.parametrize("kv", [dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0), dict(max_kv_size=24)], ids=str)
def test_kv_caches_and_forced_trees_decode_one_request_at_a_time(wide_qwen3, tmp_path, kv):
    """What the server runs with quantized or rotating caches or forced
    trees: the scheduler taking one request at a time
    (``completion_batch_size=1``), each request mlx-lm's decode with its
    caches, its cycles draft trees; a larger batch refuses both up front."""
    pair, step = wide_qwen3, 16
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=8), pair.model)
    prompts = [prompt_of(20), prompt_of(12, seed=3)]
    want = [pair.reference(p, 30, eos_ids=[], prefill_step_size=step, **kv) for p in prompts]
    gen = BatchGenerator(pair.model, draft, completion_batch_size=1, tree_budget=6, prefill_step_size=step)
    uids, got, trees = gen.insert(prompts, 30, **kv), {}, set()
    while gen.busy:
        for r in gen.next():
            assert r.batch <= 1  # (0: a prefill's token)
            got.setdefault(r.uid, []).extend(r.tokens)
            trees.add(r.tree)
    assert [got[u] for u in uids] == want and 6 in trees
    with pytest.raises(ArgumentError, match="completion_batch_size=1"):
        BatchGenerator(pair.model, draft, tree_budget=6)
    with pytest.raises(ArgumentError, match="cannot join a batch"):
        BatchGenerator(pair.model, draft).insert(prompts[:1], 5, **kv)


# ---------------------------------------------------------------------------
# Bad values: one clear error before any work


@pytest.mark.parametrize("bad, says", [
    (dict(logits_processors=[1]), "callables"),
    (dict(xtc_probability=2.0), "xtc_probability"),
    (dict(xtc_special_tokens=[10**7]), "outside the vocabulary"),
    (dict(min_tokens_to_keep=0), "min_tokens_to_keep"),
    (dict(kv_bits=7), "kv_bits must be one of"),
    (dict(kv_bits=4, max_kv_size=64), "cannot be used together"),
    (dict(sampler=lambda x: mx.argmax(x, axis=-1), xtc_probability=0.5), "xtc_probability or a sampler"),
])
def test_bad_controls_are_refused_before_any_work(qwen3_pair, tmp_path, bad, says):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    with pytest.raises(ArgumentError, match=says):
        next(generate_step(prompt_of(5), pair.model, draft, prompt_cache=cache, **bad))
    assert cache.offset == 0 and not cache.tokens  # nothing ran
    with pytest.raises(ArgumentError, match="logit_bias"):
        penalty_processors(pair.vocab, logit_bias={pair.vocab: 1.0})


def test_a_prompt_cache_reused_with_processors(qwen3_pair, tmp_path):
    """With a prompt cache, the processors see what mlx-lm's generate_step is given: the new tokens."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    first, second = prompt_of(10, seed=1), prompt_of(6, seed=2)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    got1 = [t for t, *_ in generate_step(first, pair.model, draft, prompt_cache=cache, max_tokens=8)]
    assert got1 == pair.reference(first, 8)
    # mlx-lm's generate_step on a cache holding the first turn (it ran its last token too, as it generated it), given the new ones
    lm_cache = make_prompt_cache(pair.model)
    pair.model(mx.array([first + got1]), cache=lm_cache)
    processors = make_logits_processors(**SETTINGS["combined"])
    got2 = [t for t, *_ in generate_step(second, pair.model, draft, prompt_cache=cache, max_tokens=20,
                                         logits_processors=penalty_processors(None, **SETTINGS["combined"]))]
    want2 = pair.reference(second, 20, prompt_cache=lm_cache, logits_processors=processors)
    assert got2 == want2
