"""An OpenAI-compatible HTTP server over the DFlash loop.

    mlx-dflash server --model M --draft-model D --host 127.0.0.1 --port 8080

``POST /v1/chat/completions`` and ``/v1/completions`` (streamed as SSE or
not), ``GET /v1/models`` and ``GET /health``. The HTTP side is mlx-lm's own
``APIHandler`` (routes, SSE, usage, tool calls, reasoning, stop words in the
text); this module gives it a generation side that runs the DFlash loop,
checks requests up front (one OpenAI-style 4xx error each), and adds the
DFlash statistics to ``usage.dflash``. The agent dialects (Anthropic's
``/v1/messages``, OpenAI's ``/v1/responses``) and ``GET /metrics`` live in
:mod:`dflash_mlx.api` and run on the same generation side.

Requests are served on one generation thread (MLX streams and the prompt
caches belong to it), decoded together in batched cycles
(:class:`~dflash_mlx.batch.BatchGenerator`: they join between cycles and
leave as they finish; one at a time with ``--pipeline``, forced draft
trees or quantized or rotating KV caches, the others waiting). Prompt caches are
kept across requests in mlx-lm's ``LRUPromptCache`` (bounded by entries and
bytes), keyed by the tokens and by the target and drafter: the longest
common prefix is reused, trimmed where the caches can trim; caches that
cannot (hybrid targets) are snapshotted at message boundaries and at the end
of each prompt. The drafter's context is part of each entry, so a hit
restores it with the target's. ``--prompt-cache-dir`` adds a disk tier
under it (:mod:`dflash_mlx.disk_cache`).

``--api-key`` is checked on every route but ``/health``; request bodies,
prompts and ``max_tokens`` are bounded, and token ids checked against the
vocabulary, before anything is queued (docs/server.md, "Keys and limits").
"""

import argparse
import copy
import hmac
import io
import ipaddress
import json
import logging
import math
import os
import queue
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any, Dict, List, Optional

import mlx.core as mx
from jinja2 import TemplateError
from mlx_lm.generate import generation_stream, make_stop_sequences, make_text_state_machine
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import APIHandler, GenerationContext, Response, convert_chat, process_message_content

from . import cli
from .adapt import add_learn_arguments, learning
from .api import ENDPOINTS, Metrics, ResponseStore, read_json_body
from .api.formats import request_format
from .api.harmony import text_format
from .api.turn import check_chat_tools, openai_tool_choice, tool_choice_rule
from .cache import make_prompt_cache
from .controls import TOP_LOGPROBS_LIMIT, control_keywords, kv_keywords, penalty_processors
from .disk_cache import DiskPromptCache, TieredPromptCache, pair_identity
from .defaults import DEFAULT_MAX_TOKENS, MAX_BLOCK_SIZE
from .errors import ArgumentError, RequestError
from .batch import DEFAULT_COMPLETION_BATCH_SIZE, DEFAULT_PREFILL_BATCH_SIZE, BatchGenerator
from .decode import Stats
from .prefill import feed
from .pipeline import STOP, agree_flag, share_request
from .targets.kv import KVSettings
from .traffic import record_safely

ROUTES = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}

# The roles of OpenAI's chat messages (what a chat template is written for).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# The largest number a request field may hold: MLX takes no larger integer.
MAX_INT = 2**63 - 1

API_KEY_VARIABLE = "MLX_DFLASH_API_KEY"  # --api-key's default, kept out of the process list
DEFAULT_MAX_REQUEST_BYTES = 64 << 20  # an agent's whole conversation, with room to spare
DEFAULT_DISK_BYTES = 32 << 30

@dataclass
class Prepared:
    """A checked request: its prompt tokens and where its messages end."""

    tokens: List[int]
    boundaries: List[int]
    initial_state: str
    block_size: Optional[int] = None  # fixed by the request's num_draft_tokens
    response_format: Optional[dict] = None  # structured outputs (dflash_mlx.structured's shape); None: free text
    controls: Dict[str, Any] = field(default_factory=dict)  # its decoding keywords (penalties, XTC: BatchGenerator.insert's)


@dataclass
class RequestContext(GenerationContext):
    """mlx-lm's per-request context, plus DFlash statistics and a stop flag
    the generation thread can read."""

    dflash: Dict[str, Any] = field(default_factory=dict)
    stopped: bool = False

    def stop(self):
        super().stop()
        self.stopped = True


def check_fields(body: dict) -> None:
    """Types and ranges of the sampling fields, and the fields DFlash cannot honour."""

    def number(name, lo=None, hi=MAX_INT, kind=(int, float)):
        value = body.get(name)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, kind):
            raise RequestError(f"{name} must be a {'integer' if kind is int else 'number'}", name)
        if not math.isfinite(value):  # JSON's NaN and Infinity would sample from nothing
            raise RequestError(f"{name} must be a finite number, not {value}", name)
        if lo is not None and value < lo:
            raise RequestError(f"{name} must be at least {lo}, not {value}", name)
        if value > hi:
            raise RequestError(f"{name} must be at most {hi}, not {value}", name)

    number("max_tokens", 1, kind=int)
    number("max_completion_tokens", 1, kind=int)
    number("temperature", 0)
    number("top_p", 0, 1)
    number("top_k", 0, kind=int)
    number("min_p", 0, 1)
    number("seed", 0, 2**64 - 1, int)  # what mx.random.seed takes
    number("num_draft_tokens", 0, MAX_BLOCK_SIZE - 1, int)
    number("top_logprobs", -1, TOP_LOGPROBS_LIMIT, int)  # -1: mlx-lm's "not given"
    # (penalties, logit bias and XTC: dflash_mlx.controls checks them, in request_controls)
    for name in ("stream", "logprobs"):
        if name in body and not isinstance(body[name], bool):
            raise RequestError(f"{name} must be true or false", name)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise RequestError("stop must be a string or a list of strings", "stop")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise RequestError("stream_options must be an object {include_usage: true or false}", "stream_options")
    if not isinstance(body.get("model", ""), str):
        raise RequestError("model must be a string", "model")
    if body.get("adapters") is not None:  # mlx-lm's server would load them: this one serves its --adapter-path only
        raise RequestError("adapters cannot change per request here: start the server with --adapter-path", "adapters")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1: the DFlash server answers with one choice; send one request per choice", "n")


def logit_bias(body: dict) -> Optional[dict]:
    """The request's ``logit_bias`` with its token ids (JSON's string keys)
    as ints, as mlx-lm's server reads it (the values and the ids' range:
    :func:`~dflash_mlx.controls.check_processor_settings`)."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must be an object of token id -> bias", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise RequestError(f"logit_bias: {key!r} is not a token id", "logit_bias") from None
    return out


def request_controls(body: dict, tokenizer, vocab_size: int) -> Dict[str, Any]:
    """The decoding keywords of a request's penalties, logit bias
    and XTC, built as mlx-lm's server builds them (``make_logits_processors``;
    XTC sparing newline and eos), checked by :mod:`dflash_mlx.controls`: a
    bad value is a 400 naming its field."""
    given = {k: body[k] for k in (
        "repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
        "frequency_penalty", "frequency_context_size",
    ) if body.get(k) is not None}
    xtc = {k: body[k] for k in ("xtc_probability", "xtc_threshold") if body.get(k) is not None}
    try:
        processors = penalty_processors(vocab_size, logit_bias=logit_bias(body), **given)
        return control_keywords(tokenizer, processors, **xtc)
    except ArgumentError as e:  # its message starts with the setting's name
        raise RequestError(str(e), re.match(r"\w+", str(e)).group()) from None


def chat_tokens(tokenizer, body: dict, template_args: dict):
    """Prompt tokens of a chat request and the token counts at which its
    messages end (the snapshot points for caches that cannot trim)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    check_chat_tools(body.get("tools"))
    try:
        process_message_content(messages)
    except (ValueError, KeyError, TypeError) as e:
        raise RequestError(f"bad message content: {e}", "messages") from None
    if not getattr(tokenizer, "chat_template", None):  # set after loading too (--chat-template)
        return tokenizer.encode(convert_chat(messages, body.get("role_mapping"))), []
    role = next((m["role"] for m in messages if m["role"] not in CHAT_ROLES), None)
    if role is not None:
        raise RequestError(f"a message has the role {role!r}: use one of {', '.join(CHAT_ROLES)}", "messages")
    tools = tool_choice_rule(openai_tool_choice(body.get("tool_choice")), body.get("tools") or None)
    kwargs = {**template_args, **(body.get("chat_template_kwargs") or {}), "tools": tools}
    try:  # the template meets the client's messages and tools here
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        boundaries = []
        for i in range(1, len(messages)):
            head = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=False, tokenize=True, **kwargs)
            if 0 < len(head) < len(prompt) and prompt[: len(head)] == head:
                boundaries.append(len(head))
    except (TemplateError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise RequestError(f"the chat template cannot render these messages or tools: {e}", "messages") from None
    return prompt, boundaries


def text_chars(value) -> int:
    """Characters in every string of a JSON value (messages, their parts)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def longest_token(tokenizer) -> int:
    """Characters in the vocabulary's longest token: no token covers more of
    a text (byte-level and SentencePiece pieces spell at least the
    characters they stand for), so a text of C characters is at least
    C / this many tokens."""
    return max(1, max(map(len, tokenizer.get_vocab())))


def check_prompt_chars(body: dict, kind: str, max_prompt: Optional[int], context: Optional[int], token_chars: Optional[int]) -> None:
    """Refuse a prompt whose characters alone, at the longest token's length
    each, are more tokens than ``max_prompt`` or the ``context`` holds: a
    prompt far past them is refused before it is tokenized whole."""
    if token_chars is None:
        return
    param = "messages" if kind == "chat" else "prompt"
    value = body.get(param)
    if isinstance(value, list) and kind == "text":  # token ids: counted as they are
        least = len(value)
    else:
        least = -(-text_chars(value) // token_chars)
    if max_prompt is not None and least > max_prompt:
        raise RequestError(
            f"the prompt has at least {least} tokens, more than this server's limit of {max_prompt} (--max-prompt-tokens): shorten it",
            param,
        )
    if context is not None and least >= context:
        raise RequestError(f"the prompt has at least {least} tokens but the model's context is {context}: shorten it", param)


def prompt_tokens(tokenizer, target, body: dict, kind: str, template_args: dict):
    """A request's prompt tokens and message boundaries, token ids checked."""
    if kind != "text":
        return chat_tokens(tokenizer, body, template_args)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt), []
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:
            target.check_tokens(prompt)
        except ArgumentError as e:
            raise RequestError(str(e), "prompt") from None
        return list(prompt), []
    raise RequestError("prompt must be a non-empty string or list of token ids", "prompt")


def prepare(tokenizer, target, body: dict, kind: str, max_prompt: Optional[int], template_args: dict, answers,
            token_chars: Optional[int] = None) -> Prepared:
    """Check a request and tokenize it, before it is queued: its fields, its
    prompt within the target's vocabulary, the server's ``max_prompt``
    tokens and, with its ``max_tokens``, the target's context (a prompt far
    past them is refused before tokenizing, by :func:`check_prompt_chars`
    with ``token_chars``); ``answers``: how the tokenizer's answers split
    (:func:`~dflash_mlx.api.harmony.text_format`)."""
    check_fields(body)
    controls = request_controls(body, tokenizer, target.vocab_size)
    param = "messages" if kind == "chat" else "prompt"
    context = getattr(target.args, "max_position_embeddings", None)
    check_prompt_chars(body, kind, max_prompt, context, token_chars)
    tokens, boundaries = prompt_tokens(tokenizer, target, body, kind, template_args)
    if not tokens:
        raise RequestError("the prompt is empty", "prompt")
    if max_prompt is not None and len(tokens) > max_prompt:
        raise RequestError(
            f"the prompt has {len(tokens)} tokens, more than this server's limit of {max_prompt} (--max-prompt-tokens): shorten it",
            param,
        )
    if context is not None and len(tokens) >= context:
        raise RequestError(f"the prompt has {len(tokens)} tokens but the model's context is {context}: shorten it", param)
    max_tokens = body.get("max_completion_tokens")  # mlx-lm's server reads it first
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    if context is not None and max_tokens is not None and len(tokens) + max_tokens > context:
        raise RequestError(
            f"max_tokens is {max_tokens}, but the model's context of {context} tokens holds only "
            f"{context - len(tokens)} after this prompt of {len(tokens)}: ask for fewer",
            "max_tokens",
        )
    state = "normal"
    if kind == "chat" and tokenizer.has_thinking and tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens):
        state = "reasoning"
    if kind == "chat":
        state = answers.response_initial_state or state
    draft_tokens = body.get("num_draft_tokens")
    response_format = request_format(body, tokenizer, answers, state)
    return Prepared(tokens, boundaries, state, None if draft_tokens is None else draft_tokens + 1, response_format, controls)


def top_logprobs(logprobs: mx.array, n: int, tokenizer) -> tuple:
    """The ``n`` most likely tokens at a position, in mlx-lm's format; a token
    a response format refuses (-inf, which is not JSON) at OpenAI's -9999.0."""
    if n <= 0:
        return ()
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n].tolist()
    values = [max(v, -9999.0) for v in logprobs[ids].tolist()]
    return tuple(
        {"id": i, "token": t, "logprob": v} for i, t, v in zip(ids, tokenizer.convert_ids_to_tokens(ids), values)
    )


class Served:
    """One request being answered: its tokens turned into mlx-lm's
    ``Response`` objects for its handler (text, logprobs, stop words,
    finish), and its DFlash statistics."""

    def __init__(self, generator, responses, prepared: Prepared, args, ctx, matcher, cache, todo, progress):
        self.responses, self.prepared, self.args, self.ctx, self.matcher = responses, prepared, args, ctx, matcher
        self.cache, self.todo, self.progress = cache, todo, progress
        self.before = prepared.tokens[: len(prepared.tokens) - len(todo)]  # what its cache holds: its processors see it first, as mlx-lm's server shows them
        self.tokenizer = generator.tokenizer
        self.eos = set(self.tokenizer.eos_token_ids)
        self.want = args.logprobs or args.top_logprobs > 0
        self.detok = self.tokenizer.detokenizer
        self.n = 0
        self.answer: List[int] = []  # every token out, eos included (what --learn records)
        self.stats = Stats()
        self.alive = time.monotonic()

    def add(self, token: int, logprobs, from_draft: bool, block: int, tree: int, copied: bool = False) -> bool:
        """One committed token out to the client (``copied``: a drafted token
        copied from the context); True when the request is done."""
        self.answer.append(token)
        self.stats.count(from_draft, block, tree, copied)
        finish = "stop" if token in self.eos else None
        if finish is None:
            self.detok.add_token(token)
            self.n += 1
            finish = "stop" if self.matcher.advance(token) else ("length" if self.n == self.args.max_tokens else None)
        if finish is not None:
            self.detok.finalize()
        logprob = logprobs[token].item() if self.want else 0.0
        top = top_logprobs(logprobs, self.args.top_logprobs, self.tokenizer) if self.want else ()
        self.responses.put(Response(self.detok.last_segment, token, logprob, finish, top))
        return finish is not None

    def close(self) -> None:
        """The request's DFlash statistics, into its context."""
        if self.ctx.stopped:
            logging.info("request stopped by the client after %d tokens", self.n)
        stats = self.stats
        self.ctx.dflash.update(
            cycles=stats.cycles, accepted_draft_tokens=stats.accepted, accepted_copied_tokens=stats.copied,
            forced_tokens=stats.forced,
            block_sizes=dict(sorted(stats.blocks.items())), tree_sizes=dict(sorted(stats.trees.items())),
            tokens_per_cycle=stats.tokens_per_cycle,
        )


class DFlashResponseGenerator:
    """The generation side mlx-lm's ``APIHandler`` talks to (the interface of
    mlx-lm's ``ResponseGenerator``: ``generate``, ``cli_args``,
    ``is_healthy``), serving every request on one thread with DFlash."""

    def __init__(self, model, tokenizer, draft, cli_args, model_id: str, draft_id: str, learn=(None, None)):
        self.model, self.tokenizer, self.draft, self.cli_args = model, tokenizer, draft, cli_args
        self.answers = text_format(tokenizer)  # how answers split into reasoning, text and tool calls
        self.token_chars = longest_token(tokenizer)  # bounds a prompt's tokens before tokenizing it
        self.controls = cli.generation_keywords(cli_args, tokenizer)  # --kv-bits, --max-kv-size: every request's
        self.key = (model_id, draft_id)  # cache entries never cross target/drafter pairs
        self.recorder, self.adaptation = learn  # --learn, --adapt
        self.metrics = Metrics()
        if self.adaptation is not None:  # a restart continues from the last accepted drafter
            self.metrics.drafter_in_use(self.adaptation.version, self.adaptation.scores)
        self.created = int(time.time())
        self.prompt_cache = LRUPromptCache(cli_args.prompt_cache_size, cli_args.prompt_cache_bytes)
        self.disk = None  # --prompt-cache-dir: the disk tier under the memory one
        if cli_args.prompt_cache_dir is not None:
            kv = KVSettings.of(**kv_keywords(self.controls))  # (--kv-bits, --max-kv-size: what its files hold)
            classes = [type(c).__name__ for c in draft.target.make_cache(kv)]
            self.disk = DiskPromptCache(
                cli_args.prompt_cache_dir, cli_args.prompt_cache_disk_bytes, pair_identity(model, draft), draft, classes, kv
            )
            self.prompt_cache = TieredPromptCache(self.prompt_cache, self.disk)
        self.requests: "queue.Queue" = queue.Queue()
        self.tokenizer_lock = threading.Lock()  # handler threads tokenize too
        self.failed = self.stopping = self.busy = False
        self.stored_responses = ResponseStore()  # for /v1/responses' previous_response_id
        self.done = threading.Event()  # set when the generation thread has ended its work
        # --pipeline: every rank generates what rank 0 receives (pipeline.share_request).
        self.group = mx.distributed.init() if cli_args.pipeline else None
        # Requests decode together in batched cycles, one at a time on a
        # pipelined target (every rank admits alike), with forced draft trees
        # or with quantized or rotating KV caches (a batch's rows share plain ones).
        self.one_at_a_time = bool(cli_args.pipeline or cli_args.tree_budget or kv_keywords(self.controls))
        self.batch = self.new_batch()
        self.serving: Dict[int, "Served"] = {}  # batched requests in flight, by uid
        # Weights still lazy (a model trained in this process) belong to this
        # thread's streams: evaluated here, the generation thread only reads them.
        mx.eval(model.parameters(), draft.parameters())
        self.warm_up()  # here, before the generation thread: whatever the pair left lazy is evaluated
        self.thread = threading.Thread(target=self.run, name="dflash-generation", daemon=True)
        self.thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.thread.is_alive() and not self.failed

    def queued(self) -> int:
        """Requests waiting: not yet taken by the generation thread, or taken
        and waiting for a slot in the batch."""
        return self.requests.qsize() + len(self.batch.queued())

    def stop_and_join(self):
        self.stopping = True
        self.done.wait()
        if self.disk is not None:  # what a restart will find
            self.disk.flush()

    def new_batch(self) -> BatchGenerator:
        """An empty batch over the pair (what a batch learns of the cycles'
        costs stays with the pair)."""
        args = self.cli_args
        return BatchGenerator(
            self.model, self.draft, block_size=args.block_size, tree_budget=args.tree_budget,
            completion_batch_size=1 if self.one_at_a_time else args.decode_concurrency,
            prefill_batch_size=args.prompt_concurrency, prefill_step_size=args.prefill_step_size,
            draft_window=args.draft_window, draft_sink=args.draft_sink, stream=generation_stream,
            tokenizer=self.tokenizer,
            copy_drafts=args.copy_drafts,
        )

    def warm_up(self) -> None:
        """One short generation before the first request: the first
        generation in a process measures the cycles' costs, and no client
        should wait for that."""
        with self.tokenizer_lock:
            prompt = self.tokenizer.encode("Hello")
        self.batch.insert([prompt or [0]], 4)
        while self.batch.busy:
            self.batch.next()

    def run(self):
        try:
            self.run_batched()
        except Exception:
            logging.exception("the generation thread died")
            self.failed = True
        # Ended, but not returning: MLX (0.32) aborts the process in the
        # teardown of a thread that generated, so this daemon thread stays.
        self.done.set()
        threading.Event().wait()

    def next_request(self, block: bool = True):
        """A queued request (waiting a little for one when ``block``), ``None``
        when there is none yet, or ``STOP``; with ``--pipeline`` rank 0's, on every rank."""
        item = STOP if self.stopping else None
        if item is None and (self.group is None or self.group.rank() == 0):
            try:
                item = self.requests.get(timeout=0.1) if block else self.requests.get_nowait()
            except queue.Empty:
                pass
        return item if self.group is None else share_request(item, self.group)

    def prepare(self, body: dict, kind: str) -> Prepared:
        """Check and tokenize a request (on the handler's thread)."""
        with self.tokenizer_lock:
            return prepare(
                self.tokenizer, self.draft.target, body, kind, self.cli_args.max_prompt_tokens,
                self.cli_args.chat_template_args, self.answers, self.token_chars,
            )

    def generate(self, request, args, progress_callback=None, prepared: Prepared = None):
        """Queue a request; returns its context and an iterator of responses."""
        if not self.is_healthy:
            raise RuntimeError("the generation thread died")
        responses: "queue.Queue" = queue.Queue()
        self.requests.put((responses, prepared, args))

        def next_item():
            while True:
                try:
                    return responses.get(timeout=1.0)
                except queue.Empty:
                    if not self.is_healthy:
                        raise RuntimeError("the generation thread died") from None

        def stream():
            while (item := next_item()) is not None:
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, tuple):  # prefill progress: keep-alives
                    if progress_callback is not None:
                        progress_callback(*item)
                    continue
                yield item

        ctx = next_item()
        if isinstance(ctx, Exception):
            raise ctx
        return ctx, stream()

    def restore(self, tokens: List[int]):
        """The nearest cached state for ``tokens`` (a copy) and how many of
        the tokens it already holds."""
        entry, rest = self.prompt_cache.fetch_nearest_cache(self.key, tokens)
        args = self.cli_args
        if entry is not None:
            return entry[0], len(tokens) - len(rest)
        return make_prompt_cache(self.model, self.draft, args.draft_window, args.draft_sink, **kv_keywords(self.controls)), 0


    def snapshot(self, cache, tokens, start, boundaries, progress):
        """Prefill up to each boundary past ``start`` and keep a copy there
        (for caches that cannot trim); returns where the prefill stopped."""
        if cache.is_trimmable():
            return start
        for end in [b for b in boundaries + [len(tokens)] if b > start]:
            with mx.stream(generation_stream):  # where the decoder runs
                feed(self.draft.target, cache, tokens[start:end], self.cli_args.prefill_step_size, progress)
                mx.eval(cache.state)
            self.prompt_cache.insert_cache(self.key, list(cache.tokens), [copy.deepcopy(cache)], cache_type="user")
            start = end
        return start

    def start(self, responses, prepared: Prepared, args) -> "Served":
        """A request's context and its nearest cached state, snapshotted at
        its message boundaries where the cache cannot trim; its handler
        hears the context."""
        tok, answers = self.tokenizer, self.answers
        with self.tokenizer_lock:
            stop_sequences = make_stop_sequences(tok, args.stop_words)
            text_sm = make_text_state_machine(answers, args.stop_words)
        ctx = RequestContext(
            has_tool_calling=answers.has_tool_calling, has_thinking=answers.has_thinking,
            tool_parser=answers.tool_parser,
            text_sm=text_sm, initial_state=prepared.initial_state, prompt=prepared.tokens,
        )
        tokens = prepared.tokens

        def progress(done, total):
            responses.put((done, total))

        cache, ctx.prompt_cache_count = self.restore(tokens)
        responses.put(ctx)
        start = self.snapshot(cache, tokens, ctx.prompt_cache_count, prepared.boundaries, progress)
        return Served(self, responses, prepared, args, ctx, stop_sequences.matcher(), cache, tokens[start:], progress)

    def between_requests(self):
        """--adapt: swap in an adapted drafter if one is ready (each request
        runs with one drafter; cached entries of the old one are never hit)."""
        draft = self.adaptation.swap(self.model, self.draft)
        if draft is not self.draft:
            self.draft, self.key = draft, (self.key[0], str(self.adaptation.path))
            self.metrics.drafter_in_use(self.adaptation.version, self.adaptation.scores)
            self.batch = self.new_batch()  # (idle: the next one drafts with the new drafter)

    def finish(self, served: "Served") -> None:
        """A request ended (finished or stopped): its statistics, its end of
        stream, and its cache kept for the next request."""
        served.close()
        self.metrics.served(len(served.prepared.tokens), served.ctx.prompt_cache_count, len(served.answer), served.ctx.dflash)
        if not served.ctx.stopped:
            record_safely(self.recorder, served.prepared.tokens, served.answer)  # --learn: the finished conversation
        served.responses.put(None)
        self.prompt_cache.insert_cache(self.key, list(served.cache.tokens), [served.cache])
        if self.adaptation is not None:
            self.adaptation.request_finished()

    def run_batched(self):
        """Continuous batching: new requests join between cycles, finished
        and disconnected ones leave at once (see :class:`~dflash_mlx.batch.BatchGenerator`)."""
        while self.admit(block=not self.batch.busy):
            if not self.batch.busy:
                continue
            self.busy = True
            self.keep_alive()
            try:
                out = self.batch.next()
            except Exception as e:  # every request in flight hears it; the server goes on, on a fresh batch
                logging.exception("a batched cycle failed")
                for served in self.serving.values():
                    served.responses.put(e)
                    if self.adaptation is not None:
                        self.adaptation.request_finished()
                self.serving.clear()
                self.batch = self.new_batch()
                continue
            finally:
                self.busy = False
            for batch in self.batch.cycles_read:
                self.metrics.cycle(batch)
            gone = {}  # uid -> whether the batch itself let it go
            for r in out:  # (a request may have two cycles' responses: a plain step run ahead)
                if r.uid in gone:
                    continue
                served = self.serving[r.uid]
                served.stats.forced += r.forced
                ended = False
                for i, token in enumerate(r.tokens):
                    lp = None if r.logprobs is None else r.logprobs[i]
                    if served.add(token, lp, r.from_draft[i], r.block, r.tree, r.copied[i]):
                        ended = True
                        break
                if ended or r.finish_reason is not None or self.client_gone(served.ctx):
                    gone[r.uid] = r.finish_reason is not None
            answered = {r.uid for r in out}  # (a request queued or mid-prefill: its client may have gone too, as mlx-lm's server asks)
            gone.update((uid, False) for uid, served in self.serving.items() if uid not in answered and self.client_gone(served.ctx))
            leaving = [uid for uid, left in gone.items() if not left]
            if leaving:
                self.batch.remove(leaving)
            for uid in gone:
                self.finish(self.serving.pop(uid))

    def admit(self, block: bool) -> bool:
        """Take every queued request into the batch (waiting a little for
        one when ``block``); False once the server stops. With ``--pipeline``
        one request at a time, rank 0's on every rank, while the batch is idle."""
        while True:
            item = None if self.group is not None and self.batch.busy else self.next_request(block)
            if item is None or item == STOP:
                return item is None
            block = False
            responses, prepared, args = item
            if self.adaptation is not None and not self.batch.busy:  # a swap waits for an idle batch
                self.between_requests()
            try:
                served = self.start(responses, prepared, args)
                s = args.sampling
                (uid,) = self.batch.insert(
                    [served.todo], args.max_tokens, prompt_caches=[served.cache], temperature=s.temperature,
                    top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=args.seed, eos_token_ids=served.eos,
                    logprobs=served.want, block_size=prepared.block_size, progress=served.progress,
                    response_format=prepared.response_format,
                    all_tokens=[served.before], **self.controls, **prepared.controls,
                )
                self.serving[uid] = served
                if self.adaptation is not None:  # adapting waits while any request runs
                    self.adaptation.request_started()
            except Exception as e:
                logging.exception("request failed")
                responses.put(e)

    def keep_alive(self) -> None:
        """Streaming clients of requests still waiting for a slot hear that they are queued."""
        now = time.monotonic()
        for uid in self.batch.queued():
            served = self.serving.get(uid)
            if served is not None and now - served.alive > 1.0:
                served.alive = now
                served.progress(0, len(served.todo))

    def client_gone(self, ctx) -> bool:
        """Whether to stop for a client that went away, asked after each
        cycle: with ``--pipeline`` on every rank alike, so every rank stops
        at the same token and keeps the same prompt cache."""
        if self.group is None:
            return ctx.stopped
        return agree_flag(ctx.stopped, self.group, generation_stream)


# Seconds a connection may stay silent while the server waits to read a
# request from it (its request line, headers or body); past that it gets a
# 408 or is closed and its handler thread is free. An honest client sends a
# request without pausing this long (the bound is per read, so a slow one
# that keeps sending is served); one whose Content-Length overstates its
# body, or that never sends, would otherwise hold a thread forever (mlx-lm's
# handler reads the body with a plain blocking rfile.read). The answer's
# writes are not bounded: a stream waits on its reader.
READ_TIMEOUT = 60.0


class DFlashAPIHandler(APIHandler):
    """mlx-lm's handler, with requests checked and tokenized before they are
    queued (errors in each API's dialect), ``--api-key`` checked, the loaded
    pair in ``/v1/models`` and the DFlash statistics in ``usage.dflash``.

    The status line and headers wait for ``end_headers``: until then an
    error (one from the generation thread, say) can still replace a 200
    mlx-lm began, so the client hears it instead of a dropped connection."""

    status_line = None  # (code, message) of the answer begun, not yet sent
    header_lines: list = []
    stream = False  # mlx-lm's handler sets it from the body

    def __init__(self, generator: DFlashResponseGenerator, *args, **kwargs):
        self.generator, self.prepared, self.context = generator, None, None
        super().__init__(RequestScope(generator, self), *args, **kwargs)

    def handle_one_request(self):
        """http.server's, with its reads bounded by the server's
        ``read_timeout`` (:data:`READ_TIMEOUT`; the body's read lifts it)."""
        self.connection.settimeout(self.server.read_timeout)
        super().handle_one_request()

    def send_response(self, code, message=None):
        self.status_line, self.header_lines = (code, message), []

    def send_header(self, keyword, value):
        if self.status_line is None:
            return super().send_header(keyword, value)
        self.header_lines.append((keyword, value))

    def end_headers(self):
        if self.status_line is not None:  # (not a bare "100 Continue")
            super().send_response(*self.status_line)
            for keyword, value in self.header_lines:
                super().send_header(keyword, value)
            self.status_line = None
            self.answered = True  # from here on, an error can no longer be the answer
        super().end_headers()

    def send_json(self, status: int, obj: dict):
        if status >= 400:
            self.generator.metrics.error(self.route)
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if "*" in self.generator.cli_args.allowed_origins:
            self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()
        self.wfile.write(body)

    def send_error_json(self, status: int, message: str, param: Optional[str] = None):
        kind = "invalid_request_error" if status < 500 else "server_error"
        self.send_json(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

    @property
    def route(self) -> str:
        """The request's path without its query (Claude Code adds ``?beta=true``)."""
        return self.path.partition("?")[0]

    def start_events(self):
        """Send the headers of a server-sent event stream."""
        self._set_stream_headers(200)
        self.end_headers()

    def send_error_in_dialect(self, status: int, message: str, param: Optional[str] = None):
        """An error in the shape of the API the request's route belongs to."""
        if self.route in ENDPOINTS:
            return ENDPOINTS[self.route](self).send_error(status, message)
        self.send_error_json(status, message, param)

    def authorized(self) -> bool:
        """Whether the request may be served: ``--api-key`` given as OpenAI's
        ``Authorization: Bearer`` or Anthropic's ``x-api-key`` (every route
        but ``/health``; no key set: every request)."""
        key = self.generator.cli_args.api_key
        if not key or self.route == "/health":
            return True
        bearer = self.headers.get("Authorization", "")
        given = [bearer[7:].strip() if bearer[:7].lower() == "bearer " else "", self.headers.get("x-api-key", "")]
        return any(hmac.compare_digest(g.encode(), key.encode()) for g in given)

    def refuse_unauthorized(self):
        self.close_connection = True  # the body, if any, is left unread
        self.send_error_in_dialect(401, "a valid API key is required: send it as Authorization: Bearer KEY or x-api-key: KEY")

    def do_POST(self):
        self.answered = False
        if not self.authorized():
            return self.refuse_unauthorized()
        kind, route = ROUTES.get(self.path), self.route
        if kind is None and route not in ENDPOINTS:
            routes = list(ROUTES) + list(ENDPOINTS)
            return self.send_error_json(404, f"no route {self.path}; use {', '.join(routes)}")
        self.generator.metrics.request(route)
        endpoint = ENDPOINTS[route](self) if kind is None else None
        try:
            if endpoint is not None:  # an agent dialect (dflash_mlx.api)
                return endpoint.serve()
            self.serve_openai(kind)
        except Exception as e:  # a bug or a failed generation: the client hears a 500 in its dialect
            logging.exception("request failed")
            self.fail(endpoint, e)

    def fail(self, endpoint, error: Exception):
        """Answer a request that failed: a 500 in its dialect, or, once an
        answer is under way, an error event ending the OpenAI stream."""
        message = f"internal error: {error!r}"
        if not self.answered:
            self.status_line = None  # the answer mlx-lm began, if any
            return (endpoint.send_error if endpoint is not None else self.send_error_json)(500, message)
        self.close_connection = True
        if endpoint is None and self.stream:  # mlx-lm's stream: a data event, as OpenAI streams an error
            try:
                error = {"message": message, "type": "server_error", "param": None, "code": None}
                self.wfile.write(f"data: {json.dumps({'error': error})}\n\n".encode())
                self.wfile.flush()
            except OSError:
                pass

    def serve_openai(self, kind: str):
        """A chat or text completion: checked here, then served by mlx-lm's handler."""
        try:
            body, raw = read_json_body(self)
            self.prepared = self.generator.prepare(body, kind)
        except RequestError as e:
            return self.send_error_json(e.status, str(e), e.param)
        self.rfile = io.BytesIO(raw)  # mlx-lm's handler reads the body again
        super().do_POST()

    def validate_model_parameters(self):
        """mlx-lm's checks, XTC's whole numbers (``0``, ``1``) read as the
        numbers they are (mlx-lm's refuses all but a float; dflash_mlx.controls checked them)."""
        for name in ("xtc_probability", "xtc_threshold"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))
        super().validate_model_parameters()

    def handle_completion(self, request, stop_words):
        """mlx-lm's answer, ``stream_options`` without ``include_usage`` read as OpenAI reads it (false)."""
        if self.stream_options is not None:
            self.stream_options = {"include_usage": self.stream_options.get("include_usage", False)}
        return super().handle_completion(request, stop_words)

    def generate_response(self, *args, **kwargs) -> dict:
        response = super().generate_response(*args, **kwargs)
        if "usage" in response:
            response["usage"]["dflash"] = self.context.dflash
        return response

    def completion_usage_response(self, *args, **kwargs) -> dict:
        response = super().completion_usage_response(*args, **kwargs)
        response["usage"]["dflash"] = self.context.dflash
        return response

    def do_GET(self):
        self.answered = False
        if not self.authorized():
            return self.refuse_unauthorized()
        if self.path != "/metrics":
            return super().do_GET()
        text = self.generator.metrics.render(self.generator.queued(), self.generator.busy).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def handle_models_request(self):
        """The loaded target (with its drafter), the one model served."""
        model_id, draft_id = self.generator.key
        model = {"id": model_id, "object": "model", "created": self.generator.created, "owned_by": "mlx-dflash",
                 "draft_model": draft_id}
        self.send_json(200, {"object": "list", "data": [model]})


class RequestScope:
    """The generator as one handler sees it: ``generate`` hands over the
    request the handler checked, and keeps its context for the usage."""

    def __init__(self, generator: DFlashResponseGenerator, handler: DFlashAPIHandler):
        self.generator, self.handler = generator, handler

    @property
    def cli_args(self):
        return self.generator.cli_args

    @property
    def is_healthy(self):
        return self.generator.is_healthy

    def generate(self, request, args, progress_callback=None):
        ctx, responses = self.generator.generate(request, args, progress_callback, self.handler.prepared)
        self.handler.context = ctx
        return ctx, responses


def port_number(text: str) -> int:
    """argparse ``type`` for ``--port``: 0 (any free port) to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
    return int(text)


def setup_arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description="OpenAI-compatible HTTP server for a target model drafted by DFlash.")
    cli.add_pair_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8080, help="port to listen on (0 picks a free one)")
    p.add_argument("--allowed-origins", type=lambda s: s.split(","), default=["*"], help="comma-separated CORS origins")
    p.add_argument("--block-size", type=cli.positive_int, default=None, help="fix the verify width (default: adaptive, up to the drafter's trained size; a request's num_draft_tokens fixes block_size - 1)")
    cli.add_tree_budget_argument(p)  # a request's num_draft_tokens fixes a chain
    cli.add_copy_drafts_argument(p)
    p.add_argument("--max-tokens", "-m", type=cli.positive_int, default=DEFAULT_MAX_TOKENS, help="default max_tokens of a request")
    cli.add_sampling_arguments(p)  # a request's defaults
    p.add_argument("--decode-concurrency", type=cli.positive_int, default=DEFAULT_COMPLETION_BATCH_SIZE, help="most requests decoded together in one batch (mlx-lm's flag)")
    p.add_argument("--prompt-concurrency", type=cli.positive_int, default=DEFAULT_PREFILL_BATCH_SIZE, help="most prompts prefilled between two decode cycles (mlx-lm's flag)")
    p.add_argument("--prompt-cache-size", type=cli.positive_int, default=10, help="most prompt caches kept")
    p.add_argument("--prompt-cache-bytes", type=cli.positive_int, default=1 << 63, help="most bytes of prompt caches kept in memory")
    p.add_argument("--prompt-cache-dir", default=None, help="keep prompt caches in this folder too, across restarts (see docs/server.md)")
    p.add_argument("--prompt-cache-disk-bytes", type=cli.positive_int, default=DEFAULT_DISK_BYTES, help="most bytes of prompt cache files in --prompt-cache-dir (the least recently used go first)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE), help=f"serve only requests carrying this key (Authorization: Bearer or x-api-key; /health excepted); default: ${API_KEY_VARIABLE}")
    p.add_argument("--max-request-bytes", type=cli.positive_int, default=DEFAULT_MAX_REQUEST_BYTES, help="largest request body accepted (a larger one gets a 413)")
    p.add_argument("--max-prompt-tokens", type=cli.positive_int, default=None, help="longest prompt accepted, in tokens (default: the model's context)")
    cli.add_prefill_step_size_argument(p)
    cli.add_draft_window_arguments(p)
    cli.add_kv_cache_arguments(p)  # every request's
    cli.add_load_arguments(p)
    p.add_argument("--chat-template", default=None, help="a chat template to use instead of the tokenizer's")
    p.add_argument("--use-default-chat-template", action="store_true", help="use the tokenizer's default template when it has none")
    p.add_argument("--chat-template-args", type=lambda text: cli.template_config(text, "--chat-template-args"), default={}, help="JSON object of arguments for the chat template")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--pipeline", action="store_true", help="split the target's layers across the processes mlx.launch started; rank 0 serves HTTP (see docs/pipeline.md)")
    add_learn_arguments(p, adapt=True)
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may reach beyond this machine
        return False


def listen(args) -> ThreadingHTTPServer:
    """The HTTP server bound to ``--host``/``--port``, before any model is
    loaded (a taken port fails at once); :func:`add_generator` completes it.
    Bound beyond loopback without ``--api-key``, it warns: anyone who can
    reach the port can use it."""
    if not args.api_key and not is_loopback(args.host):
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach this port can use the "
              f"server; set --api-key or ${API_KEY_VARIABLE}", file=sys.stderr, flush=True)
    try:
        server = ThreadingHTTPServer(
            (args.host, args.port), lambda *a, **kw: DFlashAPIHandler(server.generator, *a, **kw)
        )
        server.read_timeout = READ_TIMEOUT  # (per server: a test may set a shorter one)
    except OSError as e:  # the address is taken or not ours
        raise ArgumentError(
            f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; choose another --host/--port"
        ) from None
    return server


def make_generator(args, model, tokenizer, draft, draft_id: str, learn=(None, None)) -> DFlashResponseGenerator:
    """The generation thread, started (with --pipeline, on every rank)."""
    if args.chat_template:
        tokenizer.chat_template = args.chat_template
    elif args.use_default_chat_template and tokenizer.chat_template is None:
        tokenizer.chat_template = tokenizer.default_chat_template
    args.num_draft_tokens = (args.block_size or draft.block_size) - 1  # mlx-lm's default for requests
    if args.tree_budget and draft.target.no_trees:
        raise ArgumentError(draft.target.no_trees)
    if args.pipeline and args.prompt_cache_dir:  # every rank must restore the same cache, and the writes are not agreed
        raise ArgumentError("--prompt-cache-dir does not work with --pipeline yet: leave one of them out")
    model_id = str(args.model) if args.adapter_path is None else f"{args.model}+{args.adapter_path}"  # cache entries per adapter
    return DFlashResponseGenerator(model, tokenizer, draft, args, model_id, str(draft_id), learn)


def add_generator(server: ThreadingHTTPServer, args, model, tokenizer, draft, draft_id: str, learn=(None, None)) -> ThreadingHTTPServer:
    """Give a bound server its generation thread over the loaded pair."""
    server.generator = make_generator(args, model, tokenizer, draft, draft_id, learn)
    return server


def make_server(args, model, tokenizer, draft, draft_id: str, learn=(None, None)) -> ThreadingHTTPServer:
    """The HTTP server and its generation thread, bound but not serving yet
    (``learn``: :func:`dflash_mlx.adapt.learning`'s pair)."""
    return add_generator(listen(args), args, model, tokenizer, draft, draft_id, learn)


def main(argv=None):
    from .blas import warn_if_reference
    from .pair import load_pair

    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    rank = mx.distributed.init().rank() if args.pipeline else 0
    server = listen(args) if rank == 0 else None
    try:
        if args.pipeline:
            from .pair import default_draft_for
            from .pipeline import follow_rank0, load_for_command

            if args.learn is not None:
                raise ArgumentError("--learn and --adapt serve from one process: they do not combine with --pipeline")
            if args.adapter_path is not None:
                raise ArgumentError("--adapter-path does not work with --pipeline yet: leave one of them out")
            learn = (None, None)
            model, tokenizer, draft = load_for_command(args.model, args.draft_model)
            draft_id = args.draft_model or default_draft_for(args.model)
            if rank != 0:  # generates what rank 0 receives, until rank 0 stops
                return follow_rank0(make_generator(args, model, tokenizer, draft, draft_id))
        else:
            learn = learning(args)  # --learn, --adapt
            # --adapt continues from the last drafter it accepted
            model, tokenizer, draft, draft_id = load_pair(
                args.model, learn[1].path if learn[1] else args.draft_model, args.adapter_path, args.trust_remote_code
            )
        add_generator(server, args, model, tokenizer, draft, draft_id, learn)
        if learn[1] is not None:
            learn[1].start()
        warn_if_reference()  # loaded: about to serve
    except BaseException:
        if server is not None:
            server.server_close()
        raise
    host, port = server.server_address[:2]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # shut down as on Ctrl-C: pending cache files are written
    print(f"mlx-dflash server listening on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if server.generator.adaptation is not None:
            server.generator.adaptation.stop()
        server.generator.stop_and_join()
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
