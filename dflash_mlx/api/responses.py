"""OpenAI's Responses API: ``POST /v1/responses``, the API Codex speaks.

The shapes are OpenAI's public API reference
(https://platform.openai.com/docs/api-reference/responses): ``input`` as a
string or items (messages, ``function_call``, ``function_call_output``),
output items ``reasoning``, ``message`` and ``function_call``, the stream's
``response.*`` events. ``previous_response_id`` continues a response this
server made and still holds (a bounded store, newest kept).
"""

import logging
import threading
import time
from collections import OrderedDict
from typing import List, Optional, Tuple

from ..errors import RequestError
from .formats import STRICT_DEFAULT, responses_text_format
from .turn import (
    Assembler,
    Result,
    Turn,
    chat_tool,
    chat_tool_call,
    chat_tools,
    event_stream,
    new_id,
    openai_tool_choice,
    part_text,
    read_json_body,
    renamed,
    tool_choice_rule,
)

STORED_RESPONSES = 256  # responses kept for previous_response_id
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the include that asks for output text's logprobs
# The chat fields a Responses request's errors name, by this dialect's names for them.
CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class ResponseStore:
    """The conversations of the latest responses (chat messages, their output
    included), by response id; the oldest go first."""

    def __init__(self, size: int = STORED_RESPONSES):
        self.size, self.items, self.lock = size, OrderedDict(), threading.Lock()

    def put(self, response_id: str, messages: list):
        with self.lock:
            self.items[response_id] = messages
            while len(self.items) > self.size:
                self.items.popitem(last=False)

    def get(self, response_id: str) -> list:
        with self.lock:
            if response_id not in self.items:
                raise RequestError(
                    f"previous_response_id {response_id!r} is not a response this server holds (it keeps the "
                    f"latest {self.size}, while it runs): send the whole conversation in input instead",
                    "previous_response_id",
                )
            return list(self.items[response_id])


def content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts", "input")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else None
            raise RequestError(f"{where}.content.{j}: {kind!r} parts are not supported (text only)", "input")
        parts.append(part_text(part, "text", f"{where}.content.{j}", "input"))
    return "".join(parts)


def chat_messages(items) -> list:
    """Responses input items as chat-completions messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty list of items", "input")
    out = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be user, assistant, system or developer, not {role!r}", "input")
            text = content_text(item.get("content"), where)
            if role == "assistant" and out and out[-1].get("reasoning_content") is not None and not out[-1]["content"]:
                out[-1]["content"] = text  # the answer after its reasoning item
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = chat_tool_call(item.get("call_id"), item.get("name"), item.get("arguments", "{}"), f"{where} (function_call)", "input")
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{where} (function_call_output) needs a call_id", "input")
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str) else content_text(output, where)})
        elif kind == "reasoning":  # an assistant turn's reasoning, for the templates that show it again
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise RequestError(f"{where} (reasoning): content must be a list of parts", "input")
            text = "".join(part_text(p, "text", f"{where}.content.{j}", "input")
                           for j, p in enumerate(parts) if isinstance(p, dict))
            out.append({"role": "assistant", "content": "", "reasoning_content": text})
        else:
            raise RequestError(f"{where}: {kind!r} items are not supported", "input")
    return out


# Tool types of the Responses API that OpenAI hosts (or that need a runtime
# this server is not): left out of the prompt, as Codex sends some by default.
HOSTED_TOOLS = (
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search", "code_interpreter",
    "computer_use_preview", "image_generation", "mcp", "local_shell", "shell", "custom", "apply_patch",
)


def function_tool(t: dict, where: str) -> Optional[dict]:
    """A function tool as a chat tool; None for a hosted one
    (:data:`HOSTED_TOOLS`); a type neither names is refused. A tool that
    leaves ``strict`` out (or null) is strict, the Responses API's default
    (OpenAI's function-calling guide: "Responses requests will normalize your
    schema into strict mode"; chat completions' default is not strict):
    :data:`~dflash_mlx.api.formats.STRICT_DEFAULT` carries it."""
    kind = t.get("type")
    if kind in HOSTED_TOOLS:
        return None
    if kind != "function":
        raise RequestError(
            f"{where} has the type {kind!r}: use \"function\" (hosted types such as web_search are left out)", "tools"
        )
    return chat_tool(t.get("name"), t.get("description"), t.get("parameters"), where, t.get("strict"))


def to_chat(body: dict, history: list) -> Tuple[dict, list]:
    """The internal chat request of a Responses request (checked), after the
    conversation ``history`` of its previous response; and the conversation
    to keep for the next (instructions are not carried over)."""
    conversation = history + chat_messages(body.get("input"))
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:  # a string: read_json_body checked it
        messages.insert(0, {"role": "system", "content": instructions})
    max_tokens = body.get("max_output_tokens")
    chat = {
        "model": body.get("model", "default"),
        "messages": messages,
        "tools": tool_choice_rule(openai_tool_choice(body.get("tool_choice")), chat_tools(body.get("tools"), function_tool)),
        "tool_choice": body.get("tool_choice"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "response_format": responses_text_format(body.get("text")),
        STRICT_DEFAULT: [t["name"] for t in body.get("tools") or () if t.get("type") == "function" and t.get("strict") is None],
        "chat_template_kwargs": dict(body.get("chat_template_kwargs") or {}),
    }
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    chat.update(logprob_fields(body))
    for name in ("temperature", "top_p", "top_k", "stream"):
        if name in body:
            chat[name] = body[name]
    return chat, [dict(m) for m in conversation]


def logprob_fields(body: dict) -> dict:
    """The chat fields for a Responses request's logprobs: ``include``
    naming ``message.output_text.logprobs`` asks for the output text's, and
    ``top_logprobs`` (which asks too) for that many alternatives each
    (checked as the chat field, up to mlx-lm's limit). Other includes
    (``reasoning.encrypted_content``, which Codex sends) add nothing here."""
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise RequestError("include must be a list of strings", "include")
    out = {"logprobs": LOGPROBS_INCLUDE in (include or [])}
    if body.get("top_logprobs") is not None:
        out["top_logprobs"] = body["top_logprobs"]
    return out


def usage(result: Result) -> dict:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": result.output_tokens,
        "total_tokens": result.prompt_tokens + result.output_tokens,
        "dflash": result.dflash,
    }


class Output(Assembler):
    """A response's output items and the stream events that build them."""

    def new_item(self, kind: str, value) -> dict:
        if kind == "tool_call":
            return {"type": "function_call", "id": new_id("fc"), "call_id": value.id, "name": value.name,
                    "arguments": value.arguments}
        if kind == "reasoning":
            return {"type": "reasoning", "id": new_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
        return {"type": "message", "id": new_id("msg"), "role": "assistant",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}

    def started(self, item: dict, index: int) -> List[dict]:
        empty = {"arguments": ""} if item["type"] == "function_call" else {"content": []}
        shown = dict(item, status="in_progress", **empty)
        events = [{"type": "response.output_item.added", "output_index": index, "item": shown}]
        if item["type"] == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": dict(item["content"][0])})
        return events

    def extended(self, item: dict, index: int, value, logprobs: List[dict]) -> List[dict]:
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            return [
                {"type": "response.function_call_arguments.delta", **at, "delta": value.arguments},
                {"type": "response.function_call_arguments.done", **at, "name": value.name, "arguments": value.arguments},
            ]
        item["content"][0]["text"] += value
        if item["type"] == "reasoning":
            return [{"type": "response.reasoning_text.delta", **at, "content_index": 0, "delta": value}]
        item["content"][0]["logprobs"] = item["content"][0]["logprobs"] + logprobs  # (a new list: events hold the old)
        return [{"type": "response.output_text.delta", **at, "content_index": 0, "delta": value, "logprobs": logprobs}]

    def finished(self, item: dict, index: int) -> List[dict]:
        item["status"] = "completed"
        at, events = {"item_id": item["id"], "output_index": index, "content_index": 0}, []
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": part["logprobs"]},
                {"type": "response.content_part.done", **at, "part": part},
            ]
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", **at, "text": item["content"][0]["text"]})
        return events + [{"type": "response.output_item.done", "output_index": index, "item": item}]


def assistant_message(result: Result) -> dict:
    """The turn's output as the chat message a follow-up templates."""
    message = {"role": "assistant", "content": result.text}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.tool_calls
        ]
    return message


class ResponsesEndpoint:
    """One request to ``/v1/responses``."""

    def __init__(self, handler):
        self.handler, self.store = handler, handler.generator.stored_responses

    def send_error(self, status: int, message: str, param: Optional[str] = None):
        self.handler.send_json(status, error_body(status, message, param))

    def serve(self):
        try:
            body, _ = read_json_body(self.handler)
            previous = body.get("previous_response_id")
            history = self.store.get(previous) if previous is not None else []
            chat, conversation = to_chat(body, history)
            turn = Turn(self.handler.generator, chat)
        except RequestError as e:
            e = renamed(e, CHAT_NAMES)
            return self.send_error(e.status, str(e), e.param)
        response = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": body.get("model", "default"), "output": [], "previous_response_id": previous,
            "instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_logprobs": body.get("top_logprobs"),
            "max_output_tokens": body.get("max_output_tokens"), "error": None, "incomplete_details": None,
            "metadata": body.get("metadata") or {}, "text": body.get("text") or {"format": {"type": "text"}}, "usage": None,
        }
        finished = self.stream(turn, response) if body.get("stream") else self.complete(turn, response)
        if finished and body.get("store", True):
            self.store.put(response["id"], conversation + [assistant_message(turn.result)])

    def finish(self, response: dict, output: Output, result: Result):
        response.update(output=output.items, usage=usage(result), status="completed")
        if result.finish_reason == "length":
            response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})

    def complete(self, turn: Turn, response: dict) -> bool:
        output = Output()
        try:
            turn.start()
            turn.run(output)
        except Exception as e:  # the generation failed: the client hears why
            logging.exception("generation failed")
            self.send_error(500, f"generation failed: {e}")
            return False
        self.finish(response, output, turn.result)
        self.handler.send_json(200, response)
        return True

    def stream(self, turn: Turn, response: dict) -> bool:
        handler, output, sequence = self.handler, Output(), iter(range(1 << 62))

        def send(event: dict):
            event_stream(handler, event["type"], dict(event, sequence_number=next(sequence)))

        def keepalive(done, total):
            handler.wfile.write(f": keepalive {done}/{total}\n\n".encode())
            handler.wfile.flush()

        try:
            turn.start(progress=keepalive)
        except Exception as e:
            logging.exception("generation failed")
            self.send_error(500, f"generation failed: {e}")
            return False
        try:
            handler.start_events()
            send({"type": "response.created", "response": dict(response)})
            send({"type": "response.in_progress", "response": dict(response)})
            turn.run(output, send)
        except (BrokenPipeError, ConnectionResetError):  # the client left: its generation stops too
            turn.stop()
            return False
        except Exception as e:
            logging.exception("generation failed")
            send({"type": "error", "code": "server_error", "message": f"generation failed: {e}", "param": None})
            return False
        self.finish(response, output, turn.result)
        send({"type": "response.completed" if response["status"] == "completed" else "response.incomplete",
              "response": response})
        return True
