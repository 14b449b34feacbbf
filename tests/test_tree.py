"""Draft trees (DDTree): the build, the walk, and the target's tree verify
and rollback against fresh decoding of every path."""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from tiny import ScriptedDrafter, committed_sequence, prompt_of, scaled_error

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


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen3_5", "gemma4_text", "gpt_oss", "qwen3_next", "kimi_k25"])
def test_tree_rows_and_every_rollback_match_fresh_decoding(make_pair, name, device):
    """Each tree row's logits and taps equal a fresh forward of its path;
    after rolling back to any row's path, the next token's logits equal a
    fresh decode of that path (sliding windows of 8 wrap inside the tree;
    Gemma's KV-shared layers; gpt-oss's sinks; a hybrid's GatedDeltaNet
    states; MLA's array masks and compressed caches), on each
    device (``mx.fast.rope`` with one offset per row among them)."""
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


# ---------------------------------------------------------------------------
# The loop with trees


class TreeDrafter(ScriptedDrafter):
    """Slot logits whose best candidate is the target's greedy token except
    at a planted slot, where it is the second best (or, every third cycle,
    absent from the top candidates): the tree's walk then takes branches
    other than the best chain."""

    def slot_head_logits(self, block, context, cache, slots=None):
        n = block.shape[1] - 1
        seq = committed_sequence(self.prompt, block, context, cache, self.reference)
        truth = self.draft(seq, n)  # the scripted chain, a mistake planted in it
        at = len(seq) - 1 - len(self.prompt)
        right = (self.reference[at + 1 : at + 1 + n] + [0] * n)[:n]
        cache["last"] = [seq[-1]] + right  # what a walk that follows the target commits
        self.cycle = getattr(self, "cycle", 0) + 1
        self.planted = getattr(self, "planted", [])
        self.planted.append(next((j for j, (t, r) in enumerate(zip(truth, right)) if t != r), None))
        logits = np.zeros((n, self.vocab), np.float32)
        for j, (t, r) in enumerate(zip(truth, right)):
            logits[j, (t * 5 + j) % self.vocab] = 2.0  # a decoy
            logits[j, t] = 4.0
            if t != r and self.cycle % 3:
                logits[j, r] = 3.0  # the truth as runner-up
        return mx.array(logits)[None][:, :slots]


def tree_run(pair, prompt, budget, max_tokens, block=16, eos_ids=(), **kw):
    """Greedy DFlash with forced trees and mlx-lm's decode (no eos unless given)."""
    plain = pair.reference(prompt, max_tokens + block, eos_ids=())
    ref = pair.reference(prompt, max_tokens + block, eos_ids=eos_ids) if eos_ids else plain
    drafter = TreeDrafter(plain, prompt, block, range(block), pair.vocab)
    got, responses = pair.dflash(drafter, prompt, eos_ids=eos_ids, tree_budget=budget, block_size=block,
                                 max_tokens=max_tokens, **kw)
    return got, ref, responses, drafter


CASES = [  # (family, budget, prompt length): every family, every budget, short and long prompts
    ("llama", 4, 300), ("qwen2", 16, 1), ("qwen3", 32, 120), ("qwen3_moe", 64, 7),
    ("qwen3_5", 16, 300), ("qwen3_5_moe", 64, 2),
    ("gemma4_text", 32, 50), ("gemma4", 4, 1), ("gemma4_unified", 16, 9),
    ("gpt_oss", 16, 40), ("qwen3_next", 32, 9), ("deepseek_v3", 16, 120), ("kimi_k25", 4, 1),
]


@pytest.mark.parametrize("name, budget, prompt_len", CASES)
def test_forced_trees_are_lossless(make_pair, name, budget, prompt_len):
    """200 new tokens with a tree every cycle, against mlx-lm's greedy
    decode: walks that leave the best chain, depths past the sliding
    windows (Gemma's of 8 and 16 wrap many times) and the conv kernel."""
    pair = make_pair(name)
    got, ref, responses, drafter = tree_run(pair, prompt_of(prompt_len), budget, 200)
    assert got == ref[:200]
    cycles = responses[1:]
    assert all(r.tree_size == budget or r.block_size == 1 for r in cycles)
    assert all(r.block_size == r.tree_size + 1 for r in cycles if r.tree_size)
    trees = [r for r in cycles if r.tree_size]
    assert len(trees) == len(drafter.planted)
    # walks that took a runner-up went past the planted mistake; without one they stopped there
    past = [r.committed > p + 1 for r, p in zip(trees, drafter.planted) if p is not None]
    assert any(past) and not all(past)


def test_eos_and_max_tokens_inside_a_tree(qwen3_5_pair):
    pair = qwen3_5_pair
    prompt = prompt_of(12)
    plain = pair.reference(prompt, 60)
    eos = plain[17]
    got, ref, responses, _ = tree_run(pair, prompt, 16, 60, eos_ids=[eos])
    assert got == ref and responses[-1].finish_reason == "stop" and eos not in got
    assert responses[-1].committed < responses[-1].block_size  # the tree went past the eos
    for max_tokens in (1, 13):
        got, ref, responses, _ = tree_run(pair, prompt, 16, max_tokens)
        assert got == ref[:max_tokens] and responses[-1].finish_reason == "length"


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4_text"])
def test_three_turn_conversation_with_trees_equals_mlx_lm(make_pair, name):
    """A prompt cache across three turns, a tree every cycle, from a
    drafter close to the target (its walks go deep); Gemma's window of 8
    wraps in the first turn."""
    from test_prompt_cache import dflash_conversation, mlx_lm_conversation, random_turns, tokens_of, without_eos

    import dflash_mlx

    pair = make_pair(name)
    noise = mx.random.normal((pair.vocab,), key=mx.random.key(7)) * 0.05
    drafter = tiny.TreeDoubleDrafter(prompt_of(1), noise, block_size=8, scale=4.0)
    cache = drafter.follow(dflash_mlx.make_prompt_cache(pair.model, drafter))
    turns = random_turns((11, 7, 5))
    want, offset = mlx_lm_conversation(pair.model, pair.tokenizer, turns, 30, eos=[])
    got, cache = dflash_conversation(pair.model, drafter, pair.tokenizer, turns, 30, eos=[], cache=cache, tree_budget=16)
    for w, g in zip(want, got):
        assert tokens_of(g) == without_eos(w, pair.tokenizer, [])
    assert cache.offset == offset and cache.tokens == [t for p, w in zip(turns, want) for t in p + w]
    cycles = [r for turn in got for r in turn[1:]]
    assert all(r.tree_size == 16 for r in cycles if r.block_size > 1)
    assert max(r.accepted for r in cycles) >= 5  # deep walks


def test_tree_budgets_that_cannot_be_honoured_are_refused(qwen3_pair, tmp_path):
    """Pipelined targets verify chains only: a forced tree is refused with
    the reason, and the sizer keeps to chains there; so do drafters without
    per-slot logits, and a budget beside a sizer."""
    from types import SimpleNamespace

    import dflash_mlx
    from dflash_mlx.errors import ArgumentError
    from dflash_mlx.generate import tree_plan
    from dflash_mlx.targets.pipeline import PipelineTarget

    draft = dflash_mlx.load_draft(qwen3_pair.make_draft(tmp_path / "d"), qwen3_pair.model)
    pipelined = SimpleNamespace(no_trees=PipelineTarget.no_trees)
    with pytest.raises(ArgumentError, match="pipelined targets.*--tree-budget 0"):
        tree_plan(pipelined, draft, 8, None)
    assert tree_plan(pipelined, draft, None, None) == (0, False)
    assert tree_plan(draft.target, draft, None, None) == (0, True)
    assert tree_plan(draft.target, draft, 0, None) == (0, False)
    scripted = ScriptedDrafter([], [1], 4, [0], qwen3_pair.vocab)
    with pytest.raises(ArgumentError, match="per-slot logits"):
        next(dflash_mlx.stream_generate(qwen3_pair.model, scripted, qwen3_pair.tokenizer, "x", tree_budget=4))
    with pytest.raises(ArgumentError, match="tree_budget or sizer"):
        tree_plan(draft.target, draft, 4, tiny.ScriptedSizer([2]))
