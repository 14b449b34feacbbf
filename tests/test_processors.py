"""mlx-lm's controls through speculation, against mlx-lm itself: logits
processors over a verified block (each row with its own history), a tree
and a batch; XTC's distribution; logprobs; the settings checks.
(Through the decode loop itself: tests/test_controls_loop.py.)

The distribution checks use tests/test_sampling.py's bounds (tiny.tv_bound:
false-failure probability below tiny.DELTA per check)."""

import itertools
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p, apply_xtc, make_logits_processors, make_sampler
from tiny import ANCHOR, PROMPT, V, continuation_logits, draft_noise, prompt_of, small_pair, tv, tv_bound

import tiny

from dflash_mlx.controls import check_processor_settings, check_sampling, penalty_processors
from dflash_mlx.decode import Decoder
from dflash_mlx.errors import ArgumentError
from dflash_mlx.processors import Processors, logprobs
from dflash_mlx.sampling import accept_greedy
from dflash_mlx.sampling import processed_probs, sample, speculative_accept, xtc_removed
from dflash_mlx.targets import adapter_for
from dflash_mlx.tree import build_tree, chain

PROCESSOR_SETTINGS = [
    dict(repetition_penalty=1.5, repetition_context_size=6),
    dict(presence_penalty=0.8, presence_context_size=4),
    dict(frequency_penalty=0.6, frequency_context_size=30),
    dict(logit_bias={1: 2.5, 4: -3.0}),
    dict(logit_bias={2: 1.0}, repetition_penalty=1.3, presence_penalty=0.4, presence_context_size=3, frequency_penalty=0.3),
]


def from_settings(history=(), vocab_size=None, **settings) -> Processors:
    """Processors of make_logits_processors' settings, checked, all rows at once."""
    return Processors(penalty_processors(vocab_size, **settings), history)


def random_logits(rows, vocab=V, seed=0, dtype=mx.float32):
    return (mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 3).astype(dtype)


# ---------------------------------------------------------------------------
# A verified block: row i sees the history and the first i drafted tokens


def penalise_last(tokens, logits):
    """A processor make_logits_processors does not make: it reads the exact
    history (its last token and its length)."""
    return logits.at[:, tokens[-1:]].add(-2.0) + 0.01 * tokens.size


@pytest.mark.parametrize("setting", PROCESSOR_SETTINGS)
def test_block_rows_are_processed_as_plain_decoding_would(setting):
    history, proposal = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 5, 8]
    logits = random_logits(len(proposal) + 1)
    made = make_logits_processors(**setting) + [penalise_last]
    got = Processors(made, history).block(logits, mx.array(proposal))
    for i in range(len(proposal) + 1):
        row, tokens = logits[i : i + 1], mx.array(history + proposal[:i])
        for f in make_logits_processors(**setting) + [penalise_last]:
            row = f(tokens, row)
        assert mx.array_equal(got[i : i + 1], row)
    assert not mx.array_equal(got, logits)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("held", [1, 3, 40])
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("setting", PROCESSOR_SETTINGS)
def test_all_rows_at_once_is_bit_identical(setting, rows, held, dtype):
    """The vectorised path against one call per row, histories shorter and
    longer than the context sizes, drafted tokens that repeat."""
    rng = np.random.default_rng(rows * 100 + held)
    processors = from_settings(rng.integers(0, 6, held).tolist(), vocab_size=V, **setting)
    proposal = mx.array(rng.integers(0, 6, rows - 1).tolist(), dtype=mx.int32)
    logits = random_logits(rows, seed=held, dtype=dtype)
    fast = processors.block(logits, proposal)
    slow = processors.block(logits, proposal, vectorised=False)
    assert fast.dtype == slow.dtype == dtype
    assert mx.array_equal(fast, slow)
    assert not mx.array_equal(fast, logits)
    assert mx.array_equal(logits, random_logits(rows, seed=held, dtype=dtype))  # the verify's logits are left as they were


def test_history_follows_commit_with_lazy_tokens():
    """commit takes the loop's lazy outcome (an array not yet read) as well as a list."""
    setting = PROCESSOR_SETTINGS[-1]
    lazy = from_settings([1, 2], **setting)
    listed = from_settings([1, 2], **setting)
    lazy.commit(mx.argmax(mx.array([0.0, 0.0, 0.0, 1.0])))  # 3, a scalar
    lazy.commit(mx.array([[2, 2]], dtype=mx.uint32))
    listed.commit([3, 2])
    listed.commit(2)
    assert lazy.history.tolist() == listed.history.tolist() == [1, 2, 3, 2, 2]
    logits = random_logits(1)
    assert mx.array_equal(lazy.block(logits), listed.block(logits, [], vectorised=False))


@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("setting", PROCESSOR_SETTINGS[:3] + PROCESSOR_SETTINGS[-1:])
def test_tree_rows_see_their_own_path(setting, vectorised):
    """Each tree row equals the last row of the chain along its path, and a
    chain as a tree equals the block."""
    rng = np.random.default_rng(5)
    lp = -np.sort(rng.random((4, 3)), axis=1)
    ids = rng.integers(0, 6, (4, 3))
    tree = build_tree(2, ids, np.cumsum(lp, axis=1), 12)
    processors = from_settings([1, 2, 2, 5], **setting)
    logits = random_logits(tree.rows, seed=9)
    got = processors.tree(logits, tree.tokens, tree.parents, vectorised=vectorised)
    assert max(tree.depths) >= 3 and not tree.is_chain
    for r in range(tree.rows):
        path = tree.path_to(r)
        along = processors.block(logits[mx.array(path)], [tree.tokens[p] for p in path[1:]], vectorised=False)
        assert mx.array_equal(got[r], along[-1])
    line = chain(2, [4, 4, 1])
    assert mx.array_equal(
        processors.tree(logits[:4], line.tokens, line.parents, vectorised=vectorised),
        processors.block(logits[:4], [4, 4, 1], vectorised=False),
    )


@pytest.mark.parametrize("setting", PROCESSOR_SETTINGS)
def test_drafted_block_is_processed_along_its_own_proposal(setting):
    """The drafter's block under the row's processors: slot j processed with
    the history and the slots drafted before it, by mlx-lm's own processors,
    then its argmax (greedy) or a sample of the processed row (q)."""
    history, slots = [3, 1, 4, 1, 5], 6
    first = random_logits(1, seed=2)[0] * 0.05
    first = first.at[7].add(1.0).at[8].add(0.9)  # every slot prefers 7, then 8
    drafter = mx.broadcast_to(first, (slots, V))
    processors = from_settings(history, **setting)
    calls = []
    tokens, q = processors.draft_block(slots, lambda: calls.append(1) or drafter, V)
    want, seen = [], list(history)
    for j in range(slots):
        row = drafter[j : j + 1]
        for processor in make_logits_processors(**setting):
            row = processor(mx.array(seen), row)
        want.append(int(mx.argmax(row)))
        seen.append(want[-1])
    assert tokens.tolist() == want and q is None and calls == [1]
    if any(k.endswith("penalty") for k in setting):
        assert len(set(want)) > 1  # a penalised repeat is not drafted again
    sampling, key = dict(temperature=0.8, top_p=0.9), mx.random.key(4)
    tokens, q = processors.draft_block(slots, lambda: drafter, V, sampling, key)
    seen = history + tokens.tolist()
    for j in range(slots):
        row = drafter[j : j + 1]
        for processor in make_logits_processors(**setting):
            row = processor(mx.array(seen[: len(history) + j]), row)
        assert mx.allclose(q[j], processed_probs(row[0], **sampling)) and q[j, seen[len(history) + j]] > 0
    assert processors.history.tolist() == history  # drafting commits nothing


def test_batch_rows_each_with_their_own_processors():
    """The decoder's controlled logits: each row through its own request's controls."""
    rows = [[from_settings([1, 2, 3], **PROCESSOR_SETTINGS[0])], [],
            [Processors([penalise_last], [4, 4])], [from_settings([5], **PROCESSOR_SETTINGS[-1])]]
    requests = [SimpleNamespace(controls=c) for c in rows]
    logits = mx.stack([random_logits(4, seed=b) for b in range(4)])
    proposals = mx.array([[1, 1, 2], [3, 3, 3], [4, 0, 4], [5, 2, 2]], dtype=mx.int32)
    got = Decoder.controlled(requests, logits, proposals)
    for b, c in enumerate(rows):
        lone = c[0].block(logits[b], proposals[b], vectorised=False) if c else logits[b]
        assert mx.array_equal(got[b], lone)
    assert not mx.array_equal(got, logits)
    plain = logits[1:2]
    assert Decoder.controlled(requests[1:2], plain, proposals[1:2]) is plain  # no controls: untouched


# ---------------------------------------------------------------------------
# A greedy verify loop with processors: token-identical to mlx-lm's decode,
# and the logprobs mlx-lm reports


def speculate(model, prompt, processors, reference, max_tokens, block, all_rows_committed_history=False):
    """A greedy verify loop as the decode loop runs one (full forwards of the
    tiny target: the processors are under test, not the caches). Proposals
    come from ``reference`` with one wrong token at a slot that moves every
    cycle (none every ``block``-th cycle), so every acceptance length
    happens. ``all_rows_committed_history``: the bug this module prevents
    (every row processed with the committed history alone)."""
    seq = list(prompt)
    processed = processors.block(model(mx.array([seq]))[0, -1:])
    out, lps = [mx.argmax(processed[0]).item()], [logprobs(processed)[0]]
    processors.commit(out[-1:])
    cycle = 0
    while len(out) < max_tokens:
        proposal = list(reference[len(out) : len(out) + block - 1])
        if cycle % block < len(proposal):
            proposal[cycle % block] = (proposal[cycle % block] + 1) % 256
        logits = model(mx.array([seq + out + proposal]))[0, len(seq) + len(out) - 1 :]
        if all_rows_committed_history:
            processed = mx.concatenate([processors.block(logits[i : i + 1]) for i in range(len(proposal) + 1)])
        else:
            processed = processors.block(logits, proposal)
        accepted, bonus = accept_greedy(mx.array(proposal, dtype=mx.int32), mx.argmax(processed, axis=-1))
        new = (proposal[: accepted.item()] + [bonus.item()])[: max_tokens - len(out)]
        processors.commit(new)  # the committed tokens, the next anchor last
        lps.extend(logprobs(processed)[: len(new)])
        out += new
        cycle += 1
    return out, mx.stack(lps)


CONTROLS = PROCESSOR_SETTINGS[:3] + [
    dict(logit_bias={17: 3.0, 99: -2.0, 200: 4.0}),
    dict(logit_bias={17: 2.0}, repetition_penalty=1.4, repetition_context_size=5, presence_penalty=0.5, frequency_penalty=0.4),
    "custom",
]


@pytest.mark.parametrize("block", [1, 4, 8])
@pytest.mark.parametrize("control", CONTROLS, ids=str)
def test_greedy_with_processors_is_mlx_lms_decode(qwen3_pair, control, block):
    pair, prompt, n = qwen3_pair, prompt_of(20), 40
    make = (lambda: [penalise_last]) if control == "custom" else (lambda: make_logits_processors(**control))
    ref, ref_lps = pair.reference_steps(prompt, n, logits_processors=make())
    assert ref != pair.reference(prompt, n)  # the control changes the output
    processors = Processors(make(), prompt) if control == "custom" else from_settings(prompt, pair.vocab, **control)
    got, lps = speculate(pair.model, prompt, processors, ref, n, block)
    assert got == ref
    assert mx.abs(lps - ref_lps).max().item() < 1e-4
    if block > 1 and control != CONTROLS[3]:  # the check can fail: the rows' own histories matter (a bias reads none)
        wrong, wrong_lps = speculate(pair.model, prompt, Processors(make(), prompt), ref, n, block, all_rows_committed_history=True)
        assert wrong != ref or mx.abs(wrong_lps - ref_lps).max().item() > 1e-2


def speculate_trees(pair, prompt, processors, reference, max_tokens, as_chain=False):
    """A greedy loop of tree verifies on the tiny target's own cache: two
    candidates per slot (the reference's token first or second, by a
    pattern that moves every cycle), the target's processed argmax walked.
    ``as_chain``: the bug this module prevents (tree rows processed as if
    they were one chain)."""
    target = adapter_for(pair.model)
    cache = target.make_cache()
    target.forward(mx.array([prompt[:-1]]), cache, record=False)
    out, lps, anchor, cycle, branched = [], [], prompt[-1], 0, 0
    while len(out) < max_tokens:
        truth = (reference[len(out) :] + [0] * 4)[:4]
        ids = [[t, (t + 1 + j) % 256][:: 1 if (cycle + j) % 3 else -1] for j, t in enumerate(truth)]
        tree = build_tree(anchor, np.array(ids), np.array([[-0.1, -2.0]] * 4), 9)
        logits, _ = target.forward(mx.array([tree.tokens]), cache, tree=tree)
        if as_chain:
            processed = processors.block(logits[0], tree.tokens[1:])
        else:
            processed = processors.tree(logits[0], tree.tokens, tree.parents)
        path, token = tree.walk(mx.argmax(processed, axis=-1).tolist())
        branched += any(tree.ranks[r] for r in path)  # a walk off the best chain
        target.rollback(cache, path)
        new = ([tree.tokens[r] for r in path[1:]] + [token])[: max_tokens - len(out)]
        processors.commit(new)
        lps.extend(logprobs(processed)[mx.array(path[: len(new)])])
        out, anchor, cycle = out + new, new[-1], cycle + 1
    return out, mx.stack(lps), branched


@pytest.mark.parametrize("control", [CONTROLS[0], CONTROLS[2], CONTROLS[4]], ids=str)
def test_tree_verifies_with_processors_are_mlx_lms_decode(qwen3_pair, control):
    pair, prompt, n = qwen3_pair, prompt_of(20), 40
    ref, ref_lps = pair.reference_steps(prompt, n, logits_processors=make_logits_processors(**control))
    got, lps, branched = speculate_trees(pair, prompt, from_settings(prompt, pair.vocab, **control), ref, n)
    assert got == ref and branched
    assert mx.abs(lps - ref_lps).max().item() < 1e-4
    wrong, wrong_lps, _ = speculate_trees(pair, prompt, from_settings(prompt, **control), ref, n, as_chain=True)
    assert wrong != ref or mx.abs(wrong_lps - ref_lps).max().item() > 1e-2


# ---------------------------------------------------------------------------
# Sampled: a verified block with processors and XTC has the target's joint


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return small_pair(tmp_path_factory.mktemp("small_controls"), tiny.QWEN3)


PENALISED = dict(logit_bias={3: 1.0}, repetition_penalty=1.6, repetition_context_size=4, presence_penalty=0.3, frequency_penalty=0.7)
SAMPLED = dict(temperature=1.0, top_p=0.95, xtc_probability=0.5, xtc_threshold=0.1)


def exact_rows(logits, depth):
    """mlx-lm's processors on the target's logits after PROMPT + ANCHOR + every
    continuation of ``depth`` tokens, each with its own history, as probabilities."""
    rows = []
    for k, cont in enumerate(itertools.product(range(V), repeat=depth)):
        row = logits[k : k + 1]
        for f in make_logits_processors(**PENALISED):
            row = f(mx.array(PROMPT + [ANCHOR, *cont]), row)
        rows.append(row)
    return np.array(processed_probs(mx.concatenate(rows), **SAMPLED), dtype=np.float64)


def block_tables(logits, own_histories=True):
    """``[V, V, 3, V]``: the processed probabilities of the verify of
    [ANCHOR, d1, d2] for every d1, d2, through Processors.block (or, not
    ``own_histories``, every row with the committed history alone: a bug)."""
    processors = from_settings(PROMPT + [ANCHOR], V, **PENALISED)
    out = []
    for d1, d2 in itertools.product(range(V), repeat=2):
        block = mx.stack([logits[0][0], logits[1][d1], logits[2][d1 * V + d2]])
        if own_histories:
            processed = processors.block(block, [d1, d2])
        else:
            processed = mx.concatenate([processors.block(block[i : i + 1]) for i in range(3)])
        out.append(processed_probs(processed, **SAMPLED))
    return mx.stack(out).reshape(V, V, 3, V)


def first_cycle(tables, exact, q, n):
    """n independent first cycles: d1, d2 from ``q`` (no processors, no XTC:
    any drafter), accepted against ``tables``; the joint of the first three
    tokens completed from the exact rows where a cycle commits fewer."""
    d1, d2 = sample(mx.broadcast_to(q, (n, V))), sample(mx.broadcast_to(q, (n, V)))
    accepted, nxt = speculative_accept(mx.stack([d1, d2], axis=1), tables[d1, d2], mx.broadcast_to(q, (n, 2, V)))
    p2, p3 = (mx.array(e, dtype=mx.float32) for e in exact[1:])
    x1 = mx.where(accepted >= 1, d1, nxt)
    x2 = mx.where(accepted >= 2, d2, mx.where(accepted == 1, nxt, sample(p2[x1])))
    x3 = mx.where(accepted >= 2, nxt, sample(p3[x1 * V + x2]))
    return np.array((x1 * V + x2) * V + x3), np.array(accepted)


def test_sampled_block_with_processors_and_xtc_has_the_target_joint(small):
    logits = [continuation_logits(small.model, d) for d in range(3)]
    exact = [exact_rows(t, d) for d, t in enumerate(logits)]
    joint = (exact[0].reshape(V, 1, 1) * exact[1].reshape(V, V, 1) * exact[2].reshape(V, V, V)).reshape(-1)
    q = processed_probs(logits[0][0] + draft_noise(), 1.0)
    n = 100_000
    mx.random.seed(3)
    cells, accepted = first_cycle(block_tables(logits), exact, q, n)
    assert tv(cells, joint) < tv_bound(joint, n)
    assert set(np.unique(accepted)) == {0, 1, 2}
    mx.random.seed(3)  # the check can fail: rows processed with the committed history alone
    cells, _ = first_cycle(block_tables(logits, own_histories=False), exact, q, n)
    assert tv(cells, joint) > tv_bound(joint, n)


# ---------------------------------------------------------------------------
# XTC: the explicit mixture is what make_sampler samples


def test_xtc_filter_is_mlx_lms():
    """Where XTC applies (mlx-lm's apply_xtc with probability 1), it removes
    what xtc_removed says, thresholds that remove nothing and everything
    but one included, after top-p's -inf too."""
    base = mx.random.normal((3, V), key=mx.random.key(2)) * 2
    lp = base - mx.logsumexp(base, axis=-1, keepdims=True)
    removed_any = False
    for x in (lp, apply_top_p(lp, 0.8)):
        for threshold in (0.0, 0.05, 0.1, 0.3, 0.5):
            for special in (None, [int(mx.argmax(x[0]).item()), 3]):
                removed = xtc_removed(x, threshold, special)
                want = apply_xtc(x, 1.0, threshold, special or [])
                assert mx.array_equal(mx.where(removed, -mx.inf, x), want)
                removed_any |= bool(removed.any().item())
    assert removed_any


XTC_SETTINGS = [
    dict(temperature=0.8, top_p=0.9, xtc_probability=0.7, xtc_threshold=0.05),
    dict(temperature=1.2, min_p=0.1, min_tokens_to_keep=3, xtc_probability=0.5, xtc_threshold=0.08),
    dict(temperature=1.0, top_k=5, xtc_probability=0.6, xtc_threshold=0.05),
    dict(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05, xtc_special_tokens=[0]),
]


@pytest.mark.parametrize("setting", XTC_SETTINGS, ids=str)
def test_xtc_distribution_is_what_make_sampler_samples(setting):
    """make_sampler draws XTC's coin once per call, so each draw is its own call."""
    logits = mx.random.normal((V,), key=mx.random.key(0)) * 2.0
    exact = np.array(processed_probs(logits, **setting), dtype=np.float64)
    n = 20_000
    plain = {k: v for k, v in setting.items() if not k.startswith("xtc")}
    assert 0.5 * np.abs(exact - np.array(processed_probs(logits, **plain))).sum() > 2 * tv_bound(exact, n)  # XTC changes it
    lp = (logits - mx.logsumexp(logits))[None]
    kw = {k: v for k, v in setting.items() if k != "temperature"}
    sampler = make_sampler(setting["temperature"], **kw)
    mx.random.seed(1)
    drawn = []
    for _ in range(0, n, 2000):
        part = mx.concatenate([sampler(lp) for _ in range(2000)])
        mx.eval(part)
        drawn.append(np.array(part))
    drawn = np.concatenate(drawn)
    assert (exact[drawn] > 0).all()
    assert tv(drawn, exact) < tv_bound(exact, n)


def test_xtc_off_and_special_tokens():
    logits = mx.random.normal((V,), key=mx.random.key(0)) * 2.0
    off = processed_probs(logits, 1.0, xtc_probability=0.0, xtc_threshold=0.05)
    assert mx.array_equal(off, processed_probs(logits, 1.0))
    top = int(mx.argmax(logits).item())
    kept = processed_probs(logits, 1.0, xtc_probability=1.0, xtc_threshold=0.05, xtc_special_tokens=[top])
    dropped = processed_probs(logits, 1.0, xtc_probability=1.0, xtc_threshold=0.05)
    assert kept[top].item() > 0 and dropped[top].item() == 0


# ---------------------------------------------------------------------------
# Settings checks: one clear error before any work


@pytest.mark.parametrize(
    "check, kwargs, says",
    [
        (check_processor_settings, dict(repetition_context_size=0), "repetition_context_size must be a positive integer, got 0; pass 1 or more tokens (mlx-lm's default is 20)"),
        (check_processor_settings, dict(presence_context_size=-3), "presence_context_size must be a positive integer"),
        (check_processor_settings, dict(frequency_context_size=2.5), "frequency_context_size must be a positive integer"),
        (check_processor_settings, dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number in [0.0"),
        (check_processor_settings, dict(presence_penalty=float("nan")), "presence_penalty must be a finite number"),
        (check_processor_settings, dict(vocab_size=V, logit_bias={V: 1.0}), "outside the vocabulary (0..15)"),
        (check_processor_settings, dict(logit_bias={-1: 1.0}), "not a non-negative integer"),
        (check_processor_settings, dict(logit_bias={"7": 1.0}), "not a non-negative integer"),
        (check_processor_settings, dict(logit_bias={3: "high"}), "logit_bias[3] must be a finite number"),
        (check_processor_settings, dict(repetition_size=5), "unknown logits processor setting"),
        (check_sampling, dict(xtc_probability=1.5), "xtc_probability must be a finite number in [0.0, 1.0]"),
        (check_sampling, dict(xtc_threshold=0.7), "xtc_threshold must be a finite number in [0.0, 0.5]"),
        (check_sampling, dict(vocab_size=V, xtc_special_tokens=[V + 2]), "outside the vocabulary"),
        (check_sampling, dict(min_tokens_to_keep=0), "min_tokens_to_keep must be a positive integer"),
    ],
)
def test_bad_settings_get_one_clear_error(check, kwargs, says):
    with pytest.raises(ArgumentError) as err:
        check(**kwargs)
    assert says in str(err.value)


def test_good_settings_pass_and_build():
    check_sampling(V, xtc_probability=0.5, xtc_threshold=0.5, xtc_special_tokens=[0, V - 1], min_tokens_to_keep=2)
    processors = from_settings([1], vocab_size=V, logit_bias={0: 1, V - 1: -1.5}, repetition_penalty=0.0,
                                          presence_penalty=-0.5, frequency_context_size=1)
    assert len(processors.callables[0].made) == 2  # the bias and the presence penalty, as mlx-lm makes them
    assert penalty_processors(V, repetition_penalty=None, logit_bias={}) == []  # all off: none
    with pytest.raises(ArgumentError, match="outside the vocabulary"):
        from_settings([1], vocab_size=V, logit_bias={V: 1.0})
