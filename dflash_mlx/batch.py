"""Many requests in one loop: batched DFlash cycles, exact per request.

    from dflash_mlx import batch_generate
    result = batch_generate(model, draft, tokenizer, ["def fib(n):", "import os"], max_tokens=128)

Each cycle drafts a block for every request in ONE drafter forward, verifies
all of them in ONE target forward (``[B, L]``: each row its own anchor and
drafted tokens), and then each row accepts its own prefix and rolls back its
own rejected tail: the target's attention caches keep a length per row
(:mod:`dflash_mlx.targets.rows`), a hybrid target's recurrent state is
rewound per row to its accepted tokens, and each request keeps its own
drafter context (its :class:`~dflash_mlx.cache.PromptCache`; while batched,
its rows live in one buffer per drafter layer,
:class:`~dflash_mlx.models.dflash.ContextRows`). No row waits
for another's rejection, so acceptance per request does not fall with the
batch, and every row is exact as its lone run: greedy rows token for token,
sampled rows in distribution (speculative sampling per row, each with its
own settings and, given a seed, its own random key).

The block length is chosen for the whole batch (:class:`~dflash_mlx.adaptive.BatchSizer`):
the one with the most expected tokens per second over all rows, from each
row's acceptance and the measured cost of a cycle of that many rows, so a
large batch falls back to plain batched steps when verified rows get dear.

:class:`BatchGenerator` is the object a server drives (mlx-lm's
``BatchGenerator`` shape): requests are inserted and removed between
cycles, a long prompt is prefilled a chunk at a time between decode cycles,
and a finished request leaves with its prompt cache. A batch of one is a
request alone: its cycles are :func:`~dflash_mlx.generate.generate_step`'s
own (the pair's sizer, draft trees included); two requests or more verify
chains together.
"""

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import maybe_set_recommended_wired_limit

from .adaptive import BatchCosts, BatchSizer, SlotAcceptance
from .cache import PromptCache, bound_target, prompt_cache_for
from .calibration import calibrate
from .defaults import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP_SIZE
from .errors import ArgumentError
from .generate import (
    AcceptanceRule, accept_greedy, acceptance_rule, checked_prompt, commit_first, cycle_tokens, encode_prompt, feed, max_block_size,
    continue_generation, one_thread_per_pair, prefill,
)
from .models.dflash import masked_blocks
from .targets.rows import BatchCache, check_joinable

DEFAULT_COMPLETION_BATCH_SIZE = 32  # mlx-lm's --decode-concurrency default
DEFAULT_PREFILL_BATCH_SIZE = 8  # mlx-lm's --prompt-concurrency default


@dataclass
class BatchResponse:
    """What one request got from one :meth:`BatchGenerator.next`.

    Args:
        uid: the request (from :meth:`BatchGenerator.insert`).
        tokens: the tokens it committed this cycle (its first: the prefill's).
        from_draft: per token, whether it was a drafted token the target accepted.
        logprobs: per token, the target's log-probabilities ``[V]`` there
            (None unless the request asked for them).
        finish_reason: "stop" (eos), "length" (max_tokens) or None.
        block: tokens this request verified this cycle (0: its prefill's token).
        batch: requests the cycle verified together.
        prompt_cache: the request's prompt cache, once it has finished.
    """

    uid: int
    tokens: List[int]
    from_draft: List[bool]
    logprobs: Optional[List[mx.array]]
    finish_reason: Optional[str]
    block: int
    batch: int = 1
    prompt_cache: Optional[PromptCache] = None


@contextmanager
def own_random_key(r: "Request"):
    """A seeded request decoding alone draws from ``mx.random``'s state
    (:func:`~dflash_mlx.generate.continue_generation` takes no key): seeded
    from its own key first, so its run repeats whatever else used the state."""
    if r.key is not None:
        mx.random.seed(int(mx.random.randint(0, 2**31 - 1, key=r.next_key()).item()))
    yield


@dataclass
class Request:
    """One row: its prompt cache (whose target part lives in the batch's
    caches while it decodes), how it samples, and how far it has got."""

    uid: int
    cache: PromptCache
    todo: List[int]  # prompt tokens not prefilled yet
    rule: AcceptanceRule
    max_tokens: int
    eos: set
    logprobs: bool
    sampling: dict = field(default_factory=dict)  # generate_step's sampling arguments
    key: Optional[mx.array] = None  # its own random key (a seeded sampled request)
    block_limit: Optional[int] = None  # the longest block it lets the batch verify
    progress: Optional[Callable[[int, int], None]] = None  # hears its prefill's progress
    total: int = 0  # prompt tokens to prefill
    acceptance: Optional[SlotAcceptance] = None
    n: int = 0  # tokens generated
    anchor: int = -1  # the last committed token, not yet run by the target

    def next_key(self):
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key


class BatchGenerator:
    """Decodes many requests with one drafter and one target, cycle by cycle.

    ``insert`` queues requests (their prompts are prefilled a chunk at a
    time, ``prefill_step_size`` tokens per :meth:`next` across at most
    ``prefill_batch_size`` prompts, between decode cycles); each
    :meth:`next` returns what every request committed in one cycle;
    ``remove`` drops requests (a disconnected client) between cycles. At
    most ``completion_batch_size`` requests decode at once; the others wait
    for a slot before their prefill. ``block_size`` fixes every cycle's block
    (None: adaptive, see :class:`~dflash_mlx.adaptive.BatchSizer`).
    """

    def __init__(
        self,
        model,
        draft,
        *,
        block_size: Optional[int] = None,
        completion_batch_size: int = DEFAULT_COMPLETION_BATCH_SIZE,
        prefill_batch_size: int = DEFAULT_PREFILL_BATCH_SIZE,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        draft_window: Optional[int] = None,
        draft_sink: Optional[int] = None,
        stream=generation_stream,
    ):
        self.old_wired_limit = self.alone = None  # (close() may run on a generator refused below)
        for name, value in (("completion_batch_size", completion_batch_size), ("prefill_batch_size", prefill_batch_size), ("prefill_step_size", prefill_step_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"{name} must be a whole number of at least 1, not {value!r}")
        self.model, self.draft, self.stream = model, draft, stream
        self.target = bound_target(model, draft)
        self.max_block = max_block_size(draft, block_size, None)
        self.fixed = block_size is not None
        self.completion_batch_size, self.prefill_batch_size = completion_batch_size, prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.draft_window, self.draft_sink = draft_window, draft_sink
        self.waiting: List[Request] = []  # queued: not prefilled, or partly
        self.active: List[Request] = []  # decoding, in the batch's row order
        self.joining: List[Request] = []  # prefilled, first token out, joining at the next cycle
        self.cache: Optional[BatchCache] = None
        self.sizer: Optional[BatchSizer] = None
        self.settle = mx.async_eval
        self.ahead: Optional[Launched] = None  # a plain step queued before the last one was read
        self.clock = self.left = 0.0  # when the last cycle was read; when the caller got its tokens
        self.pair_acceptance: Optional[SlotAcceptance] = None
        self.alone = None  # a batch of one: its request's cycles, decoding alone
        self.uid = 0
        self.cycles_read: List[int] = []  # the rows of each cycle the last next() read
        # Held from here to close(), as mlx-lm's BatchGenerator holds it: a
        # limit set and restored every cycle would wait for the queued work.
        self.old_wired_limit = maybe_set_recommended_wired_limit()

    def close(self) -> None:
        """Give back the wired memory limit (Metal); the generator is done."""
        if self.alone is not None:
            with self.on_pair():
                self.stop_alone()
        if self.old_wired_limit is not None:
            mx.synchronize(self.stream)
            mx.set_wired_limit(self.old_wired_limit)
            self.old_wired_limit = None

    def __del__(self):
        self.close()

    @contextmanager
    def on_pair(self):
        """What every step runs in: this thread owns the pair, on the generation stream."""
        with one_thread_per_pair(self.draft), mx.stream(self.stream):
            yield

    def insert(
        self,
        prompts: Sequence,
        max_tokens=DEFAULT_MAX_TOKENS,
        *,
        prompt_caches: Optional[Sequence[Optional[PromptCache]]] = None,
        temperature=0.0,
        top_p=0.0,
        top_k=0,
        min_p=0.0,
        seed=None,
        acceptance: str = "speculative",
        eos_token_ids: Iterable[int] = (),
        logprobs: bool = False,
        block_size=None,
        progress=None,
    ) -> List[int]:
        """Queue requests; returns their uids. ``prompts``: token lists (only
        the part new to a request's prompt cache, as in
        :func:`~dflash_mlx.generate.generate_step`). ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``seed`` are one
        value for all or one per prompt; a request's seed gives it its own
        random key (None: ``mx.random``'s state). A request's ``block_size``
        caps the batch's blocks while it decodes (None: no cap); its
        ``progress(done, total)`` hears how far its prompt's prefill is."""
        n = len(prompts)

        def each(name, value):
            values = list(value) if isinstance(value, (list, tuple)) else [value] * n
            if len(values) != n:
                raise ArgumentError(f"{name} has {len(values)} values for {n} prompts")
            return values

        settings = zip(
            prompts, each("max_tokens", max_tokens), each("prompt_caches", prompt_caches or [None] * n),
            each("temperature", temperature), each("top_p", top_p), each("top_k", top_k), each("min_p", min_p),
            each("seed", seed), each("block_size", block_size), each("progress", progress),
        )
        eos = set(eos_token_ids)
        requests = []
        for prompt, limit, cache, temp, tp, tk, mp, s, cap, hear in settings:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ArgumentError(f"max_tokens must be a whole number of at least 1, got {limit!r}")
            rule = acceptance_rule(temp, tp, tk, mp, None, acceptance)
            cache = prompt_cache_for(self.model, self.draft, cache, self.draft_window, self.draft_sink)
            tokens = checked_prompt(self.target, cache, prompt)
            if cache.target.undo is not None:
                raise ArgumentError("a prompt cache is in the middle of a generation: close that generation first")
            check_joinable(cache.target)
            key = None if s is None else mx.random.key(int(s))
            if cap is not None:
                max_block_size(self.draft, cap, None)
            settings = dict(temperature=temp, top_p=tp, top_k=tk, min_p=mp, acceptance=acceptance)
            request = Request(self.uid + len(requests), cache, tokens, rule, limit, eos, logprobs, settings, key, cap, hear)
            request.total = len(tokens)
            requests.append(request)
        self.uid += len(requests)
        self.waiting.extend(requests)
        return [r.uid for r in requests]

    def remove(self, uids: Iterable[int]) -> Dict[int, PromptCache]:
        """Drop requests between cycles; returns their prompt caches, each
        consistent with the tokens it holds (``cache.tokens``)."""
        uids = set(uids)
        if self.alone is not None and self.active[0].uid in uids:
            with self.on_pair():
                self.stop_alone()
        out = {r.uid: r.cache for r in self.waiting + self.joining if r.uid in uids}
        self.waiting = [r for r in self.waiting if r.uid not in uids]
        self.joining = [r for r in self.joining if r.uid not in uids]
        self.drop_ahead()
        leaving = [b for b, r in enumerate(self.active) if r.uid in uids]
        for b in leaving:
            out[self.active[b].uid] = self.active[b].cache
        self.leave(leaving)
        return out

    def queued(self) -> List[int]:
        """Requests waiting for a slot, their prefill not begun."""
        return [r.uid for r in self.waiting if len(r.todo) == r.total]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active or self.joining)

    def next(self) -> List[BatchResponse]:
        """Prefill what fits of the queued prompts, then one decode cycle
        of the batch; what every request committed."""
        self.cycles_read = []
        with self.on_pair():
            if self.joining:
                self.join(self.joining)
                self.joining = []
            out = self.prefill_queued()
            if len(self.active) == 1:
                out += self.alone_cycle()
            elif self.active:
                out += self.cycle()
            return out

    # -- prefill -----------------------------------------------------------

    def prefill_queued(self) -> List[BatchResponse]:
        budget, out, started = self.prefill_step_size, [], 0
        while budget > 0 and started < self.prefill_batch_size and self.waiting:
            free = self.completion_batch_size - len(self.active) - len(self.joining)
            if free <= 0:
                break
            group = self.whole_prompts(min(free, self.prefill_batch_size - started), budget)
            if len(group) > 1:
                del self.waiting[: len(group)]
                started += len(group)
                budget -= len(group) * max(len(r.cache.pending) + len(r.todo) for r in group)
                out += self.prefill_together(group)
                continue
            r = self.waiting[0]
            started += 1
            chunk, r.todo = r.todo[:budget], r.todo[budget:]
            budget -= max(1, len(chunk))
            if r.todo:
                feed(self.target, r.cache, chunk, self.prefill_step_size)
                if r.progress is not None:
                    r.progress(r.total - len(r.todo), r.total)
                continue
            self.waiting.pop(0)
            logits = prefill(self.target, r.cache, chunk, self.prefill_step_size)
            if r.progress is not None:
                r.progress(r.total, r.total)
            out.append(self.first_token(r, logits))
        return out

    def whole_prompts(self, most: int, budget: int) -> List[Request]:
        """The leading queued requests (at most ``most``) whose whole
        remaining prompts fit ``budget`` tokens together, each padded to
        the longest."""
        group, longest = [], 0
        for r in self.waiting[:most]:
            need = len(r.cache.pending) + len(r.todo)
            if (len(group) + 1) * max(longest, need) > budget:
                break
            group.append(r)
            longest = max(longest, need)
        return group

    def prefill_together(self, group: List[Request]) -> List[BatchResponse]:
        """Prefill several whole prompts together, as a cycle runs: every
        row's tokens but its last, right-padded to the longest (in pieces of
        the target's ``longest_ragged``), each row then keeping only its own
        (:meth:`~dflash_mlx.targets.base.TargetAdapter.rollback_rows`; no
        real token sees the padding); then every row's last token, whose
        logits give its first token (mlx-lm's order). The requests leave
        with their own caches, to join at the next call."""
        runs = [r.cache.pending + r.todo for r in group]
        caches = BatchCache.join([r.cache.target for r in group], [r.cache.ran for r in group])
        body = [run[:-1] for run in runs]
        longest = max(map(len, body))
        piece = self.target.longest_ragged or max(1, longest)
        for start in range(0, longest, piece):
            part = [b[start : start + piece] for b in body]
            width = max(map(len, part))
            _, taps = self.target.forward(mx.array([p + [0] * (width - len(p)) for p in part], dtype=mx.int32), caches, last_logits_only=True)
            self.target.rollback_rows(caches, [len(p) for p in part])
            for r, (b, p) in zip(group, enumerate(part)):
                if p:
                    r.cache.add_hidden(taps[b : b + 1, : len(p)])
        logits, taps = self.target.forward(mx.array([run[-1:] for run in runs], dtype=mx.int32), caches, last_logits_only=True)
        self.target.rollback_rows(caches, [1] * len(group))
        out = []
        for b, r in enumerate(group):
            r.cache.add_hidden(taps[b : b + 1])
            r.cache.tokens.extend(r.todo)
            r.cache.pending, r.todo = [], []
            r.cache.target = caches.row(b)
            if r.progress is not None:
                r.progress(r.total, r.total)
            out.append(self.first_token(r, logits[b : b + 1, -1]))
        return out

    def first_token(self, r: Request, logits: mx.array) -> BatchResponse:
        """The prefill's token; the request then joins the batch, unless it is done."""
        token, lp, *_ = commit_first(r.cache, r.rule.choose(logits, r.next_key()).item(), logits, r.logprobs)
        lp = None if lp is None else [lp]
        r.anchor, r.n = token, 1
        finish = "stop" if token in r.eos else ("length" if r.max_tokens == 1 else None)
        if finish is not None:
            r.cache.drop_unreadable()
            return BatchResponse(r.uid, [token], [False], lp, finish, 0, 0, r.cache)
        self.joining.append(r)  # at the next call: its first token goes out first
        return BatchResponse(r.uid, [token], [False], lp, None, 0, 0)

    def join(self, requests: List[Request]) -> None:
        """Prefilled requests join the batch (the first one in a process
        measures the cycles' costs on its own cache first). Two requests or
        more decode in batched cycles, over one :class:`~dflash_mlx.targets.rows.BatchCache`;
        one decodes alone (:meth:`alone_cycle`) on its own cache."""
        if self.sizer is None:
            r = requests[0]
            calibration = calibrate(self.target, self.draft, r.cache.target, r.cache.target_hidden, self.max_block)
            self.settle = calibration.settle
            self.pair_acceptance = calibration.sizer.acceptance
            if calibration.batch_sizer is None:
                calibration.batch_sizer = BatchSizer(self.max_block, BatchCosts.from_table(calibration.sizer.costs))
            self.sizer = BatchSizer(self.max_block, None, fixed=True) if self.fixed else calibration.batch_sizer
        for r in requests:
            r.acceptance = copy.deepcopy(self.pair_acceptance)
        self.stop_alone()
        self.drop_ahead()
        rows = self.active + requests
        if len(rows) > 1:
            batched = [] if self.cache is None else self.active
            parts = [] if self.cache is None else [self.cache]
            positions = [] if self.cache is None else list(self.cache.rows.pos)
            for r in rows[len(batched):]:
                parts.append(r.cache.target)
                positions.append(r.cache.ran)
                r.cache.target = None  # in the batch until it leaves
            self.cache = BatchCache.join(parts, positions)
        self.active = rows

    def drop_ahead(self) -> None:
        """Forget a plain step queued ahead (its rows keep none of it): the
        batch is about to change shape."""
        if self.ahead is not None:
            self.target.rollback_rows(self.cache, [0] * len(self.ahead.rows))
            self.ahead = None

    def leave(self, rows: Sequence[int]) -> None:
        """Rows ``rows`` leave the batch, each with its own target cache back
        (and a row left alone with its own, to decode alone)."""
        if not rows:
            return
        if self.cache is None:  # the request decoding alone
            self.active[0].cache.drop_unreadable()
            self.active = []
            return
        stay = [b for b in range(len(self.active)) if b not in set(rows)]
        going = list(rows) + (stay if len(stay) == 1 else [])
        for b in going:
            r = self.active[b]
            r.cache.target = self.cache.row(b)
            r.cache.unlink_draft()
            if b in rows:
                r.cache.drop_unreadable()
        self.active = [self.active[b] for b in stay]
        if len(stay) > 1:
            self.cache.take(stay)
        else:
            self.cache = None

    # -- one cycle ---------------------------------------------------------

    def choose(self, rows: List[Request], ahead: int = 0) -> int:
        """The next cycle's block, from the cycles before it (``ahead``: chosen
        before the last cycle is read, each row that many tokens further)."""
        remaining = [r.max_tokens - r.n - ahead for r in rows]
        limits = [r.block_limit for r in rows if r.block_limit]
        if len(limits) == len(rows):  # every request fixed its block: the shortest, for all
            return max(1, min(min(limits), max(remaining)))
        return min([self.sizer.choose([r.acceptance for r in rows], remaining)] + limits)

    def alone_cycle(self) -> List[BatchResponse]:
        """A batch of one decodes as a request alone does: its cycles are
        :func:`~dflash_mlx.generate.generate_step`'s own on its prompt cache
        (:func:`~dflash_mlx.generate.continue_generation`: the pair's sizer,
        draft trees and all), one cycle per call: the accepted drafted
        tokens and the target's one after them."""
        r = self.active[0]
        if self.alone is None:
            block = self.max_block if self.fixed else r.block_limit
            self.alone = continue_generation(
                self.model, self.draft, r.cache, max_tokens=r.max_tokens - r.n, block_size=block,
                eos_token_ids=r.eos, logprobs=r.logprobs, stream=self.stream, **r.sampling,
            )
        tokens, drafted, logprobs, block = [], [], [], 1
        with own_random_key(r):
            for token, lp, from_draft, rows, _ in self.alone:
                tokens.append(token)
                drafted.append(from_draft)
                logprobs.append(lp)
                block = max(block, rows)
                if not from_draft:  # the target's own token ends a cycle
                    break
        r.n += len(tokens)
        r.anchor = tokens[-1]
        finish = "stop" if tokens[-1] in r.eos else ("length" if r.n >= r.max_tokens else None)
        self.cycles_read.append(1)
        response = BatchResponse(r.uid, tokens, drafted, logprobs if r.logprobs else None, finish, block)
        if finish is not None:
            self.stop_alone()
            response.prompt_cache = r.cache
            self.leave([0])
        return [response]

    def stop_alone(self) -> None:
        """End the lone request's generate_step between its cycles (it rolls
        back a cycle it queued ahead): its cache then holds what it committed."""
        if self.alone is not None:
            self.alone.close()
            self.alone = None

    def cycle(self) -> List[BatchResponse]:
        """Draft, verify, accept, roll back, commit: every row at once, one
        host read. A plain step keeps its one row whatever its token, so
        when the next cycle is plain too it is queued on this one's lazy
        tokens before the host reads them, as mlx-lm's batched decode runs
        ahead (and as :func:`~dflash_mlx.generate.decode` does for one
        request); a row that then ends is rolled back out of it."""
        now = time.perf_counter()
        if self.ahead is None:
            launched, self.clock = self.launch(self.active, self.choose(self.active)), now
        else:
            launched, self.ahead = self.ahead, None
            self.clock += now - self.left  # the caller's time between cycles is no cycle's
        rows = launched.rows
        if launched.block == 1 and all(r.max_tokens - r.n > 1 for r in rows) and self.choose(rows, ahead=1) == 1:
            self.commit(launched, [1] * len(rows))
            self.ahead = self.launch(rows, 1, anchors=launched.outcome[:, 1:2], queued_ahead=True)
        out, done = self.accept(launched, launched.outcome.tolist())
        if done and self.ahead is not None:  # the rows that ended leave it unkept
            ahead, self.ahead = self.ahead, None
            more, later = self.accept(ahead, ahead.outcome.tolist(), void=set(done))
            out, done = out + more, done + later
        caches = {r.uid: r.cache for r in rows}
        for response in out:
            if response.finish_reason is not None:  # its request leaves below, its cache whole again
                response.prompt_cache = caches[response.uid]
        self.leave(done)
        self.left = time.perf_counter()
        return out

    def launch(self, rows: List[Request], block: int, anchors: Optional[mx.array] = None, queued_ahead: bool = False) -> "Launched":
        """Queue a cycle of ``block`` tokens per row (1: a plain step, its
        ``anchors`` may be the last plain step's lazy tokens, ``queued_ahead``
        of its read)."""
        if anchors is None:
            anchors = mx.array([[r.anchor] for r in rows], dtype=mx.int32)
        drafted, qs = None, [None] * len(rows)
        if block > 1:
            blocks = masked_blocks(self.draft, [r.anchor for r in rows], self.max_block)
            drafted, qs = self.draft.draft_rows(
                blocks, [r.cache.target_hidden for r in rows], [r.cache.draft for r in rows], block - 1,
                [r.rule.sampling for r in rows], [r.next_key() for r in rows],
            )
            for r in rows:
                r.cache.target_hidden = None  # injected into its drafter context
            drafted = drafted.astype(mx.int32)
            self.settle(drafted)
        verify_in = anchors if drafted is None else mx.concatenate([anchors, drafted], axis=1)
        logits, taps = self.target.forward(verify_in, self.cache)
        outcome = self.outcome(rows, logits, drafted, qs)
        mx.async_eval(outcome, taps)
        return Launched(list(rows), block, outcome, logits, taps, queued_ahead)

    def commit(self, launched: "Launched", kept: List[int]) -> None:
        """Each row keeps its first ``kept[b]`` verified tokens in the
        target's caches, and their tap states for its drafter."""
        self.target.rollback_rows(self.cache, kept)
        for b, (r, k) in enumerate(zip(launched.rows, kept)):
            if k:
                r.cache.add_hidden(launched.taps[b : b + 1, :k])
        launched.committed = True

    def accept(self, launched: "Launched", values, void=frozenset()):
        """Each row's tokens from the read ``values``; rows in ``void`` (ended
        before this cycle, which ran ahead) keep nothing of it. Returns the
        responses and the rows that ended."""
        kept, out, done = [], [], []
        block, rows = launched.block, launched.rows
        for b, (r, row) in enumerate(zip(rows, values)):
            if b in void:
                kept.append(0)
                continue
            accepted = row[0]
            new, stopped = cycle_tokens(row[2:], accepted, row[1], r.eos, r.max_tokens - r.n)
            if block > 1:
                r.acceptance.observe(block - 1, accepted)
            r.n += len(new)
            kept.append(len(new))
            r.cache.tokens.extend(new)
            r.anchor = new[-1]
            r.cache.pending = [r.anchor]
            finish = "stop" if stopped else ("length" if r.n >= r.max_tokens else None)
            lp = None
            if r.logprobs:
                lps = launched.logits[b] - mx.logsumexp(launched.logits[b], axis=-1, keepdims=True)
                lp = [lps[i] for i in range(len(new))]
            out.append(BatchResponse(r.uid, new, [i < accepted for i in range(len(new))], lp, finish, block, len(rows)))
            if finish is not None:
                done.append(b)
        if not launched.committed:
            self.commit(launched, kept)
        self.cycles_read.append(len(rows))
        read = time.perf_counter()
        if block > 1 or launched.queued_ahead:
            # A plain step is priced as in a plain spell, queued ahead of the
            # last one's read: one launched after a drafting cycle waits for
            # its own forward, and priced by those, plain steps looked dearer
            # than a spell of them runs, so a large batch kept drafting.
            self.sizer.observe([r.acceptance for r in rows], [r.max_tokens - r.n for r in rows], block, read - self.clock)
        self.clock = read
        return out, done

    def outcome(self, rows: List[Request], logits: mx.array, drafted: Optional[mx.array], qs) -> mx.array:
        """``[B, 2 + L - 1]`` int32: per row its accepted count, the token
        after them and its proposal (:meth:`AcceptanceRule.outcome`'s
        layout, a row per request), greedy rows decided together."""
        B, L = logits.shape[0], logits.shape[1]
        proposal = drafted if drafted is not None else mx.zeros((B, 0), mx.int32)
        greedy = [b for b, r in enumerate(rows) if r.rule.sampler is None]
        accepted, token = [None] * B, [None] * B
        if greedy:
            idx = mx.array(greedy, dtype=mx.int32) if len(greedy) < B else None
            sub = (lambda a: a) if idx is None else (lambda a: a[idx])  # noqa: E731
            if L == 1:
                acc, tok = mx.zeros((len(greedy),), mx.int32), mx.argmax(sub(logits)[:, 0], axis=-1)
            else:
                acc, tok = accept_greedy(sub(proposal), mx.argmax(sub(logits), axis=-1))
            if len(greedy) == B:  # every row greedy: decided in one go
                return mx.concatenate([mx.stack([acc, tok], axis=1).astype(mx.int32), proposal], axis=1)
            for i, b in enumerate(greedy):
                accepted[b], token[b] = acc[i], tok[i]
        for b, r in enumerate(rows):
            if r.rule.sampler is None:
                continue
            if L == 1:
                accepted[b], token[b] = mx.array(0, mx.int32), r.rule.choose(logits[b, 0], r.next_key())
            else:  # the row's own rule, with its own key
                row = r.rule.outcome(logits[b], proposal[b], qs[b], r.next_key())
                accepted[b], token[b] = row[0], row[1]
        head = mx.stack([mx.stack([a.astype(mx.int32), t.astype(mx.int32)]) for a, t in zip(accepted, token)])
        return mx.concatenate([head, proposal], axis=1)


@dataclass
class Launched:
    """A queued cycle: its rows, block, lazy outcome (:meth:`BatchGenerator.outcome`),
    logits and tap states, whether it was queued ahead, and whether its rows'
    kept tokens are committed."""

    rows: List[Request]
    block: int
    outcome: mx.array
    logits: mx.array
    taps: mx.array
    queued_ahead: bool = False  # a plain step queued before the last one was read
    committed: bool = False


@dataclass
class BatchResult:
    """:func:`batch_generate`'s answer: per request its text, its tokens (eos
    excluded, as :func:`~dflash_mlx.generate.stream_generate` reports them),
    why it ended, its statistics and its prompt cache."""

    texts: List[str]
    tokens: List[List[int]]
    finish_reasons: List[Optional[str]]
    stats: List[dict] = field(default_factory=list)
    prompt_caches: List[PromptCache] = field(default_factory=list)


def batch_generate(
    model,
    draft,
    tokenizer,
    prompts: Sequence,
    *,
    max_tokens=DEFAULT_MAX_TOKENS,
    prompt_caches: Optional[Sequence[Optional[PromptCache]]] = None,
    verbose: bool = False,
    record=None,
    **kwargs,
) -> BatchResult:
    """Generate for every prompt at once (mlx-lm's ``batch_generate``, with
    a drafter): the requests decode together in batched cycles
    (:class:`BatchGenerator`, whose options ``kwargs`` may hold, with
    :meth:`BatchGenerator.insert`'s sampling ones). Each text is what
    :func:`~dflash_mlx.generate.generate` gives for its prompt alone:
    token-identical when greedy, identically distributed when sampled.
    ``stats[i]``: its prompt and generated tokens, cycles, accepted draft
    tokens and tokens per cycle. ``record`` (a :class:`dflash_mlx.traffic.Recorder`)
    stores each finished conversation as drafter training data, as
    :func:`~dflash_mlx.generate.stream_generate`'s does."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    insert_keys = ("temperature", "top_p", "top_k", "min_p", "seed", "acceptance", "logprobs")
    insert = {k: kwargs.pop(k) for k in insert_keys if k in kwargs}
    gen = BatchGenerator(model, draft, **kwargs)
    encoded = [encode_prompt(tokenizer, p).tolist() for p in prompts]
    contexts = [(list(c.tokens) if c is not None else []) + e for c, e in zip(prompt_caches or [None] * len(encoded), encoded)]
    uids = gen.insert(
        encoded, max_tokens, prompt_caches=prompt_caches, eos_token_ids=tokenizer.eos_token_ids, **insert
    )
    index = {u: i for i, u in enumerate(uids)}
    n = len(uids)
    tokens, finish = [[] for _ in range(n)], [None] * n
    stats = [dict(prompt_tokens=len(e), generation_tokens=0, cycles=0, accepted=0) for e in encoded]
    caches = [None] * n
    tic = time.perf_counter()
    while gen.busy:
        for r in gen.next():
            i = index[r.uid]
            tokens[i] += r.tokens
            stats[i]["cycles"] += r.block > 0
            stats[i]["accepted"] += sum(r.from_draft)
            if r.finish_reason is not None:
                finish[i], caches[i] = r.finish_reason, r.prompt_cache
                if record is not None:
                    record.record(contexts[i], tokens[i])
                if verbose:
                    print(f"[request {i} done: {len(tokens[i])} tokens, {r.finish_reason}]")
    elapsed = time.perf_counter() - tic
    gen.close()
    eos = set(tokenizer.eos_token_ids)
    texts, bodies = [], []
    for i, t in enumerate(tokens):
        body = [x for x in t if x not in eos]  # as stream_generate reports them
        bodies.append(body)
        texts.append(tokenizer.decode(body))
        s = stats[i]
        s["generation_tokens"] = len(body)
        s["tokens_per_cycle"] = round((len(t) - 1) / max(1, s["cycles"]), 3)
    total = sum(s["generation_tokens"] for s in stats)
    for s in stats:
        s["batch_tps"] = total / max(elapsed, 1e-9)
    return BatchResult(texts, bodies, finish, stats, caches)
