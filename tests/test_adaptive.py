"""The adaptive block size: the policy on scripted acceptance and costs, and
the real loop when the block changes from cycle to cycle."""

import itertools
import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from tiny import ScriptedDrafter, ScriptedSizer, prompt_of

import dflash_mlx
from dflash_mlx.adaptive import (
    PROBE_BUDGET, PROBE_WAIT, RECHECK_BUDGET, REVISIT, BlockSizer, CycleCosts, SlotAcceptance,
)
from dflash_mlx.calibration import calibrate, calibrated
from dflash_mlx.errors import ArgumentError
from dflash_mlx.prefill import prefill

# A verify of b tokens plus its draft: a 16-token cycle costs 2.4 one-token steps.
LINEAR = {1: 1.0, 2: 1.5, 8: 1.9, 16: 2.4}


def run(sizer, accept_prob, cycles, rng, costs=LINEAR):
    """Drive ``sizer`` with i.i.d. per-slot acceptance ``accept_prob``; return the chosen blocks."""
    chosen = []
    for _ in range(cycles):
        b = sizer.choose(10_000)
        accepted = 0
        while accepted < b - 1 and rng.random() < accept_prob:
            accepted += 1
        sizer.observe(b, accepted, float(np.interp(b, list(costs), list(costs.values()))))
        chosen.append(b)
    return chosen


def test_expected_tokens_follow_the_observed_acceptance():
    acc = SlotAcceptance(8)
    for _ in range(200):
        acc.observe(7, 7)
    assert acc.expected[-1] == pytest.approx(8.0, rel=0.05)
    for _ in range(200):
        acc.observe(7, 0)
    assert acc.rates()[0] < 0.05  # the prior has faded with the cycles
    assert acc.expected[-1] < 1.05


def test_runs_of_acceptance_are_kept_not_spread_into_a_geometric_tail():
    """Cycles that accept all 15 slots or none: a block of 6 commits 1 + 2.5
    tokens on average, a block of 16 commits 1 + 7.5; one rate for every
    slot (15/16) would put them at 5.5 and 10.3 and overvalue short blocks.
    (The estimate is drawn a little toward that rate, and leans up by a
    standard error, not onto it.)"""
    acc = SlotAcceptance(16)
    for _ in range(100):
        acc.observe(15, 15)
        acc.observe(15, 0)
    expected = acc.expected
    assert 3.5 <= expected[6 - 1] < 5.0  # not 5.5
    assert expected[16 - 1] / expected[6 - 1] > 2.1  # 8.5 / 3.5 = 2.4; one rate: 10.3 / 5.5 = 1.9


def test_slots_never_drafted_take_the_observed_rate():
    acc = SlotAcceptance(16)
    for _ in range(50):
        acc.observe(3, 3)  # slots 1-3 always accepted, deeper slots never drafted
    rates = acc.rates()
    assert min(rates[:3]) > 0.95
    assert rates[3] > 0.9  # optimistic about depth, so the block can grow


def test_costs_follow_measurements_with_one_intercept_for_all_drafting_lengths():
    costs = CycleCosts({1: 1.0, 2: 1.5, 16: 2.9})  # a draft of 1.4, 0.1 more per verified token
    assert costs.upto(16) == pytest.approx([1.0] + [1.4 + 0.1 * b for b in range(1, 16)])
    costs.observe(16, 100.0)  # a length's first cycle may include compiling it: not counted
    assert costs.upto(16)[16 - 1] == pytest.approx(2.9)
    for seconds in (6.0, 6.0, 60.0):  # the machine made cycles slower, one of them much slower
        costs.observe(16, seconds)
    table = costs.upto(16)  # index b - 1
    assert table[16 - 1] == pytest.approx(6.0)  # the median: the outlier does not move it
    assert table[2 - 1] == pytest.approx(6.0 - 1.4)  # every drafting length moves with it
    assert table[0] == 1.0  # plain steps are measured by plain steps only


def test_cost_tables_need_the_plain_step():
    with pytest.raises(ArgumentError, match="plain step"):
        CycleCosts({2: 1.0, 16: 2.0})


def test_high_acceptance_grows_the_block_to_the_maximum():
    sizer = BlockSizer(16, CycleCosts(LINEAR))
    chosen = run(sizer, 0.97, 60, np.random.default_rng(0))
    assert chosen[-20:] == [16] * 20


def test_a_drafter_that_never_agrees_falls_back_to_plain_decoding_and_probes_rarely():
    sizer = BlockSizer(16, CycleCosts(LINEAR))
    chosen = run(sizer, 0.0, 400, np.random.default_rng(0))
    assert chosen[-1] in (1, 16)
    drafted = [b for b in chosen[50:] if b > 1]
    assert len(drafted) <= 10  # only probes, backed off
    # each the drafting length that looks best: short, as the drafter's tokens are not accepted
    assert drafted and max(drafted) < 16


def test_drafting_returns_when_acceptance_recovers():
    sizer = BlockSizer(16, CycleCosts(LINEAR))
    rng = np.random.default_rng(1)
    run(sizer, 0.0, 100, rng)
    sizer.patience[1] = 4  # a recovery is detected by the next probe
    chosen = run(sizer, 0.95, 150, rng)
    assert max(chosen[-30:]) >= 12


def test_medium_acceptance_picks_an_intermediate_block():
    sizer = BlockSizer(16, CycleCosts({1: 1.0, 2: 1.3, 16: 4.0}))
    chosen = run(sizer, 0.6, 300, np.random.default_rng(2))
    tail = chosen[-100:]
    assert 2 <= np.median(tail) <= 8


def test_fixed_size_and_remaining_tokens_cap_the_block():
    sizer = BlockSizer(16, CycleCosts(LINEAR), fixed=True)
    assert [sizer.choose(r) for r in (100, 5, 1)] == [16, 5, 1]
    assert sizer.chosen == {16: 1, 5: 1, 1: 1}


def test_a_fixed_cost_table_ignores_measured_times():
    costs = CycleCosts(LINEAR, follow=False)
    before = costs.upto(16)
    for _ in range(3):
        costs.observe(16, 50.0)
        costs.observe(1, 50.0)
    assert costs.upto(16) == before and before[-1] == pytest.approx(2.4, abs=0.05)


def test_a_fixed_cost_table_chooses_on_acceptance_alone():
    """Pipelined ranks each time their own cycles, and their choices must
    agree: sizers over a fixed table, shown the same acceptance but
    different seconds (one clock twice the other, one far off), choose
    alike, generation after generation."""

    def choices(clock):
        sizer, rng, chosen = BlockSizer(16, CycleCosts(LINEAR, follow=False)), np.random.default_rng(3), []
        for generation in range(3):
            sizer.begin()
            for cycle in range(150):
                b = sizer.choose(10_000)
                accepted = sum(1 for _ in range(b - 1) if rng.random() < (0.9 if cycle % 50 < 20 else 0.1))
                sizer.observe(b, accepted, clock(b, cycle))
                chosen.append(b)
        return chosen

    table = choices(lambda b, i: LINEAR.get(b, 2.0))
    assert len(set(table)) > 2  # drafting, plain decoding and probes between
    assert choices(lambda b, i: 2 * LINEAR.get(b, 2.0)) == table
    assert choices(lambda b, i: 50.0 if i % 7 == 0 else 0.01) == table


def test_failed_probes_back_off_and_a_successful_probe_probes_again():
    sizer = BlockSizer(16, CycleCosts(LINEAR))
    chosen = run(sizer, 0.0, 400, np.random.default_rng(0))  # the drafter never agrees: plain decoding
    # the last probe's extra cost over a plain step spread over 100 times as many plain steps: 1% overhead
    probe = [b for b in chosen if b > 1][-1]
    costs = sizer.costs.upto(probe)
    assert sizer.patience[1] == sizer.longest_wait(probe) == math.ceil((costs[-1] - costs[0]) / 0.01)
    while sizer.choose(10_000) == 1:
        sizer.observe(1, 0, 1.0)
    sizer.observe(16, 15, 2.4)  # the whole probe was accepted: drafting pays again
    assert sizer.drafting_pays() and sizer.patience[1] == 1


def test_probes_that_accept_too_little_to_pay_back_off():
    """A drafter whose probes get a token or two accepted, when a plain step
    is cheap enough that drafting never pays, is probed ever more rarely,
    not every other cycle."""
    sizer = BlockSizer(16, CycleCosts({1: 1.0, 2: 2.0, 16: 3.5}))
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(1500):
        block = sizer.choose(10_000)
        chosen.append(block)
        accepted = min(int(rng.geometric(0.6)) - 1, block - 1)  # about 1.6 tokens per cycle at 16
        sizer.observe(block, accepted, 1.0 if block == 1 else 2.0 + 0.1 * (block - 1))
    assert not sizer.drafting_pays()
    drafted = [b for b in chosen[500:] if b > 1]
    assert len(drafted) <= 20  # under 2% of the cycles, where probing every other cycle is half


def test_a_cost_table_must_reach_the_largest_block():
    with pytest.raises(ValueError, match="max_block 32"):
        BlockSizer(32, CycleCosts(LINEAR))


def test_calibration_leaves_the_cache_as_it_was_and_runs_once(pair, tmp_path):
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=8), pair.model)
    target, prompt = draft.target, prompt_of(9)
    cache, fresh = (dflash_mlx.make_prompt_cache(pair.model, draft) for _ in range(2))
    for c in (cache, fresh):
        prefill(target, c, prompt, 2048)
    taps = cache.target_hidden
    calibration = calibrate(target, draft, cache.target, taps, 8)
    assert calibration.tree is None  # no tree timed for a generation whose sizer may not choose one
    assert calibrate(target, draft, cache.target, taps, 8, trees=True) is calibration  # once per process
    assert cache.target.undo is None and cache.target_hidden is taps and cache.pending == []
    step = mx.array([[3, 1, 4]])  # what the calibrated cache gives next is what a fresh one gives
    assert mx.array_equal(target.forward(step, cache.target)[0], target.forward(step, fresh.target)[0])
    assert sorted(calibration.costs) == [1, 2, 8] and min(calibration.costs.values()) > 0
    nodes, seconds = calibration.tree  # then a tree of the whole block's rows, timed on its own line
    assert nodes == 7 and seconds > 0
    costs = calibration.sizer.costs  # the line through it (trees() never prices one below a plain step)
    intercept, slope, _ = costs.lines[1].tree
    assert intercept + slope * nodes == pytest.approx(seconds)
    assert calibration.settle in (mx.eval, mx.async_eval)
    assert calibrate(target, draft, cache.target, taps, 8, trees=True).tree == (nodes, seconds)  # timed once


class AgreedTarget:
    """A target run by several processes (as a pipelined one) that agreed
    on other timings than this process's: 0.5 s plain, 0.2 s at block 2, 0.25 s at block 8,
    phases overlapped."""

    local_timings = False
    no_trees = "a pipelined target verifies chains only"

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        return getattr(self.target, name)

    def agreed(self, values):
        return [0.5, 0.2, 0.25, 1.0]


def test_calibration_takes_the_agreed_timings_and_keeps_them(pair, tmp_path):
    """What the processes agreed on is the cost table and the strategy, and
    the sizer keeps that table: each process's own cycle times would make
    their choices differ."""
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=8), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    prefill(draft.target, cache, prompt_of(9), 2048)
    calibration = calibrate(AgreedTarget(draft.target), draft, cache.target, cache.target_hidden, 8)
    assert calibration.costs == {1: 0.5, 2: 0.2, 8: 0.25} and calibration.settle is mx.async_eval
    for _ in range(3):  # the first plain cycle is never counted
        calibration.sizer.observe(1, 0, 0.001)
    assert calibration.sizer.costs.upto(1) == [0.5]


# ---------------------------------------------------------------------------
# The loop with a changing block

SCRIPT = [16, 1, 1, 3, 1, 8, 2, 1, 16, 5, 1, 1, 1, 4, 16, 16]


def test_greedy_is_exact_when_the_block_changes(pair, tmp_path):
    prompt = prompt_of(23)
    ref = pair.reference(prompt, 216)
    mistakes = range(17)
    scripted = ScriptedDrafter(ref, prompt, 16, mistakes, pair.vocab)
    sizer = ScriptedSizer(SCRIPT)
    # (copies off: every verified block is the drafter's, accepted up to its planted mistake)
    got, responses = pair.dflash(scripted, prompt, sizer=sizer, max_tokens=200, copy_drafts=False)
    assert got == ref[:200]
    blocks = [r.block_size for r in responses[1:]]
    assert blocks == sizer.asked[: len(blocks)] and {1, 2, 16} <= set(blocks)
    # After plain cycles the drafter still sees every committed position (the
    # scripted drafter checks it): each drafted block is accepted exactly up
    # to the mistake planted in it.
    drafted = [r for r in responses[1:] if r.block_size > 1]
    planted = [min(slot, r.block_size - 1) for slot, r in zip(itertools.cycle(mistakes), drafted)]
    assert [r.accepted for r in drafted] == planted
    assert 0 in planted and len(set(planted)) >= 6
    # Whatever length is verified, the drafter fills its whole block.
    assert set(scripted.block_lengths) == {16}

    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=16), pair.model)
    got, _ = pair.dflash(draft, prompt, sizer=ScriptedSizer(SCRIPT[3:]), max_tokens=200)
    assert got == ref[:200]


class CollapsingDrafter(ScriptedDrafter):
    """Proposes the target's greedy continuation, except a wrong token at
    each position in ``bad``: acceptance collapses there and recovers after."""

    def __init__(self, reference, prompt, bad, vocab):
        super().__init__(reference, prompt, 16, [16], vocab)  # no planted mistakes
        self.bad = bad

    def draft(self, seq, n):
        at = len(seq) - 1 - len(self.prompt)  # the anchor's index in the reference
        truth = super().draft(seq, n)
        return [(t + 1) % self.vocab if at + 1 + i in self.bad else t for i, t in enumerate(truth)]


def test_the_block_shrinks_when_acceptance_collapses_and_grows_when_it_recovers(qwen3_pair):
    pair = qwen3_pair
    prompt = prompt_of(11)
    ref = pair.reference(prompt, 516)
    drafter = CollapsingDrafter(ref, prompt, range(150, 250), pair.vocab)
    sizer = BlockSizer(16, CycleCosts(LINEAR, follow=False))  # costs fixed: no timing noise
    got, responses = pair.dflash(drafter, prompt, sizer=sizer, max_tokens=500, copy_drafts=False)  # the drafter's blocks alone
    assert got == ref[:500]
    starts = np.cumsum([0] + [len(r.tokens) for r in responses])[1:-1]  # tokens before each cycle
    phase = lambda lo, hi: [r.block_size for s, r in zip(starts, responses[1:]) if lo <= s < hi]  # noqa: E731
    assert phase(20, 140) and min(phase(20, 140)) == 16  # the drafter agrees: whole blocks
    collapsed = phase(180, 250)
    assert collapsed.count(1) > 0.8 * len(collapsed)  # plain decoding...
    once_plain = collapsed[collapsed.index(1):]
    assert sum(b > 1 for b in once_plain) <= 5  # ...and, once there, only probes, backing off
    assert max(phase(400, 500)) == 16  # drafting came back and grew
    assert sizer.chosen == Counter(r.block_size for r in responses[1:])


def test_block_size_and_sizer_together_are_refused(qwen3_pair, tmp_path):
    draft = dflash_mlx.load_draft(qwen3_pair.make_draft(tmp_path / "d"), qwen3_pair.model)
    with pytest.raises(ArgumentError, match="block_size or sizer"):
        next(dflash_mlx.stream_generate(
            qwen3_pair.model, draft, qwen3_pair.tokenizer, "x", block_size=4, sizer=ScriptedSizer([2])
        ))


def test_a_fixed_block_is_reported_every_cycle_and_cut_at_the_end(qwen3_pair, tmp_path):
    draft = dflash_mlx.load_draft(qwen3_pair.make_draft(tmp_path / "d"), qwen3_pair.model)
    pair = qwen3_pair
    responses = list(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, "x", block_size=4, max_tokens=9))
    blocks = [r.block_size for r in responses]
    emitted = np.cumsum([len(r.tokens) for r in responses])
    assert blocks[0] == 0  # the prefill's token
    assert all(b == min(4, 9 - n) for b, n in zip(blocks[1:], emitted[:-1]))


def test_plain_cycles_queue_the_next_step_and_closing_undoes_it(qwen3_pair, tmp_path):
    """b = 1 queues the next step before yielding a token, as mlx-lm does;
    closing the generator at any token rolls the queued step back."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    # The pair's first generation in the process yields its first token
    # before the cycles' costs are measured, so nothing is queued yet.
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    steps = dflash_mlx.generate_step(prompt_of(5), pair.model, draft, prompt_cache=cache, block_size=1, max_tokens=6)
    next(steps)
    assert cache.target.undo is None and not calibrated(draft.target, draft, 1)
    list(steps)
    assert calibrated(draft.target, draft, 1)
    for stop_after in range(1, 7):
        cache = dflash_mlx.make_prompt_cache(pair.model, draft)
        steps = dflash_mlx.generate_step(prompt_of(5), pair.model, draft, prompt_cache=cache, block_size=1, max_tokens=6)
        for i, (token, _, from_draft, block, _, _) in enumerate(steps, 1):
            assert not from_draft and block in (0, 1)
            assert (cache.target.undo is not None) == (i < 6)  # the last token queues nothing
            if i == stop_after:
                break
        steps.close()
        assert cache.target.undo is None
        assert cache.target[0].offset == cache.offset - 1  # all but the pending token ran


def test_costs_with_one_drafting_length_stay_flat():
    costs = CycleCosts({1: 1.0, 2: 1.5})
    for seconds in (2.0, 2.0, 2.0):
        costs.observe(2, seconds)
    assert costs.upto(2) == [1.0, 2.0] and costs.lines[1].chain[1] == 0.0


# ---------------------------------------------------------------------------
# Draft trees in the policy, on numbers alone


def test_expected_tree_tokens_by_hand_and_as_a_chain():
    from dflash_mlx.adaptive import expected_tree_tokens

    # slot 1: best candidate 0.5, runner-up 0.5 * 0.4; slot 2: 0.8 and 0.2 * 0.4
    got = expected_tree_tokens([0.5, 0.8], [0.0, 0.4, 0.1], 4)
    # nodes best first: s1r0 .5, s1r0-s2r0 .4, s1r1 .2, s1r1-s2r0 .16 (s1r0-s2r1 .04 is left out)
    assert got == pytest.approx([1.0, 1.5, 1.9, 2.1, 2.26])
    acc = SlotAcceptance(8)
    for accepted in (7, 2, 0, 5, 1):
        acc.observe(7, accepted)
    chain = expected_tree_tokens(acc.rates(), [0.0], 7)  # one candidate per slot: the chain
    assert chain == pytest.approx(acc.expected)


def test_the_tree_bound_holds_for_every_tree_size():
    from dflash_mlx.adaptive import expected_tree_tokens, tree_tokens_bound

    rng = np.random.default_rng(3)
    for _ in range(50):
        rates = list(rng.uniform(0, 1, rng.integers(1, 16)))
        shares = [0.0] + list(rng.dirichlet(np.ones(6)) * rng.uniform(0, 1))
        bound = tree_tokens_bound(rates, shares)
        assert max(expected_tree_tokens(rates, shares, 64)) <= bound + 1e-9
    # one candidate per slot: the bound is the chain's expected tokens
    acc = SlotAcceptance(8)
    for accepted in (7, 2, 0, 5, 1):
        acc.observe(7, accepted)
    assert tree_tokens_bound(acc.rates(), [0.0]) == pytest.approx(acc.expected[-1])


def test_the_tree_search_runs_only_when_a_tree_could_pay(monkeypatch):
    """A drafter that never agrees, on a backend where a draft costs as
    much as two plain steps: no tree is chosen, and no plain cycle pays for
    a tree search (one may follow a probe, whose outcome moves the
    estimates, but not the plain cycles after it); where rows are cheap and
    the drafter may be good, the search runs."""
    import dflash_mlx.adaptive as adaptive

    searches = []
    real = adaptive.expected_tree_tokens
    monkeypatch.setattr(adaptive, "expected_tree_tokens", lambda *a: searches.append(a) or real(*a))
    sizer = BlockSizer(16, CycleCosts({1: 1.0, 2: 2.0, 16: 2.5}))
    sizer.begin(trees=True)
    searched_after = []  # per cycle after the first 100: searches run by its choice
    for cycle in range(400):
        before = len(searches)
        choice = sizer.choose(1000)
        if cycle >= 100:  # the optimistic priors are spent by now
            searched_after.append((choice, len(searches) - before))
        walk = adaptive.TreeWalk([None], 15) if isinstance(choice, adaptive.TreeChoice) else None
        sizer.observe(choice, 0, 1.0 if choice == 1 else 2.5, *([walk] if walk else []))
    assert sizer.chosen.get(1, 0) > 350 and not any(isinstance(c, adaptive.TreeChoice) for c in sizer.chosen)
    probes = [i for i, (c, _) in enumerate(searched_after) if c != 1]
    searched = [i for i, (_, n) in enumerate(searched_after) if n]
    assert len(searched) <= len(probes)  # one search at most per probe's outcome
    assert all(any(p < i <= p + 1 for p in probes) for i in searched)  # on the choice right after it
    cheap = BlockSizer(16, CycleCosts({1: 1.0, 2: 1.05, 16: 1.1}))
    cheap.begin(trees=True)
    cheap.choose(1000)
    assert searches  # a tree could pay here: it was worked out


def test_tree_searches_take_at_most_their_share_of_the_decoding_time(monkeypatch):
    """Each search is timed: where cycles are long next to it, the
    estimates are searched anew after every drafting cycle; where the
    cycles are as short as a search, only while searching has taken at
    most SEARCH_BUDGET of the decoding time (the last estimates stand in
    between)."""
    import dflash_mlx.adaptive as adaptive

    clock = iter(range(10**6))  # every reading one second later: a search takes 1 s
    monkeypatch.setattr(adaptive.time, "perf_counter", lambda: float(next(clock)))
    searched = {}
    for cycle_seconds in (1e4, 1.0):
        sizer = BlockSizer(16, CycleCosts({1: 1.0, 2: 1.05, 16: 1.1}))
        sizer.begin(trees=True)
        for _ in range(40):
            choice = sizer.choose(1000)
            walk = adaptive.TreeWalk([0, 0], 15) if isinstance(choice, adaptive.TreeChoice) else None
            sizer.observe(choice, 2, cycle_seconds, walk)
        drafted = sum(sizer.chosen.values()) - sizer.chosen.get(1, 0)
        assert drafted > 30
        searched[cycle_seconds] = sizer.searching, drafted
    assert searched[1e4][0] >= searched[1e4][1]  # anew after every drafting cycle
    assert searched[1.0][0] <= 2  # the first search's two (optimistic, as seen), then none within 1% of 40 s


def simulate(sizer, rank_probs, costs_of, cycles, rng):
    """Drive ``sizer``: at every slot the target's token is the drafter's
    rank-r candidate with ``rank_probs[r]`` (else none of them), the same at
    every slot and whatever the path (the model trees are built on); a tree
    is the best-first tree over those probabilities. Returns the choices."""
    from dflash_mlx.adaptive import TreeChoice, TreeWalk
    from dflash_mlx.tree import build_tree

    probs = np.array(rank_probs)
    chosen = []
    for _ in range(cycles):
        choice = sizer.choose(10_000)
        slots = sizer.max_block - 1
        ranks = [int(r) if r < len(probs) else None for r in rng.choice(len(probs) + 1, slots, p=[*probs, 1 - probs.sum()])]
        if isinstance(choice, TreeChoice):
            k = min(choice.nodes, len(probs))
            tree = build_tree(0, np.tile(np.arange(k), (slots, 1)), np.tile(np.log(probs[:k]), (slots, 1)), choice.nodes)
            path, _ = tree.walk([r if r is not None else -1 for r in ranks] + [-1] * tree.rows)
            walked = [ranks[tree.depths[r]] for r in path if tree.depths[r] < slots]
            sizer.observe(choice, len(path) - 1, costs_of(choice), TreeWalk(walked, tree.spine))
        else:
            accepted = next((i for i, r in enumerate(ranks[: choice - 1]) if r != 0), choice - 1)
            sizer.observe(choice, accepted, costs_of(choice))
        chosen.append(choice)
    return chosen


def test_trees_are_chosen_where_rows_are_cheap_and_not_where_they_are_dear():
    """A drafter whose best guess is right 40% of the time and its second
    30%: with a verify that hardly grows with its rows (a GPU at these
    sizes) the sizer verifies large trees; where each row costs a tenth of
    a plain step (this CPU) small ones, and at a third plain decoding. The
    choice comes from the measured costs only: one rule, three cost lines."""
    from dflash_mlx.adaptive import TreeChoice

    def run(per_row):
        table = {1: 1.0, 2: 1.2 + per_row, 16: 1.2 + 15 * per_row}
        sizer = BlockSizer(16, CycleCosts(table))
        sizer.begin(trees=True)

        def costs_of(choice):
            rows = choice.nodes + 1 if isinstance(choice, TreeChoice) else choice
            return 1.0 if rows == 1 else 1.2 + (rows - 1) * per_row

        chosen = simulate(sizer, [0.4, 0.3, 0.1], costs_of, 300, np.random.default_rng(0))
        return chosen[100:], sizer

    flat, sizer = run(0.002)
    trees = [c.nodes for c in flat if isinstance(c, TreeChoice)]
    assert len(trees) > 0.9 * len(flat) and np.median(trees) >= 32
    assert sizer.ranks.shares()[1] == pytest.approx(0.3 / 0.6, abs=0.1)  # learnt from the walks
    steep, _ = run(0.1)
    trees = [c.nodes for c in steep if isinstance(c, TreeChoice)]
    assert len(trees) > 0.5 * len(steep) and np.median(trees) <= 6
    dear, _ = run(0.3)
    assert dear.count(1) > 0.7 * len(dear)


def test_a_tree_budget_forces_trees_and_zero_keeps_chains():
    from dflash_mlx.adaptive import TreeChoice

    forced = BlockSizer(16, None, fixed=True, tree_nodes=32)
    assert forced.choose(100) == TreeChoice(32) and forced.choose(1) == 1
    chains = BlockSizer(16, CycleCosts({1: 1.0, 2: 1.0, 16: 1.0}))
    chains.begin(trees=False)
    assert all(isinstance(chains.choose(100), int) for _ in range(20))


def test_tree_costs_start_as_chains_and_follow_tree_cycles():
    from dflash_mlx.adaptive import TreeChoice

    costs = CycleCosts({1: 1.0, 2: 1.5, 16: 2.9})  # a draft of 1.4, 0.1 more per verified row
    assert costs.trees(4) == pytest.approx([1.4 + 0.1 * k for k in range(5)])  # n nodes: a chain of n + 1 rows
    costs.observe(TreeChoice(8), 100.0)  # the first tree cycle is not counted, whatever its size
    for nodes in (4, 8, 16, 32, 4, 12):  # building, masking and walking a tree cost 1.2 more here
        costs.observe(TreeChoice(nodes), 2.6 + 0.1 * nodes)
    assert costs.trees(32) == pytest.approx([2.6 + 0.1 * k for k in range(33)])
    assert costs.upto(16) == pytest.approx([1.0] + [1.4 + 0.1 * b for b in range(1, 16)])  # chains unchanged
    timed = CycleCosts({1: 1.0, 2: 1.5, 16: 2.9})
    timed.seed_tree(15, 4.1, context=0)  # the table's tree cycle: 1.2 over the chain's
    assert timed.trees(4) == pytest.approx([2.6 + 0.1 * k for k in range(5)])


# ---------------------------------------------------------------------------
# Costs that follow the context


def true_cost(b, context, growth=2e-5):
    """A pair whose verify rows each attend to the context: a plain step
    costs 1.0, a draft 1.4 and each extra verified row 0.05, plus
    ``growth`` per row and context position."""
    return (1.0 if b == 1 else 1.4 + 0.05 * (b - 1)) + growth * b * context


def long_generation(with_context: bool, start=100, end=8000, accept=0.8, seed=0):
    """Drive a sizer through a generation from ``start`` to ``end``
    positions of context (each slot accepted with probability ``accept``,
    cycle costs a little noisy), from a table calibrated at ``start``.
    Returns the sizer, its choices with their contexts."""
    rng = np.random.default_rng(seed)
    table = {b: true_cost(b, start) for b in (1, 2, 16)}
    sizer = BlockSizer(16, CycleCosts(table, context=start))
    context, chosen = start, []
    while context < end:
        b = sizer.choose(10_000)
        accepted = 0
        while accepted < b - 1 and rng.random() < accept:
            accepted += 1
        seconds = true_cost(b, context) * (1 + 0.01 * rng.standard_normal())
        context += accepted + 1
        sizer.observe(b, accepted, seconds, context=context if with_context else None)
        chosen.append((context, b))
    return sizer, chosen


def test_costs_follow_the_context_and_the_choice_follows_them():
    """A table measured at 100 positions of context, a generation that
    runs to 8,000: at the end, lines the loop has not measured since the
    start (the table's slope per row; the plain step between rechecks) are
    read at the current context, the costs match the pair's, and the sizer verifies
    the block that is best there, shorter than the one at the start.
    Without the context the table's slope stays where it was measured: the
    sizer keeps the longest block, or, when that stops looking worth it,
    decodes plainly for long stretches where drafting still pays (it never
    does late in the run that follows the context)."""
    sizer, chosen = long_generation(with_context=True)
    context = chosen[-1][0]
    assert sizer.costs.upto(16) == pytest.approx([true_cost(b, context) for b in range(1, 17)], rel=0.05)
    early = [b for c, b in chosen if c < 1000]
    late = [b for c, b in chosen if c > 7000]
    assert Counter(early).most_common(1)[0][0] == 16
    expected = sizer.acceptance.expected
    best = 1 + int(np.argmax([e / true_cost(b, context) for b, e in enumerate(expected, 1)]))
    assert best < 16
    assert abs(np.median(late) - best) <= 2
    assert late.count(1) <= 0.05 * len(late)  # the plain steps of rechecks only

    stale, chosen = long_generation(with_context=False)
    stale_late = Counter(b for c, b in chosen if c > 7000)
    assert set(stale_late) == {1, 16} and stale_late[1] > 50  # the longest block, or plain steps where drafting pays


def test_context_growth_is_not_read_from_noise():
    """Cycles whose cost does not grow with the context, only jitters:
    the fitted growth stays at (or next to) nothing."""
    rng = np.random.default_rng(1)
    costs = CycleCosts({1: 1.0, 16: 2.0}, context=0)
    for context in range(0, 4000, 5):
        costs.observe(16, 2.0 * (1 + 0.05 * rng.standard_normal()), context=context)
        costs.observe(1, 1.0 * (1 + 0.05 * rng.standard_normal()), context=context)
    assert costs.growth.at(16) * 4000 < 0.05  # under a twentieth of a plain step over the whole run
    assert costs.upto(16)[0] == pytest.approx(1.0, rel=0.05)


def test_a_machine_growing_busier_over_a_short_generation_is_not_growth():
    """Cycles that slow down as a 256-token generation goes on (the machine
    getting busier, not the context): the costs are read as measured."""
    costs = CycleCosts({1: 1.0, 16: 2.0}, context=500)
    for i in range(256):
        costs.observe(1, 1.0 + i / 256, context=500 + i)
    assert costs.growth.at(16) == 0.0
    assert costs.upto(16)[-1] == 2.0  # the drafting line, not seen since the table, stays put


def test_growth_per_cycle_and_per_row_are_told_apart():
    """A backend whose one-row step grows faster with the context than each
    row of a block does (it pays per cycle for the cache's length, say):
    plain steps and 16-row cycles over a span of contexts give both terms."""
    rng = np.random.default_rng(2)
    costs = CycleCosts({1: 0.1, 16: 0.2}, context=0)
    per_cycle, per_row = 2e-5, 1e-5
    for context in range(0, 4000, 5):
        for b in (16, 1, 1, 1):  # the plain steps around a drafting cycle are the switch's, not a plain step's
            seconds = (0.1 if b == 1 else 0.15 + 0.003 * b) + (per_cycle + per_row * b) * context
            costs.observe(b, seconds * (1 + 0.01 * rng.standard_normal()), context=context)
    assert costs.growth.per_cycle == pytest.approx(per_cycle, rel=0.1)
    assert costs.growth.per_row == pytest.approx(per_row, rel=0.1)


def long_prompt_cost(b, context):
    """A CPU-like pair at long contexts: the one-row step grows three times
    faster per context position than each extra row of a block (seconds)."""
    plain = 0.1 + 3.3e-5 * context
    return plain if b == 1 else plain + 0.045 + (b - 1) * (0.0033 + 1.2e-5 * context)


def test_a_rarely_agreeing_drafter_costs_little_at_every_prompt_length():
    """One sizer through generations of 256 tokens after prompts of 512,
    2,048, 4,096 and 7,168 tokens, with a drafter that accepts a slot now
    and then (never enough to pay), from a table and a first generation
    where it did well: after the first, which learns that, each generation
    runs within a few percent of plain decoding. Probes far apart in context are moved to the current one
    before the drafting line is fitted; a drafting cycle that showed
    drafting does not pay backs probing off like a failed probe."""
    rng = np.random.default_rng(0)
    table = {b: long_prompt_cost(b, 64) for b in (1, 2, 16)}
    sizer = BlockSizer(16, CycleCosts(table, context=64))

    def generation(start, accept, tokens):
        sizer.begin()
        n, seconds = 0, 0.0
        while n < tokens:
            b = sizer.choose(tokens - n)
            accepted = 0
            while accepted < b - 1 and rng.random() < accept[min(accepted, 1)]:
                accepted += 1
            took = long_prompt_cost(b, start + n) * rng.uniform(0.95, 1.05)
            sizer.observe(b, accepted, took, context=start + n)
            n, seconds = n + accepted + 1, seconds + took
        return sum(long_prompt_cost(1, start + i) for i in range(n)) / seconds

    generation(64, (0.7, 0.8), 8)
    ratios = [generation(start, (0.08, 0.5), 256) for start in (512, 2048, 4096, 7168) for _ in range(2)]
    # The first one learns that the drafter no longer does well.
    assert ratios[0] > 0.9 and min(ratios[1:]) > 0.95, ratios


def test_a_drafting_cycle_never_costs_less_than_a_plain_step():
    """Whatever the drafting cycles' timings do to the fitted line (here a
    cycle timed far too short, and the first drafting cycles at a context
    2,000 positions past the table's), a draft and a verify of the anchor
    are never priced below a plain step, for chains and trees."""
    costs = CycleCosts({1: 0.111, 2: 0.137, 16: 0.159}, context=72)
    for i in range(40):
        costs.observe(1, 0.111, context=72 + i)
    for i in range(30):
        costs.observe(1, 0.172, context=2040 + i)
    for b, seconds, context in ((8, 0.30, 2050), (8, 0.027, 2051), (7, 0.283, 2054)):
        costs.observe(b, seconds, context=context)
    draft, slope = costs.at(costs.lines[1].chain, 1)
    line = draft + slope
    chain, trees = costs.upto(16), costs.trees(8)
    assert line < chain[0]  # the line alone would price a 2-token cycle below a plain step
    assert min(chain[1:]) >= chain[0] and min(trees) >= chain[0]


def switching(costs: CycleCosts, after: float) -> CycleCosts:
    """``costs`` after 40 spells of plain steps (1.0; the last read before a
    drafting cycle 0.1: it held the next step's forward), a 16-token cycle
    (2.0) and the plain step after it (``after``)."""
    for _ in range(40):
        for seconds in (1.0, 1.0, 1.0, 0.1):
            costs.observe(1, seconds)
        costs.observe(16, 2.0)
        costs.observe(1, after)
    return costs


def test_what_a_switch_costs_is_neither_a_plain_step_nor_a_drafting_cycle():
    """Where a plain step's timing holds the next plain step's forward (as
    measured on MLX's CPU backend): the one before a drafting cycle looks
    nearly free (0.1), the one after it twice as dear (2.0). Plain steps and
    drafting cycles keep their own costs (1.0, 2.0); the switch is the two
    less two plain steps (0.1), priced apart, and counts against probes."""
    costs = switching(CycleCosts({1: 1.0, 2: 1.5, 16: 2.0}), after=2.0)
    assert costs.upto(16)[0] == pytest.approx(1.0)
    assert costs.upto(16)[-1] == pytest.approx(2.0)
    assert costs.switch_cost() == pytest.approx(0.1)
    assert BlockSizer(16, costs).longest_wait(16) == math.ceil((2.0 + 0.1 - 1.0) / (PROBE_BUDGET * 1.0))


def test_one_slowed_plain_step_does_not_price_plain_decoding():
    """A loop that drafts on sees few plain steps it can count (those
    around a switch are the switch's): one slowed plain step among them
    does not become the plain step's cost, the table stands until steps
    of their own outnumber it."""
    costs = CycleCosts({1: 1.0, 2: 2.0, 16: 2.4})
    for seconds in (1.0, 3.0, 1.0):  # the first plain step is not counted (compiling)
        costs.observe(1, seconds)
    costs.observe(16, 2.4)
    costs.observe(16, 2.4)
    assert costs.upto(16)[0] == pytest.approx(1.0)
    for _ in range(10):
        costs.observe(1, 0.5)
    assert costs.upto(16)[0] == pytest.approx(0.5)


def test_a_drafter_that_pays_is_drafted_after_a_spell_of_probes():
    """After a plain spell with a probe every eighth cycle, each probe
    having paid (3 tokens for 2.4 plain steps' time) and its switch (the
    plain step before it nearly free, the one after it twice as dear):
    drafting is chosen. Charged to the drafting cycle, the switch priced
    every probe at 3.45 and the loop kept decoding plainly."""
    sizer = BlockSizer(16, CycleCosts({1: 1.0, 2: 2.4, 16: 2.4}))
    for _ in range(32):
        for seconds in (1.0,) * 6 + (0.05,):
            sizer.observe(1, 0, seconds)
        sizer.observe(16, 2, 2.4)
        sizer.observe(1, 0, 2.05)
    assert sizer.drafting_pays()
    assert sizer.choose(1000) > 1


def test_drafting_out_of_a_plain_step_pays_its_switch():
    """A switch (1.1 plain steps here: the step before a drafting cycle
    nearly free, the one after it three times as dear) is paid once a
    drafting spell: out of a plain step, a drafting cycle must beat plain
    decoding with it paid; inside a spell, the next one is weighed without
    it. Drafting that gains 14% over plain steps before the switch is not
    started for it, and is kept once under way."""
    costs = switching(CycleCosts({1: 1.0, 2: 2.0, 16: 2.0}), after=3.0)
    assert costs.switch_cost() == pytest.approx(1.1)
    row, sizer = accepting(0.5), BlockSizer(16, costs)
    assert 1.0 < max(e / c for e, c in zip(row.expected_as_seen[1:], costs.upto(16)[1:])) < 1.0 + 1.1 / 2.0
    assert sizer.choose([1000], [row]) == 1  # out of a plain step
    sizer.observe(16, [1], 2.0, rows=[row], drafted=[15])
    assert sizer.choose([1000], [row]) > 1  # inside a drafting spell


def after_a_slow_spell(accept: float, cycles=3000, seed=0):
    """A sizer that measured its plain steps in a slow spell (3.0 against
    their 1.0), then decodes ``cycles`` cycles at the pair's true costs
    (a draft and a verify 3.0 whatever the block), each slot accepted with
    probability ``accept``. Returns (seconds, tokens, drafting cycles)."""
    rng = np.random.default_rng(seed)
    sizer = BlockSizer(16, CycleCosts({1: 1.0, 2: 3.0, 16: 3.0}))
    for _ in range(40):
        sizer.observe(1, 0, 3.0)
    seconds = tokens = drafting = 0
    for _ in range(cycles):
        b = sizer.choose(10_000)
        accepted = 0
        while accepted < b - 1 and rng.random() < accept:
            accepted += 1
        cost = 1.0 if b == 1 else 3.0
        sizer.observe(b, accepted, cost)
        seconds, tokens, drafting = seconds + cost, tokens + accepted + 1, drafting + (b > 1)
    return seconds, tokens, drafting


def test_a_plain_step_priced_in_a_slow_spell_is_rechecked_while_drafting():
    """While the loop drafts it sees no plain step, so a plain step priced
    in a slow spell would keep a drafter that loses (about 2.5 tokens for
    three plain steps' time) drafting for good: a recheck of the plain
    step within the first few hundred cycles sends the loop back to plain
    decoding. For a drafter that pays (about 6.5 tokens a cycle), the
    rechecks cost at most their budget of the time."""
    seconds, tokens, drafting = after_a_slow_spell(accept=0.6)
    assert drafting < 0.2 * 3000 and seconds / tokens < 1.1
    seconds, tokens, drafting = after_a_slow_spell(accept=0.85)
    gain = 1.0 - 3.0 / sum(0.85**k for k in range(16))  # what drafting saves a plain step's token
    assert (3000 - drafting) * gain <= RECHECK_BUDGET * seconds


def test_a_plain_spell_is_reconsidered_every_few_steps_not_every_step():
    """A plain step should cost the target's forward, not the sizer's
    arithmetic: inside a plain spell the choice is worked out again every
    REVISIT plain steps (and before a probe), and a change that makes
    drafting pay (here plain steps turning three times dearer) is taken up
    within that many steps."""
    sizer = BlockSizer(16, CycleCosts({1: 1.0, 2: 2.0, 16: 2.4}))
    rng = np.random.default_rng(0)
    run(sizer, 0.3, 200, rng)  # about 1.4 tokens a cycle: plain decoding pays
    sizer.patience[1] = 10_000  # no probe in the way
    worked = []
    rates = sizer.rates
    sizer.rates = lambda *a, **k: worked.append(1) or rates(*a, **k)
    chosen = []
    for _ in range(4 * REVISIT):
        chosen.append(sizer.choose(10_000))
        sizer.observe(chosen[-1], 0, 1.0)
    assert set(chosen) == {1} and len(worked) <= 2 * 4  # rates() read at most twice per reconsideration
    turned, chosen = None, []
    for i in range(48):
        chosen.append(sizer.choose(10_000))
        sizer.observe(chosen[-1], 0, 3.0 if chosen[-1] == 1 else 2.4)
        if turned is None and sizer.drafting_pays():
            turned = i  # from here on drafting pays at the estimates
    assert turned is not None and max(chosen[turned + 1 : turned + 2 + REVISIT]) > 1


def test_a_new_generation_probes_soon_once_the_drafter_has_paid():
    """A prompt the drafter suits, after one it did not: the first probe
    comes within PROBE_WAIT plain steps, not after the wait the failures
    built up; if it fails too, the wait stays where it was."""
    sizer = BlockSizer(16, CycleCosts(LINEAR))
    rng = np.random.default_rng(0)
    run(sizer, 0.9, 200, rng)  # drafting pays, and saves time
    run(sizer, 0.0, 400, rng)  # then the drafter never agrees: probes backed off
    wait = sizer.patience[1]
    assert wait > 8 * PROBE_WAIT and sizer.drafting_net > 0
    sizer.begin()
    plain = 0
    while (block := sizer.choose(10_000)) == 1:
        sizer.observe(1, 0, 1.0)
        plain += 1
    assert plain <= PROBE_WAIT
    sizer.observe(block, 0, float(np.interp(block, list(LINEAR), list(LINEAR.values()))))
    assert sizer.patience[1] == wait


def test_a_drafter_that_never_agrees_costs_its_budget_however_short_the_generations():
    """Generations of 32 tokens with a drafter that never agrees: drafting
    has never paid, so the wait between probes carries over from one
    generation to the next, and probing costs PROBE_BUDGET of the plain
    decoding time, not a probe a generation (about 1.6% here)."""
    sizer = BlockSizer(16, CycleCosts(LINEAR))
    seconds = tokens = 0.0
    for generation in range(60):
        sizer.begin()
        n = 0
        while n < 32:
            b = sizer.choose(32 - n)
            took = float(np.interp(b, list(LINEAR), list(LINEAR.values())))
            sizer.observe(b, 0, took)
            n += 1
            if generation >= 10:  # after the first ones, which learn that it never agrees
                seconds, tokens = seconds + took, tokens + 1
    assert seconds / tokens - 1 <= 1.2 * PROBE_BUDGET, seconds / tokens


@pytest.mark.parametrize("paid", [True, False])
def test_plain_steps_that_end_a_generation_are_no_spell_of_the_next(paid):
    """Whether or not drafting has paid on the whole so far (``drafting_net``)."""
    sizer = BlockSizer(16, CycleCosts(LINEAR))
    run(sizer, 0.9, 100, np.random.default_rng(0))  # drafting pays (and no recheck is due yet)
    assert sizer.patience[1] == PROBE_WAIT and sizer.drafting_net > 0
    if not paid:
        sizer.drafting_net = -1.0  # as after a start where drafting lost more than it has saved since
    assert sizer.choose(1) == 1  # one token left: a plain step, whatever pays
    sizer.observe(1, 0, 1.0)
    sizer.begin()
    assert sizer.choose(10_000) > 1


# ---------------------------------------------------------------------------
# Batches: the same costs and sizer, indexed by rows


def batch_costs(a=0.02, b=0.001, d=0.004, e=0.001, s=0.002):
    """Seconds of a batched cycle of ``rows`` rows at ``block``, and a cost
    model calibrated on one row of it."""
    truth = lambda rows, block: a + b * rows + (block > 1) * (d + e * rows) + s * rows * (block - 1)  # noqa: E731
    return truth, CycleCosts({block: truth(1, block) for block in (1, 2, 16)})


def accepting(share: float, max_block: int = 16, cycles: int = 40) -> SlotAcceptance:
    """A request whose drafts are accepted slot by slot with probability ``share``."""
    acc = SlotAcceptance(max_block)
    rng = np.random.default_rng(0)
    for _ in range(cycles):
        accepted = next((i for i in range(max_block - 1) if rng.random() > share), max_block - 1)
        acc.observe(max_block - 1, accepted)
    return acc


def test_a_batch_of_one_is_a_request_alone():
    """One model, one rule: a row count of one is the lone request's line,
    and the lone call and the rows' call choose alike."""
    _, costs = batch_costs()
    assert costs.upto(16, rows=1) == costs.upto(16)
    lone, rows = BlockSizer(16, costs), BlockSizer(16, costs)
    row = accepting(0.8)
    lone.acceptance = row
    assert [lone.choose(50) for _ in range(5)] == [rows.choose([50], [row]) for _ in range(5)]


def test_a_row_count_is_priced_by_its_own_cycles():
    """A verify that grows faster than linearly with the rows (compute-bound
    past some batch size) is priced low at 8 rows by one row's line; once
    that row count has run, its own cycles price it, and a long plain spell after does not wash out what drafting showed."""
    line, costs = batch_costs()
    truth = lambda rows, block: line(rows, block) + 2e-5 * (rows * (block - 1)) ** 2  # noqa: E731
    assert costs.cost(16, rows=8) < 0.8 * truth(8, 16)  # from one row's line: too low
    for _ in range(4):
        costs.observe(16, truth(8, 16), rows=8)
    assert costs.cost(16, rows=8) == pytest.approx(truth(8, 16), rel=0.1)
    plain = costs.upto(1, rows=8)[0]
    for _ in range(500):
        costs.observe(1, truth(8, 1), rows=8)
    assert costs.cost(16, rows=8) == pytest.approx(truth(8, 16), rel=0.1)
    assert plain == pytest.approx(costs.lines[8].table[0])  # drafting cycles left the plain step alone
    assert costs.upto(1, rows=8)[0] == pytest.approx(truth(8, 1), rel=0.05)


def test_plain_steps_read_unevenly_cost_their_mean():
    """Plain steps queued ahead may be read two at a time: one read takes
    two steps' time, the next almost none. A step costs their mean."""
    costs = CycleCosts({1: 0.004, 2: 0.006, 16: 0.02})
    prices = []
    for i in range(41):
        costs.observe(1, 0.011 if i % 2 else 0.001, rows=8)
        prices.append(costs.upto(1, rows=8)[0])
    assert all(p == pytest.approx(0.006, rel=0.25) for p in prices[20:])


def test_a_batch_drafts_when_rows_are_cheap_and_falls_back_when_dear():
    truth, costs = batch_costs()
    good = [accepting(0.9) for _ in range(4)]
    assert BlockSizer(16, costs).choose([100] * 4, good) > 4  # cheap rows, drafts accepted: a long block
    _, dear = batch_costs(s=0.05, e=0.02)
    poor = [accepting(0.2) for _ in range(8)]
    assert BlockSizer(16, dear).choose([100] * 8, poor) == 1  # dear rows, drafts rejected: plain batched steps


def test_each_rows_acceptance_counts():
    """The same batch and costs: rows the drafter suits pull the block up."""
    _, costs = batch_costs(s=0.0005)
    poor = [accepting(0.3) for _ in range(4)]
    mixed = poor[:2] + [accepting(0.95) for _ in range(2)]
    assert BlockSizer(16, costs).choose([100] * 4, mixed) > BlockSizer(16, costs).choose([100] * 4, poor)


def test_a_plain_batch_probes_and_backs_off_per_row_count():
    _, costs = batch_costs(s=0.001, e=0.03)  # the draft is dear, the verified rows cheap
    sizer = BlockSizer(16, costs)
    rows = [accepting(0.5, cycles=5) for _ in range(8)]  # few cycles seen: plain for now, a probe's worth a try
    choices = [sizer.choose([1000] * 8, rows) for _ in range(PROBE_WAIT)]
    assert choices[:-1] == [1] * (PROBE_WAIT - 1) and choices[-1] > 1  # a probe after PROBE_WAIT plain cycles
    for row in rows:
        for _ in range(5):
            row.observe(15, 0)
    sizer.observe(choices[-1], [0] * 8, costs.cost(choices[-1], 8), rows=rows, drafted=[choices[-1] - 1] * 8)
    wait = sizer.patience[8]
    assert wait > PROBE_WAIT  # it did not pay: the next probe waits longer
    good = [accepting(0.95) for _ in range(2)]
    block = sizer.choose([1000] * 2, good)
    sizer.observe(block, [block - 1] * 2, costs.cost(block, 2), rows=good)
    assert block > 1 and sizer.patience[8] == wait  # drafting that pays with 2 rows says nothing of 8
    assert BlockSizer(16, costs, fixed=True).choose([5] * 8, rows) == 5  # fixed: the whole block, never past the end


def test_a_batch_judges_its_drafting_cycle_as_its_next_choice_will():
    """Whether drafting still pays after a batch's drafting cycle is judged
    on the rows' expected tokens as the next choice is handed them
    (``valued``: in a closed batch, the advance of its trailing edge), not
    on what its rows' acceptances give summed: a probe whose rows accepted
    tokens, where the choice would still see plain steps ahead, backs off
    instead of probing again at the next cycle (every other cycle a probe)."""
    _, costs = batch_costs(s=0.001, e=0.03)
    good, poor = [accepting(0.95) for _ in range(4)], [accepting(0.1) for _ in range(4)]
    waits = []
    for valued in (None, lambda: poor):
        sizer = BlockSizer(16, costs)
        choices = [sizer.choose([1000] * 4, poor) for _ in range(PROBE_WAIT)]
        assert choices[:-1] == [1] * (PROBE_WAIT - 1) and choices[-1] > 1  # a probe
        sizer.observe(choices[-1], [3] * 4, costs.cost(choices[-1], 4), rows=[accepting(0.95) for _ in range(4)],
                      drafted=[choices[-1] - 1] * 4, valued=valued)
        waits.append(sizer.patience[4])
    assert sizer.drafting_pays(good, [1000] * 4) and not sizer.drafting_pays(poor, [1000] * 4)
    assert waits[0] == 1 and waits[1] > PROBE_WAIT  # judged by the sum: probe again; as the choice sees it: back off


def test_the_pairs_acceptance_learns_from_every_row():
    """A row joining a batch starts from the pair's acceptance, which every
    row's cycles feed: what the batch has shown lately, not one request's."""
    _, costs = batch_costs()
    sizer = BlockSizer(16, costs)
    before = sizer.acceptance.expected_as_seen[-1]
    rows = [SlotAcceptance(16) for _ in range(4)]
    for _ in range(10):
        sizer.observe(16, [15] * 4, costs.cost(16, 4), rows=rows)
    assert sizer.acceptance.expected_as_seen[-1] > before + 5
    assert all(r.expected_as_seen[-1] > before + 3 for r in rows)
