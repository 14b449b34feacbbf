"""Controls over the output, exact through speculation: mlx-lm's logits
processors over a verified block, the logprobs mlx-lm reports, and the
checks of processor and sampler settings.

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
* the processors ``mlx_lm.sample_utils.make_logits_processors`` makes
  (:meth:`Processors.from_settings`): all rows at once, each row's window
  gathered from the history and the drafted tokens, then the same
  elementwise operations mlx-lm applies to one row's window, so the result
  is bit-identical.
"""

import functools
import inspect
import math
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from .errors import ArgumentError

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


class Processors:
    """One request's logits processors and the history they read.

    ``history``: the tokens mlx-lm's ``generate_step`` would have fed so far
    (the prompt it was given, then every committed token), kept in step by
    :meth:`extend`; it always ends with the next verify's anchor.
    ``settings``: make_logits_processors' keywords, where the processors
    were made from them (:meth:`from_settings`), which allows processing all
    rows at once.
    """

    def __init__(self, processors=(), history=(), settings: Optional[dict] = None):
        self.callables = list(processors)
        self.settings = settings
        self.history = as_tokens(history)

    @classmethod
    def from_settings(cls, history=(), vocab_size: Optional[int] = None, **settings) -> "Processors":
        """Processors ``make_logits_processors(**settings)`` makes, checked first
        (:func:`check_processor_settings`)."""
        check_processor_settings(vocab_size, **settings)
        return cls(make_logits_processors(**settings), history, {**PROCESSOR_DEFAULTS, **settings})

    def __bool__(self) -> bool:
        return bool(self.callables)

    def extend(self, tokens) -> None:
        """Commit ``tokens`` (a list or an array, possibly lazy) to the history."""
        self.history = mx.concatenate([self.history, as_tokens(tokens)])

    def block(self, logits: mx.array, proposal=None, vectorised: bool = True) -> mx.array:
        """Processed ``logits [L, V]`` of a verify of ``[anchor, *proposal]``
        (``proposal``: ``L - 1`` drafted tokens; None or empty for a plain
        step): row ``i`` with history ``self.history + proposal[:i]``.
        ``vectorised=False`` calls every processor once per row even where
        the settings allow all rows at once."""
        drafted = as_tokens(() if proposal is None else proposal)
        rows = logits.shape[0]
        if not self.callables:
            return logits
        if vectorised and self.settings is not None and self.history.size:
            return self.all_rows(logits, drafted, lambda held, c: chain_windows(rows, held, c))
        return mx.concatenate([self.row(logits[i : i + 1], drafted[:i]) for i in range(rows)])

    def tree(self, logits: mx.array, tokens, parents: Sequence[int], vectorised: bool = True) -> mx.array:
        """Processed ``logits [R, V]`` of a draft tree's verify (``tokens[r]``,
        ``parents[r]`` per row, row 0 the anchor, a parent before its
        children, as :class:`~dflash_mlx.tree.DraftTree` holds them): row
        ``r`` with history ``self.history`` + the drafted tokens on its path."""
        if not self.callables:
            return logits
        drafted, ancestry = as_tokens(tokens)[1:], tree_ancestry(parents)
        if vectorised and self.settings is not None and self.history.size:
            return self.all_rows(logits, drafted, lambda held, c: windows(ancestry, held, c))
        along = [drafted[mx.array(a, dtype=mx.int32)] if a else drafted[:0] for a in ancestry]
        return mx.concatenate([self.row(logits[r : r + 1], along[r]) for r in range(len(ancestry))])

    def row(self, logits: mx.array, drafted: mx.array) -> mx.array:
        """One row ``[1, V]`` through every processor, as mlx-lm calls them."""
        history = mx.concatenate([self.history, drafted]) if drafted.size else self.history
        for processor in self.callables:
            logits = processor(history, logits)
        return logits

    def all_rows(self, logits: mx.array, drafted: mx.array, window) -> mx.array:
        """Every row at once for make_logits_processors' own processors, with
        the history not empty. ``window(held, context)``: each row's window
        (see :func:`windows`) into the last ``held`` history tokens followed
        by ``drafted``; a row's last slot always holds a token (the anchor
        at least), and the slots before its window repeat it, which the
        repetition and presence penalties write twice with the same value
        and the frequency penalty subtracts 0 from."""
        s, out = self.settings, logits
        if s["logit_bias"]:
            out = out.at[:, mx.array(list(s["logit_bias"].keys()))].add(mx.array(list(s["logit_bias"].values())))
        for kind in PENALTIES:
            penalty, context = s[f"{kind}_penalty"], s[f"{kind}_context_size"]
            if penalty is None or penalty == 0:  # off, as mlx-lm leaves it
                continue
            held = min(context, self.history.size)
            at = window(held, context)
            cols = mx.concatenate([self.history[self.history.size - held :], drafted])[mx.maximum(at, 0)]
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


def process_rows(processors: Sequence[Optional[Processors]], logits: mx.array, proposals=None) -> mx.array:
    """A batched verify's ``logits [B, L, V]``, each row through its own
    request's :class:`Processors` (None or empty: unchanged) with its own
    drafted tokens ``proposals[b]`` (``[B, L - 1]``; None for plain steps)."""
    if not any(processors):
        return logits
    return mx.stack(
        [
            logits[b] if not p else p.block(logits[b], None if proposals is None else proposals[b])
            for b, p in enumerate(processors)
        ]
    )


def token_id(value, vocab_size: Optional[int], what: str) -> None:
    """A token id: an int in the vocabulary ``[0, vocab_size)``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ArgumentError(f"{what}: token id {value!r} is not a non-negative integer; pass token ids from the tokenizer")
    if vocab_size is not None and value >= vocab_size:
        raise ArgumentError(f"{what}: token id {value} is outside the vocabulary (0..{vocab_size - 1}); pass ids below {vocab_size}")


def positive_int(value, what: str, hint: str = "") -> None:
    """An int of 1 or more (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ArgumentError(f"{what} must be a positive integer, got {value!r}; pass 1 or more{hint}")


def finite(value, what: str, low: float = -math.inf, high: float = math.inf) -> None:
    """A real number in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high or math.isnan(value):
        span = f" in [{low}, {high}]" if math.isfinite(low) or math.isfinite(high) else ""
        raise ArgumentError(f"{what} must be a number{span}, got {value!r}")


def check_processor_settings(vocab_size: Optional[int] = None, **settings) -> None:
    """Raise :class:`ArgumentError` for make_logits_processors' settings
    mlx-lm would refuse or misread: an unknown keyword, a logit bias whose
    ids are outside the vocabulary (``vocab_size``; None: not checked), a
    negative repetition penalty, a context size that is not a positive
    integer (mlx-lm reads 0 as the whole history and a negative one as all
    but the first tokens)."""
    unknown = sorted(set(settings) - set(PROCESSOR_DEFAULTS))
    if unknown:
        raise ArgumentError(f"unknown logits processor setting(s) {unknown}; the settings are {sorted(PROCESSOR_DEFAULTS)}")
    s = {**PROCESSOR_DEFAULTS, **settings}
    bias = s["logit_bias"]
    if bias is not None and not isinstance(bias, dict):
        raise ArgumentError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    for token, value in (bias or {}).items():
        token_id(token, vocab_size, "logit_bias")
        finite(value, f"logit_bias[{token}]")
    for kind in PENALTIES:
        penalty, context = s[f"{kind}_penalty"], s[f"{kind}_context_size"]
        if penalty is not None:
            finite(penalty, f"{kind}_penalty", low=0.0 if kind == "repetition" else -math.inf)
        default = PROCESSOR_DEFAULTS[f"{kind}_context_size"]
        positive_int(context, f"{kind}_context_size", f" tokens (mlx-lm's default is {default})")


def check_sampler_settings(
    vocab_size: Optional[int] = None,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[Sequence[int]] = None,
    min_tokens_to_keep: int = 1,
) -> None:
    """Raise :class:`ArgumentError` for XTC and min-p settings mlx-lm's
    ``make_sampler`` refuses (it only finds out at the first token):
    ``xtc_probability`` outside [0, 1], ``xtc_threshold`` outside
    [0, 0.5], special tokens outside the vocabulary, ``min_tokens_to_keep``
    below 1."""
    finite(xtc_probability, "xtc_probability", 0.0, 1.0)
    finite(xtc_threshold, "xtc_threshold", 0.0, 0.5)
    for token in xtc_special_tokens or ():
        token_id(token, vocab_size, "xtc_special_tokens")
    positive_int(min_tokens_to_keep, "min_tokens_to_keep")
