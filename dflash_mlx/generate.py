"""Lossless block-wise generation: prefill, draft, verify, accept, roll back, stream.

    python -m dflash_mlx.generate --prompt "def fib(n):"
"""

import sys
import threading
import time
from collections import Counter
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Callable, Generator, Iterable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import cli
from .adaptive import BlockSizer, TreeChoice, TreeWalk
from .calibration import calibrated, plan
from .cache import PromptCache, bound_target, prompt_cache_for
from .defaults import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP_SIZE, MAX_BLOCK_SIZE
from .errors import ArgumentError
from .models.dflash import masked_block
from .ops.threads import compiled, release_at_thread_exit
from .sampling import ACCEPTANCE_RULES, processed_probs, sample, speculative_accept
from .tree import build_tree, candidates, walked_ranks


@dataclass
class GenerationResponse:
    """One verify cycle's worth of output (the first one is the prefill token).

    Args:
        text: the new text segment.
        tokens: the tokens committed this cycle (eos excluded, as mlx-lm does).
        accepted: drafted tokens committed this cycle.
        committed: tokens committed this cycle (accepted + 1, fewer only when
            eos ends the generation inside the block; the "acceptance
            length" papers report).
        prompt_tokens, prompt_tps: prompt size and prefill speed.
        generation_tokens, generation_tps: totals so far.
        peak_memory: in GB.
        finish_reason: "stop" (eos), "length" (max_tokens) or None.
        block_size: tokens verified this cycle (1: plain decoding, no draft;
            0: the prefill's response; a tree's rows: the anchor and its
            nodes). Varies from cycle to cycle unless ``block_size`` was fixed.
        tree_size: nodes of the draft tree this cycle verified (0: a chain
            or plain decoding); ``committed`` is then the walked path's
            length plus the target's token after it.
    """

    text: str
    tokens: List[int]
    accepted: int
    committed: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    block_size: int = 0
    tree_size: int = 0


def cycle_lengths(responses: Sequence[GenerationResponse]) -> List[int]:
    """Tokens committed by each verify cycle of one generation, from its
    responses: the first response is the prefill's token, not a cycle."""
    return [r.committed for r in responses[1:]]


def mean_tokens_per_cycle(lengths: Sequence[int]) -> float:
    """Mean of :func:`cycle_lengths` (pooled over generations); 0 without cycles."""
    return sum(lengths) / max(1, len(lengths))


def encode_prompt(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    """str, token list or mx.array -> 1-D token array (mlx-lm's rule for BOS)."""
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1)
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt, dtype=mx.int32)


@compiled  # a handful of tiny ops, fused: one task instead of seven per cycle
def accept_greedy(draft_tokens: mx.array, target_tokens: mx.array) -> Tuple[mx.array, mx.array]:
    """Longest prefix where the draft equals the target's choice, and the
    target's own token at the first mismatch (or after the last slot).

    ``[..., n]`` and ``[..., n + 1]`` in, ``(accepted, next_token)`` out, on
    the device like :func:`speculative_accept`, so the loop reads the whole
    outcome in one host sync.
    """
    n = draft_tokens.shape[-1]
    same = (draft_tokens == target_tokens[..., :n]).astype(mx.int32)
    accepted = mx.cumprod(same, axis=-1).sum(axis=-1)
    return accepted, mx.take_along_axis(target_tokens, accepted[..., None], axis=-1)[..., 0]


def feed(target, cache: PromptCache, tokens: List[int], step: int = DEFAULT_PREFILL_STEP_SIZE, progress=None) -> None:
    """Run the target over the cache's pending tokens and ``tokens``, all but
    the last, which stays pending (so the cache can stop at any boundary and
    still produce that position's logits later).

    Chunks of ``step`` tokens, as mlx-lm's ``generate_step`` prefills; the
    tap states go to ``cache.target_hidden`` for the drafter. The cache
    holds what the target ran after every chunk, so an interruption between
    chunks (``progress`` raising KeyboardInterrupt, say) leaves it usable.
    """
    tokens = list(tokens)
    todo, held = cache.pending + tokens, len(cache.pending)
    body = todo[:-1]
    for start in range(0, len(body), step):
        chunk = body[start : start + step]
        _, target_hidden = target.forward(mx.array([chunk]), cache.target, last_logits_only=True, record=False)
        mx.eval(target_hidden, [c.state for c in cache.target])
        cache.add_hidden(target_hidden)
        ran = start + len(chunk) - held  # of ``tokens``
        cache.tokens.extend(tokens[max(0, ran - len(chunk)) : max(0, ran)])
        cache.pending = []
        if progress is not None:
            progress(start + len(chunk), len(todo))
    cache.tokens.extend(tokens[max(0, len(body) - held) :])
    cache.pending = todo[-1:]


def prefill(target, cache: PromptCache, tokens: List[int], step: int, progress=None) -> mx.array:
    """Feed ``tokens`` and every pending token to the target; the last one
    runs alone (mlx-lm's order). Returns its logits ``[1, V]``."""
    feed(target, cache, tokens, step, progress)
    logits, target_hidden = target.forward(mx.array([cache.pending]), cache.target, last_logits_only=True, record=False)
    cache.add_hidden(target_hidden)
    cache.pending = []
    return logits[:, -1]


def commit_first(cache: PromptCache, token: int, logits, want_logprobs: bool) -> tuple:
    """The prefill's ``token`` committed (pending: the next verify runs it),
    as :func:`generate_step` yields it, with its logprobs if wanted."""
    cache.pending = [token]
    cache.tokens.append(token)
    return token, logits[0] - mx.logsumexp(logits[0]) if want_logprobs else None, False, 0, 0


@dataclass
class AcceptanceRule:
    """How a verified block is accepted: greedy, rejection sampling or
    exact match of the target's samples (see :func:`generate_step`)."""

    sampler: Optional[Callable[[mx.array], mx.array]]
    settings: Optional[dict] = None  # processed_probs' arguments, where the sampler was made from them
    speculative: bool = False  # rejection sampling (else the target's samples are matched exactly)

    @property
    def sampling(self) -> Optional[dict]:
        """processed_probs' arguments when rejection sampling, else None."""
        return self.settings if self.speculative else None

    def choose(self, logits, key=None):
        """The target's token(s) for logits ``[..., V]``; ``key``: a request's
        own random key (None: ``mx.random``'s state, through the sampler)."""
        if self.sampler is None:
            return mx.argmax(logits, axis=-1)
        if key is None or self.settings is None:
            return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        return sample(processed_probs(logits, **self.settings), key)

    def outcome(self, logits, proposal, q, key=None) -> mx.array:
        """A drafting cycle's result as one lazy int32 vector, so the loop
        can queue it and read it with one host sync (:func:`read_outcome`):
        ``[accepted count, the token after them, *proposal]``. A plain
        cycle's is the target's token alone, :meth:`choose` of its logits."""
        if q is None:
            accepted, token = accept_greedy(proposal, self.choose(logits, key))
        else:
            accepted, token = speculative_accept(proposal, processed_probs(logits, **self.settings), q, key)
        return mx.concatenate([accepted[None], token[None], proposal]).astype(mx.int32)


def cycle_tokens(proposed: List[int], accepted: int, bonus: int, eos, room: int) -> Tuple[List[int], bool]:
    """What a verified cycle commits: the ``accepted`` drafted tokens and
    the target's own after them, cut after an eos (kept, as mlx-lm keeps
    it) and to the ``room`` left; and whether an eos ended them."""
    new = proposed[:accepted] + [bonus]
    stop = next((i for i, t in enumerate(new) if t in eos), None)
    if stop is not None:
        new = new[: stop + 1]
    return new[:room], stop is not None and stop < room


def read_outcome(outcome: mx.array) -> Tuple[int, int, List[int]]:
    """``(accepted count, token after them, proposal)`` from :meth:`AcceptanceRule.outcome`."""
    values = outcome.tolist()
    if len(values) == 1:
        return 0, values[0], []
    return values[0], values[1], values[2:]


def acceptance_rule(temperature, top_p, top_k, min_p, sampler, acceptance) -> AcceptanceRule:
    if acceptance not in ACCEPTANCE_RULES:
        raise ArgumentError(f"acceptance must be one of {ACCEPTANCE_RULES}, not {acceptance!r}")
    if sampler is not None or temperature <= 0:
        return AcceptanceRule(sampler)
    settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    return AcceptanceRule(make_sampler(temperature, top_p=top_p, min_p=min_p, top_k=top_k), settings, acceptance == "speculative")


def max_block_size(draft, block_size: Optional[int], sizer: Optional[BlockSizer]) -> int:
    """The largest block a generation verifies: the fixed ``block_size``,
    the ``sizer``'s ``max_block`` or (adaptive) the drafter's trained size."""
    if sizer is not None and block_size is not None:
        raise ArgumentError("pass block_size or sizer, not both (a sizer's max_block is its largest block)")
    max_block = draft.block_size if block_size is None and sizer is None else sizer.max_block if sizer else int(block_size)
    if not 1 <= max_block <= MAX_BLOCK_SIZE:
        raise ArgumentError(f"block_size must be from 1 to {MAX_BLOCK_SIZE}, got {max_block}")
    draft.check_block_size(max_block)
    return max_block


GENERATING: dict = {}  # id(drafter) -> (thread generating with it, generations open there)
GENERATING_LOCK = threading.Lock()


@contextmanager
def one_thread_per_pair(draft):
    """Refuse a generation on a pair that another thread is generating with.

    A pair's adapter, compiled functions and MLX stream are shared state;
    one thread may hold several generations (a conversation's turns), two
    threads may not run at once.
    """
    me = threading.get_ident()
    release_at_thread_exit()  # mlx-lm's compiled functions and mx.random run on this thread
    with GENERATING_LOCK:
        owner, depth = GENERATING.get(id(draft), (me, 0))
        if owner != me:
            raise ArgumentError(
                "this drafter and its target are generating in another thread: run one "
                "generation per pair at a time (wait for it, queue requests on one thread "
                "as mlx-dflash server does, or load a second pair for the second thread)"
            )
        GENERATING[id(draft)] = (me, depth + 1)
    try:
        yield
    finally:
        with GENERATING_LOCK:
            if depth:
                GENERATING[id(draft)] = (me, depth)
            else:
                del GENERATING[id(draft)]


def tree_plan(target, draft, tree_budget: Optional[int], sizer) -> Tuple[int, bool]:
    """``(nodes of the tree every drafting cycle verifies (0: none forced),
    whether the sizer may choose trees)``; a budget this generation cannot
    honour is refused before any work."""
    if tree_budget is not None and tree_budget < 0:
        raise ArgumentError(f"tree_budget must be None (adaptive), 0 (chains only) or a node count, got {tree_budget}")
    able = not target.no_trees and hasattr(draft, "slot_head_logits")
    if tree_budget:
        if sizer is not None:
            raise ArgumentError("pass tree_budget or sizer, not both (a sizer makes every choice)")
        if target.no_trees:
            raise ArgumentError(target.no_trees)
        if not able:
            raise ArgumentError("this drafter gives no per-slot logits to build a tree from: use tree_budget=0")
    return tree_budget or 0, able and tree_budget is None and sizer is None


def checked_prompt(target, cache: PromptCache, prompt) -> List[int]:
    """``prompt`` as a token list, checked before any forward: not empty
    unless the cache has a pending token, every id in the target's vocabulary."""
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not prompt and not cache.pending:
        raise ArgumentError("the prompt is empty")
    target.check_tokens(prompt)
    return prompt


def generate_step(
    prompt: Union[List[int], mx.array],
    model,
    draft,
    *,
    prompt_cache: Optional[PromptCache] = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    block_size: Optional[int] = None,
    sizer: Optional[BlockSizer] = None,
    tree_budget: Optional[int] = None,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    acceptance: str = "speculative",
    eos_token_ids: Iterable[int] = (),
    logprobs: bool = False,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stream=generation_stream, draft_window: Optional[int] = None, draft_sink: Optional[int] = None,
) -> Generator[Tuple[int, Optional[mx.array], bool, int, int], None, None]:
    """Yield each committed token as ``(token, logprobs, from_draft, block,
    tree)``, like mlx-lm's ``speculative_generate_step`` plus the rows its
    cycle verified (0 for the prefill's token) and its draft tree's nodes.

    ``prompt`` holds only the tokens new to ``prompt_cache`` (it may be empty
    when the cache has a pending token; an id outside the target's
    vocabulary is refused before any forward). ``logprobs`` (the target's
    log-probabilities ``[V]`` at the token's position) is None unless asked
    for. Generation ends after ``max_tokens`` tokens or an eos (yielded, and
    kept in the cache as mlx-lm keeps it). Closing the generator at any
    token rolls back a cycle queued meanwhile: the cache is consistent after
    any token. Draft window: :func:`~dflash_mlx.cache.prompt_cache_for`.

    Greedy (``temperature == 0`` and no ``sampler``) output is token-identical
    to the target's own greedy decode. With ``temperature > 0`` every committed
    token is distributed exactly as mlx-lm's ``make_sampler(temperature,
    top_p, min_p, top_k=top_k)`` samples the target, under either
    ``acceptance`` rule:

    - ``"speculative"`` (default): the drafter samples its block from its own
      processed distribution q; each draft token survives with probability
      min(1, p/q) against the target's processed p, the first rejected slot
      is resampled from max(0, p - q) (speculative sampling, see
      :mod:`dflash_mlx.sampling`).
    - ``"exact-match"``: the drafter proposes greedily, the target samples
      every slot, and a draft token survives only if it equals that sample.
      Simpler, accepts less; kept for comparison.

    A custom ``sampler`` (mlx-lm style, fed log-probabilities; it overrides
    ``temperature`` and the truncation arguments) only yields tokens, not the
    p that rejection sampling needs, so it always uses exact match.

    By default each cycle verifies the length (up to the drafter's trained
    size; 1: plain decoding) or the draft tree (:mod:`dflash_mlx.tree`;
    ``tree_budget`` 0: none, ``n``: n nodes every cycle) that maximises expected
    tokens per second, as measured (:mod:`dflash_mlx.adaptive`; a ``sizer`` makes
    the choices instead): a seeded sampled run repeats only when they are fixed.
    """
    rule = acceptance_rule(temperature, top_p, top_k, min_p, sampler, acceptance)
    if max_tokens < 1:
        raise ArgumentError(f"max_tokens must be at least 1, got {max_tokens}")
    max_block = max_block_size(draft, block_size, sizer)
    target = bound_target(model, draft)
    trees = tree_plan(target, draft, tree_budget, sizer)
    cache = prompt_cache_for(model, draft, prompt_cache, draft_window, draft_sink)
    prompt = checked_prompt(target, cache, prompt)
    with generation(target, draft, cache, stream):
        logits = prefill(target, cache, prompt, prefill_step_size, prompt_progress_callback)
        first = commit_first(cache, rule.choose(logits).item(), logits, logprobs)
        plans = lambda: plan(target, draft, cache.target, cache.target_hidden, max_block, block_size is not None, sizer, *trees)  # noqa: E731
        ready = calibrated(target, draft, max_block, trees[1])  # else plans() measures the costs first
        yield from first_then_cycles(target, draft, cache, first, rule, plans, ready, max_tokens, set(eos_token_ids), logprobs)


@contextmanager
def generation(target, draft, cache: PromptCache, stream):
    """What a generation runs in: the pair owned by this thread, its
    stream; however it ends (closed at any token, an error), a cycle it
    queued ahead is rolled back and the cache left at rest."""
    with one_thread_per_pair(draft), mx.stream(stream):
        try:
            yield
        finally:
            if cache.target.undo is not None:  # interrupted inside a cycle
                target.rollback(cache.target, 0)
            cache.drop_unreadable()  # at rest, the cache holds only what a drafter may read
            mx.clear_cache()


def continue_generation(
    model, draft, prompt_cache: PromptCache, *, max_tokens: int, block_size: Optional[int] = None,
    temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0, acceptance: str = "speculative",
    eos_token_ids: Iterable[int] = (), logprobs: bool = False, stream=generation_stream,
):
    """The cycles of a generation another loop began, from its prompt
    cache's pending token on (a batch's request left decoding alone), as
    :func:`generate_step` yields them after its first token: at most
    ``max_tokens`` more. The pair must be calibrated (the loop that began
    it was)."""
    rule = acceptance_rule(temperature, top_p, top_k, min_p, None, acceptance)
    max_block = max_block_size(draft, block_size, None)
    target = bound_target(model, draft)
    trees = tree_plan(target, draft, None, None)
    cache = prompt_cache
    with generation(target, draft, cache, stream):
        sizer, settle = plan(target, draft, cache.target, cache.target_hidden, max_block, block_size is not None, None, *trees)
        yield from decode(target, draft, cache, None, rule, sizer, settle, max_tokens + 1, set(eos_token_ids), logprobs)


@dataclass
class Cycle:
    """A queued cycle: what the sizer chose (a block length or a
    :class:`~dflash_mlx.adaptive.TreeChoice`), its outcome
    (:meth:`AcceptanceRule.outcome`, or for a tree the target's choice at
    every row; not yet read), the target's logits and its tap states for
    the verified rows; for a tree, the tree and its candidates."""

    choice: Union[int, TreeChoice]
    outcome: mx.array
    logits: mx.array
    target_hidden: mx.array
    tree: Optional[object] = None
    ids: Optional[object] = None

    @property
    def rows(self) -> int:
        return self.tree.rows if self.tree is not None else self.choice

    def read(self):
        """``(rows kept, proposed tokens along them, accepted count, the
        target's token after them, what a tree's walk showed)`` in one host read."""
        if self.tree is None:
            accepted, token, proposed = read_outcome(self.outcome)
            return list(range(accepted + 1)), proposed, accepted, token, None
        choices = self.outcome.tolist()
        path, token = self.tree.walk(choices)
        walk = TreeWalk(walked_ranks(self.tree, self.ids, path, choices), self.tree.spine)
        return path, [self.tree.tokens[r] for r in path[1:]], len(path) - 1, token, walk


@dataclass
class Drafting:
    """What every cycle of one generation drafts and verifies with; queues
    each cycle (:meth:`launch`) and commits what it kept (:meth:`commit`)."""

    target: object
    draft: object
    cache: PromptCache
    rule: AcceptanceRule
    max_block: int
    settle: Callable

    def block(self, anchor) -> mx.array:
        """The drafter's input: the anchor and a whole block of masks. It
        always fills all ``max_block`` slots: it guesses each slot from the
        whole block of masks, and a shorter block of masks than it was
        trained on makes its early slots worse (measured in BENCHMARKS.md)."""
        return masked_block(self.draft, anchor, self.max_block)

    def launch(self, anchor, choice, remaining) -> Cycle:
        """Queue the cycle after ``anchor`` the sizer chose, never more than
        ``remaining`` tokens' worth."""
        if isinstance(choice, TreeChoice):
            return self.tree(anchor, choice.nodes, remaining)
        return self.chain(anchor, choice)

    def chain(self, anchor, length) -> Cycle:
        """Draft a whole block from the tap states the drafter has not seen,
        verify the anchor and the first ``length - 1`` drafted tokens
        (``length`` 1: plain decoding, no draft), and the outcome. A plain
        step's anchor may be the previous plain step's lazy outcome."""
        cache, rule = self.cache, self.rule
        verify_in = anchor.reshape(1, 1) if isinstance(anchor, mx.array) else mx.array([[anchor]], dtype=mx.int32)
        q = None
        if length > 1:
            block, slots = self.block(anchor), length - 1
            if rule.sampling is not None:
                drafted, q = self.draft.propose_with_probs(block, cache.target_hidden, cache.draft, **rule.sampling, slots=slots)
                q = q[0]
            else:
                drafted = self.draft.propose(block, cache.target_hidden, cache.draft, slots=slots)
            cache.target_hidden = None  # injected into the drafter's context
            self.settle(drafted)
            verify_in = mx.concatenate([verify_in, drafted.astype(mx.int32)], axis=1)
        logits, target_hidden = self.target.forward(verify_in, cache.target)
        outcome = rule.outcome(logits[0], verify_in[0, 1:], q) if length > 1 else rule.choose(logits[0, -1:])
        mx.async_eval(outcome, target_hidden)
        return Cycle(length, outcome, logits, target_hidden)

    def tree(self, anchor, nodes, remaining) -> Cycle:
        """Draft the whole block, take its best candidates per slot (one host
        read: the tree is built on the host), build a tree of ``nodes``
        nodes at most ``remaining - 1`` deep and verify it in one forward;
        the outcome is the target's choice at every row."""
        cache = self.cache
        slots = min(remaining, self.max_block) - 1
        head = self.draft.slot_head_logits(self.block(anchor), cache.target_hidden, cache.draft, slots=slots)
        cache.target_hidden = None  # injected into the drafter's context
        ids, logprobs = candidates(head[0], nodes, self.draft.vocab_ids)
        tree = build_tree(anchor, ids, logprobs, nodes)
        logits, target_hidden = self.target.forward(mx.array([tree.tokens]), cache.target, tree=tree)
        outcome = self.rule.choose(logits[0]).astype(mx.int32)
        mx.async_eval(outcome)
        return Cycle(TreeChoice(nodes), outcome, logits, target_hidden, tree, ids)

    def commit(self, cycle: Cycle, rows: List[int]) -> None:
        """Keep the verified ``rows`` (a chain's prefix, a tree's walked
        path) in the target's caches, and their taps for the drafter."""
        if cycle.tree is None:
            self.target.rollback(self.cache.target, len(rows))
            kept = cycle.target_hidden
            self.cache.add_hidden(kept if kept.shape[1] == len(rows) else kept[:, : len(rows)])
        else:
            self.target.rollback(self.cache.target, rows)
            self.cache.add_hidden(cycle.target_hidden[:, mx.array(rows)])


def first_then_cycles(target, draft, cache, first, rule, plans, ready, max_tokens, eos, want_logprobs):
    """The prefill's token ``first``, then the cycles (``plans()``: their
    sizer and evaluation, see :func:`~dflash_mlx.calibration.plan`). Unless
    the pair is ``ready`` (calibrated), ``plans()`` measures the cycles'
    costs first: the first token goes out before that, not after."""
    if max_tokens == 1 or first[0] in eos:
        yield first
        return
    if not ready:
        yield first
        first = None
    yield from decode(target, draft, cache, first, rule, *plans(), max_tokens, eos, want_logprobs)


def decode(target, draft, cache: PromptCache, first, rule, sizer, settle, max_tokens, eos, want_logprobs):
    """The cycles after the prefill's token (the cache's pending one): draft,
    verify, accept, roll back, commit, one host sync each. ``sizer``
    chooses each block or tree from the cycles before it; ``settle``
    evaluates the draft (``mx.eval``, or ``mx.async_eval`` to overlap).
    ``first``: the prefill's token as :func:`generate_step` yields it, to
    yield once the first cycle is queued (None: already yielded).

    Each cycle is queued before the previous one's tokens are yielded, as
    mlx-lm queues its next step, so the caller's work on them (detokenizing,
    streaming) overlaps the device's. A queued forward is recorded, so
    closing the generator at a yield rolls it back (see
    :func:`generate_step`).
    """
    drafting = Drafting(target, draft, cache, rule, sizer.max_block, settle)
    anchor, n = cache.pending[0], 1
    tic = time.perf_counter()  # cycles are timed without the caller's time
    cycle = drafting.launch(anchor, sizer.choose(max_tokens - n), max_tokens - n)  # never more slots than tokens left
    if first is not None:
        paused = time.perf_counter()
        yield first
        tic += time.perf_counter() - paused
    while True:
        # A plain step keeps its one row whatever its token, so when the
        # next cycle is plain too it is queued on this one's lazy token
        # before the host reads it, as mlx-lm's generate_step runs ahead.
        # The choice is the one the loop would make after the read (a plain
        # step commits one token), from the cycles before this one.
        ahead = choice = None
        if cycle.rows == 1 and n + 1 < max_tokens:
            choice = sizer.choose(max_tokens - n - 1)
            if choice == 1:
                drafting.commit(cycle, [0])
                ahead = drafting.chain(cycle.outcome, 1)
        rows, proposed, accepted, bonus, walk = cycle.read()
        # A cycle's cost: from the previous read to this one, less the
        # caller's time with the tokens, which is the same per token
        # whatever the block and so has no say in choosing it.
        now = time.perf_counter()
        sizer.observe(cycle.choice, accepted, now - tic, walk, context=cache.offset)  # before the next choice
        tic = now
        new_tokens, stopped = cycle_tokens(proposed, accepted, bonus, eos, max_tokens - n)
        rows = rows[: len(new_tokens)]
        if n // 256 != (n + len(new_tokens)) // 256:
            mx.clear_cache()  # as mlx-lm's generate_step does every 256 tokens
        n += len(new_tokens)
        ends = n >= max_tokens or stopped
        anchor = new_tokens[-1]
        if ahead is None:
            drafting.commit(cycle, rows)
        cache.pending = [anchor]
        cache.tokens.extend(new_tokens)
        logits, block, tree = cycle.logits, cycle.rows, 0 if cycle.tree is None else cycle.tree.nodes
        if ahead is not None:
            cycle = ahead  # rolled back by generate_step if the token was eos
        elif not ends:
            choice = sizer.choose(max_tokens - n) if choice is None else choice
            cycle = drafting.launch(anchor, choice, max_tokens - n)
        lp = logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True) if want_logprobs else None
        paused = time.perf_counter()
        for i, t in enumerate(new_tokens):
            yield t, None if lp is None else lp[rows[i]], i < accepted, block, tree
        if ends:
            return
        tic += time.perf_counter() - paused


def stream_generate(
    model,
    draft,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    prompt_cache: Optional[PromptCache] = None,
    stream=generation_stream,
    record=None,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Generate from ``model`` with ``draft`` proposing blocks; yields per cycle.

    The text layer over :func:`generate_step` (which documents the sampling
    options in ``kwargs``): it detokenizes, stops at the tokenizer's eos
    ids, ends at ``max_tokens`` and keeps the statistics. With
    ``prompt_cache`` (:func:`dflash_mlx.make_prompt_cache`) ``prompt`` is
    only the new part of the conversation, as in mlx-lm. ``record``
    (a :class:`dflash_mlx.traffic.Recorder`) stores the conversation when
    the generation finishes, as training data for the drafter.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = encode_prompt(tokenizer, prompt)
    context = (list(prompt_cache.tokens) if prompt_cache is not None else []) + prompt.tolist()
    eos = set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer
    detok.reset()
    steps = generate_step(
        prompt, model, draft, prompt_cache=prompt_cache, max_tokens=max_tokens,
        eos_token_ids=eos, stream=stream, **kwargs,
    )
    with wired_limit(model, [stream]), closing(steps):
        tic = time.perf_counter()
        n_out, prompt_tps, cycle, accepted, answer = 0, None, [], 0, []
        for token, _, from_draft, block, tree in steps:
            if prompt_tps is None:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            cycle.append(token)
            answer.append(token)
            accepted += from_draft
            finish = "stop" if token in eos else None
            if finish is None:
                detok.add_token(token)
                n_out += 1
                finish = "length" if n_out == max_tokens else None
            if from_draft and finish is None:
                continue
            if finish:
                detok.finalize()
                if record is not None:  # before the last yield: a caller may stop at it
                    record.record(context, answer)
            yield GenerationResponse(
                text=detok.last_segment,
                tokens=[t for t in cycle if t not in eos],
                accepted=accepted,
                committed=len(cycle),
                prompt_tokens=prompt.size,
                prompt_tps=prompt_tps,
                generation_tokens=n_out,
                generation_tps=n_out / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                block_size=block,
                tree_size=tree,
            )
            if finish:
                return
            cycle, accepted = [], 0


def generate(model, draft, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Whole-text convenience wrapper around :func:`stream_generate`."""
    text = ""
    for response in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
    return text


def setup_arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description="Generate text with a target model and a DFlash drafter.")
    cli.add_pair_arguments(p)
    p.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin; default: a bundled held-out prompt)")
    p.add_argument("--max-tokens", "-m", type=cli.positive_int, default=DEFAULT_MAX_TOKENS)
    cli.add_sampling_arguments(p)
    p.add_argument("--seed", type=int, default=None, help="seed mx.random; a sampled run repeats exactly only with a fixed --block-size (the adaptive default follows measured speed)")
    p.add_argument(
        "--acceptance",
        choices=ACCEPTANCE_RULES,
        default="speculative",
        help="rule for drafted tokens at --temp > 0: rejection sampling or exact match (both lossless)",
    )
    cli.add_block_size_argument(p)
    cli.add_tree_budget_argument(p)
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as is")
    p.add_argument("--system-prompt", default=None)
    cli.add_prefill_step_size_argument(p)
    cli.add_draft_window_arguments(p)
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True, help="stream text and print statistics")
    p.add_argument("--pipeline", action="store_true", help="split the target's layers across the processes mlx.launch started (see docs/pipeline.md)")
    return p


def build_prompt(tokenizer, prompt: str, system_prompt=None, use_chat_template=True):
    """Apply the tokenizer's chat template when it has one (mlx_lm.generate's rule)."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return prompt


def main(argv=None):
    from .blas import warn_if_reference
    from .pair import DEFAULT_TARGET, default_prompt, load_pair

    args = setup_arg_parser().parse_args(argv)
    rank = mx.distributed.init().rank() if args.pipeline else 0
    if args.pipeline:
        from .pipeline import load_for_command

        model, tokenizer, draft = load_for_command(args.model, args.draft_model, seed=args.seed)
    else:
        model, tokenizer, draft, _ = load_pair(args.model, args.draft_model)
    warn_if_reference()  # loaded: about to decode
    args.verbose = args.verbose and rank == 0  # only rank 0 prints
    if rank == 0 and str(args.model) == str(DEFAULT_TARGET):
        print(f"[bundled default pair: {DEFAULT_TARGET.parent}]", file=sys.stderr)
    prompt = args.prompt if args.prompt is not None else default_prompt(args.model)
    if prompt == "-":
        prompt = sys.stdin.read()
    prompt = build_prompt(tokenizer, prompt, args.system_prompt, not args.ignore_chat_template)
    if args.verbose and isinstance(prompt, str):
        print(prompt, end="", flush=True)
    if args.seed is not None:
        mx.random.seed(args.seed)
    responses = []
    for r in stream_generate(
        model,
        draft,
        tokenizer,
        prompt,
        block_size=args.block_size,
        tree_budget=args.tree_budget,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        acceptance=args.acceptance,
        prefill_step_size=args.prefill_step_size,
        draft_window=args.draft_window,
        draft_sink=args.draft_sink,
    ):
        if args.verbose:
            print(r.text, end="", flush=True)
        responses.append(r)
    if args.verbose and responses:
        last, cycles = responses[-1], cycle_lengths(responses)
        print("\n" + "=" * 10)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
        if cycles:
            print(f"Mean tokens per cycle: {mean_tokens_per_cycle(cycles):.2f} over {len(cycles)} cycles")
            sizes = Counter(r.block_size for r in responses[1:] if not r.tree_size)
            print("Block sizes (size:cycles): " + " ".join(f"{b}:{k}" for b, k in sorted(sizes.items())))
            trees = Counter(r.tree_size for r in responses[1:] if r.tree_size)
            if trees:
                print("Draft trees (nodes:cycles): " + " ".join(f"{n}:{k}" for n, k in sorted(trees.items())))
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
