"""The cost table a pair's sizer starts from, and whether overlapping the
phases (``mx.async_eval``) beats evaluating each in turn: the engine's own
cycles timed on the live cache (rolled back), once per process per drafter,
target, device and largest block. The sizer only ever sees the seconds."""

import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from .adaptive import BlockSizer, CycleCosts, TreeChoice
from .decode import cycle_timer


@dataclass
class Calibration:
    """What :func:`calibrate` measured (the table; ``settle``: how the loop
    evaluates each phase) and the pair's sizer, which every adaptive
    generation with the pair continues (what one learnt is not paid again)."""

    costs: Dict[int, float]
    settle: Callable
    sizer: BlockSizer
    tree: Optional[Tuple[int, float]] = None  # (nodes, seconds) of a tree cycle, once trees may be chosen


def median_seconds(fn: Callable[[], float], repeats: int = 3) -> float:
    """Median of ``fn()``'s own timings after one untimed call (which compiles)."""
    fn()
    return float(np.median([fn() for _ in range(repeats)]))


_calibrations: Dict[int, dict] = {}  # id(drafter) -> {(target id, device, max block): Calibration}


def calibration_key(target, max_block: int):
    return (id(target.model), str(mx.default_device()), max_block)


def calibrated(target, draft, max_block: int, trees: bool = False) -> bool:
    """Whether :func:`calibrate` has measured this pair already (and its
    tree cycle, when ``trees``): then a generation's cycles start at once."""
    calibration = _calibrations.get(id(draft), {}).get(calibration_key(target, max_block))
    return calibration is not None and (not trees or max_block == 1 or calibration.tree is not None)


def calibrate(target, draft, cache, context: mx.array, max_block: int, trees: bool = False) -> Calibration:
    """Time engine cycles (:func:`~dflash_mlx.decode.cycle_timer`, rolled back):
    the plain step, the shortest drafting block and the whole block (two
    lengths give the slope), both evaluation strategies at the whole block and,
    once trees may be chosen, a tree of its rows (dearer than that chain: a host
    read between draft and verify, the mask). Through the target's ``agreed``:
    pipelined ranks all take rank 0's table, and keep it (no collective a cycle)."""
    saved = _calibrations.get(id(draft))
    if saved is None:  # modules are dicts, so unhashable: key by id, forget on collection
        saved = _calibrations[id(draft)] = {}
        weakref.finalize(draft, _calibrations.pop, id(draft), None)
    key = calibration_key(target, max_block)
    if calibrated(target, draft, max_block, trees):
        return saved[key]
    # What is queued (the prefill) runs first: it is not part of the cycles'
    # cost, and a pipelined target's ranks must run their collectives in one
    # order, which a timed cycle evaluated before the prefill's would break.
    mx.eval(context, [c.state for c in cache])
    timed = cycle_timer(target, draft, cache, context[:, -1:], max_block)
    length = next((c.offset for c in cache if hasattr(c, "offset")), 0)  # the context timed at
    if key not in saved:
        saved[key] = chain_calibration(target, timed, max_block, length)
    calibration = saved[key]
    if trees and max_block > 1:  # its tree not timed yet (else calibrated)
        seconds = median_seconds(lambda: timed(TreeChoice(max_block - 1), mx.eval))
        calibration.tree = (max_block - 1, target.agreed([seconds])[0])
        calibration.sizer.costs.seed_tree(*calibration.tree, context=length)
    return calibration


def chain_calibration(target, timed: Callable, max_block: int, context: int) -> Calibration:
    """:func:`calibrate`'s plain and chain cycles (``timed``: its cycle timer) at ``context`` positions."""
    grid = sorted({1, min(2, max_block), max_block})
    measured = [median_seconds(lambda: timed(b, mx.eval)) for b in grid[:-1]]
    # The whole block under each strategy in turn, after an untimed cycle
    # that compiles: its cost is the faster strategy's, the one the loop takes.
    timed(max_block, mx.eval)
    rounds = [[timed(max_block, settle) for settle in (mx.eval, mx.async_eval)] for _ in range(3)]
    inline, overlapped = (float(m) for m in np.median(rounds, axis=0))
    *measured, overlap = target.agreed([*measured, min(inline, overlapped), float(overlapped < inline)])
    costs = dict(zip(grid, measured))
    table = CycleCosts(costs, follow=target.local_timings, context=context)
    return Calibration(costs, mx.async_eval if overlap else mx.eval, BlockSizer(max_block, table))


def plan(target, draft, cache, context: mx.array, max_block: int, fixed: bool, sizer=None, tree_nodes: int = 0, trees: bool = False):
    """The generation's block sizer and how it evaluates each phase: the
    caller's ``sizer`` or the pair's (``trees``: whether it may choose trees);
    a ``fixed`` block or forced trees of ``tree_nodes`` take only the latter."""
    calibration = calibrate(target, draft, cache, context, max_block, trees)
    if fixed or tree_nodes:
        return BlockSizer(max_block, None, fixed=True, tree_nodes=tree_nodes), calibration.settle
    if sizer is None:
        sizer = calibration.sizer
        sizer.begin(trees)
    return sizer, calibration.settle
