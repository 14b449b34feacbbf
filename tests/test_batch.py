"""Batched cycles: every request of a batch decodes exactly as it would alone.

Rows accept different numbers of drafted tokens each cycle (a scripted
drafter plants each row's mistakes where its script says), join and leave
mid-flight, stop at their own eos and max_tokens; each must end with its
lone run's tokens (greedy), its lone run's distribution (sampled), and a
prompt cache the next turn can continue.
"""

import itertools
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache
import tiny
from tiny import PROMPT, TRUNCATED, FakeDrafter, committed_sequence, pit_check, prompt_of, reference_tokens, small_pair

import dflash_mlx
from dflash_mlx.batch import BatchGenerator, batch_generate
from dflash_mlx.errors import ArgumentError
from dflash_mlx.prefill import prefill
from dflash_mlx.models.dflash import masked_block
from dflash_mlx.sampling import ACCEPTANCE_RULES
from dflash_mlx.targets import adapter_for
from dflash_mlx.targets.rows import BatchCache, in_time_order

FAMILIES = ["qwen3", "qwen3_5", "llama", "gemma4_text", "gpt_oss", "qwen3_next", "kimi_k25"]


class RowScriptedDrafter(FakeDrafter):
    """:class:`tiny.ScriptedDrafter` for a batch: each request's script (its
    prompt, the target's greedy continuation and where to plant mistakes)
    lives in its own drafter cache, so rows accept different lengths."""

    def __init__(self, vocab, block_size=16):
        super().__init__([0, 0], block_size)  # the calibration's probes read as probes
        self.vocab = vocab
        self.accepted_runs = {}

    def script(self, cache, prompt, reference, mistakes):
        cache.draft.update(prompt=list(prompt), reference=list(reference), mistakes=itertools.cycle(mistakes))
        return cache

    def draft_rows(self, blocks, target_hidden, caches, slots, samplings, keys=None):
        out = []
        for b, cache in enumerate(caches):
            seq = committed_sequence(cache["prompt"], blocks[b : b + 1], target_hidden[b], cache, cache["reference"])
            at = len(seq) - 1 - len(cache["prompt"])
            n = blocks.shape[1] - 1
            proposal = (cache["reference"][at + 1 : at + 1 + n] + [0] * n)[:n]
            slot = next(cache["mistakes"])
            if slot < n:
                proposal[slot] = (proposal[slot] + 1) % self.vocab
            cache["last"] = [seq[-1]] + proposal
            out.append(proposal[:slots])
        return mx.array(out, dtype=mx.int32), [None] * len(caches)

    def propose(self, block, context, cache, slots=None):  # a batch of one decodes as a request alone
        if "prompt" not in cache:  # the calibration's scratch cache
            return super().propose(block, context, cache, slots)
        return self.draft_rows(block, [context], [cache], block.shape[1] - 1 if slots is None else slots, [None])[0]


class Collected:
    """Every response of a :class:`BatchGenerator`, by request uid."""

    def __init__(self):
        self.tokens, self.finish, self.caches, self.cycles = {}, {}, {}, {}

    def add(self, responses):
        for r in responses:
            self.tokens.setdefault(r.uid, []).extend(r.tokens)
            self.cycles.setdefault(r.uid, []).append((r.block, len(r.tokens), sum(r.from_draft)))
            if r.finish_reason is not None:
                self.finish[r.uid], self.caches[r.uid] = r.finish_reason, r.prompt_cache
        return responses

    def drain(self, gen):
        while gen.busy:
            self.add(gen.next())
        return self


def run_all(gen):
    return Collected().drain(gen)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_rows_accept_their_own_lengths_exactly(make_pair, family, block_size):
    """Eight requests of different prompt lengths, max_tokens and mistake
    scripts, four joining after the first cycles: each ends with mlx-lm's
    own greedy tokens, and accepts what it accepts alone."""
    pair = make_pair(family)
    draft = RowScriptedDrafter(pair.vocab, block_size).bind(pair.model)
    lengths, limits = [1, 7, 40, 300, 3, 90, 12, 150], [60, 25, 80, 40, 70, 33, 90, 50]
    prompts = [prompt_of(n, seed=i) for i, n in enumerate(lengths)]
    refs = [pair.reference(p, m + block_size, eos_ids=[]) for p, m in zip(prompts, limits)]  # rows run past eos
    mistakes = [range(block_size), [0], [block_size], [1, 5, 2], [3, 0, 0, 7], range(block_size - 1, -1, -1), [13, 12, 11, 10], [9, 1]]

    def cache_for(i):
        return draft.script(dflash_mlx.make_prompt_cache(pair.model, draft), prompts[i], refs[i], mistakes[i])

    gen, seen = BatchGenerator(pair.model, draft, block_size=block_size), Collected()
    first = gen.insert(prompts[:4], limits[:4], prompt_caches=[cache_for(i) for i in range(4)])
    for _ in range(3):
        assert {r.uid for r in seen.add(gen.next())} <= set(first)
    later = gen.insert(prompts[4:], limits[4:], prompt_caches=[cache_for(i) for i in range(4, 8)])
    seen.drain(gen)
    accepted = set()
    for i, uid in enumerate(first + later):
        assert seen.tokens[uid] == refs[i][: limits[i]], f"request {i}"
        assert seen.finish[uid] == "length"
        accepted |= {a for block, _, a in seen.cycles[uid] if block}
    assert accepted >= set(range(block_size))  # every acceptance length occurred somewhere


def test_greedy_rows_match_their_lone_runs_cycle_for_cycle(qwen3_5_pair):
    """Acceptance does not fall with the batch: each row's cycles (tokens
    committed per cycle) are those of its lone run at the same block."""
    pair = qwen3_5_pair
    draft = RowScriptedDrafter(pair.vocab, 8).bind(pair.model)
    prompts = [prompt_of(n, seed=n) for n in (5, 60, 17, 33)]
    refs = [pair.reference(p, 48, eos_ids=[]) for p in prompts]
    scripts = [[0, 7], [3], [7, 7, 1], [5, 2]]

    def per_cycle(batch):
        gen = BatchGenerator(pair.model, draft, block_size=8, copy_drafts=False)  # (the drafter's blocks only)
        caches = [draft.script(dflash_mlx.make_prompt_cache(pair.model, draft), p, r, s)
                  for p, r, s in zip(prompts[:batch], refs, scripts)]
        uids = gen.insert(prompts[:batch], 40, prompt_caches=caches)
        seen = run_all(gen)
        return [[n for block, n, _ in seen.cycles[u] if block] for u in uids], [seen.tokens[u] for u in uids]

    together, tokens = per_cycle(4)
    for i in range(4):
        alone, lone_tokens = per_cycle(i + 1)
        assert alone[i] == together[i] and lone_tokens[i] == tokens[i] == refs[i][:40]


FAMILIES_REAL = ["qwen3", "qwen3_5", "qwen3_5_moe", "llama", "gemma4", "gemma4_text", "gpt_oss", "qwen3_next", "deepseek_v3", "kimi_k25"]


@pytest.mark.parametrize("family", FAMILIES_REAL)
def test_batch_generate_with_a_real_drafter_is_exact(make_pair, family, tmp_path):
    """A real (random) DFlash drafter, one batched drafter forward per cycle
    over contexts of different lengths; adaptive and fixed blocks; Gemma-4's
    sliding windows wrap many times over."""
    pair = make_pair(family)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompts = [prompt_of(n, seed=3) for n in (4, 70, 23)]
    limits = [50, 30, 64]
    refs = [pair.reference(p, m) for p, m in zip(prompts, limits)]
    for block_size in (None, 4):
        result = batch_generate(pair.model, draft, pair.tokenizer, prompts, max_tokens=limits, block_size=block_size)
        assert result.tokens == refs
        assert result.finish_reasons == ["length" if len(r) == m else "stop" for r, m in zip(refs, limits)]


def test_a_quantized_target_batches_exactly(make_pair, tmp_path):
    pair = make_pair("qwen3")
    model, tokenizer = dflash_mlx.load(str(pair.path))
    nn.quantize(model, group_size=32, bits=4)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), model)
    prompts = [prompt_of(n, seed=5) for n in (9, 41)]
    refs = [reference_tokens(model, tokenizer, p, 40) for p in prompts]
    assert batch_generate(model, draft, tokenizer, prompts, max_tokens=40, block_size=4).tokens == refs


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_rows_stop_at_their_own_eos(make_pair, tmp_path, block_size, family):
    """An eos ends its row (kept, as the lone run keeps it) and no other;
    plain batched steps (block 1) run ahead of their reads, and a row that
    ends is rolled back out of the step queued after it (a hybrid's
    recurrent state too)."""
    pair = make_pair(family)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompts = [prompt_of(n, seed=11) for n in (6, 19, 44)]
    refs = [pair.reference(p, 40) for p in prompts]
    eos = refs[1][12]  # the second row's 13th token
    gen = BatchGenerator(pair.model, draft, block_size=block_size)
    uids = gen.insert(prompts, 40, eos_token_ids=[eos])
    seen = run_all(gen)
    for uid, ref in zip(uids, refs):
        want = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert seen.tokens[uid] == want
        assert seen.finish[uid] == ("stop" if eos in ref else "length")
    assert seen.finish[uids[1]] == "stop"


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_removed_request_leaves_a_cache_to_continue(qwen3_5_pair, tmp_path, block_size):
    """A client that disconnects: its row leaves between cycles with a
    consistent prompt cache (continuing it alone gives mlx-lm's tokens);
    the rows that stay are unaffected. Then a second turn on a finished
    row's cache equals mlx-lm's second turn with its own prompt cache."""
    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompts = [prompt_of(n, seed=2) for n in (8, 30, 15)]
    refs = [pair.reference(p, 60) for p in prompts]
    gen = BatchGenerator(pair.model, draft, block_size=block_size)
    uids = gen.insert(prompts, 60)
    so_far = {u: [] for u in uids}
    while len(so_far[uids[1]]) < 10:
        for r in gen.next():
            so_far[r.uid] += r.tokens
    left = gen.remove([uids[1]])[uids[1]]
    seen = run_all(gen)
    got, caches = seen.tokens, seen.caches
    assert so_far[uids[0]] + got[uids[0]] == refs[0] and so_far[uids[2]] + got[uids[2]] == refs[2]
    n = len(so_far[uids[1]])
    assert left.tokens == prompts[1] + refs[1][:n]
    rest = [t for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, [], prompt_cache=left, max_tokens=60 - n) for t in r.tokens]
    assert so_far[uids[1]] + rest == refs[1]
    # a second turn on a finished row's cache
    turn = prompt_of(5, seed=9)
    second = [t for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, turn, prompt_cache=caches[uids[0]], max_tokens=20) for t in r.tokens]
    assert second == pair.reference(prompts[0] + refs[0] + turn, 20)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_short_prompts_prefill_together(make_pair, tmp_path, family):
    """Prompts that fit one prefill step together run as one batch of
    rows (a hybrid's in pieces of its ``longest_ragged``), each row keeping
    its own length: first a second turn on a finished request's cache
    beside fresh prompts, every answer mlx-lm's."""
    pair = make_pair(family)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    first = prompt_of(11, seed=4)
    done = batch_generate(pair.model, draft, pair.tokenizer, [first], max_tokens=12)
    turn, fresh = prompt_of(6, seed=8), [prompt_of(n, seed=n) for n in (1, 30, 130)]
    refs = [pair.reference(first + done.tokens[0] + turn, 24, eos_ids=[])] + [pair.reference(p, 24, eos_ids=[]) for p in fresh]
    gen = BatchGenerator(pair.model, draft, block_size=4)
    shapes, forward = [], gen.target.forward
    gen.target.forward = lambda tokens, cache, **kw: shapes.append(tokens.shape) or forward(tokens, cache, **kw)
    uids = gen.insert([turn] + fresh, 24, prompt_caches=[done.prompt_caches[0], None, None, None])
    firsts = gen.next()
    assert [r.uid for r in firsts] == uids and all(rows == 4 for rows, _ in shapes)
    piece = gen.target.longest_ragged or 130
    assert len(shapes) == -(-129 // piece) + 1
    seen = run_all(gen)
    assert [[t for r in firsts if r.uid == u for t in r.tokens] + seen.tokens[u] for u in uids] == refs
    ones = [[5], [7]]  # nothing to run before each prompt's last token
    assert batch_generate(pair.model, draft, pair.tokenizer, ones, max_tokens=6).tokens == [pair.reference(p, 6) for p in ones]


def test_the_generator_reports_every_cycle_it_read(qwen3_pair, tmp_path):
    """``cycles_read`` (what /metrics counts): the rows of every cycle a
    next() read, two cycles where a row's eos ended it before the plain
    step already run ahead of it."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompts = [prompt_of(n, seed=11) for n in (6, 19, 44)]
    eos = pair.reference(prompts[1], 40)[12]
    batch_generate(pair.model, draft, pair.tokenizer, prompts[:1], max_tokens=2, block_size=1)  # the costs measured first
    gen = BatchGenerator(pair.model, draft, block_size=1)
    cycles, forward = [], gen.target.forward

    def counted(tokens, cache, **kw):
        if not kw:  # a cycle's forward (a prefill's wants its last logits only)
            cycles.append(tokens.shape[0])
        return forward(tokens, cache, **kw)

    gen.target.forward = counted
    gen.insert(prompts, 40, eos_token_ids=[eos])
    read = []
    while gen.busy:
        gen.next()
        read.append(gen.cycles_read)
    assert [n for c in read for n in c] == cycles and 2 in [len(c) for c in read]


def test_a_request_alone_decodes_as_generate_step_and_joins_exactly(qwen3_5_pair, tmp_path):
    """A batch of one runs the one-request loop on its own cache; a second
    request stops it between cycles and both decode together; alone again
    once the second ends. Every token mlx-lm's; a seeded sampled request
    alone repeats itself (at a fixed block: the sizer's choices, learnt
    across generations, shape what is drawn)."""
    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    first, second = prompt_of(20, seed=21), prompt_of(9, seed=22)
    refs = [pair.reference(first, 50, eos_ids=[]), pair.reference(second, 20, eos_ids=[])]
    gen, seen = BatchGenerator(pair.model, draft, block_size=4), Collected()
    ua = gen.insert([first], 50)[0]
    for _ in range(5):
        assert all(r.uid == ua and r.batch <= 1 for r in seen.add(gen.next()))  # (0: the prefill's token)
    assert gen.active[0].cache.target is not None  # its own cache, not a batch's
    ub = gen.insert([second], 20)[0]
    batches = []
    while gen.busy:
        batches += [r.batch for r in seen.add(gen.next()) if r.block]
    assert seen.tokens[ua] == refs[0] and seen.tokens[ub] == refs[1]
    assert 2 in batches and batches[-1] == 1  # together, then the first alone again

    def sampled():
        gen = BatchGenerator(pair.model, draft, block_size=4)
        gen.insert([first], 30, temperature=1.0, seed=7)
        return Collected().drain(gen).tokens[0]

    assert sampled() == sampled()


def test_sampled_and_greedy_rows_share_a_batch(tmp_path):
    """Mixed rows: greedy ones identical to their lone run, sampled ones
    (each its own seed and settings) distributed as the target samples:
    a randomised PIT of every token under the target's processed p."""
    small = small_pair(tmp_path, tiny.QWEN3)
    model, tokenizer, draft = small.model, small.tokenizer, small.draft
    greedy_ref = reference_tokens(model, tokenizer, PROMPT, 48)
    settings = [TRUNCATED, dict(temperature=1.0), dict(temperature=0.7, min_p=0.05)]
    runs = {i: [] for i in range(len(settings))}
    for round_ in range(4):
        gen = BatchGenerator(model, draft, block_size=4)
        greedy = gen.insert([PROMPT], 48)
        sampled = [gen.insert([PROMPT], 48, seed=100 * round_ + i, **s)[0] for i, s in enumerate(settings)]
        got = run_all(gen).tokens
        assert got[greedy[0]] == greedy_ref
        for i, uid in enumerate(sampled):
            runs[i].append(got[uid])
    rng = np.random.default_rng(0)
    for i, setting in enumerate(settings):
        ks, bound, outside = pit_check(model, runs[i], setting, rng)
        assert outside == 0 and ks < bound, (setting, ks, bound)
    # a seed repeats its row, under either acceptance rule (its own key draws
    # the target's tokens, not mx.random's state its batch-mates draw from too)
    for acceptance in ACCEPTANCE_RULES:
        gen = BatchGenerator(model, draft, block_size=4)
        a, b = gen.insert([PROMPT, PROMPT], 30, seed=[7, 7], temperature=1.0, acceptance=acceptance)
        got = run_all(gen).tokens
        assert got[a] == got[b], acceptance


@pytest.mark.parametrize("order", list(itertools.permutations("GgS")))
def test_mixed_rows_in_every_order_keep_their_own_decisions(qwen3_pair, tmp_path, order):
    """Two greedy rows (different prompts, so different decisions) and a
    sampled row in every order: each greedy row ends with its own lone
    run's tokens, whichever row comes first (a greedy row that read another
    greedy row's decision, or a sampled row's, would not)."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompts = {"G": prompt_of(9, seed=31), "g": prompt_of(17, seed=32), "S": prompt_of(12, seed=33)}
    refs = {k: pair.reference(prompts[k], 24, eos_ids=[]) for k in "Gg"}
    assert refs["G"] != refs["g"]
    gen = BatchGenerator(pair.model, draft, block_size=4)
    uids = {}
    for k in order:
        sampling = dict(temperature=1.0, seed=5) if k == "S" else {}
        uids[k] = gen.insert([prompts[k]], 24, **sampling)[0]
    got = run_all(gen).tokens
    assert got[uids["G"]] == refs["G"] and got[uids["g"]] == refs["g"]
    assert len(got[uids["S"]]) == 24


def test_rows_stop_at_their_own_stop_tokens_and_limits(qwen3_pair, tmp_path):
    """Rows with different stop tokens and token limits in one batch: each
    ends where its lone run ends (at its own stop token, or its own limit),
    never at another row's."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompts = [prompt_of(9, seed=41), prompt_of(15, seed=42), prompt_of(6, seed=43)]
    free = [pair.reference(p, 40, eos_ids=[]) for p in prompts]
    stop = free[1][4]  # a token the second row writes early: only the first row stops at it
    limits, eos = [40, 30, 11], [[stop], [], [free[2][20]]]
    want, finish = [], []
    for ref, limit, ids in zip(free, limits, eos):
        end = next((i + 1 for i, t in enumerate(ref) if t in ids), None)  # just past its first stop token
        stops = end is not None and end <= limit
        want.append(ref[:end] if stops else ref[:limit])
        finish.append("stop" if stops else "length")
    assert len(want[1]) == 30 and stop in want[1]  # the second row writes the first row's stop token, and goes on
    gen = BatchGenerator(pair.model, draft, block_size=4)
    uids = gen.insert(prompts, limits, eos_token_ids=eos)
    seen = run_all(gen)
    assert [seen.tokens[u] for u in uids] == want
    assert [seen.finish[u] for u in uids] == finish


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4_text"])
def test_batch_caches_round_trip(make_pair, family):
    """Requests' caches joined into a batch and taken back out hold what they
    held (a rotating cache: the rows a next block attends to, in time order)."""
    pair = make_pair(family)
    adapter = adapter_for(pair.model)
    caches = []
    for n in (3, 40):
        c = adapter.make_cache()
        adapter.forward(mx.array([prompt_of(n)]), c, taps=[], record=False)
        caches.append(c)
    batch = BatchCache.join(caches, [3, 40])

    def held(cache):
        if isinstance(cache, ArraysCache):
            return list(cache.cache)
        if isinstance(cache, RotatingKVCache):
            keys, values = in_time_order(cache)
            keep = min(keys.shape[2], cache.max_size - 1)  # what a next block attends to
            return [keys[..., -keep:, :], values[..., -keep:, :], cache.offset]
        return [cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :], cache.offset]

    for b, c in enumerate(caches):
        for before, after in zip(c, batch.row(b)):
            assert type(before) is type(after)
            for u, v in zip(held(before), held(after)):
                assert (u == v) if isinstance(u, int) else mx.array_equal(u, v)


def test_bad_batch_requests_get_one_clear_error(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    gen = BatchGenerator(pair.model, draft)
    with pytest.raises(ArgumentError, match="max_tokens"):
        gen.insert([[1, 2]], 0)
    with pytest.raises(ArgumentError, match="empty"):
        gen.insert([[]], 5)
    with pytest.raises(ArgumentError, match="outside the target's vocabulary"):
        gen.insert([[1, 2], [10**9]], 5)
    with pytest.raises(ArgumentError, match="3 values for 2 prompts"):
        gen.insert([[1], [2]], [4, 5, 6])
    with pytest.raises(ArgumentError, match="completion_batch_size"):
        BatchGenerator(pair.model, draft, completion_batch_size=0)
    quantized = dflash_mlx.make_prompt_cache(pair.model, draft)
    quantized.target[0] = QuantizedKVCache(group_size=32, bits=8)  # (mlx-lm's kv_bits caches)
    with pytest.raises(ArgumentError, match="QuantizedKVCache cannot join a batch"):
        gen.insert([[1, 2]], 5, prompt_caches=[quantized])
    assert not gen.busy


@pytest.mark.parametrize("window", [None, 8])
def test_one_drafter_forward_drafts_what_each_request_would_alone(qwen3_pair, tmp_path, window):
    """``draft_rows`` over requests with contexts of different lengths (and,
    with a draft window, sinks and dropped positions) proposes what each
    request's own ``propose`` does, cycle after cycle, and leaves each
    drafter context as it: while the batch's buffer holds them, when a
    request leaves (the buffer is rebuilt for the rest), after the window
    has evicted more rows than the buffer first had slots for, and once
    each takes its rows back."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    target = draft.target
    kw = {} if window is None else dict(draft_window=window, draft_sink=2)

    def prefilled():
        caches = []
        for n in (3, 29, 64):
            cache = dflash_mlx.make_prompt_cache(pair.model, draft, **kw)
            prefill(target, cache, prompt_of(n, seed=n), 16)
            caches.append(cache)
        return caches

    def same_contexts(mine, theirs):
        for a, b in zip(mine.draft, theirs.draft):
            assert a.offset == b.offset and a.size == b.size
            assert mx.allclose(a.fetch()[0], b.fetch()[0], atol=1e-5) and mx.allclose(a.fetch()[1], b.fetch()[1], atol=1e-5)

    together, alone = prefilled(), prefilled()
    rounds = 3 if window is None else 70  # 64 + 4 positions a round: past the buffer's first 256 slots
    for round_ in range(rounds):
        if round_ == 2:  # the middle request leaves
            together[1].unlink_draft()
            same_contexts(together[1], alone[1])
            together, alone = [together[0], together[2]], [alone[0], alone[2]]
        anchors = [(5 + 4 * round_ + b) % pair.vocab for b in range(len(together))]
        blocks = mx.concatenate([masked_block(draft, a, draft.block_size) for a in anchors])
        got, _ = draft.draft_rows(blocks, [c.target_hidden for c in together], [c.draft for c in together],
                                  draft.block_size - 1, [None] * len(together))
        for b, cache in enumerate(alone):
            want = draft.propose(blocks[b : b + 1], cache.target_hidden, cache.draft)
            assert got[b].tolist() == want[0].tolist(), (round_, b)
            same_contexts(together[b], cache)
        for c in together + alone:  # the next round's context: a few more positions
            c.target_hidden = None
            tokens = mx.array([prompt_of(4, seed=round_)])
            _, taps = target.forward(tokens, c.target, record=False)
            c.add_hidden(taps)
    for mine, theirs in zip(together, alone):
        mine.unlink_draft()
        assert all(c.rows is None for c in mine.draft)
        same_contexts(mine, theirs)


def test_one_drafter_forward_gives_each_requests_slot_logits(qwen3_pair, tmp_path):
    """``slot_logits_rows`` (what rows whose controls draft their own blocks
    read, a grammar or logits processors): each row's logits are those its
    own ``slot_logits`` gives, cycle after cycle."""
    draft = dflash_mlx.load_draft(qwen3_pair.make_draft(tmp_path / "d"), qwen3_pair.model)
    target = draft.target

    def prefilled():
        caches = []
        for n in (5, 23, 40):
            cache = dflash_mlx.make_prompt_cache(qwen3_pair.model, draft)
            prefill(target, cache, prompt_of(n, seed=n), 16)
            caches.append(cache)
        return caches

    together, alone = prefilled(), prefilled()
    for round_ in range(2):
        blocks = mx.concatenate([masked_block(draft, (7 + round_ + b) % qwen3_pair.vocab, draft.block_size) for b in range(3)])
        got = draft.slot_logits_rows(blocks, [c.target_hidden for c in together], [c.draft for c in together], 5)
        assert got.shape == (3, 5, qwen3_pair.vocab)
        for b, cache in enumerate(alone):
            want = draft.slot_logits(blocks[b : b + 1], cache.target_hidden, cache.draft, slots=5)
            assert mx.allclose(got[b], want[0], atol=1e-4), (round_, b)
        for c in together + alone:
            c.target_hidden = None
            _, taps = target.forward(mx.array([prompt_of(3, seed=round_)]), c.target, record=False)
            c.add_hidden(taps)


@pytest.mark.skipif(os.environ.get("DFLASH_MLX_SMOLLM2") != "1", reason="downloads SmolLM2 (set DFLASH_MLX_SMOLLM2=1)")
def test_smollm2_requests_batched_are_exact_and_accept_as_alone():
    """The real pair: eight held-out chat requests at once, adaptive, each
    mlx-lm's own greedy answer; at a fixed block each accepts what it does
    alone (tokens per cycle per row at batch 8 within 5% of batch 1)."""
    from dflash_mlx.pair import load_pair, named_prompts

    model, tokenizer, draft, _ = load_pair("smollm2")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in named_prompts("smollm2")[:8]]
    refs = [reference_tokens(model, tokenizer, p, 64) for p in prompts]
    assert batch_generate(model, draft, tokenizer, prompts, max_tokens=64).tokens == refs
    together = batch_generate(model, draft, tokenizer, prompts, max_tokens=64, block_size=4)
    alone = [batch_generate(model, draft, tokenizer, [p], max_tokens=64, block_size=4) for p in prompts]
    assert together.tokens == refs == [a.tokens[0] for a in alone]
    per_row = [s["tokens_per_cycle"] for s in together.stats]
    lone = [a.stats[0]["tokens_per_cycle"] for a in alone]
    assert sum(per_row) >= 0.95 * sum(lone)


def test_each_rows_recurrent_state_after_its_own_prefix():
    """A hybrid target's per-row rollback: the state after each row's own
    kept tokens, in one weighted sum, is each row's ``state_after``."""
    from dflash_mlx.ops.gated_delta import DeltaChunk, state_after_rows

    key = iter(mx.random.split(mx.random.key(3), 5))
    B, H, T, Dv, Dk = 4, 2, 6, 8, 4
    chunk = DeltaChunk(
        mx.random.normal((B, H, T, Dv), key=next(key)),
        mx.cumsum(-mx.abs(mx.random.normal((B, H, T), key=next(key))), axis=-1),
        mx.random.normal((B, H, T, Dk), key=next(key)),
        mx.random.normal((B, H, Dv, Dk), key=next(key)),
    )
    n = [1, 6, 3, 4]
    got = state_after_rows(chunk, mx.array(n))
    for b, k in enumerate(n):
        assert mx.allclose(got[b], chunk.state_after(k)[b], atol=1e-5)
