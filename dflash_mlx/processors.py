"""mlx-lm's logits processors, exact through speculation: each row of a
verified block or draft tree processed with its own history, and the
logprobs mlx-lm reports. (The settings' checks: :mod:`dflash_mlx.controls`.)

mlx-lm's ``generate_step`` calls each processor as ``f(tokens, logits)``,
``tokens`` being every token fed so far (the prompt, the generated tokens,
the token whose logits these are) and ``logits`` ``[1, V]``. A verify of
``[anchor, d_1 .. d_{L-1}]`` gives logits whose row ``i`` follows ``d_i``
(row 0 the anchor), so plain decoding would have processed row ``i`` with
the history ``context + anchor + d_1 .. d_i``; in a draft tree, a row's
history is its own path. :class:`Processors` keeps one request's committed
history (ending with the anchor) and processes a block, a tree or a plain
step with each row's own history:

* any callables: one call per row and processor, exactly as mlx-lm calls
  them, so any processor that is a function of its arguments is exact (one
  that keeps state between calls, counting on one call per committed token,
  is not: rows past a rejection are processed too, and trees branch);
* the processors ``mlx_lm.sample_utils.make_logits_processors`` makes,
  held by a :class:`Penalties` (what
  :func:`dflash_mlx.controls.penalty_processors` returns): all rows at once, each row's window
  gathered from the history and the drafted tokens, then the same
  elementwise operations mlx-lm applies to one row's window, so the result
  is bit-identical.
"""

import functools
import inspect
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from .sampling import processed_probs, sample

# make_logits_processors' keywords and mlx-lm's defaults for them.
PROCESSOR_DEFAULTS = {k: p.default for k, p in inspect.signature(make_logits_processors).parameters.items()}
PENALTIES = ("repetition", "presence", "frequency")  # make_logits_processors' order, after the logit bias


def as_tokens(tokens) -> mx.array:
    """Token ids (a list, a scalar or an array, possibly lazy) as a flat int32 array."""
    if isinstance(tokens, mx.array):
        return tokens.reshape(-1).astype(mx.int32)
    return mx.array([tokens] if isinstance(tokens, (int, np.integer)) else list(tokens), dtype=mx.int32)


def logprobs(processed: mx.array) -> mx.array:
    """What mlx-lm's ``generate_step`` yields as a token's logprobs: the
    log-softmax of the logits after the processors, before the sampler,
    for every row of ``processed [..., V]``."""
    return processed - mx.logsumexp(processed, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=256)
def chain_windows(rows: int, held: int, context: int) -> mx.array:
    """:func:`windows` of a chain: row ``r`` follows the first ``r`` drafted tokens."""
    return windows([list(range(r)) for r in range(rows)], held, context)


def windows(ancestry, held: int, context: int) -> mx.array:
    """Where each row's last ``context`` history tokens are in
    ``tail + drafted`` (``tail``: the last ``held`` committed tokens, the
    anchor last; ``ancestry[r]``: the drafted tokens row ``r`` follows, in
    order), right-aligned in ``[rows, width]`` int32 (``width``: the longest
    such window), -1 where a row's history is shorter."""
    width = min(context, held + max(len(a) for a in ancestry))
    out = np.full((len(ancestry), width), -1, dtype=np.int32)
    for r, path in enumerate(ancestry):
        drafted = held + np.asarray(path[max(0, len(path) - width) :], dtype=np.int32)
        k = min(width - drafted.size, held)  # committed tokens still in the window
        out[r, width - drafted.size :] = drafted
        out[r, width - drafted.size - k : width - drafted.size] = np.arange(held - k, held)
    return mx.array(out)


def tree_ancestry(parents: Sequence[int]):
    """Per tree row, the drafted tokens (tree rows less the root, so row
    ``j`` is drafted ``j - 1``) on its path from the root, root side first."""
    out = [[]]
    for r in range(1, len(parents)):
        out.append(out[parents[r]] + [r - 1])
    return out


class Penalties:
    """The processors ``make_logits_processors(**settings)`` makes (logit
    bias, then the repetition, presence and frequency penalties), as one
    processor that keeps its settings, so a verify processes all its rows at
    once (:meth:`all_rows`). Called as mlx-lm calls a processor, it is
    mlx-lm's processors in turn. Build it with
    :func:`dflash_mlx.controls.penalty_processors`, which checks the settings."""

    def __init__(self, **settings):
        self.settings = {**PROCESSOR_DEFAULTS, **settings}
        self.made = make_logits_processors(**settings)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        for processor in self.made:
            logits = processor(tokens, logits)
        return logits

    def all_rows(self, logits: mx.array, history: mx.array, drafted: mx.array, window) -> mx.array:
        """Every row at once, ``history`` not empty. ``window(held, context)``:
        each row's window (see :func:`windows`) into the last ``held``
        history tokens followed by ``drafted``; a row's last slot always
        holds a token (the anchor at least), and the slots before its window
        repeat it, which the repetition and presence penalties write twice
        with the same value and the frequency penalty subtracts 0 from."""
        s, out = self.settings, logits
        if s["logit_bias"]:
            out = out.at[:, mx.array(list(s["logit_bias"].keys()))].add(mx.array(list(s["logit_bias"].values())))
        for kind in PENALTIES:
            penalty, context = s[f"{kind}_penalty"], s[f"{kind}_context_size"]
            if penalty is None or penalty == 0:  # off, as mlx-lm leaves it
                continue
            held = min(context, history.size)
            at = window(held, context)
            cols = mx.concatenate([history[history.size - held :], drafted])[mx.maximum(at, 0)]
            cols = mx.where(at >= 0, cols, cols[:, -1:])
            if kind == "frequency":
                rows = mx.broadcast_to(mx.arange(cols.shape[0])[:, None], cols.shape)
                out = out.at[rows, cols].subtract(mx.where(at >= 0, penalty, 0.0).astype(out.dtype))
                continue
            picked = mx.take_along_axis(out, cols, axis=-1)
            if kind == "repetition":
                picked = mx.where(picked < 0, picked * penalty, picked / penalty)
            else:
                picked = picked - penalty
            out = mx.put_along_axis(out, cols, picked, axis=-1)
        return out


class Processors:
    """One request's logits processors and the history they read: a
    control of :attr:`dflash_mlx.decode.Request.controls` (``block``,
    ``tree``, ``commit``).

    ``history``: the tokens mlx-lm's ``generate_step`` would have fed so far
    (the prompt it was given, then every committed token), kept in step by
    :meth:`commit`; it always ends with the next verify's anchor. Each
    processor runs over every row in turn (rows are independent, so this is
    each row through the processors in order): a :class:`Penalties` on all
    rows at once, any other callable once per row.
    """

    def __init__(self, processors=(), history=()):
        self.callables = list(processors)
        self.history = as_tokens(history)
        self.early = 0  # tokens committed by :meth:`ahead`, not yet by :meth:`commit`

    def commit(self, tokens) -> None:
        """Commit ``tokens`` (a list, a scalar or an array, possibly lazy) to
        the history, less those :meth:`ahead` committed already."""
        tokens = as_tokens(tokens)
        skip = min(self.early, tokens.size)
        self.early -= skip
        if tokens.size > skip:
            self.history = mx.concatenate([self.history, tokens[skip:]])

    def ahead(self, token: mx.array) -> None:
        """Commit a plain step's lazy ``token`` before the loop reads it, so
        the next plain step is processed with it and runs ahead of the read
        (as mlx-lm's ``generate_step`` runs ahead with its processors)."""
        self.commit(token)
        self.early += 1

    def block(self, logits: mx.array, proposal=None, vectorised: bool = True) -> mx.array:
        """Processed ``logits [L, V]`` of a verify of ``[anchor, *proposal]``
        (``proposal``: ``L - 1`` drafted tokens; None or empty for a plain
        step): row ``i`` with history ``self.history + proposal[:i]``.
        ``vectorised=False`` calls every processor once per row even where
        it could take all rows at once."""
        if not self.callables:
            return logits
        drafted = as_tokens(() if proposal is None else proposal)
        rows = logits.shape[0]
        along = [drafted[:i] for i in range(rows)]
        return self.staged(logits, drafted, along, lambda held, c: chain_windows(rows, held, c), vectorised)

    def tree(self, logits: mx.array, tokens, parents: Sequence[int], vectorised: bool = True) -> mx.array:
        """Processed ``logits [R, V]`` of a draft tree's verify (``tokens[r]``,
        ``parents[r]`` per row, row 0 the anchor, a parent before its
        children, as :class:`~dflash_mlx.tree.DraftTree` holds them): row
        ``r`` with history ``self.history`` + the drafted tokens on its path."""
        if not self.callables:
            return logits
        drafted, ancestry = as_tokens(tokens)[1:], tree_ancestry(parents)
        along = [drafted[mx.array(a, dtype=mx.int32)] if a else drafted[:0] for a in ancestry]
        return self.staged(logits, drafted, along, lambda held, c: windows(ancestry, held, c), vectorised)

    def draft_block(self, slots: int, logits, vocab_size: int, sampling: Optional[dict] = None, key=None) -> Tuple[mx.array, Optional[mx.array]]:
        """The drafter's block ``logits() [slots, V]`` processed along its own
        proposal, slot ``j`` with the history and the tokens drafted before
        it, as the verify will process the target's row ``j``: a drafter
        that never saw the processors proposes what they change (a penalised
        repeat), and each such slot is rejected. Returns the ``slots`` tokens
        (lazy) and the distribution ``q [slots, V]`` each was drawn from
        (None: greedy; else a sample of :func:`~dflash_mlx.sampling.processed_probs`
        of its processed row with ``sampling``'s settings and ``key``).
        ``vocab_size``: the grammar's hook takes it; the rows carry it here."""
        rows, history, tokens, qs = logits(), self.history, [], []
        keys = None if key is None or sampling is None else mx.random.split(key, slots)
        for j in range(slots):
            row = rows[j : j + 1]
            for processor in self.callables:
                row = processor(history, row)
            if sampling is None:
                token = mx.argmax(row, axis=-1).astype(mx.int32)
            else:
                qs.append(processed_probs(row[0], **sampling))
                token = sample(qs[-1], None if keys is None else keys[j]).reshape(1).astype(mx.int32)
            tokens.append(token)
            history = mx.concatenate([history, token])
        return mx.concatenate(tokens), (mx.stack(qs) if qs else None)

    def staged(self, logits: mx.array, drafted: mx.array, along: list, window, vectorised: bool) -> mx.array:
        """Every processor in turn over every row (``along[r]``: the drafted
        tokens row ``r`` follows; ``window``: the same as row windows)."""
        out = logits
        for processor in self.callables:
            if vectorised and isinstance(processor, Penalties) and self.history.size:
                out = processor.all_rows(out, self.history, drafted, window)
                continue
            rows = []
            for r, path in enumerate(along):
                history = mx.concatenate([self.history, path]) if path.size else self.history
                rows.append(processor(history, out[r : r + 1]))  # (a fresh row: mlx-lm's may write into it)
            out = mx.concatenate(rows)
        return out
