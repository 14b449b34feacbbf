"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

The shapes are Anthropic's public API reference
(https://docs.anthropic.com/en/api/messages): content blocks ``text``,
``tool_use``, ``tool_result`` and ``thinking``; the stream's
``message_start`` ... ``message_stop`` events, with ``ping`` events while a
long prompt is prefilled; errors as ``{"type": "error", "error": {...}}``.
"""

import json
import logging
from typing import List, Optional, Tuple

from ..errors import RequestError
from .formats import messages_output_format, output_format_field
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

# Anthropic's error types for the statuses the server answers with (the others: invalid_request_error).
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error") if status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": message}}


def block_text(content, where: str) -> str:
    """The text of a string or a list of text blocks (what a system prompt or
    a tool result holds)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text blocks", "messages")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise RequestError(f"{where} may hold only text blocks here", "messages")
        parts.append(block["text"])
    return "".join(parts)


def chat_messages(messages) -> list:
    """Anthropic messages as chat-completions messages: tool_use blocks as
    the assistant's tool calls, each tool_result as a tool message."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            role = m.get("role") if isinstance(m, dict) else None
            raise RequestError(f"{where}.role must be user or assistant, not {role!r}", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or a list of blocks", "messages")
        text, reasoning, calls, results = [], [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                call = chat_tool_call(block.get("id"), block.get("name"), block.get("input", {}), f"{at} (tool_use)", "messages")
                calls.append(call)
            elif kind == "tool_result" and m["role"] == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise RequestError(f"{at} (tool_result) needs a tool_use_id", "messages")
                results.append({"role": "tool", "tool_call_id": call_id,
                                "content": block_text(block.get("content", ""), f"{at}.content")})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                reasoning.append(part_text(block, "thinking", at, "messages"))
            else:
                raise RequestError(f"{at}: a {kind!r} block is not supported in a {m['role']} message", "messages")
        out += results
        if m["role"] == "assistant":
            message = {"role": "assistant", "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            out.append(message)
        elif text or not results:
            out.append({"role": "user", "content": "".join(text)})
    return out


def anthropic_tool(t: dict, where: str) -> Optional[dict]:
    """A client tool as a chat tool; None for a server tool (``web_search_...``)."""
    if t.get("type") not in (None, "custom"):
        return None
    return chat_tool(t.get("name"), t.get("description"), t.get("input_schema"), where, t.get("strict"))


def tool_choice(choice):
    """An Anthropic tool choice as chat completions' (``any``: required; ``tool``: a named function)."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError("tool_choice must be {type: auto | any | tool | none}", "tool_choice")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"any": "required"}.get(kind, kind)


def parallel_calls(choice) -> bool:
    """Chat's ``parallel_tool_calls`` from an Anthropic tool choice (its ``disable_parallel_tool_use``)."""
    disable = choice.get("disable_parallel_tool_use", False) if isinstance(choice, dict) else False
    if not isinstance(disable, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
    return not disable


def to_chat(body: dict, count_only: bool = False) -> dict:
    """The internal chat request of a Messages request (checked)."""
    max_tokens = body.get("max_tokens")
    if not count_only and max_tokens is None:
        raise RequestError("max_tokens is required: the most tokens to generate", "max_tokens")
    system = body.get("system")
    messages = chat_messages(body.get("messages"))
    if system:
        messages.insert(0, {"role": "system", "content": block_text(system, "system")})
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("stop_sequences must be a list of strings", "stop_sequences")
    kwargs = dict(body.get("chat_template_kwargs") or {})
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise RequestError("thinking must be {type: enabled | disabled}", "thinking")
        kwargs["enable_thinking"] = kind != "disabled"
    choice = tool_choice(body.get("tool_choice"))
    chat = {
        "model": body.get("model", "default"),
        "messages": messages,
        "tools": tool_choice_rule(openai_tool_choice(choice), chat_tools(body.get("tools"), anthropic_tool)),
        "tool_choice": choice,
        "parallel_tool_calls": parallel_calls(body.get("tool_choice")),
        "response_format": messages_output_format(body),
        "stop": stop,
        "chat_template_kwargs": kwargs,
    }
    for name in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if name in body and not (count_only and name == "max_tokens"):
            chat[name] = body[name]
    return chat


def stop_reason(result: Result) -> str:
    if result.finish_reason == "tool_calls":
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_sequence is not None else "end_turn"


def usage(result: Result) -> dict:
    """Anthropic's usage: ``input_tokens`` counts the prompt tokens not read
    from the cache, ``cache_read_input_tokens`` the ones that were."""
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": result.cached_tokens,
        "output_tokens": result.output_tokens,
        "dflash": result.dflash,
    }


class Blocks(Assembler):
    """A message's content blocks and the stream events that build them."""

    def new_item(self, kind: str, value) -> dict:
        if kind == "tool_call":
            return {"type": "tool_use", "id": value.id, "name": value.name, "input": json.loads(value.arguments)}
        if kind == "reasoning":
            return {"type": "thinking", "thinking": "", "signature": ""}
        return {"type": "text", "text": ""}

    def started(self, block: dict, index: int) -> List[Tuple[str, dict]]:
        shown = dict(block, input={}) if block["type"] == "tool_use" else dict(block)
        return [("content_block_start", {"type": "content_block_start", "index": index, "content_block": shown})]

    def extended(self, block: dict, index: int, value, logprobs) -> List[Tuple[str, dict]]:
        if block["type"] == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": value.arguments}
        else:
            field = block["type"]  # "text" or "thinking"
            block[field] += value
            delta = {"type": f"{field}_delta", field: value}
        return [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})]

    def finished(self, block: dict, index: int) -> List[Tuple[str, dict]]:
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]


class MessagesEndpoint:
    """One request to ``/v1/messages`` or ``/v1/messages/count_tokens``."""

    def __init__(self, handler, count_only: bool = False):
        self.handler, self.count_only = handler, count_only

    def send_error(self, status: int, message: str):
        self.handler.send_json(status, error_body(status, message))

    def serve(self):
        body = {}
        try:
            body, _ = read_json_body(self.handler)
            if self.count_only:
                prepared = self.handler.generator.prepare(to_chat(body, count_only=True), "chat")
                return self.handler.send_json(200, {"input_tokens": len(prepared.tokens)})
            turn = Turn(self.handler.generator, to_chat(body))
        except RequestError as e:
            return self.send_error(e.status, str(renamed(e, {"response_format": output_format_field(body)})))
        message = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": body.get("model", "default"),
                   "content": [], "stop_reason": None, "stop_sequence": None}
        if body.get("stream"):
            self.stream(turn, message)
        else:
            self.complete(turn, message)

    def complete(self, turn: Turn, message: dict):
        blocks = Blocks()
        try:
            turn.start()
            turn.run(blocks)
        except Exception as e:  # the generation failed: the client hears why
            logging.exception("generation failed")
            return self.send_error(500, f"generation failed: {e}")
        result = turn.result
        message.update(content=blocks.items, stop_reason=stop_reason(result),
                       stop_sequence=result.stop_sequence, usage=usage(result))
        self.handler.send_json(200, message)

    def stream(self, turn: Turn, message: dict):
        handler, blocks = self.handler, Blocks()
        try:
            turn.start(progress=lambda done, total: event_stream(handler, "ping", {"type": "ping"}))
        except Exception as e:
            logging.exception("generation failed")
            return self.send_error(500, f"generation failed: {e}")
        start = dict(message, usage=dict(usage(turn.result), output_tokens=0))
        try:
            handler.start_events()
            event_stream(handler, "message_start", {"type": "message_start", "message": start})
            turn.run(blocks, lambda event: event_stream(handler, *event))
        except (BrokenPipeError, ConnectionResetError):  # the client left: its generation stops too
            return turn.stop()
        except Exception as e:
            logging.exception("generation failed")
            return event_stream(handler, "error", error_body(500, f"generation failed: {e}"))
        result = turn.result
        delta = {"stop_reason": stop_reason(result), "stop_sequence": result.stop_sequence}
        event_stream(handler, "message_delta", {"type": "message_delta", "delta": delta, "usage": usage(result)})
        event_stream(handler, "message_stop", {"type": "message_stop"})
