"""One decode engine for a request alone and for a batch: each cycle
chooses, drafts, verifies, accepts, keeps and emits, for B >= 1 rows at once.

A :class:`Decoder` holds its rows (:class:`Request`: a prompt cache, an
acceptance rule, a token budget, stop tokens, a random key). One row decodes
on its own prompt cache, with the target's caches as mlx-lm makes them, and
may verify a draft tree (:mod:`dflash_mlx.tree`) where the sizer chooses
one; two rows or more verify chains together over one
:class:`~dflash_mlx.targets.rows.BatchCache`, whose rows keep lengths of
their own, so no row pays for another's rejections. Every rule is written
once, for all of them: the acceptance over rows
(:func:`~dflash_mlx.sampling.accept_rows`), what a cycle commits
(:func:`cycle_tokens`), the rollback (``TargetAdapter.keep``), the plain
step run ahead of its read, and the clock the sizer learns from.

:func:`~dflash_mlx.generate.generate_step` is a decoder holding one request;
:class:`~dflash_mlx.batch.BatchGenerator` schedules requests in and out of
one (z-lab's MLX loop and mlx-lm's ``generate_step`` read the same way:
prefill, draft, verify, accept, yield, trim).
"""

import copy
import functools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from .adaptive import BlockSizer, SlotAcceptance, TreeChoice, TreeWalk
from .cache import PromptCache
from .copy_source import CopyDrafts, class_acceptance
from .drafts import Drafts, grammar
from .processors import logprobs as log_probs
from .sampling import AcceptanceRule, accept_rows
from .targets.rows import BatchCache
from .tree import walked_ranks


@dataclass
class Request:
    """One row: its prompt cache (whose target part lives in a batch's
    caches while it decodes batched), how it accepts, and how far it has
    got; ``todo``, ``total`` and ``progress`` are its prefill's, for a
    scheduler."""

    uid: int
    cache: PromptCache
    rule: AcceptanceRule
    max_tokens: int
    eos: frozenset
    logprobs: bool = False
    key: Optional[mx.array] = None  # its own random key (a seeded sampled request)
    block_limit: Optional[int] = None  # the longest block it lets a batch verify
    todo: List[int] = field(default_factory=list)  # prompt tokens not prefilled yet
    total: int = 0  # prompt tokens to prefill
    progress: Optional[Callable[[int, int], None]] = None  # hears its prefill's progress
    acceptance: Optional[SlotAcceptance] = None  # how far into a batch's blocks it accepts
    controls: List = field(default_factory=list)  # what shapes its target's logits (see Decoder.controlled)
    copies: Optional[CopyDrafts] = None  # its copy source (None: copy drafts off)
    n: int = 0  # tokens generated
    anchor: int = -1  # the last committed token, not yet run by the target

    def next_key(self):
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key

    @property
    def room(self) -> int:
        return self.max_tokens - self.n

    def finish(self, stopped: bool) -> Optional[str]:
        return "stop" if stopped else ("length" if self.n >= self.max_tokens else None)

    def start(self, logits: mx.array) -> "BatchResponse":
        """The prefill's token from its ``logits [1, V]``, committed (and
        pending: the first verify runs it)."""
        for c in self.controls:
            logits = c.block(logits, None)
        token = self.rule.choose(logits, self.next_key()).item()
        forced = sum(c.commit([token]) or 0 for c in self.controls)
        self.cache.commit([token], pending=[token])
        self.anchor, self.n = token, 1
        lp = [log_probs(logits)[0]] if self.logprobs else None
        return BatchResponse(self.uid, [token], [False], lp, self.finish(token in self.eos), 0, 0, forced=forced, copied=[False])


@dataclass
class BatchResponse:
    """What one request got from one cycle (or its prefill: ``block`` 0).

    Args:
        uid: the request.
        tokens: the tokens it committed (its first: the prefill's).
        from_draft: per token, whether it was a drafted token the target accepted.
        logprobs: per token, the target's log-probabilities ``[V]`` there
            (None unless the request asked for them).
        finish_reason: "stop" (eos), "length" (max_tokens) or None.
        block: tokens it verified this cycle (1: a plain step; a tree's rows).
        batch: requests the cycle verified together.
        tree: nodes of the draft tree it verified (0: a chain or a plain step).
        prompt_cache: the request's prompt cache, once it has finished.
        forced: of ``tokens``, those its grammar forced (the only token its
            mask allowed; see :mod:`dflash_mlx.structured`).
        copied: per token, whether it was a token copied from the context
            (:mod:`dflash_mlx.copy_source`) the target accepted (the others
            ``from_draft`` came from the drafter).
    """

    uid: int
    tokens: List[int]
    from_draft: List[bool]
    logprobs: Optional[List[mx.array]]
    finish_reason: Optional[str]
    block: int
    batch: int = 1
    tree: int = 0
    prompt_cache: Optional[PromptCache] = None
    forced: int = 0
    copied: List[bool] = field(default_factory=list)


@dataclass
class Stats:
    """One request's decode statistics, token by token as it goes out:
    cycles by block size and by tree size, drafted tokens the target
    accepted (``copied``: those copied from the context), tokens (eos
    included, the prefill's first too), and those a response format
    forced (:attr:`BatchResponse.forced`). What ``stream_generate``,
    ``batch_generate`` and the server report."""

    tokens: int = 0
    accepted: int = 0
    copied: int = 0
    forced: int = 0
    blocks: Counter = field(default_factory=Counter)
    trees: Counter = field(default_factory=Counter)
    starts: bool = False  # the next token starts a cycle (the last one was the target's own)

    def count(self, from_draft: bool, block: int, tree: int = 0, copied: bool = False) -> None:
        self.tokens += 1
        self.accepted += from_draft
        self.copied += copied
        if self.starts and block:
            (self.trees if tree else self.blocks)[tree or block] += 1
        self.starts = not from_draft  # each cycle ends with the target's own token

    @property
    def cycles(self) -> int:
        return sum(self.blocks.values()) + sum(self.trees.values())

    @property
    def tokens_per_cycle(self) -> float:
        return round((self.tokens - 1) / max(1, self.cycles), 3)


def cycle_tokens(proposed: List[int], accepted: int, bonus: int, eos, room: int) -> Tuple[List[int], bool]:
    """What a verified cycle commits: the ``accepted`` drafted tokens and
    the target's own after them, cut after an eos (kept, as mlx-lm keeps
    it) and to the ``room`` left; and whether an eos ended them."""
    new = proposed[:accepted] + [bonus]
    stop = next((i for i, t in enumerate(new) if t in eos), None)
    if stop is not None:
        new = new[: stop + 1]
    return new[:room], stop is not None and stop < room


@dataclass
class Cycle:
    """A queued cycle: its rows, what was chosen (tokens verified per row,
    or a :class:`~dflash_mlx.adaptive.TreeChoice`), its lazy outcome
    (:func:`~dflash_mlx.sampling.accept_rows`' ``[B, 2 + L - 1]``, or a
    tree's target choice at every row), logits and tap states; a tree and
    its candidates; whether it was queued before the last cycle was read,
    and whether its rows' kept tokens are in the caches yet; per row where
    its proposal came from (``spans``, see :meth:`Drafts.propose`; None:
    the drafter's block, every slot) and whether the drafter ran."""

    rows: List[Request]
    choice: Union[int, TreeChoice]
    outcome: mx.array
    logits: mx.array
    taps: mx.array
    tree: Optional[object] = None
    ids: Optional[mx.array] = None
    queued_ahead: bool = False
    kept: bool = False
    spans: Optional[List[Tuple[int, int, int]]] = None  # per row (drafted slots, proposed slots, copy class)
    drafted: bool = True

    @property
    def block(self) -> int:
        return self.tree.rows if self.tree is not None else self.outcome.shape[1] - 1

    def read(self) -> List[Tuple[List[int], List[int], int, int, Optional[TreeWalk]]]:
        """Per row ``(rows kept, proposed tokens along them, accepted count,
        the target's token after them, what a tree's walk showed)``, in one
        host read."""
        if self.tree is None:
            return [(list(range(v[0] + 1)), v[2:], v[0], v[1], None) for v in self.outcome.tolist()]
        choices = self.outcome.tolist()
        path, token = self.tree.walk(choices)
        walk = TreeWalk(walked_ranks(self.tree, self.ids, path, choices), self.tree.spine)
        return [(path, [self.tree.tokens[r] for r in path[1:]], len(path) - 1, token, walk)]


def edge_advance(rooms: List[int], tokens) -> np.ndarray:
    """How far rows with ``rooms`` tokens left move their trailing edge (the
    row with the most left) when each commits ``tokens`` (``[rows]``, or
    ``[rows, k]``: k cycles' worth, an advance each)."""
    rooms = np.asarray(rooms, dtype=float)
    tokens = np.asarray(tokens, dtype=float)
    rooms = rooms if tokens.ndim == 1 else rooms[:, None]
    return rooms.max() - (rooms - tokens).max(axis=0)


class Expected:
    """Expected tokens by block length, optimistic and as seen, as a row's
    :class:`~dflash_mlx.adaptive.SlotAcceptance` gives them: what
    :meth:`Sizing.choose` hands the sizer for a closed batch's rows, each the
    advance of the rows' trailing edge (worked out when the sizer reads it:
    a plain spell reads none)."""

    def __init__(self, rooms: List[int], acceptance: List[SlotAcceptance]):
        self.rooms, self.acceptance = rooms, acceptance

    @functools.cached_property
    def expected(self) -> List[float]:
        return edge_advance(self.rooms, [a.expected for a in self.acceptance]).tolist()

    @functools.cached_property
    def expected_as_seen(self) -> List[float]:
        return edge_advance(self.rooms, [a.expected_as_seen for a in self.acceptance]).tolist()


class Sizing:
    """What chooses each cycle: the pair's :class:`~dflash_mlx.adaptive.BlockSizer`
    over the rows (one row: chains, plain steps and draft trees, by the
    pair's acceptance; several: chains, each row by its own), and what each
    row's copy source offers (:meth:`copies`). Rows that each cap their
    block verify the shortest cap."""

    def __init__(self, sizer: BlockSizer):
        self.sizer = sizer
        self.plain_last = False  # whether the last cycle read was a plain step (one may be queued ahead)
        self.closed = False  # whether no request waits to take the place of a row that ends (see worth)

    def rows_joined(self, rows: List[Request]) -> None:
        """Two rows or more, or a row held to a grammar: each keeps an
        acceptance of its own, a joining one starting from the pair's (what
        the rows have shown lately)."""
        if self.alone(rows):
            return
        for r in rows:
            if r.acceptance is None or r.acceptance is self.sizer.acceptance:
                r.acceptance = copy.deepcopy(self.sizer.acceptance)

    @staticmethod
    def alone(rows: List[Request]) -> bool:
        """Whether the rows are a lone request the pair's acceptance speaks
        for. A row held to a grammar keeps its acceptance to itself: the
        tokens the grammar forces are accepted whatever the drafter
        proposes, so they say nothing of the drafter the pair's acceptance,
        where every request starts, describes."""
        return len(rows) == 1 and grammar(rows[0]) is None

    def copies_joined(self, requests: List[Request]) -> None:
        """Each joining request's copies start from the pair's copy
        acceptance (and feed it), held to its grammar."""
        if self.sizer.copies is None:
            self.sizer.copies = class_acceptance()
        for r in requests:
            if r.copies is not None:
                r.copies.start_from(self.sizer.copies)
                r.copies.hold_to(grammar(r))

    def acceptance(self, rows: List[Request]) -> List[SlotAcceptance]:
        return [self.sizer.acceptance] if self.alone(rows) else [r.acceptance for r in rows]

    def trailing(self, rows: List[Request]) -> Optional[List[int]]:
        """The rows' rooms where a cycle is worth how far their trailing edge
        advances (:meth:`worth`: no request waits to join, two rows or
        more), else None."""
        return [r.room for r in rows] if self.closed and len(rows) > 1 else None

    def worth(self, rows: List[Request], tokens: List[float]) -> float:
        """What the tokens each row expects from a cycle are worth to the
        batch: their sum; where no request waits to join (``closed``), the
        batch runs until its last row ends, so the rows' count times how far
        their trailing edge advances (a row that gets ahead leaves sooner
        and the others finish in a smaller batch, whose tokens cost more
        each: a copy one row verifies, or a block the others reject, moves
        that edge no further than a plain step does)."""
        rooms = self.trailing(rows)
        return np.sum(tokens, axis=0) if rooms is None else len(rows) * edge_advance(rooms, tokens)

    def expected(self, rows: List[Request]) -> List:
        """Each row's expected tokens by block length as the sizer weighs
        them (:meth:`worth`: in a closed batch, its share of the edge's advance)."""
        acceptance, rooms = self.acceptance(rows), self.trailing(rows)
        return acceptance if rooms is None else [Expected(rooms, acceptance)] * len(rows)

    def choose(self, rows: List[Request], ahead: int = 0):
        """The next cycle, from the cycles before it (``ahead``: chosen before
        the last cycle is read, each row that many tokens further)."""
        remaining = [r.room - ahead for r in rows]
        limits = [r.block_limit for r in rows if r.block_limit]
        if len(limits) == len(rows):  # every request fixed its block: the shortest, for all
            return max(1, min(min(limits), max(remaining)))
        if self.alone(rows):
            return self.sizer.choose(remaining[0])
        return min([self.sizer.choose(remaining, self.expected(rows))] + limits)

    def fixed(self, rows: List[Request]) -> bool:
        """Whether the rows' block is fixed, by the sizer or every row's cap."""
        return self.sizer.fixed or all(r.block_limit for r in rows)

    def copies(self, rows: List[Request], choice) -> Tuple[object, List, bool]:
        """What the cycle at ``choice`` verifies from the rows' copy sources:
        ``(choice, per row its copied span (tokens, class) or None, whether
        the drafter drafts for the rows without one)``. A cycle of copies
        alone (no draft) replaces the sizer's choice where it commits more
        tokens per second at each row's acceptance of its copies and of the
        drafter; otherwise a row verifies its copy in place of the drafter's
        block where it expects more of it. A fixed block keeps its length."""
        plans = [None] * len(rows)
        if self.fixed(rows) and not (isinstance(choice, int) and choice > 1):
            return choice, plans, True  # a fixed plain step or tree verifies no copy: none proposed
        spans, rooms = [([], 0)] * len(rows), self.trailing(rows) if choice == 1 else None
        for b in sorted(range(len(rows)), key=lambda b: -rooms[b]) if rooms else range(len(rows)):
            r = rows[b]
            spans[b] = r.copies.propose(r.room - 1) if r.copies is not None else ([], 0)
            if rooms and not spans[b][0] and rooms[b] == max(rooms):  # (see worth: no copy cycle then moves the edge past a plain step)
                return choice, plans, True
        if not any(tokens for tokens, _ in spans):
            return choice, plans, True
        drafter = [a.expected_as_seen for a in self.acceptance(rows)]
        if not self.fixed(rows):
            best = self.copy_cycle(rows, spans, choice, drafter)
            if best:
                return best, [(t[: best - 1], k) if t else None for t, k in spans], False
        if isinstance(choice, int) and choice > 1:
            for b, (r, (tokens, klass)) in enumerate(zip(rows, spans)):
                if tokens and r.copies.expected(klass)[min(len(tokens) + 1, choice) - 1] >= drafter[b][choice - 1]:
                    plans[b] = (tokens[: choice - 1], klass)
        return choice, plans, not all(plans)

    def continued(self, r: Request, proposal: mx.array) -> Tuple[mx.array, Optional[list]]:
        """A lone row's drafted ``proposal [1, slots]`` continued by its copy
        source, where a copy has lately been accepted: the tokens its index
        copies after the committed ones and the drafted ones (an edit's new
        tokens drafted, the copy taken up after them), as many as raise the
        expected tokens per second. Returns the proposal and its spans
        (None: not continued)."""
        slots = proposal.shape[1]
        if r.copies is None or not r.copies.live or self.fixed([r]):
            return proposal, None
        tokens, klass = r.copies.propose(r.room - slots - 1, after=proposal[0].tolist())  # (a host read, only here)
        if not tokens:
            return proposal, None
        costs, expected = self.sizer.costs, self.acceptance([r])[0].expected_as_seen
        reach = expected[slots] - expected[slots - 1]  # every drafted slot accepted
        chain, copied = costs.upto(slots + 2), r.copies.expected(klass)
        rate = lambda k: (expected[slots] + reach * (copied[k] - 1)) / (chain[-2] + (chain[-1] - chain[-2]) * k)  # noqa: E731
        k = max(range(len(tokens) + 1), key=rate)
        if k == 0:
            return proposal, None
        return mx.concatenate([proposal, mx.array([tokens[:k]], dtype=mx.int32)], axis=1), [(slots, slots + k, klass)]

    def copy_cycle(self, rows: List[Request], spans, choice, drafter: List[List[float]]) -> int:
        """Rows verified by the best cycle of copies alone, if it beats
        ``choice`` as each row would verify it (its copy where it expects more
        of it than of the drafter's block; a switch out of a plain spell
        counted); 0 if not."""
        n, costs = len(rows), self.sizer.costs
        limit = min([r.block_limit for r in rows if r.block_limit] + [max(len(t) for t, _ in spans) + 1])
        expect = [r.copies.expected(k) if t else None for r, (t, k) in zip(rows, spans)]
        # per row, its expected tokens of a copy cycle verifying 1..limit a row (the anchor's alone: 1)
        tokens = np.ones((n, limit))
        for b, (e, (t, _)) in enumerate(zip(expect, spans)):
            if t:
                tokens[b, 1:] = [e[min(len(t) + 1, m) - 1] for m in range(2, limit + 1)]
        copied = self.worth(rows, tokens)  # what each length is worth to the batch
        if copied[-1] <= copied[0]:  # (at its longest, worth no more than a plain step)
            return 0
        if isinstance(choice, TreeChoice):
            rate = max(self.sizer.rates(self.sizer.max_block, optimistic=False))
        else:
            mine = [max(d[choice - 1], e[min(len(t) + 1, choice) - 1] if t else 0.0) for d, e, (t, _) in zip(drafter, expect, spans)]
            rate = self.worth(rows, mine) / costs.cost(choice, n)
        # Out of a plain spell a copy cycle loses at most the plain step queued ahead.
        switch = min(costs.switch_cost(n), costs.cost(1, n)) if choice == 1 and self.plain_last else 0.0
        rates = copied[1:] / (np.array([costs.verify(m, n) for m in range(2, limit + 1)]) + switch)
        best = int(np.argmax(rates))  # (limit is 2 or more here: at 1, copied[-1] is copied[0], returned above)
        return best + 2 if rates[best] > rate else 0

    def observe(self, cycle: Cycle, read, seconds: float, context: int) -> None:
        """A cycle read ``seconds`` after the one before it."""
        rows, self.plain_last = cycle.rows, cycle.choice == 1
        spans = cycle.spans or [None] * len(rows)
        for r, span, (_, _, accepted, _, _) in zip(rows, spans, read):
            if span is not None and span[1] > span[0] <= accepted:  # its copy reached
                r.copies.observe(span[2], span[1] - span[0], accepted - span[0])
        if not cycle.drafted and cycle.block > 1:  # copies alone: nothing of the drafter, a line of their own
            if not self.fixed(rows):
                self.sizer.costs.observe(cycle.block, seconds, context, len(rows), copies=True)
            return
        drafted = [cycle.block - 1 if span is None else span[0] for span in spans]
        accepted = [min(a, d) for (_, _, a, _, _), d in zip(read, drafted)]
        lone = len(rows) == 1
        self.sizer.observe(
            cycle.choice, accepted, seconds, read[0][4] if lone else None, context=context, rows=self.acceptance(rows),
            drafted=drafted, remaining=None if lone else [r.room for r in rows], valued=lambda: self.expected(rows),
            pooled=[grammar(r) is None for r in rows],
        )


class Decoder:
    """Decodes its rows cycle by cycle with one drafter and one target.

    :meth:`step` reads the queued cycle (queuing one first if none is),
    commits what every row kept, lets the rows that ended leave and, with
    ``run_ahead``, queues the next cycle before returning, so the caller's
    work on the tokens (detokenizing, streaming) overlaps the device's, as
    mlx-lm queues its next step. A plain step keeps its one row whatever its
    token, so when the next cycle is plain too it is queued on this one's
    lazy tokens before the host reads them. ``settle`` evaluates a draft
    (``mx.eval``, or ``mx.async_eval`` to overlap it with the verify).
    """

    def __init__(self, target, draft, max_block: int, settle: Callable, sizing: Sizing):
        self.target, self.max_block, self.sizing = target, max_block, sizing
        self.drafts = Drafts(target, draft, max_block, settle)
        self.rows: List[Request] = []
        self.cache = None  # the rows' target caches: a lone row's own, or a BatchCache
        self.queued: Optional[Cycle] = None
        self.then = None  # the next cycle's choice, made before the last read (see plain_ahead)
        self.clock = self.returned = 0.0  # when the last cycle was read; when the caller got its tokens
        self.cycles_read: List[int] = []  # the rows of each cycle the last step read
        self.committed = 0  # tokens committed, all rows

    # -- membership ----------------------------------------------------------

    def join(self, requests: Sequence[Request]) -> None:
        """Requests whose prefill is done (their anchor pending) join."""
        self.drop_queued()
        self.then = None
        rows = self.rows + list(requests)
        self.sizing.copies_joined(requests)
        self.sizing.rows_joined(rows)
        if len(rows) > 1:
            batched = isinstance(self.cache, BatchCache)
            parts, positions = ([self.cache], list(self.cache.rows.pos)) if batched else ([], [])
            for r in rows[len(self.rows) if batched else 0 :]:
                parts.append(r.cache.target)
                positions.append(r.cache.ran)
                r.cache.target = None  # in the batch until it leaves
            self.cache = BatchCache.join(parts, positions)
        else:
            self.cache = rows[0].cache.target
        self.rows = rows

    def leave(self, indices: Sequence[int]) -> List[Request]:
        """Rows ``indices`` leave, each with its own target cache back (a row
        left alone gets its own too, to decode alone). Returns them."""
        if not indices:
            return []
        gone, self.then = set(indices), None
        stay = [b for b in range(len(self.rows)) if b not in gone]
        leaving = [self.rows[b] for b in indices]
        if isinstance(self.cache, BatchCache):
            for b in list(indices) + (stay if len(stay) == 1 else []):
                r = self.rows[b]
                r.cache.target = self.cache.row(b)
                r.cache.unlink_draft()
        for r in leaving:
            r.cache.drop_unreadable()  # at rest, the cache holds only what a drafter may read
        self.rows = [self.rows[b] for b in stay]
        if len(stay) > 1:
            self.cache.take(stay)
        else:
            self.cache = self.rows[0].cache.target if stay else None
        return leaving

    def drop_queued(self) -> None:
        """Forget a queued cycle (its rows keep none of it): the rows are
        about to change."""
        if self.queued is not None:
            self.keep(self.queued, [0] * len(self.queued.rows))
            self.queued = None

    # -- one cycle -----------------------------------------------------------

    def choice(self):
        """The next cycle's choice: one made before the last read, if the
        rows are the same, else the sizer's now."""
        choice, self.then = self.then, None
        return self.sizing.choose(self.rows) if choice is None else choice

    def queue(self) -> None:
        """Queue the rows' next cycle (before the caller's work on the last one's tokens)."""
        self.clock = time.perf_counter()
        self.queued = self.launch(self.rows, self.choice())
        self.returned = time.perf_counter()

    def step(self, run_ahead: bool = True) -> List[BatchResponse]:
        """What every row got (see the class; two cycles' worth where a plain step ran ahead and a row ended)."""
        self.cycles_read = []
        now = time.perf_counter()
        if self.queued is None:
            cycle, self.clock = self.launch(self.rows, self.choice()), now
        else:
            cycle, self.queued = self.queued, None
            self.clock += now - self.returned  # the caller's time between cycles is no cycle's
        ahead = self.plain_ahead(cycle)
        out, ended = self.accept(cycle)
        if ended and ahead is not None:  # the rows that ended leave it unkept
            more, later = self.accept(ahead, void=set(ended))
            out, ended, ahead = out + more, ended + later, None
        caches = {r.uid: r.cache for r in self.rows}
        for e in out:
            if e.finish_reason is not None:  # its request leaves below, its cache whole again
                e.prompt_cache = caches[e.uid]
        self.leave(sorted(set(ended)))
        if ahead is not None:
            self.queued = ahead
        elif run_ahead and self.rows:
            self.queued = self.launch(self.rows, self.choice())
        self.returned = time.perf_counter()
        return out

    def plain_ahead(self, cycle: Cycle) -> Optional[Cycle]:
        """After a plain step, the next one queued on its lazy tokens before
        the read, if the sizer would choose a plain step next too (the
        choice is the one the loop would make after the read, from the
        cycles before this one; it stands for the cycle after the read)."""
        if cycle.block != 1 or any(r.room <= 1 or not all(hasattr(c, "ahead") for c in r.controls) for r in cycle.rows):
            return None  # (a grammar reads its committed tokens on the host: none runs ahead of a read)
        self.then = self.sizing.choose(cycle.rows, ahead=1)
        if self.then != 1 or (len(cycle.rows) == 1 and getattr(cycle.rows[0].copies, "resyncing", False)):
            return None  # (a lone row's broken-off copy may resume at the token only the read shows; in a batch some row nearly always waits so)
        if any(r.copies for r in cycle.rows) and self.sizing.copies(cycle.rows, 1)[0] != 1:
            return None  # (copies are chosen after the read: one looked worth it a token ago)
        self.then = None
        for b, r in enumerate(cycle.rows):
            for c in r.controls:  # (logits processors: the next step sees the lazy token)
                c.ahead(cycle.outcome[b, 1:2])
        self.keep(cycle, [1] * len(cycle.rows))
        try:
            return self.launch(cycle.rows, 1, anchors=cycle.outcome[:, 1:2], queued_ahead=True)
        except BaseException:  # (a logits processor or sampler raising): the caches ran the kept step, so its rows commit it
            self.accept(cycle)
            raise

    def launch(self, rows: List[Request], choice, anchors: Optional[mx.array] = None, queued_ahead: bool = False) -> Cycle:
        """Queue a cycle: a tree (one row), or per row its anchor and the
        first ``choice - 1`` drafted tokens (1: a plain step, whose
        ``anchors`` may be the last plain step's lazy tokens)."""
        choice = self.drafts.forced_choice(rows, choice)
        plans, drafts = [None] * len(rows), True
        if anchors is None and any(r.copies for r in rows):
            choice, plans, drafts = self.sizing.copies(rows, choice)
        if isinstance(choice, TreeChoice):
            room = min(rows[0].room, self.max_block, self.cache.rows_before_quantizing() or self.max_block)
            if room > 1:  # (a tree may not cross quantized_kv_start: it stops short of it, or is a plain step)
                return self.tree_cycle(rows[0], choice, room)
            choice = 1
        if anchors is None:
            anchors = mx.array([[r.anchor] for r in rows], dtype=mx.int32)
        proposal, qs, spans = mx.zeros((len(rows), 0), mx.int32), [None] * len(rows), None
        if choice > 1:
            proposal, qs, spans = self.drafts.propose(rows, choice - 1, plans, drafts)
            if spans is None and len(rows) == 1:
                proposal, spans = self.sizing.continued(rows[0], proposal)
        logits, taps = self.target.forward(mx.concatenate([anchors, proposal], axis=1), self.cache)
        logits = self.controlled(rows, logits, proposal)
        lengths = None if spans is None else [n for _, n, _ in spans]
        outcome = accept_rows([r.rule for r in rows], logits, proposal, qs, [r.next_key() for r in rows], lengths)
        mx.async_eval(outcome, taps)
        return Cycle(list(rows), choice, outcome, logits, taps, queued_ahead=queued_ahead, spans=spans, drafted=drafts)

    def tree_cycle(self, r: Request, choice: TreeChoice, room: int) -> Cycle:
        """One row's draft tree (:meth:`Drafts.tree`) verified in one
        forward; the outcome is the target's choice at every row."""
        tree, ids = self.drafts.tree(r, choice, room)
        logits, taps = self.target.forward(mx.array([tree.tokens]), self.cache, tree=tree)
        for c in r.controls:
            logits = c.tree(logits[0], tree.tokens, tree.parents)[None]
        outcome = r.rule.choose(logits[0], r.next_key()).astype(mx.int32)
        mx.async_eval(outcome)
        return Cycle([r], choice, outcome, logits, taps, tree, ids)

    @staticmethod
    def controlled(rows: List[Request], logits: mx.array, proposal: mx.array) -> mx.array:
        """Each row's verified logits under its own controls (logits
        processors, a grammar's mask: each ``block(logits [L, V], proposal
        [L - 1])``), row ``i`` seeing the request's committed tokens and its
        draft up to ``i``, as the target alone would see them at that
        position. The acceptance rule and the log-probabilities read these,
        so each control is exact through speculation."""
        if not any(r.controls for r in rows):
            return logits
        out = []
        for b, r in enumerate(rows):
            x = logits[b]
            for c in r.controls:
                x = c.block(x, proposal[b])
            out.append(x)
        return mx.stack(out)

    def keep(self, cycle: Cycle, kept: List) -> None:
        """Each row keeps its verified rows ``kept[b]`` (a count, or a tree's
        walked rows) in the target's caches, and their tap states for its drafter."""
        self.target.keep(self.cache, kept)
        for b, (r, k) in enumerate(zip(cycle.rows, kept)):
            if isinstance(k, list):
                r.cache.add_hidden(cycle.taps[b : b + 1, mx.array(k)])
            elif k:
                r.cache.add_hidden(cycle.taps[b : b + 1, :k])
        cycle.kept = True

    def accept(self, cycle: Cycle, void=frozenset()) -> Tuple[List[BatchResponse], List[int]]:
        """Each row's tokens from the cycle's outcome, read once; rows in
        ``void`` (ended before this cycle, which ran ahead) keep nothing of
        it. Returns what every row got and the rows that ended."""
        read = cycle.read()
        now = time.perf_counter()
        context = sum(r.cache.offset for r in cycle.rows) // len(cycle.rows)
        self.sizing.observe(cycle, read, now - self.clock, context)  # before the next choice
        self.clock = now
        self.cycles_read.append(len(cycle.rows))
        kept, out, ended = [], [], []
        tree = 0 if cycle.tree is None else cycle.tree.nodes
        for b, (r, (rows, proposed, accepted, token, _)) in enumerate(zip(cycle.rows, read)):
            if b in void:
                kept.append(0)
                continue
            new, stopped = cycle_tokens(proposed, accepted, token, r.eos, r.room)
            rows = rows[: len(new)]
            kept.append(rows if cycle.tree is not None else len(rows))
            r.n += len(new)
            r.anchor = new[-1]
            forced = sum(c.commit(new) or 0 for c in r.controls)  # (a grammar says how many it forced)
            r.cache.commit(new, pending=new[-1:])
            lp = None
            if r.logprobs:
                lps = log_probs(cycle.logits[b])
                lp = [lps[i] for i in rows]
            finish = r.finish(stopped)
            copy_start = cycle.spans[b][0] if cycle.spans is not None else accepted  # (its copied tokens start there)
            out.append(BatchResponse(
                r.uid, new, [i < accepted for i in range(len(new))], lp, finish, cycle.block, len(cycle.rows), tree,
                forced=forced, copied=[copy_start <= i < accepted for i in range(len(new))],
            ))
            if finish is not None:
                ended.append(b)
        if not cycle.kept:
            self.keep(cycle, kept)
        committed = sum(len(e.tokens) for e in out)
        if self.committed // 256 != (self.committed + committed) // 256:
            mx.clear_cache()  # as mlx-lm's generate_step does every 256 tokens
        self.committed += committed
        return out, ended


def cycle_timer(target, draft, cache, context: mx.array, max_block: int) -> Callable:
    """``seconds(choice, settle)``: one engine cycle at ``choice`` (a block
    length or a :class:`~dflash_mlx.adaptive.TreeChoice`) on the live target
    ``cache`` (a request's own), drafting from a scratch drafter context fed
    ``context``; read, then rolled back. What calibration times: the cycle
    the loop runs, not a copy of it."""

    def seconds(choice, settle: Callable) -> float:
        scratch = PromptCache(cache, draft.make_cache())
        scratch.target_hidden = context
        probe = Request(-1, scratch, AcceptanceRule(None), max_block + 1, frozenset(), anchor=0)
        decoder = Decoder(target, draft, max_block, settle, Sizing(BlockSizer(max_block, None, fixed=True)))
        decoder.join([probe])
        tic = time.perf_counter()
        cycle = decoder.launch([probe], choice)
        cycle.outcome.tolist()
        target.keep(cache, [[] if cycle.tree is not None else 0])
        mx.eval([c.state for c in cache])
        return time.perf_counter() - tic

    return seconds
