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

Requests run one at a time on one generation thread (MLX streams and the
prompt caches belong to it); the others wait in a queue. Prompt caches are
kept across requests in mlx-lm's ``LRUPromptCache`` (bounded by entries and
bytes), keyed by the tokens and by the target and drafter: the longest
common prefix is reused, trimmed where the caches can trim; caches that
cannot (hybrid targets) are snapshotted at message boundaries and at the end
of each prompt. The drafter's context is part of each entry, so a hit
restores it with the target's.
"""

import argparse
import copy
import io
import json
import logging
import math
import queue
import sys
import threading
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any, Dict, List, Optional

import mlx.core as mx
from jinja2 import TemplateError
from mlx_lm.generate import generation_stream, make_stop_sequences, make_text_state_machine, wired_limit
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import APIHandler, GenerationContext, Response, convert_chat, process_message_content

from . import cli
from .adapt import add_learn_arguments, learning
from .api import ENDPOINTS, Metrics, ResponseStore, read_json_body
from .api.turn import openai_tool_choice, tool_choice_rule
from .cache import make_prompt_cache
from .defaults import DEFAULT_MAX_TOKENS, MAX_BLOCK_SIZE
from .errors import ArgumentError, RequestError
from .generate import feed, generate_step
from .pipeline import STOP, agree_flag, share_request
from .traffic import record_safely

ROUTES = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}

# The roles of OpenAI's chat messages (what a chat template is written for).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# The largest number a request field may hold: MLX takes no larger integer.
MAX_INT = 2**63 - 1

# mlx-lm request fields the lossless loop cannot honour, with their "off" values.
UNSUPPORTED = {
    "repetition_penalty": (0.0, 1.0),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "xtc_probability": (0.0,),
    "logit_bias": (None, {}),
    "n": (1,),
}


@dataclass
class Prepared:
    """A checked request: its prompt tokens and where its messages end."""

    tokens: List[int]
    boundaries: List[int]
    initial_state: str
    block_size: Optional[int] = None  # fixed by the request's num_draft_tokens


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
    number("top_logprobs", 0, 11, int)
    for name in ("stream", "logprobs"):
        if name in body and not isinstance(body[name], bool):
            raise RequestError(f"{name} must be true or false", name)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise RequestError("stop must be a string or a list of strings", "stop")
    for name, off in UNSUPPORTED.items():
        if body.get(name, off[0]) not in off:
            raise RequestError(f"{name} is not supported by the DFlash server (it decodes losslessly)", name)


def chat_tokens(tokenizer, body: dict, template_args: dict):
    """Prompt tokens of a chat request and the token counts at which its
    messages end (the snapshot points for caches that cannot trim)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
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


def prepare(tokenizer, body: dict, kind: str, context: Optional[int], template_args: dict) -> Prepared:
    """Check a request and tokenize it, before it is queued."""
    check_fields(body)
    if kind == "text":
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            tokens, boundaries = tokenizer.encode(prompt), []
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tokens, boundaries = list(prompt), []
        else:
            raise RequestError("prompt must be a non-empty string or list of token ids", "prompt")
    else:
        tokens, boundaries = chat_tokens(tokenizer, body, template_args)
    if not tokens:
        raise RequestError("the prompt is empty", "prompt")
    if context is not None and len(tokens) >= context:
        raise RequestError(
            f"the prompt has {len(tokens)} tokens but the model's context is {context}: shorten it",
            "messages" if kind == "chat" else "prompt",
        )
    state = "normal"
    if kind == "chat" and tokenizer.has_thinking and tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens):
        state = "reasoning"
    if kind == "chat":
        state = tokenizer.response_initial_state or state
    draft_tokens = body.get("num_draft_tokens")
    return Prepared(tokens, boundaries, state, None if draft_tokens is None else draft_tokens + 1)


def top_logprobs(logprobs: mx.array, n: int, tokenizer) -> tuple:
    """The ``n`` most likely tokens at a position, in mlx-lm's format."""
    if n <= 0:
        return ()
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n].tolist()
    values = logprobs[ids].tolist()
    return tuple(
        {"id": i, "token": t, "logprob": v} for i, t, v in zip(ids, tokenizer.convert_ids_to_tokens(ids), values)
    )


class DFlashResponseGenerator:
    """The generation side mlx-lm's ``APIHandler`` talks to (the interface of
    mlx-lm's ``ResponseGenerator``: ``generate``, ``cli_args``,
    ``is_healthy``), serving every request on one thread with DFlash."""

    def __init__(self, model, tokenizer, draft, cli_args, model_id: str, draft_id: str, learn=(None, None)):
        self.model, self.tokenizer, self.draft, self.cli_args = model, tokenizer, draft, cli_args
        self.key = (model_id, draft_id)  # cache entries never cross target/drafter pairs
        self.recorder, self.adaptation = learn  # --learn, --adapt
        self.metrics = Metrics()
        if self.adaptation is not None:  # a restart continues from the last accepted drafter
            self.metrics.drafter_in_use(self.adaptation.version, self.adaptation.scores)
        self.created = int(time.time())
        self.context_length = getattr(draft.target.args, "max_position_embeddings", None)
        self.prompt_cache = LRUPromptCache(cli_args.prompt_cache_size, cli_args.prompt_cache_bytes)
        self.requests: "queue.Queue" = queue.Queue()
        self.tokenizer_lock = threading.Lock()  # handler threads tokenize too
        self.failed = self.stopping = self.busy = False
        self.stored_responses = ResponseStore()  # for /v1/responses' previous_response_id
        self.done = threading.Event()  # set when the generation thread has ended its work
        # --pipeline: every rank generates what rank 0 receives (pipeline.share_request).
        self.group = mx.distributed.init() if cli_args.pipeline else None
        self.thread = threading.Thread(target=self.run, name="dflash-generation", daemon=True)
        self.thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.thread.is_alive() and not self.failed

    def stop_and_join(self):
        self.stopping = True
        self.done.wait()

    def run(self):
        try:
            while (item := self.next_request()) != STOP:
                if item is not None:
                    self.serve(*item)
        except Exception:
            logging.exception("the generation thread died")
            self.failed = True
        # Ended, but not returning: MLX (0.32) aborts the process in the
        # teardown of a thread that generated, so this daemon thread stays.
        self.done.set()
        threading.Event().wait()

    def next_request(self):
        """A queued request, ``None`` when there is none yet, or ``STOP``;
        with ``--pipeline`` rank 0's, on every rank."""
        item = STOP if self.stopping else None
        if item is None and (self.group is None or self.group.rank() == 0):
            try:
                item = self.requests.get(timeout=0.1)
            except queue.Empty:
                pass
        return item if self.group is None else share_request(item, self.group)

    def prepare(self, body: dict, kind: str) -> Prepared:
        """Check and tokenize a request (on the handler's thread)."""
        with self.tokenizer_lock:
            return prepare(self.tokenizer, body, kind, self.context_length, self.cli_args.chat_template_args)

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
        cache = entry[0] if entry is not None else make_prompt_cache(self.model, self.draft, args.draft_window, args.draft_sink)
        return cache, len(tokens) - len(rest)

    def snapshot(self, cache, tokens, start, boundaries, progress):
        """Prefill up to each boundary past ``start`` and keep a copy there
        (for caches that cannot trim); returns where the prefill stopped."""
        if cache.is_trimmable():
            return start
        for end in [b for b in boundaries + [len(tokens)] if b > start]:
            with mx.stream(generation_stream):  # where generate_step runs
                feed(self.draft.target, cache, tokens[start:end], self.cli_args.prefill_step_size, progress)
                mx.eval(cache.state)
            self.prompt_cache.insert_cache(self.key, list(cache.tokens), [copy.deepcopy(cache)], cache_type="user")
            start = end
        return start

    def between_requests(self):
        """--adapt: swap in an adapted drafter if one is ready (each request
        runs with one drafter; cached entries of the old one are never hit)."""
        draft = self.adaptation.swap(self.model, self.draft)
        if draft is not self.draft:
            self.draft, self.key = draft, (self.key[0], str(self.adaptation.path))
            self.metrics.drafter_in_use(self.adaptation.version, self.adaptation.scores)

    def serve(self, responses, prepared: Prepared, args):
        """One request, start to end; its errors go back to its handler."""
        self.busy = True
        if self.adaptation is not None:
            self.between_requests()
            self.adaptation.request_started()
        try:
            tok = self.tokenizer
            with self.tokenizer_lock:
                stop_sequences = make_stop_sequences(tok, args.stop_words)
                text_sm = make_text_state_machine(tok, args.stop_words)
            ctx = RequestContext(
                has_tool_calling=tok.has_tool_calling, has_thinking=tok.has_thinking, tool_parser=tok.tool_parser,
                text_sm=text_sm, initial_state=prepared.initial_state, prompt=prepared.tokens,
            )
            tokens = prepared.tokens

            def progress(done, total):
                responses.put((done, total))

            cache, ctx.prompt_cache_count = self.restore(tokens)
            responses.put(ctx)
            if args.seed is not None:
                mx.random.seed(args.seed)
            start = self.snapshot(cache, tokens, ctx.prompt_cache_count, prepared.boundaries, progress)
            block_size = prepared.block_size or self.cli_args.block_size  # None: adaptive
            tree_budget = 0 if prepared.block_size else self.cli_args.tree_budget  # num_draft_tokens: a chain
            answer = self.decode(cache, tokens[start:], block_size, tree_budget, args, ctx, stop_sequences.matcher(), responses, progress)
            self.metrics.served(len(tokens), ctx.prompt_cache_count, len(answer), ctx.dflash)
            if not ctx.stopped:
                record_safely(self.recorder, tokens, answer)  # --learn: the finished conversation
            responses.put(None)
            self.prompt_cache.insert_cache(self.key, list(cache.tokens), [cache])
        except Exception as e:
            logging.exception("request failed")
            responses.put(e)
        finally:
            self.busy = False
            if self.adaptation is not None:
                self.adaptation.request_finished()

    def decode(self, cache, tokens, block_size, tree_budget, args, ctx, matcher, responses, progress) -> List[int]:
        """Token by token, as mlx-lm's server streams: text, logprobs, finish;
        returns the tokens it yielded."""
        tok, eos = self.tokenizer, set(self.tokenizer.eos_token_ids)
        want = args.logprobs or args.top_logprobs > 0
        steps = generate_step(
            tokens, self.model, self.draft, prompt_cache=cache, max_tokens=args.max_tokens,
            block_size=block_size, tree_budget=tree_budget, temperature=args.sampling.temperature,
            top_p=args.sampling.top_p, top_k=args.sampling.top_k, min_p=args.sampling.min_p,
            eos_token_ids=eos, logprobs=want, prefill_step_size=self.cli_args.prefill_step_size,
            prompt_progress_callback=progress,
        )
        detok = tok.detokenizer
        detok.reset()
        n = accepted = 0
        answer = []
        sizes, cycle_starts = Counter(), False  # verified block lengths; the prefill's token is no cycle
        trees = Counter()  # nodes of the draft trees verified
        with wired_limit(self.model, [generation_stream]), closing(steps):
            for token, logprobs, from_draft, block, tree in steps:
                answer.append(token)
                accepted += from_draft
                sizes[block] += cycle_starts and not tree
                trees[tree] += cycle_starts and tree > 0
                cycle_starts = not from_draft  # each cycle ends with the target's own token
                finish = "stop" if token in eos else None
                if finish is None:
                    detok.add_token(token)
                    n += 1
                    finish = "stop" if matcher.advance(token) else ("length" if n == args.max_tokens else None)
                if finish is not None:
                    detok.finalize()
                logprob = logprobs[token].item() if want else 0.0
                top = top_logprobs(logprobs, args.top_logprobs, tok) if want else ()
                responses.put(Response(detok.last_segment, token, logprob, finish, top))
                if finish is not None or self.client_gone(ctx, from_draft):
                    break
        if ctx.stopped:
            logging.info("request stopped by the client after %d tokens", n)
        cycles = sum(sizes.values()) + sum(trees.values())
        ctx.dflash.update(
            cycles=cycles, accepted_draft_tokens=accepted,
            block_sizes={b: k for b, k in sorted(sizes.items()) if k},
            tree_sizes={n: k for n, k in sorted(trees.items()) if k},
            tokens_per_cycle=round((len(answer) - 1) / max(1, cycles), 3),
        )
        return answer

    def client_gone(self, ctx, from_draft: bool) -> bool:
        """Whether to stop for a client that went away: with ``--pipeline``
        decided at the end of each cycle on every rank alike, so every rank
        stops at the same token and keeps the same prompt cache."""
        if self.group is None:
            return ctx.stopped
        return not from_draft and agree_flag(ctx.stopped, self.group, generation_stream)


class DFlashAPIHandler(APIHandler):
    """mlx-lm's handler, with requests checked and tokenized before they are
    queued (OpenAI-style errors), the loaded pair in ``/v1/models`` and the
    DFlash statistics in ``usage.dflash``."""

    def __init__(self, generator: DFlashResponseGenerator, *args, **kwargs):
        self.generator, self.prepared, self.context = generator, None, None
        super().__init__(RequestScope(generator, self), *args, **kwargs)

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

    def send_response(self, *args, **kwargs):
        self.answered = True  # from here on, an error can no longer be the answer
        super().send_response(*args, **kwargs)

    def do_POST(self):
        kind, route = ROUTES.get(self.path), self.route
        if kind is None and route not in ENDPOINTS:
            routes = list(ROUTES) + list(ENDPOINTS)
            return self.send_error_json(404, f"no route {self.path}; use {', '.join(routes)}")
        self.generator.metrics.request(route)
        self.answered = False
        endpoint = ENDPOINTS[route](self) if kind is None else None
        try:
            if endpoint is not None:  # an agent dialect (dflash_mlx.api)
                return endpoint.serve()
            self.serve_openai(kind)
        except Exception as e:  # a bug: the client hears a 500 in its dialect, not a dropped connection
            logging.exception("request failed")
            if self.answered:  # half an answer went out: end it by closing
                self.close_connection = True
            else:
                (endpoint.send_error if endpoint is not None else self.send_error_json)(500, f"internal error: {e!r}")

    def serve_openai(self, kind: str):
        """A chat or text completion: checked here, then served by mlx-lm's handler."""
        try:
            body, raw = read_json_body(self)
            self.prepared = self.generator.prepare(body, kind)
        except RequestError as e:
            return self.send_error_json(e.status, str(e), e.param)
        self.rfile = io.BytesIO(raw)  # mlx-lm's handler reads the body again
        super().do_POST()

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
        if self.path != "/metrics":
            return super().do_GET()
        text = self.generator.metrics.render(self.generator.requests.qsize(), self.generator.busy).encode()
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
    p.add_argument("--max-tokens", "-m", type=cli.positive_int, default=DEFAULT_MAX_TOKENS, help="default max_tokens of a request")
    cli.add_sampling_arguments(p)  # a request's defaults
    p.add_argument("--prompt-cache-size", type=cli.positive_int, default=10, help="most prompt caches kept")
    p.add_argument("--prompt-cache-bytes", type=cli.positive_int, default=1 << 63, help="most bytes of prompt caches kept")
    cli.add_prefill_step_size_argument(p)
    cli.add_draft_window_arguments(p)
    p.add_argument("--chat-template", default=None, help="a chat template to use instead of the tokenizer's")
    p.add_argument("--use-default-chat-template", action="store_true", help="use the tokenizer's default template when it has none")
    p.add_argument("--chat-template-args", type=json.loads, default={}, help="JSON arguments for the chat template")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--pipeline", action="store_true", help="split the target's layers across the processes mlx.launch started; rank 0 serves HTTP (see docs/pipeline.md)")
    add_learn_arguments(p, adapt=True)
    return p


def listen(args) -> ThreadingHTTPServer:
    """The HTTP server bound to ``--host``/``--port``, before any model is
    loaded (a taken port fails at once); :func:`add_generator` completes it."""
    try:
        server = ThreadingHTTPServer(
            (args.host, args.port), lambda *a, **kw: DFlashAPIHandler(server.generator, *a, **kw)
        )
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
    return DFlashResponseGenerator(model, tokenizer, draft, args, str(args.model), str(draft_id), learn)


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

            model, tokenizer, draft = load_for_command(args.model, args.draft_model)
            draft_id = args.draft_model or default_draft_for(args.model)
            if rank != 0:  # generates what rank 0 receives, until rank 0 stops
                return follow_rank0(make_generator(args, model, tokenizer, draft, draft_id))
        else:
            learn = learning(args)  # --learn, --adapt
            # --adapt continues from the last drafter it accepted
            model, tokenizer, draft, draft_id = load_pair(args.model, learn[1].path if learn[1] else args.draft_model)
        add_generator(server, args, model, tokenizer, draft, draft_id, learn)
        if learn[1] is not None:
            learn[1].start()
        warn_if_reference()  # loaded: about to serve
    except BaseException:
        if server is not None:
            server.server_close()
        raise
    host, port = server.server_address[:2]
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
