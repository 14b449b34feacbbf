"""One chat turn, as every API dialect asks for it and gets it back.

Each dialect translates its request into one internal chat request: a
chat-completions body (``messages``, ``tools``, ``max_tokens``, sampling,
``stop``, ``chat_template_kwargs`` with the thinking switch), which the
server checks and templates exactly as it does ``/v1/chat/completions``.
The turn runs on the server's DFlash generation thread, and its tokens come
back split the way mlx-lm's chat-completions handler splits them, with
mlx-lm's own pieces: the tokenizer's text state machine (reasoning, tool
and normal text, stop words stripped) and its tool parser. Each dialect
renders the resulting events, and the :class:`Result`, in its own shape.
"""

import json
import logging
import uuid
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from mlx_lm.generate import TextStateMachine
from mlx_lm.server import (
    GenerationArguments,
    LogitsProcessorArguments,
    ModelDescription,
    SamplingArguments,
    ToolCallFormatter,
)

from ..errors import RequestError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """A parsed tool call: ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str


@dataclass
class Result:
    """What a turn produced, in every dialect's terms."""

    text: str = ""
    reasoning: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop", "length" or "tool_calls", as chat completions says
    stop_sequence: Optional[str] = None  # the stop word that ended the turn, if one did
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    dflash: Dict[str, Any] = field(default_factory=dict)


# Events of a turn: (kind, value, logprobs): ("reasoning", text, []), ("text",
# text, logprobs) or ("tool_call", ToolCall, []); ``logprobs``: the text's
# tokens' log-probabilities (:class:`TextLogprobs`), when the request asks.
Event = Tuple[str, Any, List[dict]]


def scored_token(tokenizer, token: int, logprob: float) -> dict:
    """One token and its log-probability in OpenAI's shape: the token's
    text, its UTF-8 bytes (a token that is part of a character reads as
    U+FFFD, the tokenizer's decoding of it alone) and the logprob."""
    text = tokenizer.decode([token])
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}


class TextLogprobs:
    """The log-probabilities of the tokens behind each piece of answer text,
    as mlx-lm's server reports them for each token (its ``Response``'s
    ``logprob`` and ``top_tokens``: the target's processed distribution), in
    OpenAI's Responses shape (``top_logprobs`` most likely first).

    A token belongs to the answer text its own text goes to; a token that
    shows no text yet (part of a character, of a stop word held back)
    belongs to the next answer text, and with reasoning or a tool call to
    neither; a token whose text is reasoning or a tool call's is left out,
    and so is a marker (a token that shows no text and moves the state
    machine: ``</think>``, a tool call's tags).
    """

    def __init__(self, tokenizer, wanted: bool):
        self.tokenizer, self.wanted = tokenizer, wanted
        self.pending: List[dict] = []  # earlier tokens that showed no text
        self.current: Optional[dict] = None  # the token read, until its text is placed
        self.spoke = False  # whether the token read showed any text

    def read(self, gen) -> None:
        """A token out of the generation (mlx-lm's ``Response``)."""
        self.spoke = False
        if self.wanted:
            top = sorted(gen.top_tokens, key=lambda t: -t["logprob"])
            self.current = dict(scored_token(self.tokenizer, gen.token, gen.logprob),
                                top_logprobs=[scored_token(self.tokenizer, t["id"], t["logprob"]) for t in top])

    def elsewhere(self) -> None:
        """The token's text (some of it) is reasoning or a tool call's."""
        self.spoke = True
        self.pending = []

    def text(self) -> List[dict]:
        """The token's text (some of it) is answer text: the tokens behind it."""
        self.spoke = True
        out = self.pending + ([self.current] if self.current is not None else [])
        self.pending, self.current = [], None
        return out

    def placed(self, moved: bool) -> None:
        """The token's text is all placed (``moved``: it moved the state machine)."""
        if moved and not self.spoke:
            self.pending = []
        elif self.current is not None and not self.spoke:
            self.pending.append(self.current)
        self.current = None


def tool_choice_rule(choice: Optional[str], tools: Optional[list]) -> Optional[list]:
    """The tools to template for a normalised tool choice (``auto``, ``none``,
    ``required`` or ``named``): ``none`` withholds them; a forced call
    (``required``, ``named``) is the request's constraint
    (:mod:`dflash_mlx.api.formats`), the tools are offered as for ``auto``."""
    return None if choice == "none" else tools


def renamed(error: RequestError, names: dict) -> RequestError:
    """``error`` with the chat field it names (``names``' keys) called as the
    dialect's client sent it (their values): a Responses or Messages client
    never sent ``response_format`` or ``max_tokens``."""
    name = names.get(error.param)
    if name is None:
        return error
    return RequestError(str(error).replace(error.param, name), name, error.status)


def openai_tool_choice(choice) -> Optional[str]:
    """An OpenAI tool choice (chat completions' or Responses'), normalised."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return "named"
    raise RequestError("tool_choice must be auto, none, required or {type: function, ...}", "tool_choice")


def chat_tool(name, description, parameters, where: str, strict=None) -> dict:
    """A chat-completions function tool, checked (``strict``: its arguments held to its schema)."""
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where} needs a name (a non-empty string), not {name!r}", "tools")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"{where}'s schema must be a JSON object, not {type(parameters).__name__}", "tools")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{where}'s description must be a string", "tools")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"{where}'s strict must be true or false", "tools")
    function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        function["description"] = description
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def check_chat_tools(tools) -> None:
    """Chat completions' own ``tools``, checked before the template reads
    them: each ``{type: function, function: {name, description?, parameters?}}``."""
    for i, t in enumerate(tools or ()):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise RequestError(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        f = t["function"]
        chat_tool(f.get("name"), f.get("description"), f.get("parameters"), f"tools.{i}.function", f.get("strict"))


def chat_tools(tools, convert) -> Optional[list]:
    """A dialect's tool list as chat-completions tools; ``convert(tool, where)``
    checks and converts one, or gives None for a hosted tool (web search and
    the like), which this server cannot run: those are left out, with a
    warning, so an agent that always sends them can still use the server."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise RequestError(f"tools.{i} must be an object", "tools")
        tool = convert(t, f"tools.{i}")
        if tool is None:
            logging.warning("tools.%d: a %r tool is hosted by the API provider; left out", i, t.get("type"))
        else:
            out.append(tool)
    return out or None


def part_text(part: dict, key: str, where: str, param: str) -> str:
    """The text a content part holds under ``key`` (none: empty), checked."""
    text = part.get(key, "")
    if not isinstance(text, str):
        raise RequestError(f"{where}.{key} must be a string", param)
    return text


def chat_tool_call(call_id, name, arguments, where: str, param: str) -> dict:
    """A chat-completions assistant tool call, checked (``arguments``: a dict or its JSON text)."""
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where} needs an id", param)
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where} needs a name", param)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}'s arguments are not JSON: {e}", param) from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}'s arguments must be a JSON object", param)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def generation_arguments(body: dict, cli_args) -> GenerationArguments:
    """mlx-lm's generation arguments of a checked chat body, with the
    server's defaults where the body names none or null (as the server's
    checks read a null: not given)."""
    stop = body.get("stop") or []

    def given(name, default):
        return default if body.get(name) is None else body[name]

    return GenerationArguments(
        model=ModelDescription(model=body.get("model", "default_model"), draft="default_model", adapter=None),
        sampling=SamplingArguments(
            temperature=given("temperature", cli_args.temp), top_p=given("top_p", cli_args.top_p),
            top_k=given("top_k", cli_args.top_k), min_p=given("min_p", cli_args.min_p),
            xtc_probability=0.0, xtc_threshold=0.0,
        ),
        logits=LogitsProcessorArguments(None, 0.0, 20, 0.0, 20, 0.0, 20),
        stop_words=[stop] if isinstance(stop, str) else stop,
        max_tokens=body.get("max_tokens") or cli_args.max_tokens,
        num_draft_tokens=cli_args.num_draft_tokens,
        logprobs=bool(body.get("logprobs")),
        top_logprobs=given("top_logprobs", -1),
        seed=body.get("seed"),
        chat_template_kwargs=body.get("chat_template_kwargs"),
    )


class Turn:
    """A chat turn on the server's generation thread.

    Built on the handler's thread: the request is checked and templated
    there (a bad one raises :class:`RequestError` before anything is queued).
    :meth:`start` queues it; :meth:`events` then yields its output as it is
    decoded, and fills :attr:`result`.
    """

    def __init__(self, generator, body: dict):
        self.generator, self.body = generator, body
        self.prepared = generator.prepare(body, "chat")
        self.args = generation_arguments(body, generator.cli_args)
        self.result = Result(prompt_tokens=len(self.prepared.tokens))

    def start(self, progress=None):
        """Queue the turn; returns once its prompt cache is found (cached
        tokens known). ``progress(done, total)`` hears the prefill."""
        self.ctx, self.responses = self.generator.generate(None, self.args, progress, self.prepared)
        self.result.cached_tokens = max(0, self.ctx.prompt_cache_count)

    def events(self) -> Iterator[Event]:
        """The turn's output, split as mlx-lm's chat-completions handler
        splits it; stops the generation if the caller stops reading."""
        ctx, result, eos = self.ctx, self.result, set(self.generator.tokenizer.eos_token_ids)
        formatter = ToolCallFormatter(ctx.tool_parser, self.body.get("tools"))
        sm = ctx.text_sm.make_state(ctx.initial_state)
        prev, tool_text, tokens = ctx.initial_state, "", []
        scores = TextLogprobs(self.generator.tokenizer, self.args.logprobs or self.args.top_logprobs > 0)

        def close_tool(text):
            for call in formatter([text]):
                tc = ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"])
                result.tool_calls.append(tc)
                yield "tool_call", tc, []

        try:
            for gen in self.responses:
                tokens.append(gen.token)
                scores.read(gen)
                before = prev
                if gen.finish_reason == "stop":
                    sm, state = TextStateMachine.discard(sm)
                    segments = [(state, "")]
                elif gen.finish_reason == "length":
                    sm, segments = TextStateMachine.split(sm, gen.text)
                    sm, flushed, state = TextStateMachine.flush(sm)
                    segments.append((state, flushed))
                else:
                    sm, segments = TextStateMachine.split(sm, gen.text)
                for state, text in segments:
                    if state == "tool":
                        tool_text += text
                        if text:
                            scores.elsewhere()
                    elif state in ("normal", "reasoning"):
                        if prev == "tool":
                            yield from close_tool(tool_text)
                            tool_text = ""
                        if text and state == "normal":
                            result.text += text
                            yield "text", text, scores.text()
                        elif text:
                            result.reasoning += text
                            scores.elsewhere()
                            yield "reasoning", text, []
                    prev = state
                scores.placed(prev != before)
                if gen.finish_reason is not None:
                    result.finish_reason = gen.finish_reason
                    if gen.finish_reason == "stop" and gen.token not in eos:
                        result.stop_sequence = self.stop_word(tokens)
            if prev == "tool" and tool_text:
                yield from close_tool(tool_text)
        finally:
            ctx.stop()
        if result.finish_reason == "stop" and result.tool_calls:
            result.finish_reason = "tool_calls"
        result.output_tokens = len(tokens)
        result.dflash = ctx.dflash

    def run(self, assembler: "Assembler", send=None):
        """Feed the turn's events to ``assembler`` until it ends, passing
        each stream event it returns to ``send`` (when streaming)."""
        with closing(self.events()) as events:
            for kind, value, logprobs in events:
                for event in assembler.feed(kind, value, logprobs):
                    if send is not None:
                        send(event)
        for event in assembler.close():
            if send is not None:
                send(event)

    def stop(self) -> None:
        """Stop the generation of a started turn whose events are not read
        (its client went away first); :meth:`events` stops it as it ends."""
        self.ctx.stop()

    def stop_word(self, tokens: List[int]) -> Optional[str]:
        """The stop word whose tokens end ``tokens`` (the one that matched)."""
        tokenizer = self.generator.tokenizer
        for word in self.args.stop_words:
            ids = tokenizer.encode(word, add_special_tokens=False)
            if ids and tokens[-len(ids):] == ids:
                return word
        return None


class Assembler:
    """A dialect's answer built from a turn's events: one item (a content
    block, an output item) per run of text or of reasoning and per tool
    call. Each step also returns the stream events that build the same
    items, so a streamed answer and a whole one cannot differ.

    Dialects give the items' shapes and events: :meth:`new_item`,
    :meth:`started`, :meth:`extended` and :meth:`finished`.
    """

    def __init__(self):
        self.items: List[dict] = []
        self.open: Optional[str] = None  # the event kind the last item takes, until it is finished

    def feed(self, kind: str, value, logprobs: List[dict] = ()) -> list:
        """An event of the turn (``logprobs``: its text's tokens', see :class:`TextLogprobs`)."""
        events = []
        if kind == "tool_call" or kind != self.open:
            events += self.close()
            self.items.append(self.new_item(kind, value))
            self.open = kind
            events += self.started(self.items[-1], len(self.items) - 1)
        events += self.extended(self.items[-1], len(self.items) - 1, value, list(logprobs))
        return events + (self.close() if kind == "tool_call" else [])

    def close(self) -> list:
        """Finish the open item (its closing events)."""
        if self.open is None:
            return []
        self.open = None
        return self.finished(self.items[-1], len(self.items) - 1)

    def new_item(self, kind: str, value) -> dict:
        raise NotImplementedError

    def started(self, item: dict, index: int) -> list:
        raise NotImplementedError

    def extended(self, item: dict, index: int, value, logprobs: List[dict]) -> list:
        """Add an event's text (or a tool call) to ``item``; ``logprobs``:
        the text's tokens' (empty unless the request asked; a dialect
        without logprobs leaves them)."""
        raise NotImplementedError

    def finished(self, item: dict, index: int) -> list:
        raise NotImplementedError


# Body fields of the same JSON type in every dialect that reads them, checked
# as the body is read (a dialect's fields that others lack are its own to check).
FIELD_TYPES = {
    "chat_template_kwargs": dict,
    "role_mapping": dict,
    "metadata": dict,
    "tools": list,
    "instructions": str,
    "previous_response_id": str,
}
TYPE_NAMES = {dict: "an object", list: "a list", str: "a string"}


def check_field_types(body: dict) -> None:
    """Refuse a field of :data:`FIELD_TYPES` that is neither null nor of its type."""
    for name, kind in FIELD_TYPES.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise RequestError(f"{name} must be {TYPE_NAMES[kind]}", name)


# The most bytes of a refused body read (and dropped) so that its client,
# still sending, hears the refusal; past this the connection is just closed.
DRAIN_BYTES = 1 << 30


def drain(rfile, length: int, chunk: int = 1 << 20) -> None:
    """Read and drop up to ``length`` bytes of a refused body: a client that
    sends its whole body before reading (Python's urllib, curl) would
    otherwise meet a reset connection instead of the answer."""
    left = min(length, DRAIN_BYTES)
    while left > 0:
        try:
            data = rfile.read(min(chunk, left))
        except TimeoutError:  # (the connection's read timeout: the client stopped sending)
            return
        if not data:
            return
        left -= len(data)


def read_body(handler, length: int) -> bytes:
    """The request's ``length`` bytes of body, read under the connection's
    read timeout (the server's ``read_timeout``), which is then lifted so the
    answer's writes wait on the client; a body that stops short (the client
    silent past the timeout, or gone) is a 408 or 400 and the connection closes."""
    try:
        raw = handler.rfile.read(length)
    except TimeoutError:
        handler.close_connection = True
        raise RequestError(
            f"the request body stopped arriving before its Content-Length of {length} bytes (no data for "
            f"{handler.server.read_timeout:g} s): send the whole body, with its true length", status=408,
        ) from None
    if len(raw) < length:
        handler.close_connection = True
        raise RequestError(f"the request body has {len(raw)} bytes, fewer than its Content-Length of {length}")
    handler.connection.settimeout(None)
    return raw


def read_json_body(handler) -> Tuple[dict, bytes]:
    """The request's JSON object body and its bytes, its shared fields'
    types checked (a :class:`RequestError` if there is none or one is wrong)."""
    try:
        length = int(handler.headers.get("Content-Length", ""))
        if length < 0:
            raise ValueError(length)
    except ValueError:
        raise RequestError("a valid Content-Length header is required", status=411) from None
    limit = handler.generator.cli_args.max_request_bytes
    if length > limit:
        handler.close_connection = True
        drain(handler.rfile, length)
        raise RequestError(
            f"the request body has {length} bytes, more than this server's limit of {limit} (--max-request-bytes)",
            status=413,
        )
    raw = read_body(handler, length)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("the request body is not UTF-8: send JSON encoded as UTF-8") from None
    except (ValueError, RecursionError) as e:  # ValueError: JSON's, or an integer of thousands of digits
        raise RequestError(f"invalid JSON in the request body: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_field_types(body)
    return body, raw


def event_stream(handler, name: Optional[str], data: dict) -> None:
    """Write one server-sent event (``event:`` line only where named)."""
    head = f"event: {name}\n" if name else ""
    handler.wfile.write(f"{head}data: {json.dumps(data)}\n\n".encode())
    handler.wfile.flush()
