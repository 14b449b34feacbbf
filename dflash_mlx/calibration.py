"""The cost table a generation's block sizer starts from, measured by the
loop's own forwards: mock cycles on the live cache, once per process for
each drafter, target, device and largest block (the costs are properties
of the models and the backend; the cycles' own timings rescale them to the
current context). The sizer (:mod:`dflash_mlx.adaptive`) only ever sees
the seconds.

How each phase is evaluated (``mx.eval``, so the host waits, or
``mx.async_eval``, so the host builds the next graph meanwhile) is measured
here too: which is faster depends on the backend and the machine.
"""

import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict

import mlx.core as mx
import numpy as np

from .adaptive import BlockSizer, CycleCosts


@dataclass
class Calibration:
    """What :func:`calibrate` measured: seconds per cycle at a few block
    lengths, and whether overlapping the phases (``mx.async_eval``) beat
    evaluating each in turn (``mx.eval``); and the pair's sizer, which every
    adaptive generation with this pair continues, so that what one
    generation learnt (acceptance, measured costs, the probing back-off)
    is not paid for again by the next turn or request."""

    costs: Dict[int, float]
    overlap: bool
    sizer: BlockSizer

    @property
    def settle(self) -> Callable:
        """How the loop evaluates each phase."""
        return mx.async_eval if self.overlap else mx.eval


def cycle_seconds(
    target, draft, cache, context: mx.array, block: int, settle: Callable, cycles: int = 1, max_block: int = 0
) -> float:
    """Seconds per cycle of a mock decoding cycle at ``block``: draft a
    whole block of ``max_block`` (for ``block > 1``; as the loop does, the
    drafter fills its whole block whatever length is verified), verify
    ``block`` tokens, one host read of the outcome, roll back; on the live
    ``cache`` (left as it was) and a fresh scratch drafter cache per cycle,
    each fed one context position."""
    max_block = max(block, max_block)
    scratches = [draft.make_cache() for _ in range(cycles)]
    head = mx.zeros((1, 1), dtype=mx.int32)
    tic = time.perf_counter()
    for scratch in scratches:
        verify_in = head
        if block > 1:
            masks = mx.array([[0] + [draft.mask_token_id] * (max_block - 1)])
            drafted = draft.propose(masks, context, scratch, slots=block - 1)
            settle(drafted)
            verify_in = mx.concatenate([head, drafted.astype(mx.int32)], axis=1)
        logits, taps = target.forward(verify_in, cache)
        mx.argmax(logits[0], axis=-1).tolist()
        target.rollback(cache, 0)
        settle([c.state for c in cache], taps)
    mx.eval([c.state for c in cache])
    return (time.perf_counter() - tic) / cycles


def median_seconds(fn: Callable[[], float], repeats: int = 3) -> float:
    """Median of ``fn()``'s own timings after one untimed call (which compiles)."""
    fn()
    return float(np.median([fn() for _ in range(repeats)]))


_calibrations: Dict[int, dict] = {}  # id(drafter) -> {(target id, device, max block): Calibration}


def calibrate(target, draft, cache, context: mx.array, max_block: int) -> Calibration:
    """Measure cycle costs at a few block lengths up to ``max_block``, and
    the faster evaluation strategy (cycles at ``max_block``, the two
    strategies alternating). The lengths are the plain step, the shortest
    drafting cycle and the whole block: the two drafting ones give the
    table its slope, what each verified row adds (with the whole block
    alone, a short block would look as dear as a long one until the loop
    happened to try short ones).

    Runs on the live cache (each verify is rolled back), once per process
    for each drafter, target, device and maximum block: the costs are
    properties of the models and the backend, and the online measurements
    rescale them to the current context. The pair's sizer is made here too,
    once, and kept with the costs. What is measured goes through the
    target's ``agreed``, so the ranks of a pipelined target (which run
    these mock cycles together) all take rank 0's costs and strategy; its
    sizer then keeps that table (``local_timings`` false): following each
    cycle's timings would need one more collective per cycle to agree on
    them.
    """
    key = (id(target.model), str(mx.default_device()), max_block)
    saved = _calibrations.get(id(draft))
    if saved is None:  # modules are dicts, so unhashable: key by id, forget on collection
        saved = _calibrations[id(draft)] = {}
        weakref.finalize(draft, _calibrations.pop, id(draft), None)
    if key in saved:
        return saved[key]
    # What is queued (the prefill) runs first: it is not part of the cycles'
    # cost, and a pipelined target's ranks must run their collectives in one
    # order, which a mock cycle evaluated before the prefill's would break.
    mx.eval(context, [c.state for c in cache])
    context = context[:, -1:]
    grid = sorted({1, min(2, max_block), max_block})
    measured = [
        median_seconds(lambda: cycle_seconds(target, draft, cache, context, b, mx.eval, max_block=max_block)) for b in grid
    ]
    timings = {mx.eval: [], mx.async_eval: []}
    for _ in range(3):
        for settle in timings:
            timings[settle].append(cycle_seconds(target, draft, cache, context, max_block, settle, cycles=3))
    faster = np.median(timings[mx.async_eval]) < np.median(timings[mx.eval])
    *measured, overlap = target.agreed([*measured, float(faster)])
    costs = dict(zip(grid, measured))
    at = next((c.offset for c in cache if hasattr(c, "offset")), 0)  # the context the table was measured at
    sizer = BlockSizer(max_block, CycleCosts(costs, follow=target.local_timings, context=at))
    saved[key] = Calibration(costs, bool(overlap), sizer)
    return saved[key]


def plan(target, draft, cache, context: mx.array, max_block: int, fixed: bool, sizer=None, tree_nodes: int = 0, trees: bool = False):
    """The generation's block sizer and how it evaluates each phase, both
    from the calibration; a ``fixed`` block (never with a ``sizer``) takes
    only the evaluation strategy from it, and so do forced trees of
    ``tree_nodes`` nodes. ``trees``: whether the pair's sizer may choose
    trees this generation."""
    calibration = calibrate(target, draft, cache, context, max_block)
    if fixed or tree_nodes:
        return BlockSizer(max_block, None, fixed=True, tree_nodes=tree_nodes), calibration.settle
    if sizer is None:
        sizer = calibration.sizer
        sizer.begin(trees)
    return sizer, calibration.settle
