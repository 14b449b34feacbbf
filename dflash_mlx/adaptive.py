"""Adaptive block size: each cycle verifies what maximises expected
committed tokens per second, ``E(b) / C(rows, b)``, for one row or a batch
(a lone row may verify a draft tree instead), chosen from past cycles only,
before drafting: it changes the speed, never the output. Numbers only (the
loop hands over seconds and acceptance), so tested on numbers alone;
docs/block-size.md walks it."""

import itertools
import math
import operator
import statistics
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .errors import ArgumentError
from .tree import best_first

MAX_TREE_NODES = 64  # the largest draft tree the sizer considers
PLAIN_PRIOR, WINDOW = 3, 32  # plain steps the table counts as in a plain median (CycleCosts.refit); cycles a line is fitted to
PROBE_WAIT = 4  # plain cycles before a probe while drafting looks faster; failed probes double it
PROBE_BUDGET = 0.01  # the most probing a drafter that never agrees may slow plain decoding by
# The most rechecking the plain step's price may slow a drafter that pays by,
# and a recheck's plain steps: the two of its switch and one more counted
# step than the table's prior, so that its own steps price plain decoding.
RECHECK_BUDGET, RECHECK_STEPS = 0.01, PLAIN_PRIOR + 3
REVISIT = 8  # plain steps between two reconsiderations of a plain spell


@dataclass(frozen=True)
class TreeChoice:
    """A cycle that verifies a draft tree of ``nodes`` nodes (and the anchor)."""

    nodes: int


@dataclass
class TreeWalk:
    """What a tree cycle showed: for each slot its walk reached, the rank of
    the target's token among the drafter's candidates there (None: not one
    of them); and the depth of the best-candidate chain the tree held."""

    ranks: List[Optional[int]]
    spine: int

    @property
    def chain_accepted(self) -> int:
        """What a chain of the spine would have accepted: up to the first slot the best candidate missed."""
        lead = next((i for i, r in enumerate(self.ranks) if r != 0), len(self.ranks))
        return min(lead, self.spine)


@dataclass
class SlotAcceptance:
    """How far into a block the target accepts: per slot ``j``, the share ``a_j``
    of the recent cycles (decayed) that reached it and had it accepted
    (product-limit: one rate for all slots would spread runs into a tail that
    overvalues short blocks), drawn toward the pooled share as if ``prior_weight``
    more cycles had shown it. Shares one standard error up (``optimistic``: only
    drafting a slot shows it) choose how far to draft; as seen, whether to."""

    max_block: int
    prior: float = 0.8
    prior_weight: float = 4.0
    decay: float = 0.9

    def __post_init__(self):
        self.hits, self.misses, self.pooled_prior = 0.0, 0.0, self.prior_weight
        # per slot j (index j - 1): decayed cycles that reached it, and that rejected it
        self.reached, self.rejected = ([0.0] * max(self.max_block - 1, 0) for _ in range(2))
        self.update()

    def update(self) -> None:
        """Recompute ``E(b)`` for b = 1..max_block: ``expected`` (optimistic) and ``expected_as_seen``."""
        self.expected, self.expected_as_seen = (chain_tokens(self.rates(optimistic)) for optimistic in (True, False))

    def observe(self, drafted: int, accepted: int) -> None:
        """A cycle drafted ``drafted`` slots and the target accepted the first ``accepted``."""
        if drafted < 1:
            return
        self.hits = self.hits * self.decay + accepted
        self.misses = self.misses * self.decay + (accepted < drafted)
        self.pooled_prior *= self.decay
        for i in range(min(accepted + 1, drafted, len(self.reached))):
            self.reached[i] = self.reached[i] * self.decay + 1
            self.rejected[i] = self.rejected[i] * self.decay + (i == accepted)
        self.update()

    def rates(self, optimistic: bool = True) -> List[float]:
        """``a_j`` for slots 1..max_block-1, each drawn toward the pooled share
        of drafted slots accepted lately (each rejection ends a cycle)."""
        prior, w = self.pooled_prior, self.prior_weight
        pooled = (self.hits + prior * self.prior) / (self.hits + self.misses + prior)
        out = []
        for n, rej in zip(self.reached, self.rejected):
            a = 1 - (rej + w * (1 - pooled)) / (n + w)
            if optimistic:
                a = min(1.0, a + math.sqrt(a * (1 - a) / (n + w)))  # one standard error up
            out.append(a)
        return out


class RankAcceptance:
    """Of the slots a tree's walk reached where the target's token was not the
    drafter's best candidate, the share ``q_r`` where it was the r-th (pooled
    over slots: rank ``r`` at slot ``j`` has probability ``(1 - a_j) q_r``; rank
    ``ranks`` or lower counts as none). Decayed as the slot shares, drawn
    toward a prior halving with each rank (so trees get tried early)."""

    def __init__(self, ranks: int = 16, prior: float = 0.5, prior_weight: float = 4.0, decay: float = 0.9):
        self.prior = [0.0] + [prior * 0.5 ** (r - 1) * 0.5 for r in range(1, ranks)]
        self.prior_weight, self.decay = prior_weight, decay
        self.counts = [0.0] * ranks  # decayed misses of the best candidate that were rank r
        self.total = 0.0  # decayed misses of the best candidate

    def observe(self, ranks: List[Optional[int]]) -> None:
        misses = [r for r in ranks if r != 0]
        if not misses:
            return
        self.total *= self.decay
        self.counts = [c * self.decay for c in self.counts]
        for r in misses:
            self.total += 1
            if r is not None and r < len(self.counts):
                self.counts[r] += 1

    def shares(self) -> List[float]:
        """``q_r`` for r = 0..ranks-1 (``q_0`` is 0)."""
        w = self.prior_weight
        return [(c + w * p) / (self.total + w) for c, p in zip(self.counts, self.prior)]


def chain_tokens(rates: List[float]) -> List[float]:
    """``E(b) = 1 + sum_{i<b} prod_{j<=i} a_j`` for b = 1..len(rates) + 1: the
    expected tokens a chain commits, ``a_j`` slot j's share accepted given
    the slots before it were."""
    return list(itertools.accumulate(itertools.accumulate(rates, operator.mul, initial=1.0)))


def expected_tree_tokens(rates: List[float], shares: List[float], nodes: int) -> List[float]:
    """``T(n)`` for n = 0..nodes: expected tokens a cycle commits with the best
    tree of n nodes when slot ``j``'s rank-r candidate is the target's token
    with probability ``rates[j-1]`` (r = 0) or ``(1 - rates[j-1]) shares[r]``,
    independently per slot: 1 plus the first n nodes' chances to be reached and
    taken, as the best-first build (the drafter's) adds the likeliest first."""
    if not rates or nodes < 1:
        return [1.0] * (nodes + 1)
    k = min(nodes, len(shares))
    rows = [sorted([a] + [(1 - a) * q for q in shares[1:k]], reverse=True) for a in rates]
    logs = [[math.log(p) if p > 0 else -math.inf for p in row] for row in rows]
    scores = best_first(logs, nodes)[3]
    out = list(itertools.accumulate([1.0] + [math.exp(x) for x in scores[1:]]))
    return out + [out[-1]] * (nodes + 1 - len(out))


def tree_tokens_bound(rates: List[float], shares: List[float]) -> float:
    """An upper bound on every ``T(n)`` in a few products (where it cannot beat the chain,
    no search): a walk passes slot ``j`` at most as often as a modelled candidate is right up to ``j``."""
    covered = sum(shares[1:])
    return chain_tokens([a + (1 - a) * covered for a in rates])[-1]


class ContextGrowth:
    """Seconds a cycle verifying ``rows`` rows grows by per context position,
    ``at(rows) = per_cycle + per_row * rows`` (every verified row attends to
    the context; a backend may also pay per cycle for the cache's length):
    least squares within each kind of cycle (its own intercept), sums
    decayed slowly, as growth shows only over a span of contexts. A term
    counts only where it exceeds its standard error, and none until the
    cycles span ``span`` positions (a machine growing busier would pass)."""

    def __init__(self, decay: float = 1 - 1 / 256, every: int = 32, span: int = 1024):
        self.decay, self.every, self.span = decay, every, span
        self.sums: Dict[object, List[float]] = {}  # kind -> [rows it verifies, w, c, y, cc, cy, yy]
        self.per_cycle = self.per_row = 0.0
        self.seen, self.low, self.high = 0, math.inf, -math.inf  # cycles, and the contexts they span

    def at(self, rows: int) -> float:
        return self.per_cycle + self.per_row * rows

    def observe(self, kind, rows: int, context: int, seconds: float, drafted: bool) -> None:
        """A cycle of ``kind`` verifying ``rows`` rows took ``seconds`` at ``context``;
        refitted after each ``drafted`` one (rare in a plain spell, the only news of
        how its rows grow) and every ``every`` others (plain steps' host time is short)."""
        self.low, self.high = min(self.low, context), max(self.high, context)
        s = self.sums.setdefault(kind, [rows] + [0.0] * 6)
        for i, v in enumerate((1.0, context, seconds, context * context, context * seconds, seconds * seconds), 1):
            s[i] = s[i] * self.decay + v
        self.seen += 1
        if drafted or self.seen % self.every == 0:
            self.per_cycle, self.per_row = self.fit()

    def fit(self) -> Tuple[float, float]:
        """(per_cycle, per_row) where each exceeds its standard error; else
        ``per_row`` alone (never cheaper for long blocks than the truth)."""
        if self.high - self.low < self.span:
            return 0.0, 0.0
        # Normal equations of the context terms, each kind centred on its own means.
        a, b, weight, residual = np.zeros((2, 2)), np.zeros(2), 0.0, 0.0
        for rows, w, c, y, cc, cy, yy in self.sums.values():
            r = np.array([1.0, rows])
            a += np.outer(r, r) * (cc - c * c / w)
            b += r * (cy - c * y / w)
            weight += w
            residual += yy - y * y / w
        if a[0, 0] > 0 and a[0, 1] ** 2 < a[0, 0] * a[1, 1] * (1 - 1e-6):  # row counts tell the terms apart
            both = least_squares(a, b, residual, weight - len(self.sums) - 2)
            if both is not None and both[0] > 0 and both[1] > 0:
                return both
        one = least_squares(a[1:, 1:], b[1:], residual, weight - len(self.sums) - 1)
        return (0.0, one[0]) if one is not None and one[0] > 0 else (0.0, 0.0)


def least_squares(a: np.ndarray, b: np.ndarray, residual: float, dof: float) -> Optional[Tuple[float, ...]]:
    """``a x = b`` solved (``residual``: the centred sum of squares), each term
    0 unless it exceeds its standard error; None without the dof to tell."""
    if dof < 4 or a[-1, -1] <= 0:
        return None
    theta = np.linalg.solve(a, b)
    error = np.sqrt(max(residual - float(theta @ b), 0.0) / dof * np.diag(np.linalg.inv(a)))
    return tuple(float(t) if t > e else 0.0 for t, e in zip(theta, error))


class Line:
    """Prices of cycles of ``rows`` rows, lines ``(seconds at 0 tokens past the
    anchor, seconds per token a row verifies past it, context fitted at)`` of
    plain steps (flat), drafting chains, one row's trees and copies alone (None
    until fitted), and the ``table`` they started from; each kind's window."""

    def __init__(self, rows: int, plain: float, draft: float, slope: float, context: int):
        self.rows, self.table = rows, (plain, slope, context)
        self.plain, self.chain = (plain, 0.0, context), (draft, slope, context)
        self.tree = self.copy = None
        self.recent = {kind: deque(maxlen=WINDOW) for kind in ("plain", "chain", "tree", "copy")}
        self.dirty = False  # whether plain steps came since the plain line was fitted


class CycleCosts:
    """Seconds per cycle by its shape, measured, at the current context:
    ``rows`` rows each verifying ``b`` tokens (``b = 1``: a plain step) or
    copies alone, or one row's draft tree (docs/block-size.md walks it). One
    row's :class:`Line` starts from the table ``calibrated`` by the engine's
    own cycles, ``C(1)`` and ``C(b) = D + s (b - 1)``; another row count's
    from one row's (further rows priced as verified rows, half the draft per
    request), then from its own cycles (a compute-bound verify costs more a
    row in a large batch). ``follow=False`` keeps the table (pipelined ranks
    must agree). A plain step is queued before the last one is read, so the
    step before a drafting cycle looks nearly free and the one after twice
    as dear: the two less two plain steps are a ``switch``, paid going out
    of plain steps, not by drafting on."""

    def __init__(self, calibrated: Dict[int, float], follow: bool = True, context: int = 0):
        if 1 not in calibrated:
            raise ArgumentError("a cost table needs the plain step's cost (block 1)")
        drafting = sorted(b for b in calibrated if b > 1)
        plain = draft = float(calibrated[1])
        lengths, costs = np.array(drafting, float) - 1, np.array([calibrated[b] for b in drafting])
        # Least squares, kept >= 0; one drafting length: flat until cycles of others show a slope.
        slope = max(0.0, float(np.polyfit(lengths, costs, 1)[0])) if len(drafting) > 1 else 0.0
        if drafting:
            draft = float(np.mean(costs - slope * lengths))
        self.max_block = drafting[-1] if drafting else 1
        self.follow, self.context = follow, context
        self.lines = {1: Line(1, plain, draft, slope, context)}
        self.growth = ContextGrowth()
        self.warm = set()  # the kinds of cycle seen once (see first)
        self.switches = deque(maxlen=WINDOW)  # switches, each over a plain step's cost
        self.entry, self.drafted, self.held = 0.0, False, None  # see observe

    def line(self, rows: int) -> Line:
        """The line of ``rows`` rows (made from one row's, see the class)."""
        if rows not in self.lines:
            plain, draft, slope = self.along("chain", 1)
            many = plain + (rows - 1) * slope
            self.lines[rows] = Line(rows, many, many + (draft - plain) * (1 + rows) / 2, rows * slope, self.context)
        return self.lines[rows]

    def at(self, fitted: Tuple[float, float, int], rows: int, context: Optional[int] = None) -> Tuple[float, float]:
        """``(intercept, slope)`` of a line of ``rows`` rows moved by the
        growth from the context it was fitted at to ``context`` (None: now)."""
        intercept, slope, then = fitted
        grown = (self.context if context is None else context) - then
        return intercept + self.growth.at(rows) * grown, max(0.0, slope + self.growth.per_row * rows * grown)

    def along(self, kind: str, rows: int = 1) -> Tuple[float, float, float]:
        """``(plain step, intercept, slope)`` of ``kind``'s line ("chain",
        "tree" or "copy") now, the intercept never below a plain step; a tree
        line not fitted yet is the chain's, a copy line a plain step at the
        chain's slope."""
        line = self.line(rows)
        if line.dirty:
            self.refit(line, "plain")
        plain = self.at(line.plain, rows)[0]
        fitted = getattr(line, kind)
        anchor, slope = self.at(line.chain if fitted is None else fitted, rows)
        return plain, max(plain if kind == "copy" and fitted is None else anchor, plain), slope

    def upto(self, n: int, rows: int = 1) -> List[float]:
        """Seconds per cycle at b = 1..n."""
        plain, anchor, slope = self.along("chain", rows)
        return [plain] + [anchor + slope * (b - 1) for b in range(2, n + 1)]

    def trees(self, n: int) -> List[float]:
        """Seconds of one row's trees of 0..n nodes (0: the anchor alone)."""
        _, anchor, slope = self.along("tree")
        return [anchor + slope * k for k in range(n + 1)]

    def verify(self, n: int, rows: int = 1) -> float:
        """Seconds of a cycle verifying ``n > 1`` tokens a row that it did not
        draft (copied), never more than a chain as long (which also drafts)."""
        _, anchor, slope = self.along("copy", rows)
        return min(anchor + slope * (n - 1), self.upto(n, rows)[-1])

    def cost(self, choice, rows: int = 1) -> float:
        """Seconds of a cycle at ``choice`` (a block length or a :class:`TreeChoice`)."""
        return self.trees(choice.nodes)[-1] if isinstance(choice, TreeChoice) else self.upto(choice, rows)[-1]

    def switch_cost(self, rows: int = 1) -> float:
        return max(0.0, statistics.median(self.switches)) * self.upto(1, rows)[0] if self.switches else 0.0

    def seed_tree(self, nodes: int, seconds: float, context: int) -> None:
        """The tree line through a tree cycle timed at ``context``, at the chain's slope there."""
        slope = self.at(self.lines[1].chain, 1, context)[1]
        self.lines[1].tree = (float(seconds) - slope * nodes, slope, context)

    def observe(self, choice, seconds: float, context: Optional[int] = None, rows: int = 1, copies: bool = False) -> None:
        """A cycle of ``rows`` rows at ``choice`` (a block length or a tree; with
        ``copies``, the tokens a row of a cycle of copies alone) took ``seconds``
        at ``context`` (None: unknown, the costs stay where they were measured)."""
        if not self.follow:
            return
        if context is not None:
            self.context = context
        if copies:  # at the current context, outside the growth fit and the switches
            if not self.first("copy", choice, rows):
                self.count("copy", choice, seconds, None, rows)
            return
        plain = choice == 1
        held, self.held = self.held, None
        after_drafting, self.drafted = self.drafted, not plain
        tree = isinstance(choice, TreeChoice)
        kind, verified = ("tree", choice.nodes + 1) if tree else ("plain" if plain else "chain", choice)
        if self.first(kind, verified, rows):
            return
        if plain and after_drafting:  # the last step of a switch (see the class)
            step = self.upto(1, rows)[0]
            self.switches.append((self.entry + seconds - step) / step)
            self.entry = 0.0
            return
        if held is not None and not plain:  # the first step of a switch
            self.entry = held[0] - self.upto(1, held[2])[0]
        elif held is not None:
            self.count("plain", 1, *held)
        if plain:  # counted once the next cycle shows it was no switch's
            self.held = (seconds, context, rows)
        else:
            self.count(kind, verified, seconds, context, rows)

    def first(self, kind: str, verified: int, rows: int) -> bool:
        """Whether a cycle is its kind's first (it may compile: not counted)."""
        key = (kind, rows, verified if kind == "chain" else 0)  # each chain length its own
        seen = key in self.warm
        self.warm.add(key)
        return not seen

    def forget_plain(self, rows: int = 1) -> None:
        """Drop the plain steps measured so far (a recheck measures them afresh)."""
        line = self.line(rows)
        line.recent["plain"].clear()
        line.dirty = True

    def count(self, kind: str, verified: int, seconds: float, context: Optional[int], rows: int) -> None:
        """A cycle's seconds into its line's window (and, at a known context, the growth fit)."""
        if context is not None:
            self.growth.observe((kind, verified, rows), rows * verified, context, seconds, verified > 1)
        line = self.line(rows)
        line.recent[kind].append((verified - 1, seconds, self.context if context is None else context))
        if kind == "plain":
            line.dirty = True  # refitted when next read: plain steps come fast, reads less often
        else:
            self.refit(line, kind)

    def refit(self, line: Line, kind: str) -> None:
        """``kind``'s line from its window moved to the current context. Plain
        steps: their median two by two, the table counted as ``PLAIN_PRIOR`` of
        them. Others: the slope by least squares drawn toward a prior (as if one
        more cycle sat at each end of the block range; the chain's the table's,
        the others' the chain's), kept >= 0; the intercept the median of the
        cycles less their slope part (a cycle slowed by the machine is not its length's)."""
        now = self.context
        moved = [(x, y + self.growth.at(line.rows * (x + 1)) * (now - c)) for x, y, c in line.recent[kind]]
        table, prior = self.at(line.table, line.rows)
        if kind == "plain":
            steps = [y for _, y in moved]
            pairs = [(a + b) / 2 for a, b in zip(steps, steps[1:])] or steps  # steps queued ahead are read unevenly
            line.plain, line.dirty = (statistics.median([*pairs, *[table] * PLAIN_PRIOR]), 0.0, now), False
            return
        if kind != "chain":
            prior = self.at(line.chain, line.rows)[1]
        x_mean, y_mean = (sum(v[i] for v in moved) / len(moved) for i in (0, 1))
        spread = sum((x - x_mean) ** 2 for x, _ in moved)
        fitted = sum((x - x_mean) * (y - y_mean) for x, y in moved)
        ends = (self.max_block - 2) ** 2 / 2
        slope = max(0.0, (fitted + ends * prior) / (spread + ends)) if spread + ends > 0 else prior
        setattr(line, kind, (statistics.median(y - slope * x for x, y in moved), slope, now))


class BlockSizer:
    """Chooses each cycle a block length for every row (1: a plain step) or, for
    one row, a draft tree; ``fixed`` pins the block, ``tree_nodes`` (fixed too)
    makes every drafting cycle a tree. A request alone is chosen by the pair's
    ``acceptance`` (kept across generations), a batch's rows by their own, which
    feed the pair's (a held row's, alone too, does not). A stand-in needs ``max_block``,
    ``choose(remaining, rows=None)``, ``observe(block, accepted, seconds, walk=None, context=None, **rows)``."""

    def __init__(self, max_block: int, costs: Optional[CycleCosts], fixed: bool = False, tree_nodes: int = 0):
        if costs is not None and costs.max_block < max_block:
            raise ArgumentError(f"the cost table stops at block {costs.max_block}; it must reach max_block {max_block}")
        self.max_block, self.costs, self.tree_nodes = max_block, costs, tree_nodes
        self.fixed, self.trees = fixed or max_block == 1 or costs is None, False
        self.acceptance, self.ranks = SlotAcceptance(max_block), RankAcceptance()
        self.copies = None  # the pair's copy acceptance per match class, where a request's copies start (copy_source)
        # Per row count (2 rows that pay say nothing of 8): plain cycles before the next probe, and since drafting.
        self.patience: Dict[int, int] = defaultdict(lambda: PROBE_WAIT)
        self.plain_run: Dict[int, int] = defaultdict(int)
        self.drafting_net = 0.0  # seconds drafting has saved over plain decoding, less what it lost
        self.chosen = Counter()
        self.tree_tokens: Dict[int, tuple] = {}  # by cap: what best_tree worked out at the last refresh
        self.stale = False  # whether a drafting cycle has moved the acceptance since
        self.searching = self.decoded = 0.0  # seconds spent searching trees, and decoding
        # Seconds drafted since the plain step was priced, plain steps in a row, left in a recheck.
        self.drafted_since, self.plain_streak, self.recheck_left = 0.0, 0, 0

    def begin(self, trees: bool = False) -> None:
        """Start a lone generation (``trees``: whether it may verify trees): a
        probe within ``PROBE_WAIT`` plain cycles where drafting has paid so far,
        else the backed-off wait (``PROBE_BUDGET`` however short the generations)."""
        self.chosen, self.trees = Counter(), trees
        patience = self.patience[1]
        if self.drafting_net > 0 or patience <= PROBE_WAIT:
            self.plain_run[1] = max(0, patience - PROBE_WAIT)

    def choose(self, remaining, rows: Optional[List[SlotAcceptance]] = None):
        """The next cycle, never more than each row's ``remaining`` tokens'
        worth (an int: a request alone; else one per row of ``rows``)."""
        if isinstance(remaining, int):
            remaining, rows = [remaining], [self.acceptance]
        n, cap = len(rows), max(1, min(self.max_block, max(remaining)))
        run, patience = self.plain_run[n], self.patience[n]
        if self.tree_nodes and cap > 1 and n == 1:
            choice = TreeChoice(self.tree_nodes)
        elif self.fixed:
            choice = cap
        elif 0 < run and run + 1 < patience and run % REVISIT:
            # Inside a plain spell nothing moves the acceptance and a plain step
            # barely moves the costs: reconsidered every REVISIT steps and before a probe.
            self.plain_run[n] = run + 1
            choice = 1
        else:
            switch = not self.costs.drafted  # out of a plain step, a drafting cycle pays the switch
            rate = self.rates(cap, rows, remaining, switch=switch)
            best = max(rate)
            choice = rate.index(best) + 1
            nodes = self.best_tree(cap, best, rows[0]) if self.trees and cap > 1 and n == 1 else 0
            if nodes:
                choice = TreeChoice(nodes)
            elif choice > 1 and not self.drafting_pays(rows, remaining, choice, switch):
                choice = 1
            if self.recheck_left or (choice != 1 and self.drafted_since >= self.recheck_interval(best, n)):
                if not self.recheck_left:  # a recheck starts
                    self.costs.forget_plain(n)
                    self.recheck_left, self.drafted_since = RECHECK_STEPS, 0.0
                self.recheck_left -= 1
                choice = 1
            elif choice == 1:
                self.plain_run[n] = run + 1
                if run + 1 >= patience:  # a probe: the drafting length that looks best
                    choice = max(range(2, cap + 1), key=lambda b: rate[b - 1], default=1)
        self.chosen[choice] += 1
        return choice

    def best_tree(self, cap: int, chain_rate: float, row: SlotAcceptance) -> int:
        """Nodes of the tree with the most expected tokens per second, if it
        beats ``chain_rate`` and, at the shares as seen, plain decoding; else 0.
        Searched only where bounds leave room, and anew only while searching
        (host work on a drafting cycle's path) takes at most 1% of the time."""
        if self.stale and self.searching <= 0.01 * self.decoded:
            self.tree_tokens.clear()
            self.stale = False
        if cap not in self.tree_tokens:  # the shares, the slot rates and bounds, optimistic and as seen
            shares = self.ranks.shares()
            rates = [row.rates(optimistic)[: cap - 1] for optimistic in (True, False)]
            self.tree_tokens[cap] = (shares, rates, [tree_tokens_bound(r, shares) for r in rates], {})
        shares, rates, bounds, searched = self.tree_tokens[cap]

        def expected(i: int) -> List[float]:  # T(n), optimistic (0) or as seen (1), its host time counted
            if i not in searched:
                tic = time.perf_counter()
                searched[i] = expected_tree_tokens(rates[i], shares, MAX_TREE_NODES)
                self.searching += time.perf_counter() - tic
            return searched[i]

        cheapest, plain_rate = self.costs.trees(1)[1], 1 / self.costs.upto(1)[0]
        if bounds[1] / cheapest <= plain_rate or bounds[0] / cheapest <= chain_rate:
            return 0
        costs = self.costs.trees(MAX_TREE_NODES)
        tree_rate = [e / c for e, c in zip(expected(0), costs)]
        nodes = max(range(1, MAX_TREE_NODES + 1), key=tree_rate.__getitem__)
        return nodes if tree_rate[nodes] > chain_rate and expected(1)[nodes] / costs[nodes] > plain_rate else 0

    def rates(self, cap: int, rows=None, remaining=None, optimistic: bool = True, switch: bool = False) -> List[float]:
        """Expected tokens per second, all rows (None: the pair's), at blocks
        1..``cap``; the ``optimistic`` shares' hope shared among the rows (a long
        block tried on a hope costs every row's verify; one row tells as much).
        With ``switch``, a drafting cycle also pays the switch from plain steps."""
        rows = rows or [self.acceptance]
        tokens, n = [0.0] * cap, len(rows)
        for r, left in zip(rows, remaining or [cap] * n):
            seen, hope = r.expected_as_seen, r.expected if optimistic else r.expected_as_seen
            for b in range(cap):
                i = min(b + 1, left) - 1
                tokens[b] += seen[i] + (hope[i] - seen[i]) / n
        extra = self.costs.switch_cost(n) if switch else 0.0
        return [t / (c + (b > 0) * extra) for b, (t, c) in enumerate(zip(tokens, self.costs.upto(cap, n)))]

    def drafting_pays(self, rows=None, remaining=None, block: Optional[int] = None, switch: bool = False) -> bool:
        """Whether drafting ``block`` (None: some length) beats plain decoding
        at the shares as seen: optimism chooses how far to draft, never
        whether to (a drafter rarely accepted would keep looking worth a try)."""
        rate = self.rates(block or self.max_block, rows, remaining, optimistic=False, switch=switch)
        return max(rate[1:] if block is None else rate[-1:], default=0.0) > rate[0]

    def longest_wait(self, probe: int, rows: int = 1) -> int:
        """Plain cycles between failed probes at most: probing a drafter that
        never agrees (a probe and its switch) costs ``PROBE_BUDGET`` of the time."""
        costs = self.costs.upto(probe, rows)
        plain, probing = costs[0], costs[-1] + self.costs.switch_cost(rows)
        return max(PROBE_WAIT, math.ceil((probing - plain) / (PROBE_BUDGET * plain)))

    def recheck_interval(self, best_rate: float, rows: int = 1) -> float:
        """Seconds of drafting before ``RECHECK_STEPS`` plain steps price it
        afresh (the last price may be a slow spell's): rechecks (their switch,
        what drafting would have gained) cost ``RECHECK_BUDGET`` of the time."""
        plain = self.costs.upto(1, rows)[0]
        lost = self.costs.switch_cost(rows) + RECHECK_STEPS * max(0.0, plain - 1 / best_rate)
        return max(lost / RECHECK_BUDGET, RECHECK_STEPS * plain)

    def observe(
        self, block, accepted, seconds: float, walk: Optional[TreeWalk] = None, context: Optional[int] = None,
        rows: Optional[List[SlotAcceptance]] = None, drafted: Optional[List[int]] = None, remaining: Optional[List[int]] = None,
        valued: Optional[Callable[[], list]] = None, pooled: Optional[List[bool]] = None,
    ) -> None:
        """The cycle at ``block`` (a length or a tree, whose ``walk`` says what
        it showed) took ``seconds`` at ``context`` (None: unknown); each row (one:
        the pair's) had the first ``accepted`` of ``drafted`` (``block - 1``) accepted;
        ``pooled``: whether each also feeds the pair's (None: all). ``valued()``: the rows'
        expected tokens as :meth:`choose` is handed them (None: ``rows``), so whether
        drafting still pays is judged as the next choice will be."""
        accepted = [accepted] if isinstance(accepted, int) else accepted
        rows = rows or [self.acceptance]
        n = len(rows)
        for r, a, d, feeds in zip(rows, accepted, drafted or [block - 1 if isinstance(block, int) else 0] * n, pooled or [True] * n):
            for acceptance in [r] if r is self.acceptance or not feeds else [r, self.acceptance]:  # the row's, and the pair's
                if walk is not None:
                    acceptance.observe(walk.spine, walk.chain_accepted)
                elif d:
                    acceptance.observe(d, min(a, d))
        if walk is not None:
            self.ranks.observe(walk.ranks)
        if self.fixed:
            return
        if not self.costs.follow:
            seconds = self.costs.cost(block, n)  # choices on acceptance alone (see CycleCosts)
        self.costs.observe(block, seconds, context, n)
        self.decoded += seconds
        self.stale = self.stale or block != 1
        if block == 1:
            self.plain_streak += 1
            if self.plain_streak >= RECHECK_STEPS:  # the plain step is priced afresh
                self.drafted_since = 0.0
            return
        self.drafted_since += seconds
        self.plain_streak = 0
        probe, self.plain_run[n] = self.plain_run[n] >= self.patience[n], 0
        self.drafting_net += (n + sum(accepted)) * self.costs.upto(1, n)[0] - seconds
        # A probe that had tokens accepted, drafting looking faster, probes again next plain cycle;
        # a chosen drafting cycle that still looks faster waits PROBE_WAIT; any other doubles the wait.
        if (any(accepted) or not probe) and self.drafting_pays(valued() if valued else rows, remaining):
            self.patience[n] = 1 if probe else PROBE_WAIT
        else:
            self.drafting_net -= self.costs.switch_cost(n)  # back to plain decoding
            probed = block if isinstance(block, int) else self.max_block
            self.patience[n] = min(max(self.patience[n], PROBE_WAIT) * 2, self.longest_wait(probed, n))
