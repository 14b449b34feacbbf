"""Exact speculative sampling at temperature > 0 (Leviathan et al., arXiv
2211.17192; Chen et al., arXiv 2302.01318).

Rejection sampling needs the target's and the drafter's *processed*
distributions as explicit vectors, not just a sampled token, so
:func:`processed_probs` re-expresses mlx-lm's ``make_sampler`` chain
(top-p, then min-p, then XTC, then top-k on the log-probabilities, then
the temperature) as probabilities. It calls mlx-lm's own filters, so
sampling from it is sampling what ``make_sampler`` samples, rule for rule.
XTC ("exclude top choices", proposed in text-generation-webui PR 6335, as
mlx-lm's ``apply_xtc`` draws it) is random per step: with probability
``xtc_probability`` every token above ``xtc_threshold`` but the least likely
of them is removed. Its distribution is therefore the two-part mixture
``(1 - xtc_probability) * plain + xtc_probability * filtered``, written out
exactly so the acceptance rule can use it. mlx-lm's sampler draws that coin
once per call, so rows sampled by one call of it share one coin where plain
decoding flips one per token: a verify's rows are drawn from
:func:`processed_probs`, one independent draw per row (:func:`sample`).

:func:`speculative_accept` is the verification rule: a drafted token ``x``
survives with probability ``min(1, p(x) / q(x))``; at the first rejection the
replacement comes from ``normalize(max(0, p - q))``; after a fully accepted
block the bonus comes from ``p`` at the last slot. A token copied from the
context is a draft with a point-mass ``q`` (:func:`accept_point_mass`). Every committed token is
then distributed exactly as the target samples it. All randomness is drawn
from ``mx.random``, so ``mx.random.seed(n)`` reproduces a run.
"""

import math
import numbers
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from .errors import ArgumentError
from .ops.threads import compiled

ACCEPTANCE_RULES = ("speculative", "exact-match")


def processed_probs(
    logits: mx.array,
    temperature: float,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[Sequence[int]] = None,
) -> mx.array:
    """The distribution ``make_sampler(temperature, top_p, min_p,
    min_tokens_to_keep, top_k, xtc_probability, xtc_threshold,
    xtc_special_tokens)`` samples from, as float32 probabilities ``[..., V]``.

    Same rules as mlx-lm: the filters see the untempered log-probabilities in
    make_sampler's order, ``0 < top_p < 1`` and ``top_k > 0`` enable theirs,
    min-p is relative to the most likely token (keeping at least
    ``min_tokens_to_keep``), XTC (``xtc_probability > 0``) sees what top-p and
    min-p kept and top-k sees what XTC kept, and the temperature divides what
    survives. Under XTC the result is the mixture of the step with and
    without XTC's filter (see the module docstring).
    """
    if temperature <= 0:
        raise ArgumentError("processed_probs needs temperature > 0 (temperature 0 is argmax)")
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p != 0.0:
        logprobs = apply_min_p(logprobs, min_p, min_tokens_to_keep)

    def rest(x):  # top-k and the temperature
        x = apply_top_k(x, top_k) if top_k > 0 else x
        return mx.softmax(x / temperature, axis=-1)

    plain = rest(logprobs)
    if xtc_probability <= 0.0:
        return plain
    removed = xtc_removed(logprobs, xtc_threshold, xtc_special_tokens)
    filtered = rest(mx.where(removed, -mx.inf, logprobs))
    return (1.0 - xtc_probability) * plain + xtc_probability * filtered


def xtc_removed(logprobs: mx.array, threshold: float, special_tokens: Optional[Sequence[int]] = None) -> mx.array:
    """XTC's filter, where it applies: which tokens of ``logprobs [..., V]``
    (bool) it removes. Every token whose probability (renormalised over what
    earlier filters kept) exceeds ``threshold`` is removed, except the least
    likely of those, and the ``special_tokens``, which it never removes;
    nothing is removed where no token exceeds it."""
    probs = mx.softmax(logprobs, axis=-1)
    least_above = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    removed = probs > least_above
    if special_tokens:
        removed[..., mx.array(list(special_tokens))] = False
    return removed


def sample(probs: mx.array, key=None) -> mx.array:
    """One token per row of ``probs [..., V]`` (unnormalized is fine);
    ``key``: a request's own random key (None: ``mx.random``'s state)."""
    return mx.random.categorical(mx.log(probs), key=key)


def speculative_accept(
    draft_tokens: mx.array, p: mx.array, q: mx.array, key=None
) -> Tuple[mx.array, mx.array]:
    """Rejection-sample a drafted block against the target.

    Args:
        draft_tokens: ``[..., n]`` tokens sampled from ``q``.
        p: ``[..., n + 1, V]`` target distribution at every verified slot
            (row ``i`` is the target's choice for draft slot ``i``; row ``n``
            is the bonus slot).
        q: ``[..., m, V]``, ``m <= n``: the drafter distribution the first
            ``m`` tokens were drawn from; the tokens after them were
            proposed with certainty (a copied span, a point mass each),
            with no ``[n - m, V]`` one-hot rows built for them.

        key: a request's own random key (None: ``mx.random``'s state).

    Returns:
        ``(accepted, next_token)``, each ``[...]``: the accepted prefix length
        and the token committed after it (the residual sample at the first
        rejection, or the bonus from ``p[n]``).
    """
    n, m = draft_tokens.shape[-1], q.shape[-2]
    idx = draft_tokens.astype(mx.int32)[..., None]
    p_x = mx.take_along_axis(p[..., :n, :], idx, axis=-1)[..., 0]
    q_x = mx.take_along_axis(q, idx[..., :m, :], axis=-1)[..., 0]
    q_x = mx.concatenate([q_x, mx.ones_like(p_x[..., m:])], axis=-1)
    # u < p/q, written without dividing (q_x > 0 for a token sampled from q).
    keys = (None, None) if key is None else mx.random.split(key)
    keep = mx.random.uniform(shape=p_x.shape, key=keys[0]) * q_x < p_x
    accepted = mx.cumprod(keep.astype(mx.int32), axis=-1).sum(axis=-1)
    # A zero q row after the last slot turns the residual rule into the bonus rule.
    q = mx.concatenate([q, mx.zeros_like(p[..., :1, :])], axis=-2)
    at = accepted[..., None, None]
    p_row = mx.take_along_axis(p, at, axis=-2)[..., 0, :]
    residual = mx.maximum(p_row - mx.take_along_axis(q, mx.minimum(at, m), axis=-2)[..., 0, :], 0.0)
    if m < n:  # a point mass rejected at slot a leaves p without the token it proposed
        proposed = mx.concatenate([draft_tokens.astype(mx.int32), mx.full(draft_tokens.shape[:-1] + (1,), -1, mx.int32)], axis=-1)
        point = mx.take_along_axis(proposed, accepted[..., None], axis=-1)
        point = mx.where((accepted >= m)[..., None], point, -1)
        residual = mx.where(mx.arange(p.shape[-1]) == point, 0.0, residual)
    # Rounding can empty the residual when p == q; p itself is then exact.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_row)
    return accepted, sample(residual, keys[1])


@compiled  # a handful of tiny ops, fused: one task instead of seven per cycle
def accept_greedy(draft_tokens: mx.array, target_tokens: mx.array) -> Tuple[mx.array, mx.array]:
    """Longest prefix where the draft equals the target's choice, and the
    target's own token at the first mismatch (or after the last slot).

    ``[..., n]`` and ``[..., n + 1]`` in, ``(accepted, next_token)`` out, on
    the device like :func:`speculative_accept`, so the loop reads the whole
    outcome in one host sync.
    """
    n = draft_tokens.shape[-1]
    same = (draft_tokens == target_tokens[..., :n]).astype(mx.int32)
    accepted = mx.cumprod(same, axis=-1).sum(axis=-1)
    return accepted, mx.take_along_axis(target_tokens, accepted[..., None], axis=-1)[..., 0]


DRAFTING = ("temperature", "top_p", "top_k", "min_p")  # what a drafter samples its block with


@dataclass
class AcceptanceRule:
    """How a request accepts a verified block: greedy, rejection sampling
    or exact match of the target's samples (see
    :func:`~dflash_mlx.generate.generate_step`)."""

    sampler: Optional[Callable[[mx.array], mx.array]]
    settings: Optional[dict] = None  # processed_probs' arguments, where the sampler was made from them
    speculative: bool = False  # rejection sampling (else the target's samples are matched exactly)

    @property
    def drafting(self) -> Optional[dict]:
        """What the drafter samples its block with when rejection sampling
        (processed_probs' temperature and truncations; any q is exact, so XTC
        and ``min_tokens_to_keep`` stay the target's), else None: it proposes greedily."""
        return {k: self.settings[k] for k in DRAFTING} if self.speculative else None

    def choose(self, logits, key=None):
        """The target's token(s) for logits ``[..., V]``, one independent draw
        per row; ``key``: a request's own random key (None: ``mx.random``'s
        state). mlx-lm's sampler flips one XTC coin per call, so under XTC
        the rows are drawn from :func:`processed_probs`, never by one call."""
        if self.sampler is None:
            return mx.argmax(logits, axis=-1)
        if self.settings is None or (key is None and not self.settings.get("xtc_probability")):
            return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        return sample(processed_probs(logits, **self.settings), key)

    def outcome(self, logits, proposal, q, key=None) -> Tuple[mx.array, mx.array]:
        """``(accepted count, the token after them)`` for one request's
        verified ``logits [n + 1, V]`` of its ``proposal [n]`` (``q``: the
        distribution its first ``m <= n`` tokens were sampled from, the rest
        copied from the context, point masses; None: proposed greedily, or
        all copied when rejection sampling)."""
        if q is None and not self.speculative:
            return accept_greedy(proposal, self.choose(logits, key))
        p = processed_probs(logits, **self.settings)
        return speculative_accept(proposal, p, p[:0] if q is None else q, key)


def acceptance_rule(temperature, top_p, top_k, min_p, sampler, acceptance, **sampler_settings) -> AcceptanceRule:
    """A request's :class:`AcceptanceRule` from its sampling arguments
    (``sampler_settings``: make_sampler's ``min_tokens_to_keep`` and XTC
    keywords, checked by :func:`dflash_mlx.controls.check_sampling`)."""
    if acceptance not in ACCEPTANCE_RULES:
        raise ArgumentError(f"acceptance must be one of {ACCEPTANCE_RULES}, not {acceptance!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
        # (a negative one decoded greedily unsaid; nan sampled junk ids)
        raise ArgumentError(f"temperature must be a finite number of at least 0 (0: greedy), got {temperature!r}")
    if sampler is not None and sampler_settings.get("xtc_probability"):
        raise ArgumentError("pass xtc_probability or a sampler, not both (a sampler makes every choice itself)")
    if sampler is not None or temperature <= 0:
        return AcceptanceRule(sampler)
    settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, **sampler_settings)
    return AcceptanceRule(make_sampler(temperature, **{k: v for k, v in settings.items() if k != "temperature"}), settings, acceptance == "speculative")


def accept_rows(
    rules: Sequence[AcceptanceRule], logits: mx.array, proposal: mx.array, qs: List, keys: List,
    lengths: Optional[List[int]] = None,
) -> mx.array:
    """A verified cycle's outcome for every row as one lazy ``[B, 2 + n]``
    int32 array, read with one host sync: per row its accepted count, the
    token after them and its ``proposal [B, n]`` (``n`` 0: a plain step).
    Greedy rows are decided together; each other row by its own rule, with
    its own key (``qs[b]``: the q its drafted tokens were sampled from, see
    :meth:`AcceptanceRule.outcome`). ``lengths[b]``: how many of row ``b``'s
    slots it proposed (None: all); the slots after them are padding, never
    accepted, and the token after its accepted ones is chosen as if they
    were not there."""
    B, n = proposal.shape
    capped = lengths is not None and any(k < n for k in lengths)
    greedy = [b for b, rule in enumerate(rules) if rule.sampler is None]
    accepted, token = [None] * B, [None] * B
    if greedy:
        idx = mx.array(greedy, dtype=mx.int32) if len(greedy) < B else None
        sub = (lambda a: a) if idx is None else (lambda a: a[idx])  # noqa: E731
        drafted = sub(proposal)
        if capped:  # a padded slot proposes no token (-1), so it is never accepted
            drafted = mx.where(mx.arange(n) < sub(mx.array(lengths))[:, None], drafted, -1)
        acc, tok = accept_greedy(drafted, mx.argmax(sub(logits), axis=-1))
        if len(greedy) == B:  # every row greedy: decided in one go
            return mx.concatenate([mx.stack([acc, tok], axis=1).astype(mx.int32), proposal], axis=1)
        for i, b in enumerate(greedy):
            accepted[b], token[b] = acc[i], tok[i]
    for b, rule in enumerate(rules):
        if rule.sampler is not None:
            k = n if lengths is None else lengths[b]
            q = qs[b] if qs[b] is None or qs[b].shape[0] <= k else qs[b][:k]
            accepted[b], token[b] = rule.outcome(logits[b, : k + 1], proposal[b, :k], q, keys[b])
    head = mx.stack([mx.stack([a.astype(mx.int32), t.astype(mx.int32)]) for a, t in zip(accepted, token)])
    return mx.concatenate([head, proposal], axis=1)


def accept_point_mass(draft_tokens: mx.array, p: mx.array, key=None) -> Tuple[mx.array, mx.array]:
    """:func:`speculative_accept` for tokens proposed with certainty (copied
    from the context): token ``x`` is kept with probability ``p(x)``; at the
    first rejection the next token is drawn from ``p`` without ``x``,
    renormalised; after a fully accepted span the bonus is drawn from the
    last row of ``p`` (shapes as there)."""
    return speculative_accept(draft_tokens, p, p[..., :0, :], key)
