"""Exact speculative sampling at temperature > 0 (Leviathan et al., arXiv
2211.17192; Chen et al., arXiv 2302.01318).

Rejection sampling needs the target's and the drafter's *processed*
distributions as explicit vectors, not just a sampled token, so
:func:`processed_probs` re-expresses mlx-lm's ``make_sampler`` chain
(top-p, then min-p, then top-k on the log-probabilities, then the
temperature) as probabilities. It calls mlx-lm's own filters, so sampling
from it is sampling what ``make_sampler`` samples, rule for rule.

:func:`speculative_accept` is the verification rule: a drafted token ``x``
survives with probability ``min(1, p(x) / q(x))``; at the first rejection the
replacement comes from ``normalize(max(0, p - q))``; after a fully accepted
block the bonus comes from ``p`` at the last slot. A token copied from the
context is a draft with a point-mass ``q`` (:func:`accept_point_mass`). Every committed token is
then distributed exactly as the target samples it. All randomness is drawn
from ``mx.random``, so ``mx.random.seed(n)`` reproduces a run.
"""

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
) -> mx.array:
    """The distribution ``make_sampler(temperature, top_p, min_p, top_k=top_k)``
    samples from, as float32 probabilities ``[..., V]``.

    Same rules as mlx-lm: the filters see the untempered log-probabilities in
    make_sampler's order, ``0 < top_p < 1`` and ``top_k > 0`` enable theirs,
    min-p is relative to the most likely token (keeping at least one), and
    the temperature divides what survives.
    """
    if temperature <= 0:
        raise ArgumentError("processed_probs needs temperature > 0 (temperature 0 is argmax)")
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p != 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    return mx.softmax(logprobs / temperature, axis=-1)


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


@dataclass
class AcceptanceRule:
    """How a request accepts a verified block: greedy, rejection sampling
    or exact match of the target's samples (see
    :func:`~dflash_mlx.generate.generate_step`)."""

    sampler: Optional[Callable[[mx.array], mx.array]]
    settings: Optional[dict] = None  # processed_probs' arguments, where the sampler was made from them
    speculative: bool = False  # rejection sampling (else the target's samples are matched exactly)

    @property
    def sampling(self) -> Optional[dict]:
        """processed_probs' arguments when rejection sampling, else None."""
        return self.settings if self.speculative else None

    def choose(self, logits, key=None):
        """The target's token(s) for logits ``[..., V]``; ``key``: a request's
        own random key (None: ``mx.random``'s state, through the sampler)."""
        if self.sampler is None:
            return mx.argmax(logits, axis=-1)
        if key is None or self.settings is None:
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


def acceptance_rule(temperature, top_p, top_k, min_p, sampler, acceptance) -> AcceptanceRule:
    """A request's :class:`AcceptanceRule` from its sampling arguments."""
    if acceptance not in ACCEPTANCE_RULES:
        raise ArgumentError(f"acceptance must be one of {ACCEPTANCE_RULES}, not {acceptance!r}")
    if sampler is not None or temperature <= 0:
        return AcceptanceRule(sampler)
    settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    return AcceptanceRule(make_sampler(temperature, top_p=top_p, min_p=min_p, top_k=top_k), settings, acceptance == "speculative")


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
