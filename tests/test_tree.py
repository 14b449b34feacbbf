"""Draft trees (DDTree): the build, the walk, and the target's tree verify
and rollback against fresh decoding of every path."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import prompt_of, scaled_error

from dflash_mlx.targets import adapter_for
from dflash_mlx.tree import DraftTree, build_tree, chain


def test_budget_b_minus_1_with_one_candidate_is_the_chain():
    rng = np.random.default_rng(0)
    logprobs = -np.sort(rng.random((7, 1)), axis=0)
    ids = rng.integers(0, 100, (7, 1))
    tree = build_tree(5, ids, logprobs, 7)
    want = chain(5, ids[:, 0])
    assert (tree.tokens, tree.parents, tree.depths) == (want.tokens, want.parents, want.depths)
    assert tree.is_chain


def test_best_first_takes_the_best_paths():
    """Slot log-probs chosen so the best 4 paths are known by hand."""
    ids = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    lp = np.log(np.array([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]]))
    tree = build_tree(1, ids, lp, 5)
    # scores: 10 (.6), 10-20 (.54), 11 (.3), 10-20-30 (.27), 11-20 (.27), 10-20-31 (.216)
    assert tree.tokens == [1, 10, 20, 11, 30, 20]
    assert tree.parents == [-1, 0, 1, 0, 2, 3]
    assert tree.depths == [0, 1, 2, 1, 3, 2]
    assert tree.ranks == [0, 0, 0, 1, 0, 0]
    # every node after its parent; each path's score at most its parent's
    assert all(p < r for r, p in enumerate(tree.parents) if r)
    anc = tree.ancestors()
    assert anc[4].tolist() == [True, True, True, False, True, False]
    assert tree.positions(100).tolist() == [100, 101, 102, 101, 103, 102]
    assert tree.walk([10, 20, 30, 7, 99, 8]) == ([0, 1, 2, 4], 99)
    assert tree.walk([11, 0, 0, 20, 0, 5]) == ([0, 3, 5], 5)
    assert tree.walk([12, 0, 0, 0, 0, 0]) == ([0], 12)


def test_budget_bounds_the_tree():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((15, 64))
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-logprobs, axis=-1)
    lp = np.take_along_axis(logprobs, ids, -1)
    for budget in (1, 4, 16, 32, 64):
        tree = build_tree(0, ids[:, :budget], lp[:, :budget], budget)
        assert tree.nodes == budget and max(tree.depths) <= 15
        scores = [0.0]
        for r in range(1, tree.rows):
            scores.append(scores[tree.parents[r]] + lp[tree.depths[r] - 1, tree.ranks[r]])
        # best-first: no node outside the tree scores better than the worst inside
        worst = min(scores[1:])
        frontier = [scores[r] + lp[tree.depths[r], 0] for r in range(tree.rows)
                    if tree.depths[r] < 15 and (r, int(ids[tree.depths[r], 0])) not in tree.children]
        assert all(f <= worst + 1e-12 for f in frontier)


# A tree with branches at several depths, deep enough to cross a sliding
# window of 8 and the conv kernel of a GatedDeltaNet layer.
SHAPE = [-1, 0, 1, 0, 2, 3, 4, 2, 6, 8, 9, 5, 0]


def scripted_tree(anchor, vocab, seed=0):
    rng = np.random.default_rng(seed)
    depths = [0]
    for p in SHAPE[1:]:
        depths.append(depths[p] + 1)
    tokens = [anchor] + rng.integers(0, vocab, len(SHAPE) - 1).tolist()
    for r in range(1, len(SHAPE)):  # siblings must differ
        while any(SHAPE[o] == SHAPE[r] and tokens[o] == tokens[r] for o in range(1, r)):
            tokens[r] = (tokens[r] + 1) % vocab
    return DraftTree(tokens, SHAPE, depths, [0] * len(SHAPE))


def prefilled(target, prompt):
    cache = target.make_cache()
    target.forward(mx.array([prompt[:-1]]), cache, record=False)
    return cache


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen3_5", "gemma4_text"])
def test_tree_rows_and_every_rollback_match_fresh_decoding(make_pair, name):
    """Each tree row's logits and taps equal a fresh forward of its path;
    after rolling back to any row's path, the next token's logits equal a
    fresh decode of that path (sliding windows of 8 wrap inside the tree;
    Gemma's KV-shared layers; a hybrid's GatedDeltaNet states)."""
    pair = make_pair(name)
    target = adapter_for(pair.model)
    target.tap_ids = [0, target.num_layers - 1]
    prompt = prompt_of(21)
    tree = scripted_tree(prompt[-1], pair.vocab)
    for row in range(tree.rows):
        cache = prefilled(target, prompt)
        logits, taps = target.forward(mx.array([tree.tokens]), cache, tree=tree)
        path = tree.path_to(row)
        seq = prompt[:-1] + [tree.tokens[r] for r in path]
        fresh_logits, fresh_taps = target.forward(mx.array([seq]), target.make_cache(), record=False)
        assert scaled_error(logits[0, row], fresh_logits[0, -1]) < 1e-4
        assert scaled_error(taps[0, path], fresh_taps[0, -len(path):]) < 1e-4
        target.rollback(cache, path)
        nxt = (row * 7 + 3) % pair.vocab
        step_logits, _ = target.forward(mx.array([[nxt]]), cache)
        target.rollback(cache, 1)
        want = pair.model(mx.array([seq + [nxt]]))[0, -1]
        assert scaled_error(step_logits[0, -1], want) < 1e-4, f"row {row} path {path}"
