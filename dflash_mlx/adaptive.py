"""Adaptive block size: each cycle verify the block length that maximises
expected committed tokens per second.

A cycle that verifies ``b`` tokens (the anchor and the first ``b - 1``
slots of the drafter's whole block) commits
``E(b) = 1 + sum_{i<b} prod_{j<=i} a_j`` tokens on average, where ``a_j`` is
the probability that slot ``j`` is accepted given that the slots before it
were. It costs ``C(b)``: a verify of ``b`` tokens, plus a draft when
``b > 1`` (``b = 1`` is plain decoding). The draft is always the whole
block the drafter was trained on: fewer masks would make its early slots
worse, so a shorter block saves verify work only. The loop picks
``argmax_b E(b) / C(b)``, with ``a_j`` estimated from recent cycles and
``C(b)`` measured (:class:`CycleCosts`). The choice changes only the speed:
greedy output and the sampled distribution do not depend on it, since it is
made from past cycles only, before the block is drafted.

At ``b = 1`` nothing is drafted, so nothing is learnt about acceptance; the
sizer then probes now and then, drafting the length that looks best for
drafting at the optimistic estimates, and backs off while the drafter keeps
failing (at most ``PROBE_BUDGET`` of the plain decoding time), so drafting
comes back when acceptance recovers. Where verified rows are dear (a CPU at
a long context) the probe is short and costs little; where they are cheap
it drafts the whole block, and one probe of every slot tells more than one
of the first slot, since a drafter's acceptance comes in runs. While it
drafts, it sees no plain step, so now and then it decodes a few plainly to
price them afresh (a recheck, at most ``RECHECK_BUDGET`` of the drafting
time). What a pair's sizer has learnt carries over to its next generation
in the process.

A cycle may also verify a draft tree of ``n`` nodes (:mod:`dflash_mlx.tree`):
its expected committed tokens ``T(n)`` come from the same slot acceptance
and, for the drafter's other candidates, from how often the target's token
was the drafter's r-th candidate at the slots past walks reached
(:class:`RankAcceptance`); its cost is measured on its own line
(:class:`CycleCosts`). The sizer takes the best of plain decoding, chains and
trees by expected tokens per second, so a backend whose verify cost grows
fast with rows gets small trees or none, and one where it hardly grows gets
large ones (the crossover is worked out in docs/ddtree.md).

The policy is numbers only: the loop runs every forward, measures them
(:mod:`dflash_mlx.calibration` for the table a generation starts from, the
cycles' own timings after that) and hands this module seconds and
acceptance, so it is tested on numbers alone.
"""

import itertools
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from .errors import ArgumentError
from .tree import best_first

# The largest draft tree the sizer considers (nodes), and the candidates per
# slot its acceptance model tells apart (a target token ranked lower counts
# as no candidate's).
MAX_TREE_NODES = 64
MODELLED_RANKS = 16


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
        """What a chain of the tree's spine would have accepted: the slots
        up to the first where the target's token was not the best candidate."""
        lead = next((i for i, r in enumerate(self.ranks) if r != 0), len(self.ranks))
        return min(lead, self.spine)


@dataclass
class SlotAcceptance:
    """Running estimate of how far into a block the target accepts.

    Slot by slot, as a product-limit (Kaplan-Meier) estimate: of the recent
    cycles that drafted slot ``j`` and had every slot before it accepted,
    the share that had ``j`` accepted too is ``a_j``, each cycle weighing
    ``decay`` times less per later cycle that reached the slot. A drafter's
    acceptance comes in runs, long accepted stretches between early
    rejections: once past the first slots a cycle tends to go far, and
    per-slot shares keep that shape, where one rate for all slots would
    spread it into a geometric tail that overvalues short blocks. A cycle
    that stopped drafting before slot ``j`` says nothing about it. Each
    slot's share is drawn toward the share of all drafted slots accepted
    lately (:meth:`rate`, from a prior of ``prior`` at first) as if
    ``prior_weight`` more cycles had shown that: a slot seen in a few
    cycles is not judged on them alone, and one the loop has not drafted
    lately follows how the drafter does overall. ``optimistic`` shares are
    taken one standard error up: a slot seen in few cycles may do better
    than they showed, and drafting it is the only way to find out, while a
    share seen in many cycles is taken nearly as it is. The sizer uses
    those to choose how far to draft, and the shares as they are to decide
    whether drafting pays at all (:meth:`BlockSizer.choose`).
    """

    max_block: int
    prior: float = 0.8
    prior_weight: float = 4.0
    decay: float = 0.9

    def __post_init__(self):
        n = max(self.max_block - 1, 0)
        self.hits = self.misses = 0.0
        self.pooled_prior = self.prior_weight
        # per slot j (index j - 1): decayed cycles that reached it, and that rejected it
        self.reached = [0.0] * n
        self.rejected = [0.0] * n
        self.update()

    def update(self) -> None:
        """Recompute ``expected`` (optimistic) and ``expected_as_seen``."""
        self.expected = self.expected_tokens()
        self.expected_as_seen = self.expected_tokens(optimistic=False)

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

    def rate(self) -> float:
        """Share of drafted slots accepted lately (each rejection ends a cycle), prior included."""
        w = self.pooled_prior
        return (self.hits + w * self.prior) / (self.hits + self.misses + w)

    def rates(self, optimistic: bool = True) -> List[float]:
        """``a_j`` for slots 1..max_block-1."""
        pooled, w = self.rate(), self.prior_weight
        out = []
        for n, rej in zip(self.reached, self.rejected):
            a = 1 - (rej + w * (1 - pooled)) / (n + w)
            if optimistic:
                a = min(1.0, a + math.sqrt(a * (1 - a) / (n + w)))  # one standard error up
            out.append(a)
        return out

    def expected_tokens(self, optimistic: bool = True) -> List[float]:
        """``E(b)`` for b = 1..max_block (index b - 1)."""
        out, reach = [1.0], 1.0
        for a in self.rates(optimistic):
            reach *= a
            out.append(out[-1] + reach)
        return out


class RankAcceptance:
    """How often the target's token at a slot the walk reached is the
    drafter's r-th candidate, for r >= 1 (r = 0 is the chain's acceptance,
    :class:`SlotAcceptance`), as shares of the slots where it was not the
    best one, pooled over slots: ``q_r``, so that the probability of rank
    ``r`` at slot ``j`` is ``(1 - a_j) q_r``. Decayed as the slot shares
    are, and drawn toward a prior: half the misses go to the next
    candidates, halving with each rank (so trees get tried before the
    cycles have shown anything).
    """

    def __init__(self, ranks: int = MODELLED_RANKS, prior: float = 0.5, prior_weight: float = 4.0, decay: float = 0.9):
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


def expected_tree_tokens(rates: List[float], shares: List[float], nodes: int) -> List[float]:
    """``T(n)`` for n = 0..nodes: expected tokens a cycle commits with the
    best tree of n nodes when slot ``j``'s rank-r candidate is the target's
    token with probability ``rates[j-1]`` (r = 0) or ``(1 - rates[j-1])
    shares[r]``, independently per slot given the walk reached it. A node
    adds the probability that the walk reaches it and the target takes it;
    the best-first build (the drafter's, on these probabilities) adds the
    most probable nodes first, so ``T(n)`` is 1 plus the first n of them."""
    if not rates or nodes < 1:
        return [1.0] * (nodes + 1)
    k = min(nodes, len(shares))
    rows = [sorted([a] + [(1 - a) * q for q in shares[1:k]], reverse=True) for a in rates]
    logs = [[math.log(p) if p > 0 else -math.inf for p in row] for row in rows]
    scores = best_first(logs, nodes)[3]
    out = list(itertools.accumulate([1.0] + [math.exp(x) for x in scores[1:]]))
    return out + [out[-1]] * (nodes + 1 - len(out))


def tree_tokens_bound(rates: List[float], shares: List[float]) -> float:
    """An upper bound on ``T(n)`` for every n (:func:`expected_tree_tokens`):
    a walk passes slot ``j`` at most as often as the target's token is one
    of the drafter's modelled candidates at every slot up to ``j``, however
    many nodes the tree holds. A few products, where the tree search is a
    best-first build: when even this bound cannot beat the chain, the
    search is skipped."""
    covered = sum(shares[1:])
    out, reach = 1.0, 1.0
    for a in rates:
        reach *= a + (1 - a) * covered
        out += reach
    return out


class ContextGrowth:
    """How much a cycle's cost grows per context position: ``at(rows)`` =
    ``per_cycle + per_row * rows`` seconds for a cycle verifying ``rows``
    rows. Every verified row attends to the context (``per_row``); a
    backend may also pay per cycle for the cache's length whatever the rows
    (``per_cycle``: copying it, say), so a one-row step's cost can grow
    faster per row than a block's. Fitted by least squares to the seconds
    against context and rows times context within each kind of cycle (a
    block length, or trees), each kind with its own intercept; sums decayed
    by ``decay`` per cycle of that kind, slowly: the growth is the model's
    and the backend's, and it shows only over a span of contexts. Until
    kinds of two row counts have spanned contexts, ``per_row`` alone is
    fitted. Each is taken as fitted when it exceeds one standard error, and
    as 0 otherwise or until the cycles have spanned ``span`` positions of
    context: over a short span, a machine growing busier as a generation
    goes on (its context growing with it) would pass for growth. Not a
    fraction of it down: a growth read low prices long blocks low at long
    contexts, and the loop drafts where it should not."""

    def __init__(self, decay: float = 1 - 1 / 256, every: int = 32, span: int = 1024):
        self.decay, self.every, self.span = decay, every, span
        self.sums: Dict[object, List[float]] = {}  # kind -> [w, c, y, cc, cy, yy]
        self.rows: Dict[object, int] = {}  # kind -> rows it verifies
        self.per_cycle = self.per_row = 0.0
        self.seen = 0
        self.low = self.high = None  # the contexts seen

    def at(self, rows: int) -> float:
        """Seconds a cycle verifying ``rows`` rows grows by per context position."""
        return self.per_cycle + self.per_row * rows

    def observe(self, kind, rows: int, context: int, seconds: float) -> None:
        """A cycle of ``kind`` verifying ``rows`` rows after ``context``
        positions took ``seconds``; refitted after every multi-row cycle
        (those are rare while the loop decodes plainly, and each is the
        only news of how its rows grow) and every ``every`` plain ones (a
        plain step's host time should stay the forward's)."""
        self.low = context if self.low is None else min(self.low, context)
        self.high = context if self.high is None else max(self.high, context)
        s = self.sums.setdefault(kind, [0.0] * 6)
        self.rows[kind] = rows
        for i, v in enumerate((1.0, context, seconds, context * context, context * seconds, seconds * seconds)):
            s[i] = s[i] * self.decay + v
        self.seen += 1
        if rows > 1 or self.seen % self.every == 0:
            self.per_cycle, self.per_row = self.fit()

    def fit(self) -> Tuple[float, float]:
        """(per_cycle, per_row): both terms where each exceeds its standard
        error; else ``per_row`` alone where it does (a per-cycle growth then
        counts per row, dearer for long blocks than it is, never cheaper:
        a term read as 0 would price a long block at a long context far
        below its cost); else none."""
        if self.high - self.low < self.span:
            return 0.0, 0.0
        # Normal equations of the context terms, each kind centred on its own means.
        a = np.zeros((2, 2))
        b, weight, residual = np.zeros(2), 0.0, 0.0
        for kind, (w, c, y, cc, cy, yy) in self.sums.items():
            r = np.array([1.0, self.rows[kind]])
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
    """The solution of the normal equations ``a x = b`` (``residual``: the
    centred sum of squares of the seconds), each term 0 unless it exceeds
    its standard error; None without the degrees of freedom to tell."""
    if dof < 4 or a[-1, -1] <= 0:
        return None
    theta = np.linalg.solve(a, b)
    error = np.sqrt(max(residual - float(theta @ b), 0.0) / dof * np.diag(np.linalg.inv(a)))
    return tuple(float(t) if t > e else 0.0 for t, e in zip(theta, error))


# Plain steps the cost table counts as in the plain step's median (see CycleCosts.refit).
PLAIN_PRIOR = 3


class CycleCosts:
    """Seconds per cycle at each block length, measured.

    A plain step costs ``C(1)``; a drafting cycle ``C(b) = D + s (b - 1)``:
    one draft of the whole block, plus a verify growing by ``s`` per token. The
    table a generation starts from (``calibrated``: the plain step and
    drafting lengths, see :func:`dflash_mlx.calibration.calibrate`) gives all three. Online,
    ``C(1)`` is the median of the last ``window`` plain cycles and the
    table's, counted as ``PLAIN_PRIOR`` of them; ``s`` is
    fitted by least squares to the last ``window`` drafting cycles, drawn
    toward the table's slope as much as if the table were one more cycle
    at each end of the block range (a window at one length says nothing of
    the slope); ``D`` is the median of those cycles less their slope part.
    Medians, since a cycle now and then is slowed by the machine, not by
    its length; one ``D`` for every drafting length, so that each drafting
    cycle informs them all and the length the loop happens to use never
    looks cheaper for being the one measured. A first cycle at a length is
    not counted: it may include compiling that length's graphs.
    ``follow=False`` keeps the table as given, so that the choices depend
    on acceptance alone (tests, simulations, pipelined ranks).

    A tree of ``n`` nodes verifies ``n + 1`` rows and costs
    ``C_tree(n) = D_t + s_t n``: it starts through the tree cycle the table
    measured (``tree``: nodes and seconds) with the chain's slope, or
    without one as the chain of as many rows costs, and follows tree cycles
    the same way (its own window, the chain's slope as its prior), since
    building, masking and walking it, and the host read between the draft
    and the verify, cost what they cost on this backend.

    Switching between plain decoding and drafting moves time between
    cycles: a plain step is queued before the previous one is read, and on
    MLX's CPU backend a plain step's timing then holds the next one's
    forward (measured, BENCHMARKS.md). The last plain step before a drafting
    cycle looks nearly free, the first one after it twice as dear, and
    on a device that runs ahead the first one after it waits for its own
    forward. Neither is a plain step's cost, nor a drafting cycle's: the two
    together, less two plain steps, are one ``switch`` (the median of the
    last ``window``), which a probe between plain steps pays and a drafting
    cycle followed by another does not (:meth:`BlockSizer.longest_wait`).
    Charged to the drafting cycle, the excess after it made a loop that had
    been probing see only cycles that paid it and price drafting as dear as
    an isolated probe, so it kept probing a drafter that pays when it drafts
    on; charged to the plain step, it made plain decoding look dearer the
    more often the loop switched.

    Costs follow the context: every verified row attends to all the
    positions before it, so a cycle verifying ``r`` rows at context ``L``
    costs ``G(r) L`` more than at context 0, ``G(r)`` the
    :class:`ContextGrowth` fitted to the cycles' own timings against their
    context. Each window's cycles are moved from their own contexts to the
    current one (the last cycle's ``context``) by ``G`` before its line is
    fitted: probes far apart span thousands of positions, and a line fitted
    across them would read what the context added as what the block length
    did. A line the loop has not used since the prompt was short (plain
    steps while it drafts, trees, the table's slope) is moved by ``G`` of
    its rows times the context grown since. Without
    ``context`` the costs stay where they were measured.
    """

    def __init__(
        self, calibrated: Dict[int, float], window: int = 32, follow: bool = True, context: int = 0,
        tree: Optional[Tuple[int, float]] = None,
    ):
        drafting = sorted(b for b in calibrated if b > 1)
        if 1 not in calibrated:
            raise ArgumentError("a cost table needs the plain step's cost (block 1)")
        self.plain, self.slope, self.draft = float(calibrated[1]), 0.0, float(calibrated[1])
        self.table_plain = self.plain
        if len(drafting) > 1:  # least squares, the slope kept >= 0
            lengths, costs = np.array(drafting, float) - 1, np.array([calibrated[b] for b in drafting])
            self.slope = max(0.0, float(np.polyfit(lengths, costs, 1)[0]))
            self.draft = float(np.mean(costs - self.slope * lengths))
        elif drafting:  # one drafting length: flat until cycles of other lengths show a slope
            self.draft = float(calibrated[drafting[0]])
        self.max_block = drafting[-1] if drafting else 1
        self.prior_slope = self.slope
        self.follow = follow
        self.warm = set()
        self.plain_recent = deque(maxlen=window)  # (0, seconds, context)
        self.plain_dirty = False  # whether plain steps came since the plain line was fitted
        self.drafting_recent = deque(maxlen=window)  # (b - 1, seconds, context)
        self.tree_recent = deque(maxlen=window)  # (nodes, seconds, context)
        # Switches: the plain steps around drafting cycles, their seconds over two plain steps.
        self.switch_recent = deque(maxlen=window)
        self.switch = self.entry = 0.0
        self.drafted, self.held = False, None  # whether the last cycle drafted; a plain step not yet counted
        self.tree_draft, self.tree_slope = None, None  # None: as the chain of as many rows
        # Cycles verifying copies alone (rows - 1, seconds, context), and their
        # line (intercept, slope, context; None: a chain's without the draft).
        self.copy_recent = deque(maxlen=window)
        self.copy_line: Optional[Tuple[float, float, int]] = None
        # Contexts each line was measured at, the current one, and the growth fit.
        self.table_context = self.plain_context = self.draft_context = self.context = context
        self.tree_context = None
        self.growth = ContextGrowth()
        if tree is not None:
            self.seed_tree(*tree, context=context)

    def seed_tree(self, nodes: int, seconds: float, context: int) -> None:
        """Start the tree line through a tree cycle of ``nodes`` nodes timed
        at ``context``, with the chain's slope there (see the class)."""
        self.tree_draft = float(seconds) - self.slope_at(context) * nodes
        self.tree_slope, self.tree_context = self.slope_at(context), context

    def fit(self, recent, prior_slope: float):
        """(intercept, slope) of ``recent`` (x, seconds, context): least squares
        for the slope, drawn toward ``prior_slope`` as if it were one more
        cycle at each end of the block range, kept >= 0; the intercept the
        median of the cycles less their slope part."""
        # Plain Python: a few dozen numbers, on the path between two cycles.
        n = len(recent)
        x_mean = sum(x for x, _, _ in recent) / n
        y_mean = sum(y for _, y, _ in recent) / n
        spread = sum((x - x_mean) ** 2 for x, _, _ in recent)
        fitted = sum((x - x_mean) * (y - y_mean) for x, y, _ in recent)
        ends = (self.max_block - 2) ** 2 / 2  # the table as one cycle at each end of b - 1 = 1..max-1
        slope = prior_slope
        if spread + ends > 0:  # else one drafting length: no slope to fit
            slope = max(0.0, (fitted + ends * prior_slope) / (spread + ends))
        return statistics.median(y - slope * x for x, y, _ in recent), slope

    def observe(self, choice, seconds: float, context: Optional[int] = None) -> None:
        """A cycle at ``choice`` (a block length or a :class:`TreeChoice`)
        took ``seconds`` at ``context`` positions before it (None: unknown,
        the costs do not move with context)."""
        if not self.follow:
            return
        plain = choice == 1
        held, self.held = self.held, None
        after_drafting, self.drafted = self.drafted, not plain
        if context is not None:
            self.context = context
        # Trees of any size share one first cycle: a tree compiles nothing
        # per size, and each size seen once would never be counted.
        key = "tree" if isinstance(choice, TreeChoice) else choice
        if key not in self.warm:
            self.warm.add(key)
            return
        if plain and after_drafting:  # the last step of a switch (see the class)
            self.switch_recent.append(self.entry + seconds - self.upto(1)[0])
            self.switch, self.entry = max(0.0, statistics.median(self.switch_recent)), 0.0
            return
        if held is not None and not plain:  # the first step of a switch
            self.entry = held[0] - self.upto(1)[0]
        elif held is not None:
            self.count(1, *held)
        if plain:  # counted once the next cycle shows it was no switch's
            self.held = (seconds, context)
        else:
            self.count(choice, seconds, context)

    def forget_plain(self) -> None:
        """Drop the plain steps measured so far: a recheck measures them
        afresh (see :meth:`BlockSizer.recheck_interval`); the table stands
        until its steps outnumber it."""
        self.plain_recent.clear()
        self.plain_dirty = True

    def count(self, choice, seconds: float, context: Optional[int]) -> None:
        """A cycle's seconds into its line's window (and the growth fit)."""
        tree = isinstance(choice, TreeChoice)
        rows = choice.nodes + 1 if tree else choice
        if context is not None:
            self.growth.observe(choice, rows, context, seconds)
        window = self.tree_recent if tree else self.plain_recent if choice == 1 else self.drafting_recent
        window.append((rows - 1, seconds, self.context if context is None else context))
        if window is self.plain_recent:
            self.plain_dirty = True  # refitted when next read: plain steps come fast, reads less often
        else:
            self.refit(window)

    def refit(self, window) -> None:
        """The line of ``window`` (trees, plain steps or drafting chains), at the current context."""
        if window is self.tree_recent:
            self.tree_draft, self.tree_slope = self.fit(self.moved(window), self.slope_at(self.context))
            self.tree_context = self.context
        elif window is self.plain_recent:
            # The table counts as PLAIN_PRIOR more steps: a loop that drafts
            # on sees few plain steps between its switches, and one slowed
            # step must not price plain decoding for the rest of the run.
            table = self.table_plain + self.growth.at(1) * (self.context - self.table_context)
            self.plain = statistics.median([*(y for _, y, _ in self.moved(window)), *[table] * PLAIN_PRIOR])
            self.plain_context, self.plain_dirty = self.context, False
        else:
            self.draft, self.slope = self.fit(self.moved(window), self.prior_slope_at(self.context))
            self.draft_context = self.context

    def moved(self, recent) -> list:
        """The cycles of a window, ``(x, seconds, context)`` with ``x + 1``
        rows verified, their seconds moved from their own context to the
        current one: a window spans contexts, and a fit across them would
        take what the context added for what the block length did."""
        now = self.context
        return [(x, y + self.growth.at(x + 1) * (now - c), now) for x, y, c in recent]

    def prior_slope_at(self, context: float) -> float:
        """The table's slope moved from its context to ``context``: each
        extra row attends to the context grown since."""
        return max(0.0, self.prior_slope + self.growth.per_row * (context - self.table_context))

    def slope_at(self, context: float) -> float:
        """The drafting line's slope at ``context``."""
        return max(0.0, self.slope + self.growth.per_row * (context - self.draft_context))

    def upto(self, n: int) -> List[float]:
        """Seconds per cycle at b = 1..n, at the current context."""
        if self.plain_dirty:
            self.refit(self.plain_recent)
        one = self.growth.at(1)  # a one-row cycle's growth; each further row adds per_row
        plain = self.plain + one * (self.context - self.plain_context)
        draft, slope = self.draft + one * (self.context - self.draft_context), self.slope_at(self.context)
        draft = max(draft, plain)  # a draft and a verify of the anchor: never less than a plain step
        return [plain] + [draft + slope * (b - 1) for b in range(2, n + 1)]

    def verify(self, n: int) -> float:
        """Seconds a cycle verifying ``n`` rows it did not draft costs (a
        span copied from the context), at the current context: the line of
        such cycles measured (:meth:`observe_verify`), else a chain of ``n``
        rows without the draft."""
        plain = self.upto(1)[0]
        if self.copy_line is None:
            return plain + self.slope_at(self.context) * (n - 1)
        anchor, slope, context = self.copy_line
        grown = self.context - context
        return max(anchor + self.growth.at(1) * grown, plain) + max(0.0, slope + self.growth.per_row * grown) * (n - 1)

    def observe_verify(self, n: int, seconds: float, context: Optional[int] = None) -> None:
        """A cycle verifying ``n`` rows copied, not drafted, took ``seconds``
        (the first one not counted: it may compile); its line is fitted as
        the drafting line is, the chain's slope its prior."""
        if not self.follow:
            return
        if context is not None:
            self.context = context
        if "copy" not in self.warm:
            self.warm.add("copy")
            return
        self.copy_recent.append((n - 1, seconds, self.context))
        self.copy_line = (*self.fit(self.moved(self.copy_recent), self.slope_at(self.context)), self.context)

    def cost(self, choice) -> float:
        """Seconds a cycle at ``choice`` (a block length or a
        :class:`TreeChoice`) costs by the table, at the current context."""
        return self.trees(choice.nodes)[-1] if isinstance(choice, TreeChoice) else self.upto(choice)[-1]

    def trees(self, n: int) -> List[float]:
        """Seconds per cycle of trees of 0..n nodes (0: the anchor alone), at the current context."""
        plain, one = self.upto(1)[0], self.growth.at(1)
        if self.tree_draft is None:  # as the chain of as many rows
            anchor = self.draft + one * (self.context - self.draft_context)
            return [max(anchor, plain) + self.slope_at(self.context) * k for k in range(n + 1)]
        grown = self.context - self.tree_context
        anchor, slope = self.tree_draft + one * grown, self.tree_slope + self.growth.per_row * grown
        return [max(anchor, plain) + slope * k for k in range(n + 1)]


# The most a drafter that never agrees may slow plain decoding down by
# probing it (see BlockSizer.longest_wait).
PROBE_BUDGET = 0.01
# The most of the decoding time the sizer may spend searching draft trees
# (see BlockSizer.best_tree).
SEARCH_BUDGET = 0.01
# The most a drafter that pays may be slowed down by rechecking the plain
# step's cost while drafting (see BlockSizer.recheck_interval), and the
# plain steps a recheck takes: the two of its switch and one more counted
# step than the table's prior, so that its own steps price plain decoding.
RECHECK_BUDGET = 0.01
RECHECK_STEPS = PLAIN_PRIOR + 3
# Plain steps between two reconsiderations of a plain spell (see BlockSizer.choose).
REVISIT = 8
# Every so many drafting cycles a batch sizer tries another length (see BatchSizer.choose).
EXPLORE_EVERY = 8
# Plain cycles before the first probe, and before the next one while
# drafting looks faster (see BlockSizer.observe); failed probes double it.
PROBE_WAIT = 4


class BlockSizer:
    """Chooses each cycle's block length, or a draft tree
    (:class:`TreeChoice`); ``fixed`` pins the block (``--block-size``), and
    with ``tree_nodes`` every drafting cycle is a tree of that many nodes.

    The loop calls :meth:`choose` before drafting and :meth:`observe` after
    the cycle (with the tree's ``walk`` and the ``context`` it verified
    after); ``chosen`` counts the choices made (a histogram). Anything
    with these two methods and ``max_block`` can stand in for it. Trees are
    considered while ``trees`` is true (:meth:`begin`).
    """

    def __init__(
        self, max_block: int, costs: Optional[CycleCosts], fixed: bool = False,
        probe_block: Optional[int] = None, tree_nodes: int = 0,
    ):
        if costs is not None and costs.max_block < max_block:
            raise ArgumentError(f"the cost table stops at block {costs.max_block}; it must reach max_block {max_block}")
        self.max_block = max_block
        self.costs = costs
        self.fixed = fixed or max_block == 1 or costs is None
        self.tree_nodes = tree_nodes
        self.trees = False
        self.acceptance = SlotAcceptance(max_block)
        self.ranks = RankAcceptance()
        # The longest probe (see the module's docstring for how long each is).
        self.probe_block = max_block if probe_block is None else min(probe_block, max_block)
        self.patience = PROBE_WAIT  # plain cycles before the next probe; doubles on each failed probe
        self.drafting_net = 0.0  # seconds drafting has saved over plain decoding, less what it lost
        self.plain_run = 0
        self.chosen: Dict[int, int] = {}
        # By cap, the bound on T(n) and T(n) itself at the acceptance of the
        # last refresh (see best_tree): plain cycles change only the plain
        # step's cost, and a plain step should cost what the target's
        # forward costs, not a tree search too.
        self.tree_tokens: Dict[int, dict] = {}
        self.stale = False  # whether a drafting cycle has moved the acceptance since
        self.searching = self.decoded = 0.0  # seconds spent searching trees, and decoding
        # Seconds of drafting since the plain step's cost was last measured
        # (a recheck, or a plain spell as long), plain steps observed in a
        # row, and plain steps left in the recheck under way.
        self.drafted_since, self.plain_streak, self.recheck_left = 0.0, 0, 0

    def begin(self, trees: bool = False) -> None:
        """Start a generation (``trees``: whether it may verify draft trees):
        a new histogram, the rest carried over (what the acceptance and the
        costs have shown so far still holds). A new prompt may suit the
        drafter where the last one did not: where drafting has paid so far
        (``drafting_net``), the first probe comes within ``PROBE_WAIT``
        plain cycles, as the first one ever does, a failed one leaving the
        wait where it was, and the plain steps that ended the last
        generation (too few tokens left to draft) are no spell of this one.
        Where it has not and probing has backed off, the wait carries over,
        so a drafter that never agrees is probed at ``PROBE_BUDGET``'s pace
        however short the generations, not once more in each."""
        self.chosen = {}
        self.trees = trees
        if self.drafting_net > 0 or self.patience <= PROBE_WAIT:
            self.plain_run = max(0, self.patience - PROBE_WAIT)

    def choose(self, remaining: int):
        """Block length or :class:`TreeChoice` for the next cycle, never
        more than ``remaining`` tokens' worth."""
        cap = max(1, min(self.max_block, remaining))
        if self.tree_nodes and cap > 1:
            choice = TreeChoice(self.tree_nodes)
        elif self.fixed:
            choice = cap
        elif 0 < self.plain_run and self.plain_run + 1 < self.patience and self.plain_run % REVISIT:
            # Inside a plain spell nothing moves the acceptance estimates and
            # a plain step barely moves the costs: the choice stands, and is
            # reconsidered every REVISIT plain steps and before a probe.
            self.plain_run += 1
            choice = 1
        else:
            rate = self.rates(cap)
            choice = rate.index(max(rate)) + 1
            if self.trees and cap > 1:
                nodes = self.best_tree(cap, max(rate))
                if nodes:
                    choice = TreeChoice(nodes)
            if not isinstance(choice, TreeChoice) and choice > 1 and not self.pays(choice):
                choice = 1
            if self.recheck_left or (choice != 1 and self.drafted_since >= self.recheck_interval(max(rate))):
                if not self.recheck_left:  # a recheck starts
                    self.costs.forget_plain()
                    self.recheck_left, self.drafted_since = RECHECK_STEPS, 0.0
                self.recheck_left -= 1
                choice = 1
            elif choice == 1:
                self.plain_run += 1
                if self.plain_run >= self.patience:
                    choice = max(range(2, min(self.probe_block, cap) + 1), key=lambda b: rate[b - 1], default=1)
        self.chosen[choice] = self.chosen.get(choice, 0) + 1
        return choice

    def best_tree(self, cap: int, chain_rate: float) -> int:
        """Nodes of the tree with the best expected tokens per second, if it
        beats ``chain_rate`` (the best of plain decoding and chains) and, at
        the shares as seen, plain decoding (see :meth:`pays`); else 0. A
        tree's cost grows with its nodes, so none beats a bound over the
        cheapest tree's cost; only when both bounds leave room is the tree
        search run.

        The search is host work between two cycles, on the path of a
        drafting cycle, which cannot be queued before the previous one is
        read. After a drafting cycle moves the acceptance, the estimates are
        refreshed only while searching has cost at most ``SEARCH_BUDGET`` of
        the decoding time; until then the last ones stand (the acceptance
        moves by one cycle's share at a time)."""
        if self.stale and self.searching <= SEARCH_BUDGET * self.decoded:
            self.tree_tokens.clear()
            self.stale = False
        known = self.tree_tokens.setdefault(cap, {})
        if "bound" not in known:
            known["shares"] = shares = self.ranks.shares()
            known["rates"], known["as_seen"] = (self.acceptance.rates(o)[: cap - 1] for o in (True, False))
            known["bound"], known["bound_as_seen"] = (tree_tokens_bound(known[k], shares) for k in ("rates", "as_seen"))
        cheapest, plain_rate = self.costs.trees(1)[1], 1 / self.costs.upto(1)[0]
        if known["bound_as_seen"] / cheapest <= plain_rate or known["bound"] / cheapest <= chain_rate:
            return 0
        if "expected" not in known:
            known["expected"] = self.search(known["rates"], known["shares"])
        costs = self.costs.trees(MAX_TREE_NODES)
        tree_rate = [e / c for e, c in zip(known["expected"], costs)]
        nodes = max(range(1, MAX_TREE_NODES + 1), key=tree_rate.__getitem__)
        if tree_rate[nodes] <= chain_rate:
            return 0
        if "expected_as_seen" not in known:
            known["expected_as_seen"] = self.search(known["as_seen"], known["shares"])
        return nodes if known["expected_as_seen"][nodes] / costs[nodes] > plain_rate else 0

    def search(self, rates: List[float], shares: List[float]) -> List[float]:
        """:func:`expected_tree_tokens` up to ``MAX_TREE_NODES``, its host time counted."""
        tic = time.perf_counter()
        out = expected_tree_tokens(rates, shares, MAX_TREE_NODES)
        self.searching += time.perf_counter() - tic
        return out

    def rates(self, cap: int, optimistic: bool = True) -> List[float]:
        """Expected tokens per second at block lengths 1..``cap``, at the
        current estimates (``optimistic``: the slot shares one standard
        error up, see :class:`SlotAcceptance`)."""
        expected = self.acceptance.expected if optimistic else self.acceptance.expected_as_seen
        return [e / c for e, c in zip(expected[:cap], self.costs.upto(cap))]

    def pays(self, block: int) -> bool:
        """Whether drafting ``block`` beats plain decoding at the slot shares
        as seen. The optimistic shares choose how far to draft, so that
        slots seen in few cycles get tried; whether to draft at all is
        decided on the shares as they are, or a drafter accepted too rarely
        to pay would keep looking worth a try, and the loop would pay for
        that hope every cycle."""
        rate = self.rates(block, optimistic=False)
        return rate[-1] > rate[0]

    def drafting_pays(self) -> bool:
        """Whether some block length beats plain decoding at the slot shares as seen."""
        rate = self.rates(self.max_block, optimistic=False)
        return max(rate[1:], default=0.0) > rate[0]

    def longest_wait(self, probe: int) -> int:
        """Plain cycles between failed probes at most: enough that probing a
        drafter that never agrees costs at most ``PROBE_BUDGET`` of the time
        spent decoding plainly, at the measured costs (a probe's own and the
        switch back to plain decoding after it)."""
        costs = self.costs.upto(probe)
        plain, probing = costs[0], costs[-1] + self.costs.switch
        return max(PROBE_WAIT, math.ceil((probing - plain) / (PROBE_BUDGET * plain)))

    def recheck_interval(self, best_rate: float) -> float:
        """Seconds of drafting before the plain step's cost is measured
        again, in a recheck of ``RECHECK_STEPS`` plain steps. While the loop
        drafts it sees no plain step, and the cost it last measured may be
        a slow spell's: drafting then looks better than it is, and nothing
        would show otherwise. A recheck costs its switch and what drafting
        would have gained over its plain steps at ``best_rate`` (tokens per
        second at the best choice, optimistic estimates);
        rechecks cost at most ``RECHECK_BUDGET`` of the drafting time, and
        take no more time than the drafting between them where both are
        nearly free."""
        plain = self.costs.upto(1)[0]
        per_token = 1 / best_rate
        lost = self.costs.switch + RECHECK_STEPS * max(0.0, plain - per_token)
        return max(lost / RECHECK_BUDGET, RECHECK_STEPS * plain)

    def observe(
        self, block, accepted: int, seconds: float, walk: Optional[TreeWalk] = None, context: Optional[int] = None
    ) -> None:
        """The cycle at ``block`` (a length or a :class:`TreeChoice`, whose
        ``walk`` says what it showed) accepted ``accepted`` drafted tokens
        in ``seconds``, verifying after ``context`` positions (None: unknown)."""
        if self.fixed or self.tree_nodes:
            return
        if not self.costs.follow:
            # Choices on acceptance alone (see CycleCosts): the clock differs
            # from run to run, and between pipelined ranks, whose choices
            # must agree; every one of them holds the same table.
            seconds = self.costs.cost(block)
        self.costs.observe(block, seconds, context)
        self.decoded += seconds
        self.stale = self.stale or block != 1  # a drafting cycle moves the acceptance estimates
        if isinstance(block, TreeChoice):
            self.acceptance.observe(walk.spine, walk.chain_accepted)
            self.ranks.observe(walk.ranks)
        else:
            self.acceptance.observe(block - 1, accepted)
        if block == 1:
            self.plain_streak += 1
            if self.plain_streak >= RECHECK_STEPS:  # the plain step's cost is measured afresh
                self.drafted_since = 0.0
            return
        self.drafted_since += seconds
        self.plain_streak = 0
        probe, self.plain_run = self.plain_run >= self.patience, 0
        # A probe succeeds when it had tokens accepted and drafting now looks
        # faster than plain decoding: then the next plain cycle probes again.
        # After a drafting cycle the sizer chose, while drafting still looks
        # faster, the next probe is PROBE_WAIT plain cycles away, should the sizer
        # stop drafting. After any other drafting cycle the next probe waits
        # twice as long: a drafter whose tokens are accepted now and then,
        # but too rarely to pay, is neither probed every other cycle nor,
        # after the sizer drafted on the strength of one lucky cycle,
        # probed from 4 plain cycles anew.
        self.drafting_net += (1 + accepted) * self.costs.upto(1)[0] - seconds
        if probe and accepted and self.drafting_pays():
            self.patience = 1
        elif not probe and self.drafting_pays():
            self.patience = PROBE_WAIT
        else:
            self.drafting_net -= self.costs.switch  # back to plain decoding
            self.patience = min(max(self.patience, PROBE_WAIT) * 2, self.longest_wait(block if isinstance(block, int) else self.probe_block))


class BatchCosts:
    """Seconds of a batched cycle by its shape, measured: ``B`` rows, each
    verifying ``L`` tokens (``L = 1``: a plain batched step, no draft).

    A plain step costs ``p + q B``; a drafting cycle ``a + b B + s B (L - 1)``,
    the drafter's forward and the target's for ``B`` requests (``s`` per
    verified draft row). The two lines are fitted apart, by least squares to
    the shapes of their kind the loop has run: a plain step runs no draft and
    is queued ahead of its read, and on one line with the drafting cycles it
    was priced by whatever they left over (at 8 requests, above what it
    costs: the batch never tried one). Each shape counts by the mean of its
    last ``per_shape`` cycles (not the median: plain steps queued ahead are
    read in pairs, one read waiting for two steps and the next for none),
    weighted by how many, so that shapes run rarely (probes, a batch's last
    rows) are not outweighed by a long plain spell. Each shape the prior (the
    pair's one-request table, :meth:`from_table`) was measured at and the
    loop has not run stands in with ``prior_weight`` cycles of the prior's
    cost, and a slight pull toward the prior's terms settles what the shapes
    cannot tell apart (``p`` from ``q B`` until several batch sizes have run).

    A shape not run yet is priced by its line; one that has run, by its own
    cycles with the line's figure counted as one more: where the verify is
    compute-bound a verified row costs more in a large batch than the line
    fitted on small ones says.
    """

    def __init__(self, plain: List[float], drafting: List[float], blocks=(1, 2), per_shape: int = 8, prior_weight: float = 2.0):
        self.prior = {False: np.asarray(plain, float), True: np.asarray(drafting, float)}  # by whether it drafts
        self.theta = {k: v.copy() for k, v in self.prior.items()}
        self.per_shape = per_shape
        self.shapes: Dict[Tuple[int, int], deque] = {}  # (rows, block): the last seconds of that shape
        self.verified: Dict[Tuple[int, int], deque] = {}  # the same, of cycles verifying copies alone
        self.anchors = {(1, b): float(np.dot(self.prior[b > 1], self.features(1, b))) for b in blocks}
        self.prior_weight = prior_weight
        self.warm = set()

    @classmethod
    def from_table(cls, table: CycleCosts) -> "BatchCosts":
        """The prior from one request's costs: a plain step, a draft and a
        verified row. Split between what the batch shares and what each row
        adds as a one-request table can tell: a row of a plain step costs
        what a verified row does, and half the draft is per request."""
        plain, draft, slope = table.upto(2)[0], table.draft, table.slope
        extra = max(0.0, draft - plain)
        shared = max(plain - slope, 0.0)
        return cls([shared, slope], [shared + extra / 2, slope + extra / 2, slope], blocks=(1, 2, table.max_block))

    @staticmethod
    def features(rows: int, block: int) -> List[float]:
        return [1.0, rows] if block == 1 else [1.0, rows, rows * (block - 1)]

    def cost(self, rows: int, block: int) -> float:
        fit = max(float(np.dot(self.theta[block > 1], self.features(rows, block))), 1e-6)
        seen = self.shapes.get((rows, block))
        if not seen:
            return fit
        return (sum(seen) + fit) / (len(seen) + 1)

    def verify(self, rows: int, block: int) -> float:
        """Seconds a cycle of ``rows`` rows verifying ``block`` tokens each
        costs without a draft (spans copied from the context): a plain step
        and the drafting line's verified rows, and once that shape has run,
        its own last cycles with that figure counted as one more."""
        fit = self.cost(rows, 1) + float(self.theta[True][2]) * rows * (block - 1)
        seen = self.verified.get((rows, block))
        return fit if not seen else (sum(seen) + fit) / (len(seen) + 1)

    def observe_verify(self, rows: int, block: int, seconds: float) -> None:
        """A cycle of ``rows`` rows verifying ``block`` copied tokens each took ``seconds``."""
        if (rows, -block) not in self.warm:
            self.warm.add((rows, -block))
            return
        self.verified.setdefault((rows, block), deque(maxlen=self.per_shape)).append(seconds)

    def observe(self, rows: int, block: int, seconds: float) -> None:
        """A cycle of ``rows`` rows at ``block`` took ``seconds``; the first
        of each shape is not counted (it may include compiling)."""
        if (rows, block) not in self.warm:
            self.warm.add((rows, block))
            return
        self.shapes.setdefault((rows, block), deque(maxlen=self.per_shape)).append(seconds)
        kind = block > 1
        shapes = [(k, len(v), sum(v) / len(v)) for k, v in self.shapes.items() if (k[1] > 1) == kind]
        shapes += [(k, self.prior_weight, t) for k, t in self.anchors.items() if k not in self.shapes and (k[1] > 1) == kind]
        x = np.array([self.features(*k) for k, _, _ in shapes])
        weights = np.array([w for _, w, _ in shapes], float)
        y = np.array([t for _, _, t in shapes])
        pull = 1e-3 * weights.sum() * np.diag(np.mean(x * x, axis=0))
        theta = np.linalg.solve(x.T @ (weights[:, None] * x) + pull, x.T @ (weights * y) + pull @ self.prior[kind])
        self.theta[kind] = np.maximum(theta, 0.0)


class BatchSizer:
    """Chooses each batched cycle's block length: the ``L`` that maximises
    the batch's expected committed tokens per second,
    ``sum_b E_b(min(L, r_b)) / C(B, L)``, with each row's own acceptance
    (``E_b`` from its :class:`SlotAcceptance`, so a row the drafter suits
    pulls toward longer blocks and one it does not toward shorter) and
    :class:`BatchCosts`. The length is chosen on the shares as seen, not
    the optimistic ones :class:`BlockSizer` drafts a lone request by: a
    verified row costs compute in proportion to the rows, so every row's
    optimism would be paid for at every cycle; the batch explores on its
    own schedule instead (``EXPLORE_EVERY``: half or twice the best
    length). While plain steps win, a probe drafts now and then at the
    optimistic best (every other one at half of it), after ``PROBE_WAIT``
    plain cycles, twice as many after each probe that did not pay, at most
    ``PROBE_BUDGET`` of the plain time, counted for each batch size apart."""

    def __init__(self, max_block: int, costs: Optional[BatchCosts], fixed: bool = False):
        self.max_block = max_block
        self.costs = costs
        self.fixed = fixed or costs is None or max_block == 1
        # By rows in the batch: plain cycles before the next probe, and plain
        # cycles since the last drafting one. Kept apart, since drafting that
        # pays with 2 rows says nothing of 8, and a batch's last rows, fewer
        # as they end, would otherwise restart every larger batch's probing.
        self.patience: Dict[int, int] = {}
        self.plain_run: Dict[int, int] = {}
        self.probing = False
        self.drafting = self.probes = 0  # drafting cycles chosen, probes
        self.chosen: Dict[int, int] = {}

    def rates(self, rows: List[SlotAcceptance], remaining: List[int], optimistic: bool = True) -> List[float]:
        """Expected tokens per second at block lengths 1..max_block."""
        out = []
        for block in range(1, self.max_block + 1):
            tokens = sum(
                (r.expected if optimistic else r.expected_as_seen)[min(block, rem) - 1] for r, rem in zip(rows, remaining)
            )
            out.append(tokens / self.costs.cost(len(rows), block))
        return out

    def choose(self, rows: List[SlotAcceptance], remaining: List[int]) -> int:
        cap = max(1, min(self.max_block, max(remaining)))
        if self.fixed:
            choice = cap
        else:
            as_seen = self.rates(rows, remaining, optimistic=False)[:cap]
            choice = as_seen.index(max(as_seen)) + 1
            self.probing = False
            n = len(rows)
            if choice == 1:
                self.plain_run[n] = self.plain_run.get(n, 0) + 1
                if self.plain_run[n] >= self.patience.get(n, PROBE_WAIT) and cap > 1:
                    rate = self.rates(rows, remaining)
                    choice = max(range(2, cap + 1), key=lambda b: rate[b - 1])
                    self.probing, self.probes = True, self.probes + 1
                    if self.probes % 2 == 0:
                        # Every other probe at half that length: probes at one
                        # length cannot tell the draft's cost from the verified rows'.
                        choice = max(2, choice // 2)
            else:
                self.plain_run[n] = 0
                self.drafting += 1
                if self.drafting % EXPLORE_EVERY == 0:
                    # Now and then half or twice the best length: cycles at one
                    # length cannot tell the draft's cost from the verified rows'.
                    choice = max(2, min(cap, choice // 2 if self.drafting // EXPLORE_EVERY % 2 else choice * 2))
        self.chosen[choice] = self.chosen.get(choice, 0) + 1
        return choice

    def observe(self, rows: List[SlotAcceptance], remaining: List[int], block: int, seconds: float) -> None:
        """The cycle at ``block`` over ``len(rows)`` rows took ``seconds``
        (the rows' acceptance is already updated with it)."""
        if self.fixed:
            return
        self.costs.observe(len(rows), block, seconds)
        if block == 1:
            return
        n = len(rows)
        as_seen = self.rates(rows, remaining, optimistic=False)
        if max(as_seen[1:], default=0.0) > as_seen[0]:
            self.patience[n], self.plain_run[n] = PROBE_WAIT, 0
        elif self.probing:
            plain, probe = self.costs.cost(n, 1), self.costs.cost(n, block)
            wait = max(PROBE_WAIT, math.ceil((probe - plain) / (PROBE_BUDGET * plain)))
            self.patience[n], self.plain_run[n] = min(self.patience.get(n, PROBE_WAIT) * 2, wait), 0
