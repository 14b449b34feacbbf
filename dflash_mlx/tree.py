"""Draft trees (DDTree): many continuations from one drafter pass, verified
by the target in one forward.

Ringel and Romano, "Accelerating Speculative Decoding with Block Diffusion
Draft Trees" (arXiv 2604.12989; reference code liranringel/ddtree). The
drafter gives one distribution per slot of its block. A tree rooted at the
anchor holds, at depth ``d``, candidate tokens for slot ``d``; a path is
scored by the sum of its tokens' drafter log-probabilities (each slot's
distribution taken as independent of the path, as the drafter gives it).
:func:`build_tree` expands the best-scoring frontier node first until the
node budget is spent: a budget of ``B - 1`` with one candidate per slot is
the DFlash chain.

The target verifies every node in one forward: row 0 is the anchor, row
``r`` node ``r``; each row sees the cached context and its own ancestors
only (:meth:`DraftTree.ancestors`), at position context + depth
(:meth:`DraftTree.positions`). :meth:`DraftTree.walk` then follows the
target's own choice at each row (its argmax, or its sample) while a child
holds it; the walked path and the target's token after it are committed.
Every committed token is the target's own choice given its prefix, so the
output is exact at any temperature; the tree only decides how far one
forward reaches.

Rows are numbered in the order :func:`build_tree` adds them, so a parent's
row is always smaller than its children's: verify rows can be processed in
order, level by level or one at a time.
"""

import heapq
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .ops import fast_math


@dataclass
class DraftTree:
    """A verify block shaped as a tree.

    ``tokens[r]``, ``parents[r]`` (-1 for the root), ``depths[r]``,
    ``ranks[r]`` (the token's rank among its slot's candidates, best 0; 0 for
    the root) and ``scores[r]`` (the path's summed log-probability, 0 for
    the root) per row ``r``; row 0 is the anchor.
    """

    tokens: List[int]
    parents: List[int]
    depths: List[int]
    ranks: List[int]
    scores: Optional[List[float]] = None
    children: Dict[Tuple[int, int], int] = field(init=False, repr=False)

    def __post_init__(self):
        self.children = {(p, t): r for r, (p, t) in enumerate(zip(self.parents, self.tokens)) if r}

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def nodes(self) -> int:
        """Drafted nodes (rows less the anchor)."""
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        """Whether every row's parent is the row before it (a plain block)."""
        return all(p == r - 1 for r, p in enumerate(self.parents))

    def ancestors(self) -> np.ndarray:
        """``[rows, rows]`` bool: row ``i`` may attend to row ``j`` (``j`` is
        ``i`` or one of its ancestors)."""
        n = self.rows
        seen = np.zeros((n, n), dtype=bool)
        for r, p in enumerate(self.parents):
            if p >= 0:
                seen[r] = seen[p]
            seen[r, r] = True
        return seen

    def positions(self, offset: int) -> np.ndarray:
        """Each row's sequence position, ``offset`` being the anchor's."""
        return offset + np.asarray(self.depths, dtype=np.int32)

    def path_to(self, row: int) -> List[int]:
        """Rows from the root to ``row``, both included."""
        path = []
        while row >= 0:
            path.append(row)
            row = self.parents[row]
        return path[::-1]

    @property
    def spine(self) -> int:
        """Depth of the chain of best candidates the tree holds (rank 0 at every slot)."""
        row, depth = 0, 0
        for r in range(1, self.rows):
            if self.parents[r] == row and self.ranks[r] == 0:
                row, depth = r, depth + 1
        return depth

    def levels(self) -> List[List[int]]:
        """Rows grouped by depth, shallowest first."""
        out: List[List[int]] = [[] for _ in range(max(self.depths) + 1)]
        for r, d in enumerate(self.depths):
            out[d].append(r)
        return out

    def walk(self, choices: Sequence[int]) -> Tuple[List[int], int]:
        """Follow the target: ``choices[r]`` is its token after row ``r``.

        Returns the walked rows (the root first) and the target's token
        after the last of them (the next anchor).
        """
        row, path = 0, [0]
        while (row, int(choices[row])) in self.children:
            row = self.children[(row, int(choices[row]))]
            path.append(row)
        return path, int(choices[row])


def chain(anchor: int, tokens: Sequence[int]) -> DraftTree:
    """A plain block as a tree: each token the only child of the one before."""
    n = len(tokens)
    return DraftTree([anchor, *map(int, tokens)], list(range(-1, n)), list(range(n + 1)), [0] * (n + 1))


def build_tree(anchor: int, ids: np.ndarray, logprobs: np.ndarray, budget: int,
               takes: Optional[Callable[[Sequence[int]], bool]] = None) -> DraftTree:
    """Best-first tree over per-slot candidates.

    ``ids[j]`` / ``logprobs[j]``: slot ``j + 1``'s candidates, best first, and
    their drafter log-probabilities. A node's score is the sum of the
    log-probabilities along its path; the heap adds the best frontier node
    until ``budget`` nodes are in (:func:`best_first`). ``takes(path)``:
    whether a node's path of tokens below the anchor may be verified (a
    grammar's: a node it refuses could never be accepted, so the budget
    goes to the next best); None: every path.
    """
    ids = ids.tolist() if isinstance(ids, np.ndarray) else ids  # scalars read fast
    parents, depths, ranks, scores = best_first(logprobs, budget, None if takes is None else (ids, takes))
    tokens = [int(anchor)] + [int(ids[d - 1][r]) for d, r in zip(depths[1:], ranks[1:])]
    return DraftTree(tokens, parents, depths, ranks, scores)


def best_first(logprobs, budget: int, held=None) -> Tuple[List[int], List[int], List[int], List[float]]:
    """``(parents, depths, ranks, scores)`` per row of the best-first tree
    (row 0 the root) over ``logprobs[j]``, slot ``j + 1``'s candidates' sorted
    log-probabilities. Candidates are sorted, so a node's next sibling and
    its first child are the only new frontier nodes it opens, every node is
    added after its parent, and scores never rise from row to row. Ties go
    to the node offered first, so the tree is a function of the numbers
    alone (and of ``held``: ``(ids, takes)``, where a node whose path of
    candidate ids ``takes`` refuses is left out, its next sibling offered)."""
    logprobs = logprobs.tolist() if isinstance(logprobs, np.ndarray) else logprobs
    slots, k = len(logprobs), len(logprobs[0]) if logprobs else 0
    parents, depths, ranks, scores = [-1], [0], [0], [0.0]
    paths: List[Tuple[int, ...]] = [()]  # (with ``held``: each row's path)
    order = 0
    frontier: List[Tuple[float, int, int, int, int]] = []  # (-score, order, parent, depth, rank)
    if slots and k and budget > 0:
        frontier.append((-logprobs[0][0], order, 0, 1, 0))
    while frontier and len(parents) <= budget:
        neg, _, parent, depth, rank = heapq.heappop(frontier)
        if rank + 1 < k:
            order += 1
            heapq.heappush(frontier, (-(scores[parent] + logprobs[depth - 1][rank + 1]), order, parent, depth, rank + 1))
        if held is not None:
            path = paths[parent] + (int(held[0][depth - 1][rank]),)
            if not held[1](path):
                continue
            paths.append(path)
        row = len(parents)
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        scores.append(-neg)
        if depth < slots:
            order += 1
            heapq.heappush(frontier, (-(scores[row] + logprobs[depth][0]), order, row, depth + 1, 0))
    return parents, depths, ranks, scores


def walked_ranks(tree: DraftTree, ids: np.ndarray, path: Sequence[int], choices: Sequence[int]) -> List[Optional[int]]:
    """The rank among slot ``d + 1``'s candidates ``ids`` of the target's
    token at each walked row of depth ``d`` (None: not a candidate), for
    the slots the candidates cover: what :class:`~dflash_mlx.adaptive.TreeWalk` learns from."""
    out = []
    for row in path:
        slot = tree.depths[row]
        if slot < len(ids):
            hits = np.nonzero(ids[slot] == choices[row])[0]
            out.append(int(hits[0]) if hits.size else None)
    return out


def candidates(head_logits, k: int, vocab_ids: Optional[mx.array] = None):
    """The best ``k`` tokens of each slot and their log-probabilities, best
    first, as numpy arrays ``[slots, k]`` (one host read), from the
    drafter's head logits ``[slots, K]`` (column ``j`` is target id
    ``vocab_ids[j]``; None: id ``j``). The top ``k`` are picked before
    anything else is computed, and the normaliser is the approximate
    logsumexp on the CPU: these numbers only shape the tree, every token it
    commits is the target's own."""
    logits = head_logits.astype(mx.float32)
    k = min(k, logits.shape[-1])
    top = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    values = mx.take_along_axis(logits, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    top, values = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    norm = fast_math.logsumexp_approx(logits) if fast_math.approx_for(logits) else mx.logsumexp(logits, axis=-1)
    ids = top if vocab_ids is None else vocab_ids[top]
    values = values - norm[..., None]
    mx.eval(ids, values)
    return np.array(ids), np.array(values)
