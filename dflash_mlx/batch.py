"""Many requests in one loop: batched DFlash cycles, exact per request.

    from dflash_mlx import batch_generate
    result = batch_generate(model, draft, tokenizer, ["def fib(n):", "import os"], max_tokens=128)

:class:`BatchGenerator` is the scheduler over one
:class:`~dflash_mlx.decode.Decoder` (mlx-lm's ``BatchGenerator`` shape, the
object a server drives): requests are inserted and removed between cycles,
short prompts are prefilled together and a long one a chunk at a time
between decode cycles, prefilled requests join the decoder, and a finished
request leaves with its prompt cache. The decoder verifies every row in one
target forward per cycle and each row accepts its own prefix
(:mod:`dflash_mlx.decode`): every row is exact as its lone run, greedy rows
token for token, sampled rows in distribution (each with its own settings
and, given a seed, its own random key). A batch of one decodes as a request
alone does (the pair's sizer, draft trees included).
"""

import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import maybe_set_recommended_wired_limit

from .cache import PromptCache, bound_target, prompt_cache_for
from .controls import KV_KEYWORDS, positive_int
from .copy_source import CopyDrafts
from .decode import BatchResponse, Request, Stats
from .defaults import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP_SIZE
from .errors import ArgumentError
from .generate import (
    checked_prompt, controlled_rule, decoder_for, encode_prompt, max_block_size, on_pair, row_controls, stop_tokens, tree_plan,
)
from .prefill import feed, prefill, prefill_together
from .structured import constraint_for
from .targets.rows import check_joinable

DEFAULT_COMPLETION_BATCH_SIZE = 32  # mlx-lm's --decode-concurrency default
DEFAULT_PREFILL_BATCH_SIZE = 8  # mlx-lm's --prompt-concurrency default
CONTROL_KEYS = ("logits_processors", "min_tokens_to_keep", "xtc_probability", "xtc_threshold", "xtc_special_tokens", "all_tokens")


def one_each(name: str, value, n: int, many=(list, tuple)) -> list:
    """A setting for each of ``n`` prompts: one value for all, or one per prompt (a ``many``)."""
    values = list(value) if isinstance(value, many) else [value] * n
    if len(values) != n:
        raise ArgumentError(f"{name} has {len(values)} values for {n} prompts")
    return values


def per_prompt(name: str, value, n: int) -> list:
    """A list-valued setting (processors, token ids) for each of ``n``
    prompts: None or one list for all, or one list (or None) per prompt."""
    value = list(value or [])
    if value and all(v is None or isinstance(v, (list, tuple, set, frozenset)) for v in value):
        if len(value) != n:
            raise ArgumentError(f"{name} has {len(value)} lists for {n} prompts: pass one list for all, or one per prompt")
        return [list(v or []) for v in value]
    return [value] * n


class BatchGenerator:
    """Decodes many requests with one drafter and one target, cycle by cycle.

    ``insert`` queues requests (their prompts are prefilled between decode
    cycles, ``prefill_step_size`` tokens per :meth:`next` across at most
    ``prefill_batch_size`` prompts); each :meth:`next` returns what every
    request committed in one cycle; ``remove`` drops requests (a
    disconnected client) between cycles. At most ``completion_batch_size``
    requests decode at once; the others wait for a slot before their
    prefill. ``block_size`` fixes every cycle's block (None: adaptive);
    ``tree_budget`` as :func:`~dflash_mlx.generate.generate_step` takes it
    (a forced tree verifies one request: ``completion_batch_size=1``).
    ``tokenizer`` (the target's) is what requests' response formats need.
    ``copy_drafts``: whether requests may verify spans copied from their
    context (:mod:`dflash_mlx.copy_source`; :meth:`insert` may set it per
    request).
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
        tokenizer=None,
        copy_drafts: bool = True,
        tree_budget: Optional[int] = None,
    ):
        self.old_wired_limit = self.decoder = None  # (close() may run on a generator refused below)
        positive_int(completion_batch_size, "completion_batch_size")
        positive_int(prefill_batch_size, "prefill_batch_size")
        positive_int(prefill_step_size, "prefill_step_size")
        self.model, self.draft, self.stream, self.tokenizer = model, draft, stream, tokenizer
        self.target = bound_target(model, draft)
        self.max_block = max_block_size(draft, block_size, None)
        self.fixed = block_size is not None
        self.trees = tree_plan(self.target, draft, tree_budget, None)  # (nodes forced, whether the sizer may choose trees)
        if self.trees[0] and completion_batch_size > 1:
            raise ArgumentError("a forced draft tree (tree_budget) verifies one request a cycle: pass completion_batch_size=1")
        self.completion_batch_size, self.prefill_batch_size = completion_batch_size, prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.draft_window, self.draft_sink = draft_window, draft_sink
        self.copy_drafts = bool(copy_drafts)
        self.waiting: List[Request] = []  # queued: not prefilled, or partly
        self.joining: List[Request] = []  # prefilled, first token out, joining at the next cycle
        self.uid = 0
        # Held from here to close(), as mlx-lm's BatchGenerator holds it: a
        # limit set and restored every cycle would wait for the queued work.
        self.old_wired_limit = maybe_set_recommended_wired_limit()

    def close(self) -> None:
        """Roll back a queued cycle and give back the wired memory limit
        (Metal); the generator is done."""
        if self.decoder is not None:
            with on_pair(self.draft, self.stream):
                self.decoder.drop_queued()
        if self.old_wired_limit is not None:
            mx.synchronize(self.stream)
            mx.set_wired_limit(self.old_wired_limit)
            self.old_wired_limit = None

    def __del__(self):
        self.close()

    @property
    def active(self) -> List[Request]:
        """The requests decoding, in the batch's row order."""
        return [] if self.decoder is None else self.decoder.rows

    @property
    def cycles_read(self) -> List[int]:
        """The rows of each cycle the last :meth:`next` read."""
        return [] if self.decoder is None else self.decoder.cycles_read

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
        response_format=None,
        logits_processors=None,
        min_tokens_to_keep=1,
        xtc_probability=0.0,
        xtc_threshold=0.1,
        xtc_special_tokens=None,
        kv_bits=None,
        kv_group_size=None,
        quantized_kv_start=None,
        max_kv_size=None,
        all_tokens=None,
        copy_drafts=None,
    ) -> List[int]:
        """Queue requests; returns their uids. ``prompts``: token lists (only
        the part new to a request's prompt cache, as in
        :func:`~dflash_mlx.generate.generate_step`). ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed`` and
        ``logprobs`` are one value for all or one per prompt, and so are the
        stop tokens (``eos_token_ids``: ids, or a collection of ids per prompt); a request's seed gives it its own random key (None:
        ``mx.random``'s state). A request's ``block_size`` caps the batch's
        blocks while it decodes (None: no cap); its ``progress(done, total)``
        hears how far its prompt's prefill is; ``copy_drafts`` (None: the
        generator's) whether it may verify spans copied from its context.
        ``response_format`` (one for all, or a list: one per prompt) holds a
        request's answer to a JSON schema, a regular expression or a grammar
        (:mod:`dflash_mlx.structured`; built with the generator's
        ``tokenizer``, checked here). mlx-lm's controls, exact per row as in
        :func:`~dflash_mlx.generate.generate_step`: ``logits_processors`` (one
        list of callables for all, or one list per prompt, as mlx-lm's
        ``BatchGenerator.insert`` takes them), ``min_tokens_to_keep``,
        ``xtc_probability`` and ``xtc_threshold`` (one value or one per
        prompt), ``xtc_special_tokens`` (ids for all, or a list per prompt);
        mlx-lm's KV cache keywords (``kv_bits``, ``kv_group_size``,
        ``quantized_kv_start``, ``max_kv_size``) for the requests' caches (a
        quantized or rotating cache cannot join a batch: it is refused, see
        :func:`~dflash_mlx.targets.rows.check_joinable`); ``all_tokens``: per
        prompt, the tokens before it that its processors see (None: see
        :func:`~dflash_mlx.generate.row_controls`)."""
        n = len(prompts)
        each = lambda name, value, many=(list, tuple): one_each(name, value, n, many)  # noqa: E731
        settings = zip(
            prompts, each("max_tokens", max_tokens), each("prompt_caches", prompt_caches or [None] * n),
            each("temperature", temperature), each("top_p", top_p), each("top_k", top_k), each("min_p", min_p),
            each("seed", seed), each("block_size", block_size), each("progress", progress),
            per_prompt("eos_token_ids", eos_token_ids, n), each("logprobs", logprobs),
            each("response_format", response_format, (list,)), each("copy_drafts", copy_drafts),
        )
        controls = zip(
            per_prompt("logits_processors", logits_processors, n), each("min_tokens_to_keep", min_tokens_to_keep),
            each("xtc_probability", xtc_probability), each("xtc_threshold", xtc_threshold),
            per_prompt("xtc_special_tokens", xtc_special_tokens, n), each("all_tokens", all_tokens or [None] * n),
        )
        kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size)
        requests = [
            self.request(self.uid + i, *row, acceptance, dict(zip(CONTROL_KEYS, c)), kv)
            for i, (row, c) in enumerate(zip(settings, controls))
        ]
        held = [id(c) for r in requests for c in r.controls]
        if len(set(held)) < len(held):
            raise ArgumentError("each request needs a Constraint of its own: pass response formats (or one fresh Constraint per prompt)")
        self.uid += len(requests)
        self.waiting.extend(requests)
        return [r.uid for r in requests]

    def request(self, uid, prompt, limit, cache, temp, tp, tk, mp, seed, cap, hear, eos, want, form, copies, acceptance, controls, kv) -> Request:
        """One inserted request, checked before any work."""
        positive_int(limit, "max_tokens")
        processors, before = controls.pop("logits_processors"), controls.pop("all_tokens")
        rule = controlled_rule(self.target, (temp, tp, tk, mp, None, acceptance), processors, kv, **controls)
        constraint = constraint_for(form, self.tokenizer)
        cache = prompt_cache_for(self.model, self.draft, cache, self.draft_window, self.draft_sink, **kv)
        tokens = checked_prompt(self.target, cache, prompt)
        if cache.target.undo is not None:
            raise ArgumentError("a prompt cache is in the middle of a generation: close that generation first")
        if self.completion_batch_size > 1:
            check_joinable(cache.target)
        if cap is not None:  # (a cap above the generator's largest block caps nothing)
            cap = min(max_block_size(self.draft, cap, None), self.max_block)
        key = None if seed is None else mx.random.key(int(seed))
        controls = row_controls(processors, constraint, tokens, before)
        copies = CopyDrafts(cache) if (self.copy_drafts if copies is None else copies) else None
        return Request(uid, cache, rule, limit, stop_tokens(eos, constraint), bool(want), key, cap, tokens, len(tokens), hear,
                       controls=controls, copies=copies)

    def remove(self, uids: Iterable[int]) -> Dict[int, PromptCache]:
        """Drop requests between cycles; returns their prompt caches, each
        consistent with the tokens it holds (``cache.tokens``)."""
        uids = set(uids)
        out = {r.uid: r.cache for r in self.waiting + self.joining if r.uid in uids}
        self.waiting = [r for r in self.waiting if r.uid not in uids]
        self.joining = [r for r in self.joining if r.uid not in uids]
        leaving = [b for b, r in enumerate(self.active) if r.uid in uids]
        if leaving:
            with on_pair(self.draft, self.stream):
                self.decoder.drop_queued()
                out.update((r.uid, r.cache) for r in self.decoder.leave(leaving))
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
        with on_pair(self.draft, self.stream):
            if self.joining:
                self.join(self.joining)
                self.joining = []
            out = self.prefill_queued()
            if self.active:
                self.decoder.sizing.closed = not self.waiting
                # A cycle is queued before the caller's work on this one's
                # tokens unless requests are about to join (it would be undone).
                out += self.decoder.step(run_ahead=not (self.waiting or self.joining))
            elif self.decoder is not None:
                self.decoder.cycles_read = []
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
                logits = prefill_together(self.target, [r.cache for r in group], [r.todo for r in group])
                out += [self.first_token(r, logits[b : b + 1]) for b, r in enumerate(group)]
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
            out.append(self.first_token(r, prefill(self.target, r.cache, chunk, self.prefill_step_size)))
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

    def first_token(self, r: Request, logits: mx.array) -> BatchResponse:
        """The prefill's token; the request then joins the batch, unless it is done."""
        r.todo = []
        if r.progress is not None:
            r.progress(r.total, r.total)
        response = r.start(logits)
        if response.finish_reason is not None:
            r.cache.drop_unreadable()
            response.prompt_cache = r.cache
        else:
            self.joining.append(r)  # at the next call: its first token goes out first
        return response

    def join(self, requests: List[Request]) -> None:
        """Prefilled requests join the decoder; the first one in a process
        measures the cycles' costs on its own cache first."""
        if self.decoder is None:
            self.decoder = decoder_for(self.target, self.draft, requests[0].cache, self.max_block, self.fixed, None, self.trees)
        self.decoder.join(requests)


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
    tokens (``forced``: of them, those its ``response_format`` forced;
    ``copied``: those copied from the context) and tokens per cycle.
    ``record`` (a :class:`dflash_mlx.traffic.Recorder`)
    stores each finished conversation as drafter training data, as
    :func:`~dflash_mlx.generate.stream_generate`'s does."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    insert_keys = ("temperature", "top_p", "top_k", "min_p", "seed", "acceptance", "logprobs", "response_format") + CONTROL_KEYS + KV_KEYWORDS
    insert = {k: kwargs.pop(k) for k in insert_keys if k in kwargs}
    gen = BatchGenerator(model, draft, tokenizer=tokenizer, **kwargs)
    encoded = [encode_prompt(tokenizer, p).tolist() for p in prompts]
    contexts = [(list(c.tokens) if c is not None else []) + e for c, e in zip(prompt_caches or [None] * len(encoded), encoded)]
    uids = gen.insert(
        encoded, max_tokens, prompt_caches=prompt_caches, eos_token_ids=tokenizer.eos_token_ids, **insert
    )
    index = {u: i for i, u in enumerate(uids)}
    n = len(uids)
    tokens, finish = [[] for _ in range(n)], [None] * n
    counts = [Stats() for _ in encoded]
    caches = [None] * n
    tic = time.perf_counter()
    while gen.busy:
        for r in gen.next():
            i = index[r.uid]
            tokens[i] += r.tokens
            for from_draft, copied in zip(r.from_draft, r.copied):
                counts[i].count(from_draft, r.block, copied=copied)
            counts[i].forced += r.forced
            if r.finish_reason is not None:
                finish[i], caches[i] = r.finish_reason, r.prompt_cache
                if record is not None:
                    record.record(contexts[i], tokens[i])
                if verbose:
                    print(f"[request {i} done: {len(tokens[i])} tokens, {r.finish_reason}]")
    elapsed = time.perf_counter() - tic
    gen.close()
    eos = set(tokenizer.eos_token_ids)
    bodies = [[x for x in t if x not in eos] for t in tokens]  # as stream_generate reports them
    texts = [tokenizer.decode(body) for body in bodies]
    total = sum(map(len, tokens))  # an eos counted, as mlx-lm's batch_generate and stream_generate count it
    stats = [
        dict(prompt_tokens=len(e), generation_tokens=len(t), cycles=c.cycles, accepted=c.accepted, forced=c.forced, copied=c.copied,
             tokens_per_cycle=c.tokens_per_cycle, batch_tps=total / max(elapsed, 1e-9))
        for e, t, c in zip(encoded, tokens, counts)
    ]
    return BatchResult(texts, bodies, finish, stats, caches)
