"""Sampling at temperature > 0 is exact: every committed token is distributed
as mlx-lm's ``make_sampler`` samples the target, whatever the drafter does.

Statistical checks are seeded (deterministic) and each has a false-failure
probability below DELTA for a fresh seed; the 14 checks of correct samplers
in this file stay below 1e-4 together (union bound). Each bound is finite-sample, not asymptotic:

* Total variation (TV) of an empirical histogram of n iid draws from a known
  distribution J: E|c_i/n - J_i| <= sqrt(J_i (1 - J_i) / n) (Jensen), so
  E[TV] <= 1/2 sum_i sqrt(J_i (1 - J_i) / n). Changing one draw moves TV by at
  most 1/n, so McDiarmid gives P(TV >= E[TV] + t) <= exp(-2 n t^2); with
  t = sqrt(ln(1/DELTA) / (2n)) a correct sampler fails with probability
  <= DELTA.
* Generated sequences (real ``stream_generate``): for each token x_t with
  target distribution p_t given its actual prefix, the randomised probability
  integral transform U_t = p_t(tokens ranked above x_t) + W_t p_t(x_t), W_t ~
  U(0, 1), is U(0, 1) given the whole past when x_t ~ p_t; so U_1..U_n are
  iid U(0, 1). The Dvoretzky-Kiefer-Wolfowitz inequality (Massart's
  constant) bounds the Kolmogorov-Smirnov distance D of their empirical CDF:
  P(D > eps) <= 2 exp(-2 n eps^2), eps = sqrt(ln(2/DELTA) / (2n)). Ranking
  tokens by p makes a sampler that favours unlikely tokens push U upward.

Power: the same checks must reject deliberately broken acceptance rules.
"""

import importlib
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler
from tiny import (
    ANCHOR, PROMPT, TRUNCATED, V, DoubleDrafter, EchoDFlash2, continuation_logits, draft_noise, generated_tokens,
    pit_check, small_pair, reference_tokens, sampled_runs, tv, tv_bound,
)

import dflash_mlx
import dflash_mlx.tree
import tiny
from dflash_mlx.benchmark import tokens_per_cycle_by_rule
from dflash_mlx.models.dflash import DFlashConfig, masked_block
from dflash_mlx.sampling import processed_probs, sample, speculative_accept

SETTINGS = [dict(temperature=1.0), TRUNCATED, dict(temperature=0.7, min_p=0.05)]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return small_pair(tmp_path_factory.mktemp("small_qwen3"), tiny.QWEN3)


# ---------------------------------------------------------------------------
# processed_probs is what make_sampler samples


def test_processed_probs_filter_rules():
    logits = mx.log(mx.array([0.5, 0.3, 0.15, 0.05]))
    support = lambda **kw: (np.array(processed_probs(logits, 1.0, **kw)) > 0).tolist()  # noqa: E731
    # top-p keeps the most likely tokens until their mass reaches top_p
    assert support(top_p=0.75) == [True, True, False, False]
    assert support(top_p=0.85) == [True, True, True, False]
    # min-p is relative to the most likely token (0.5 * 0.5 = 0.25 here)
    assert support(min_p=0.5) == [True, True, False, False]
    assert support(top_k=1) == [True, False, False, False]
    # the temperature reshapes only what survives
    probs = processed_probs(logits, 0.5, top_k=2)
    assert np.allclose(np.array(probs), [0.25 / 0.34, 0.09 / 0.34, 0, 0], atol=1e-6)


@pytest.mark.parametrize("setting", SETTINGS + [dict(temperature=1.3, top_p=0.7, min_p=0.1, top_k=5)])
def test_processed_probs_is_what_make_sampler_samples(setting):
    logits = mx.random.normal((V,), key=mx.random.key(0)) * 2.0
    exact = np.array(processed_probs(logits, **setting), dtype=np.float64)
    n = 40_000
    logprobs = mx.broadcast_to(logits - mx.logsumexp(logits), (n, V))
    mx.random.seed(1)
    sampler = make_sampler(
        setting["temperature"],
        top_p=setting.get("top_p", 0.0),
        min_p=setting.get("min_p", 0.0),
        top_k=setting.get("top_k", 0),
    )
    drawn = np.array(sampler(logprobs))
    assert (exact[drawn] > 0).all()  # never outside the processed support
    assert tv(drawn, exact) < tv_bound(exact, n)


# ---------------------------------------------------------------------------
# The acceptance rule, vectorised over many independent first cycles


def accept_with_prob_p(tokens, p, q, key=None):
    """Broken: accepts x with probability p(x), not min(1, p(x)/q(x))."""
    return _broken(tokens, p, q, lambda p_x, q_x, u: u < p_x, residual=True)


def accept_always(tokens, p, q, key=None):
    """Broken: trusts the drafter."""
    return _broken(tokens, p, q, lambda p_x, q_x, u: u <= 1, residual=True)


def resample_from_p(tokens, p, q, key=None):
    """Broken: right acceptance test, but the rejected slot redrawn from p."""
    return _broken(tokens, p, q, lambda p_x, q_x, u: u * q_x < p_x, residual=False)


def _broken(tokens, p, q, keep_rule, residual):
    n = tokens.shape[-1]
    idx = tokens[..., None]
    p_x = mx.take_along_axis(p[..., :n, :], idx, axis=-1)[..., 0]
    q_x = mx.take_along_axis(q, idx, axis=-1)[..., 0]
    keep = keep_rule(p_x, q_x, mx.random.uniform(shape=p_x.shape))
    accepted = mx.cumprod(keep.astype(mx.int32), axis=-1).sum(axis=-1)
    at = accepted[..., None, None]
    row = mx.take_along_axis(p, at, axis=-2)[..., 0, :]
    if residual:
        q_row = mx.take_along_axis(mx.concatenate([q, mx.zeros_like(p[..., :1, :])], -2), at, axis=-2)
        row = mx.maximum(row - q_row[..., 0, :], 0) + 1e-30  # never an all-zero row
    return accepted, sample(row)


@pytest.fixture(scope="module")
def tables(small):
    """Exact target logits for 0..2 tokens after the anchor, and the random
    drafter's logits for the block [ANCHOR, MASK, MASK] (prompt as context)."""
    logits = [continuation_logits(small.model, d) for d in range(3)]
    target = small.draft.target
    _, taps = target.forward(mx.array([PROMPT]), target.make_cache(), last_logits_only=True, record=False)
    block = masked_block(small.draft, ANCHOR, 3)
    draft_logits = small.draft(block, taps, small.draft.make_cache())[0, 1:]  # [2, V]
    noise = draft_noise()
    mx.eval(logits, draft_logits, noise)
    return SimpleNamespace(logits=logits, draft_logits=draft_logits, noise=noise)


def simulate_first_cycle(tables, drafter, accept_fn, n, setting):
    """n independent first cycles of stream_generate with block size 3.

    The cycle drafts d1, d2 from q and verifies them against the target's p
    after the anchor, after d1 and after d1 d2. It commits 1..3 tokens; the
    joint of the first three (x1, x2, x3) is completed, when the cycle
    commits fewer, with later tokens drawn from p (what an exact next cycle
    gives). So every path is checked: rejection at slot 1 or 2 (residual
    draw) and a fully accepted block (bonus from the last p row).
    ``drafter`` "random" is the DFlash drafter (q far from p); "double"
    proposes autoregressively from p's own logits plus fixed noise (q close
    to p, so whole blocks get accepted).
    Returns (cell index x1*V*V + x2*V + x3, accepted counts).
    """
    p1, p2, p3 = (processed_probs(t, **setting) for t in tables.logits)  # [1|V|V*V, V]
    if drafter == "random":
        q_rand = processed_probs(tables.draft_logits, **setting)
        q1, q2_of = mx.broadcast_to(q_rand[0], (n, V)), lambda d1: mx.broadcast_to(q_rand[1], (n, V))
    else:
        q_dbl = [processed_probs(t + tables.noise, **setting) for t in tables.logits]
        q1, q2_of = mx.broadcast_to(q_dbl[0], (n, V)), lambda d1: q_dbl[1][d1]
    d1 = sample(q1)
    q2 = q2_of(d1)
    d2 = sample(q2)
    p = mx.stack([mx.broadcast_to(p1, (n, V)), p2[d1], p3[d1 * V + d2]], axis=1)
    accepted, nxt = accept_fn(mx.stack([d1, d2], axis=1), p, mx.stack([q1, q2], axis=1))
    x1 = mx.where(accepted >= 1, d1, nxt)
    x2 = mx.where(accepted >= 2, d2, mx.where(accepted == 1, nxt, sample(p2[x1])))
    x3 = mx.where(accepted >= 2, nxt, sample(p3[x1 * V + x2]))
    return np.array((x1 * V + x2) * V + x3), np.array(accepted)


def exact_joint(tables, setting) -> np.ndarray:
    p1, p2, p3 = (np.array(processed_probs(t, **setting), dtype=np.float64) for t in tables.logits)
    return (p1.reshape(V, 1, 1) * p2.reshape(V, V, 1) * p3.reshape(V, V, V)).reshape(-1)


N_SIM = 100_000


@pytest.mark.parametrize("drafter", ["random", "double"])
@pytest.mark.parametrize("setting", SETTINGS[:2], ids=["plain", "top_p+top_k"])
def test_first_tokens_have_the_target_joint_distribution(tables, drafter, setting):
    mx.random.seed(11)
    exact = exact_joint(tables, setting)
    cells, accepted = simulate_first_cycle(tables, drafter, speculative_accept, N_SIM, setting)
    assert tv(cells, exact) < tv_bound(exact, N_SIM)
    # every path ran; the random drafter mostly rejects, the double mostly accepts
    assert set(np.unique(accepted)) == {0, 1, 2}
    if drafter == "random":
        assert (accepted == 0).mean() > 0.3
    else:
        assert (accepted == 2).mean() > 0.3


@pytest.mark.parametrize("broken", [accept_with_prob_p, accept_always, resample_from_p])
@pytest.mark.parametrize("setting", SETTINGS[:2], ids=["plain", "top_p+top_k"])
def test_the_joint_check_rejects_broken_rules(tables, broken, setting):
    mx.random.seed(11)
    exact = exact_joint(tables, setting)
    cells, _ = simulate_first_cycle(tables, "random", broken, N_SIM, setting)
    assert tv(cells, exact) > tv_bound(exact, N_SIM)


def test_accept_edge_cases():
    p = mx.softmax(mx.random.normal((3, V), key=mx.random.key(2)), axis=-1)
    tokens = mx.array([[2, 9]] * 1000)
    # q == p: nothing is ever rejected
    accepted, _ = speculative_accept(tokens, mx.broadcast_to(p, (1000, 3, V)), mx.broadcast_to(p[:2], (1000, 2, V)))
    assert (np.array(accepted) == 2).all()
    # q all on a token p forbids: always rejected, and never resampled
    p_no2 = mx.where(mx.arange(V) == 2, 0.0, p)
    q = mx.broadcast_to((mx.arange(V) == 2).astype(mx.float32), (1000, 2, V))
    accepted, nxt = speculative_accept(tokens, mx.broadcast_to(p_no2, (1000, 3, V)), q)
    assert (np.array(accepted) == 0).all() and (np.array(nxt) != 2).all()
    # an empty block draws the bonus from p
    accepted, nxt = speculative_accept(mx.zeros((0,), mx.int32), p[:1], mx.zeros((0, V)))
    assert accepted.item() == 0 and 0 <= nxt.item() < V


# ---------------------------------------------------------------------------
# The real loop: stream_generate end to end


@pytest.mark.parametrize(
    "drafter, acceptance, setting, runs",
    [
        ("random", "speculative", TRUNCATED, 5),
        ("double", "speculative", SETTINGS[2], 4),
        ("double", "exact-match", dict(temperature=1.0, top_p=0.95), 3),
    ],
)
def test_stream_generate_samples_the_target(small, tables, drafter, acceptance, setting, runs):
    draft = small.draft if drafter == "random" else DoubleDrafter(PROMPT, tables.noise)
    only = {} if drafter == "random" else dict(copy_drafts=False)  # (a double follows its own blocks only)
    tokens, accepted = sampled_runs(small, draft, runs, setting, acceptance=acceptance, block_size=4, **only)
    ks, bound, outside = pit_check(small.model, tokens, setting, np.random.default_rng(0))
    assert outside == 0 and ks < bound
    assert min(accepted) == 0 and max(accepted) >= 2  # rejections and accepted drafts both occurred
    if drafter == "double":
        assert max(accepted) == draft.block_size - 1


def test_hybrid_target_samples_the_target(tmp_path):
    """Qwen3.5: rejections roll GatedDeltaNet state back mid-block."""
    hybrid = small_pair(tmp_path, tiny.QWEN3_5)
    draft = DoubleDrafter(PROMPT, draft_noise())
    tokens, accepted = sampled_runs(hybrid, draft, 2, TRUNCATED, block_size=4, copy_drafts=False)
    ks, bound, outside = pit_check(hybrid.model, tokens, TRUNCATED, np.random.default_rng(0))
    assert outside == 0 and ks < bound
    assert len(set(accepted)) == draft.block_size  # every acceptance length 0..3


def test_sampling_stays_exact_when_the_block_changes(small):
    """Scripted block changes, plain cycles included, then the default
    (timing-driven) choice: whatever is chosen, the target's distribution."""
    sizer = tiny.ScriptedSizer([4, 1, 2, 3, 1, 1, 4], max_block=4)
    tokens, accepted = sampled_runs(small, small.draft, 5, TRUNCATED, sizer=sizer)
    ks, bound, outside = pit_check(small.model, tokens, TRUNCATED, np.random.default_rng(1))
    assert outside == 0 and ks < bound
    assert max(accepted) >= 1 and {1, 2, 3, 4} <= set(sizer.asked)
    tokens, _ = sampled_runs(small, small.draft, 4, TRUNCATED)
    ks, bound, outside = pit_check(small.model, tokens, TRUNCATED, np.random.default_rng(2))
    assert outside == 0 and ks < bound


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """The small target with its logits three times as far apart, and a
    DFlash2 drafter whose candidates are its likely tokens. At T = 3 the
    target's p is spread while the untempered scores are sharp, so a q that
    misses the temperature is far from the distribution the walk samples."""
    pair = small_pair(tmp_path_factory.mktemp("sharp"), dict(tiny.QWEN3, tie_word_embeddings=False))
    pair.model.lm_head.weight = pair.model.lm_head.weight * 3
    cfg = tiny.dflash2_config(
        pair.base, V, block_size=4, selector_top_k=12, output_multiplier=1.0, final_logit_softcapping=0.0
    )
    pair.draft = EchoDFlash2(DFlashConfig.from_hf(cfg), PROMPT).bind(pair.model)
    return pair


@pytest.mark.parametrize("setting", [dict(temperature=3.0), dict(temperature=3.0, top_p=0.9, top_k=6)],
                         ids=["plain", "top_p+top_k"])
def test_dflash2_drafter_samples_the_target(sharp, setting):
    """DFlash2's selector walk through the real loop, at T != 1, its drafts
    mostly accepted (with q computed without the temperature this fails)."""
    tokens, accepted = sampled_runs(sharp, sharp.draft, 8, setting, block_size=4, copy_drafts=False)
    ks, bound, outside = pit_check(sharp.model, tokens, setting, np.random.default_rng(0))
    assert outside == 0 and ks < bound
    assert np.mean(accepted) > 1.5  # the candidates overlap the target's likely tokens


def test_stream_generate_check_rejects_a_broken_rule(small, monkeypatch):
    """Power through the real loop (subtler broken rules: the joint check)."""
    monkeypatch.setattr(importlib.import_module("dflash_mlx.sampling"), "speculative_accept", accept_always)
    setting = dict(temperature=1.0)  # no truncation: the PIT check alone must catch it
    tokens, _ = sampled_runs(small, small.draft, 3, setting, block_size=4)
    ks, bound, outside = pit_check(small.model, tokens, setting, np.random.default_rng(0))
    assert ks > bound


@pytest.mark.parametrize("acceptance", ["speculative", "exact-match"])
def test_seed_reproduces_a_run(small, acceptance):
    kw = dict(acceptance=acceptance, temperature=1.0, top_k=12, block_size=4)  # adaptive choices follow timing
    run = lambda seed: generated_tokens(small.model, small.draft, small.tokenizer, seed, 24, **kw)[0]  # noqa: E731
    first = run(5)
    assert run(5) == first
    assert run(6) != first


def test_greedy_is_unchanged(small):
    ref = reference_tokens(small.model, small.tokenizer, PROMPT, 30)
    for acceptance in ("speculative", "exact-match"):
        got, _ = generated_tokens(small.model, small.draft, small.tokenizer, 0, 30, acceptance=acceptance)
        assert got == ref


def test_custom_sampler_uses_exact_match(small):
    """An opaque sampler gives no p: the acceptance switch must not matter."""
    outs = [
        generated_tokens(
            small.model, small.draft, small.tokenizer, 3, 24, sampler=make_sampler(0.9), acceptance=rule, block_size=4
        )[0]
        for rule in ("speculative", "exact-match")
    ]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_custom_sampler_decides_every_token(small, temperature):
    """A sampler that always returns one token: every committed token is
    that token, whatever the temperature, as with mlx-lm's own decode."""
    def always_nine(logprobs):
        return mx.full(logprobs.shape[:-1], 9, mx.int32)

    got, _ = generated_tokens(small.model, small.draft, small.tokenizer, 0, 20, sampler=always_nine,
                              temperature=temperature)
    assert got == [9] * 20
    assert reference_tokens(small.model, small.tokenizer, PROMPT, 20, sampler=always_nine) == got


def test_unknown_acceptance_rule(small):
    with pytest.raises(ValueError, match="acceptance"):
        next(dflash_mlx.stream_generate(small.model, small.draft, small.tokenizer, PROMPT, acceptance="greedy"))


def test_tokens_per_cycle_hook(small):
    prompts = [PROMPT, [2, 4, 6]]
    got = tokens_per_cycle_by_rule(small.model, small.draft, small.tokenizer, prompts, max_tokens=20)
    assert set(got) == {"speculative", "exact-match"}
    assert all(1.0 <= v <= small.draft.block_size for v in got.values())


# ---------------------------------------------------------------------------
# Draft trees: the target samples every row, the walk follows its samples


def tree_runs(pair, setting, budget, runs, **kw):
    """Seeded sampled generations with a draft tree every cycle, from a
    drafter whose candidates are the target's likely tokens; the tokens of
    each and the accepted count of every cycle."""
    drafter = tiny.TreeDoubleDrafter(PROMPT, draft_noise())
    out, accepted = [], []
    for seed in range(runs):
        cache = drafter.follow(dflash_mlx.make_prompt_cache(pair.model, drafter))
        tokens, rs = generated_tokens(pair.model, drafter, pair.tokenizer, seed, tiny.REAL_TOKENS, prompt_cache=cache,
                                      tree_budget=budget, block_size=4, copy_drafts=False, **setting, **kw)
        out.append(tokens)
        accepted += [r.accepted for r in rs[1:]]
    return out, accepted


@pytest.mark.parametrize("setting, budget", [(dict(temperature=1.0), 8), (TRUNCATED, 16)], ids=["T1", "top_p+top_k"])
def test_trees_sample_the_target(small, setting, budget):
    tokens, accepted = tree_runs(small, setting, budget, 3)
    ks, bound, outside = pit_check(small.model, tokens, setting, np.random.default_rng(3))
    assert outside == 0 and ks < bound
    assert min(accepted) == 0 and max(accepted) >= 2  # walks that stop at once and walks that go deep
    assert np.mean(accepted) > 0.75  # drafted tokens are most of what is committed: the check has power


def test_the_tree_check_rejects_a_walk_that_ignores_the_target(small, monkeypatch):
    """Power through the real loop: a walk that always takes a row's first
    child commits the drafter's tokens, not the target's samples."""
    def first_child(tree, choices):
        path = [0]
        while any(p == path[-1] for p in tree.parents):
            path.append(tree.parents.index(path[-1]))
        return path, int(choices[path[-1]])

    monkeypatch.setattr(dflash_mlx.tree.DraftTree, "walk", first_child)
    tokens, _ = tree_runs(small, dict(temperature=1.0), 8, 2)
    ks, bound, _ = pit_check(small.model, tokens, dict(temperature=1.0), np.random.default_rng(0))
    assert ks > bound


def test_seed_reproduces_a_tree_run(small):
    kw = dict(temperature=1.0, top_k=12, block_size=4, tree_budget=8)
    run = lambda seed: generated_tokens(small.model, small.draft, small.tokenizer, seed, 24, **kw)[0]  # noqa: E731
    first = run(5)
    assert run(5) == first
    assert run(6) != first


def test_custom_sampler_decides_every_tree_row(small):
    def always_nine(logprobs):
        return mx.full(logprobs.shape[:-1], 9, mx.int32)

    got, _ = generated_tokens(small.model, small.draft, small.tokenizer, 0, 20, sampler=always_nine, tree_budget=8)
    assert got == [9] * 20
