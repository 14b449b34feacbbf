"""Drafts copied from the context: prompt lookup decoding (Saxena, 2023; the
``ngram`` speculator of vLLM; SuffixDecoding, Oliaro et al., arXiv
2411.04975, does the same over suffix trees).

A request's answer often repeats what it has read: a file written back with
one change, a quoted paragraph, a JSON record from a tool. :class:`CopyIndex`
holds a request's whole context (the prompt cache's tokens, the prompt, the
tokens generated so far) and proposes what followed the longest earlier
occurrence of its current suffix. A proposal is a draft like the drafter's,
with a point-mass proposal distribution (see
:func:`~dflash_mlx.sampling.accept_point_mass`); the target verifies it, so
the output is the target's whatever the index proposes.

The index is a hash table from every n-gram (``min_match <= n <=
max_ngram``) to the last position it ended at; committing a token adds its
n-grams, ``max_ngram - min_match + 1`` table writes whatever the context's
length, and a lookup reads at most as many entries (longest first; among
matches as long, up to ``max_ngram``, the most recent). Hashes are
polynomial (mod 2**64) and every hit is checked against the tokens, so a
collision can cost a proposal, never propose tokens that did not follow the
suffix. A proposal that the committed tokens then follow is continued from
where it left off (one slice comparison, no lookup), so a long copy stays
aligned with its source even where its n-grams recur elsewhere; one that
broke off a few tokens ago (an edit) is picked up again where the answer's
last token appears near where the copy would be. ``propose(k, after=block)``
proposes what would follow a drafter's block, without committing it.

:func:`index_for` keeps a :class:`~dflash_mlx.cache.PromptCache`'s index in
step with the cache's tokens (built on first use, extended with what was
committed since, rebuilt after a trim), so it follows a conversation from
turn to turn and a cache copied for another request. :class:`CopyDrafts` is
a request's copy source in the decode loop: its index and how far into
copied spans the target accepts, which the loop prices against the
drafter's block each cycle (:meth:`dflash_mlx.decode.Sizing.copies`).
"""

import copy
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .adaptive import SlotAcceptance
from .errors import ArgumentError

# Longest n-gram hashed. A match of 12 tokens rarely recurs by chance in
# text or code, so a longer one only breaks ties, which following the copy
# being accepted already breaks; each committed token costs this many writes.
DEFAULT_MAX_NGRAM = 12
# Shortest match proposed from. A single token recurs everywhere, but where
# an answer has left its source for a word or two, the last one is often
# where it picks up again; a match that short is a class of its own (see
# CopyDrafts), so a request whose answer does not repeat soon stops
# proposing it, and one near a copy that broke off is tried first.
DEFAULT_MIN_MATCH = 1
# How far from a broken-off copy, and for how many tokens, its source is
# searched for the answer's last token (an edit, see CopyIndex.resynced).
RESYNC = 8
# Extends of at least this many tokens are hashed with numpy.
BULK = 64

# Longest span one cycle verifies from a copy.
MAX_COPY = 32
# The match lengths each class of copies starts at (see CopyDrafts): a
# single token (a resync or a lone match), short matches, longer ones, long ones.
MATCH_CLASSES = (1, 2, 4, 8)
# A copied slot's prior chance of being accepted, per class, before a
# request shows whether its answer repeats its context: the share of copied
# slots a target's greedy answers accepted, class by class, over the tuning
# set of edit-shaped requests (prompt_sets/edit_tuning.json; derived by
# ``examples/copy_replay.py --block-size 33``, MAX_COPY + 1), non-decreasing
# in match length. The bench's edit set is held out from it.
COPY_PRIORS = (0.66, 0.91, 0.91, 0.98)

MASK = (1 << 64) - 1
BASE = 0x9E3779B97F4A7C15  # odd, so every power is a unit mod 2**64


def match_class(length: int) -> int:
    """The class (index into ``MATCH_CLASSES``) of a match ``length`` tokens long."""
    return sum(length >= m for m in MATCH_CLASSES[1:])


class CopyIndex:
    """The n-gram index of one sequence of tokens (see the module docstring).

    ``extend(tokens)`` commits tokens; ``propose(max_tokens)`` returns what
    followed the longest earlier occurrence of the sequence's suffix (up to
    ``max_tokens``; empty without a match of ``min_match`` tokens or more).
    ``work`` counts table reads and writes and tokens compared: what the
    index costs, in operations.
    """

    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = DEFAULT_MAX_NGRAM, min_match: int = DEFAULT_MIN_MATCH):
        for name, value in (("max_ngram", max_ngram), ("min_match", min_match)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"CopyIndex's {name} must be a whole number of at least 1, not {value!r}")
        if min_match > max_ngram:
            raise ArgumentError(f"CopyIndex's min_match ({min_match}) must not exceed its max_ngram ({max_ngram})")
        self.max_ngram, self.min_match = max_ngram, min_match
        self.powers = [pow(BASE, k, 1 << 64) for k in range(max_ngram)]
        self.tokens: List[int] = []
        # hash -> last end position, over the n-grams ending before the last token
        self.table: Dict[int, int] = {}
        self.suffix: List[int] = []  # hashes of the n-grams ending at the last token (n = 1, 2, ...)
        self.copy: Optional[Tuple[int, int, int]] = None  # (length then, source end, match length) being followed
        self.broken: Optional[Tuple[int, int]] = None  # (length then, source end) of the last copy that broke off
        self.work = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __deepcopy__(self, memo):
        """A copy for a forked cache: the table's entries are ints, so a
        shallow copy of each container is a deep one."""
        twin = copy.copy(self)
        twin.tokens, twin.table, twin.suffix = list(self.tokens), dict(self.table), list(self.suffix)
        return twin

    def hashes(self, tail: Sequence[int]) -> List[int]:
        """Hashes of the n-grams ending at ``tail``'s last token, n = 1..min(len, max_ngram)."""
        out, h = [], 0
        for k, p in enumerate(self.powers[: len(tail)]):
            h = (h + (tail[-1 - k] + 1) * p) & MASK
            out.append(h)
        return out

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` (ints) to the sequence."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        if len(tokens) >= BULK:
            self.extend_bulk(tokens)
            return
        lo, hi, table = self.min_match - 1, self.max_ngram, self.table
        for t in tokens:
            end = len(self.tokens) - 1
            for h in self.suffix[lo:hi]:
                table[h] = end
            self.tokens.append(t)
            self.suffix = self.hashes(self.tokens[-hi:])
        self.work += 2 * self.max_ngram * len(tokens)

    def extend_bulk(self, tokens: List[int]) -> None:
        """:meth:`extend` with the hashes computed by numpy (a prompt, a
        rebuild): the same table, entry for entry, in the same order."""
        start = max(len(self.tokens) - 1, 0)  # the first end position to enter the table
        self.tokens.extend(tokens)
        stop = len(self.tokens) - 1  # the last token's n-grams wait in ``suffix``
        base = max(start - self.max_ngram + 1, 0)
        seq = np.asarray(self.tokens[base:stop], dtype=np.uint64) + np.uint64(1)
        ends = np.arange(start, stop)
        acc = np.zeros(len(ends), dtype=np.uint64)
        columns, valid = [], []
        for k, p in enumerate(self.powers):
            acc = acc + seq[np.maximum(ends - k - base, 0)] * np.uint64(p)
            if k >= self.min_match - 1:
                columns.append(acc)
                valid.append(ends >= k)
        keep = np.stack(valid, axis=1)  # position-major, n-minor: the order extend writes in
        keys = np.stack(columns, axis=1)[keep]
        where = np.broadcast_to(ends[:, None], keep.shape)[keep]
        self.table.update(zip(keys.tolist(), where.tolist()))
        self.suffix = self.hashes(self.tokens[-self.max_ngram :])
        self.work += 2 * self.max_ngram * len(tokens)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (a trimmed cache): rebuilt from
        them, the table's entries for the dropped tokens having overwritten
        older ones."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self.table, self.suffix, self.copy, self.broken = [], {}, [], None, None
            self.extend(kept)

    def lookup(self, tail: Sequence[int], hashes: List[int]) -> Tuple[int, int]:
        """(end, n): the last position before the last token where the
        longest of ``tail``'s suffixes (n from ``max_ngram`` down to
        ``min_match``) ended; (-1, 0) if none did."""
        tokens = self.tokens
        for n in range(len(hashes), self.min_match - 1, -1):
            end = self.table.get(hashes[n - 1])
            self.work += 1
            if end is not None:
                self.work += n
                if tokens[end - n + 1 : end + 1] == list(tail[len(tail) - n :]):
                    return end, n
        return -1, 0

    def match(self) -> Tuple[int, int]:
        """(source end, length) of the match :meth:`propose` copies from:
        the copy proposed last if the tokens committed since followed it,
        else the most recent occurrence of the longest suffix (lengths
        compared up to ``max_ngram``), where that is a single token one
        near a copy that broke off lately first (:meth:`resynced`);
        (-1, 0) if none is ``min_match`` long."""
        n = len(self.tokens)
        if self.copy is not None:
            at, end, length = self.copy
            self.work += n - at
            if self.tokens[end + 1 : end + 1 + n - at] == self.tokens[at:n]:
                self.copy = (n, end + n - at, length + n - at)
                return self.copy[1:]
            self.broken = (at, end)
        end, length = self.lookup(self.tokens[-self.max_ngram :], self.suffix)
        if length < 2:  # (a single token recurs everywhere: near a copy that broke off first)
            back, one = self.resynced()
            if one:
                end, length = back, one
        self.copy = (n, end, length) if length else None
        return end, length

    def resyncing(self) -> bool:
        """Whether a copy broke off within the last ``RESYNC`` tokens (the
        next token may take its source up again)."""
        return self.broken is not None and len(self.tokens) - self.broken[0] <= RESYNC

    def resynced(self) -> Tuple[int, int]:
        """(end, 1): the last token found within ``RESYNC`` positions of
        where a copy that broke off in the last ``RESYNC`` tokens would be
        now, the nearest first (an edit: the answer went on with its source
        after a token or a few replaced, inserted or left out); (-1, 0) if
        not found."""
        n = len(self.tokens)
        if self.broken is None or n - self.broken[0] > RESYNC:
            return -1, 0
        expected = self.broken[1] + n - self.broken[0]
        last = self.tokens[-1]
        for q in sorted(range(max(expected - RESYNC, 0), min(expected + RESYNC + 1, n - 1)), key=lambda q: abs(q - expected)):
            self.work += 1
            if self.tokens[q] == last:
                return q, 1
        return -1, 0

    def continued(self, end: int, length: int, after: List[int]) -> Tuple[int, int]:
        """:meth:`match` as if ``after`` were committed too (not recorded):
        the same copy where ``after`` is its continuation, else a lookup of
        the new suffix."""
        if length and self.copied(end, len(after), after) == after:
            return end + len(after), length + len(after)
        tail = (self.tokens[-self.max_ngram :] + after)[-self.max_ngram :]
        return self.lookup(tail, self.hashes(tail))

    def copied(self, end: int, count: int, after: List[int]) -> List[int]:
        """``count`` tokens from ``end + 1`` of the sequence continued by
        ``after``; past its end, the copy continues itself (a repeat)."""
        out = self.tokens[end + 1 : end + 1 + count]
        while len(out) < count:
            at = end + 1 + len(out) - len(self.tokens)
            out.append(after[at] if at < len(after) else out[at - len(after)])
        self.work += count
        return out

    def propose(self, max_tokens: int, after: Sequence[int] = ()) -> List[int]:
        """Up to ``max_tokens`` tokens that followed the match (:meth:`match`);
        empty if there is none. ``after``: tokens drafted past the committed
        ones (a drafter's block), to propose what follows them instead."""
        after = [int(t) for t in after]
        end, length = self.match()
        if after:
            end, length = self.continued(end, length, after)
        return self.copied(end, max_tokens, after) if length and max_tokens > 0 else []

    @property
    def match_length(self) -> int:
        """Length of the last match proposed from (0: none); lengths of
        ``max_ngram`` or more are lower bounds."""
        return self.copy[2] if self.copy else 0


def index_for(cache) -> CopyIndex:
    """The copy index of a prompt cache's tokens, brought up to them: built
    on first use, extended with the tokens committed since, rebuilt if the
    cache was trimmed below it or its tokens replaced."""
    index, tokens = cache.copy_index, cache.tokens
    if index is not None and len(index) > len(tokens):
        index.truncate(len(tokens))
    if index is None or (len(index) and index.tokens[-1] != tokens[len(index) - 1]):
        index = cache.copy_index = CopyIndex(tokens)
    elif len(index) < len(tokens):
        index.extend(tokens[len(index) :])
    return index


def class_acceptance(max_copy: int = MAX_COPY) -> List[SlotAcceptance]:
    """Copy acceptance per class of match length, each from its prior."""
    return [SlotAcceptance(max_copy + 1, prior=p) for p in COPY_PRIORS]


class CopyDrafts:
    """A request's copy source in the decode loop: its prompt cache's index
    (:func:`index_for`, so only committed tokens enter it) and, per class of
    match length (``MATCH_CLASSES``), how far into copied spans the target
    accepts (a :class:`~dflash_mlx.adaptive.SlotAcceptance` each): a short
    match recurs by chance where a long one is a copy under way, and a
    request whose answer does not repeat its context soon shows, class by
    class, that its copies are not worth verifying."""

    def __init__(self, cache, max_copy: int = MAX_COPY):
        self.cache, self.max_copy = cache, max_copy
        self.acceptance, self.pooled = class_acceptance(max_copy), None
        self.live = False  # whether its last verified copy had a token accepted
        self.grammar = None  # the row's grammar (a structured.Constraint), if it is held to one

    def start_from(self, pooled: List[SlotAcceptance]) -> None:
        """Start from ``pooled`` (the pair's acceptance per class: what the
        copies of the requests before it showed, from ``COPY_PRIORS``) and
        feed it: where answers lately did not repeat their context, a new
        request does not try copies long on a prior's hope."""
        self.acceptance, self.pooled = copy.deepcopy(pooled), pooled

    def hold_to(self, grammar) -> None:
        """Propose only what ``grammar`` (a
        :class:`~dflash_mlx.structured.Constraint`, or None) can take: a
        span starts with the tokens it forces and is cut at the first it
        refuses (the target's masked choice never takes one)."""
        self.grammar = grammar

    def propose(self, most: int, after: Sequence[int] = ()) -> Tuple[List[int], int]:
        """Up to ``most`` tokens copied after the committed ones (and
        ``after``, drafted past them), and the class of their match. Under a
        grammar, what it forces next comes first (the copy continues after
        it) and the span ends before the first token it refuses; a span
        with nothing copied in it is none."""
        if most < 1:
            return [], 0
        index, after = index_for(self.cache), [int(t) for t in after]
        most = min(most, self.max_copy)
        lead = self.grammar.forced(most - 1) if self.grammar is not None and not after else []
        tokens = index.propose(most - len(lead), after + lead)
        if self.grammar is not None and tokens:
            tokens = tokens[: max(0, self.grammar.takes(after + lead + tokens) - len(after) - len(lead))]
        return (lead + tokens if tokens else []), match_class(index.match_length)

    @property
    def resyncing(self) -> bool:
        """Whether its copy broke off lately (:meth:`CopyIndex.resyncing`):
        whether the next token takes it up again, only a read shows."""
        index = self.cache.copy_index
        return index is not None and index.resyncing()

    def expected(self, klass: int) -> List[float]:
        """Expected tokens a cycle commits verifying the anchor and ``n - 1``
        copied tokens of class ``klass`` (index ``n - 1``), at the shares as seen."""
        return self.acceptance[klass].expected_as_seen

    def observe(self, klass: int, proposed: int, accepted: int) -> None:
        """The target reached a copied span of ``proposed`` tokens and accepted ``accepted``."""
        for acceptance in [self.acceptance] + ([self.pooled] if self.pooled is not None else []):
            acceptance[klass].observe(proposed, accepted)
        self.live = accepted > 0
