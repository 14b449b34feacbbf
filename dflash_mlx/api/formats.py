"""Structured outputs as every dialect asks for them, read into one response
format (:mod:`dflash_mlx.structured`'s shape) that the decode loop applies.

Chat completions: ``response_format`` (``text``, ``json_object``,
``json_schema`` with ``strict``, and this server's ``regex`` and
``grammar``); function tools with ``strict: true`` (their arguments held to
their schema); ``tool_choice`` ``required`` or a named function (a call
forced). The Responses API's ``text.format`` and Anthropic's
``output_config.format`` (and its beta ``output_format``) are translated to
chat's ``response_format`` by their dialects, tool choices and ``strict``
tools likewise, so :func:`request_format` reads one shape.

Tool calls are constrained in the format the model writes them in and
mlx-lm's ``json_tools`` parser reads (``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``, the Qwen and Hermes templates' shape),
by a Lark grammar that embeds each call's JSON schema (llguidance's
``%json``); a model whose calls take another shape gets a 400 for strict tools
and forced calls.
"""

import json
import re
from typing import List, Optional

from llguidance import regex_to_lark
from mlx_lm.tool_parsers import json_tools

from ..errors import ArgumentError, RequestError
from ..structured import JSON_OBJECT, bridge, constraint_from_response_format, grammar_of
from .turn import check_chat_tools, openai_tool_choice

# Any JSON object: a non-strict tool's arguments.
ANY_OBJECT = {"type": "object"}

# llguidance's JSON options for a held call: no free whitespace, and the
# separators Python's json.dumps writes, which the json_tools templates
# (Qwen's, Hermes') render calls with and mlx-lm's parser re-dumps arguments
# with. Flexible whitespace (llguidance's default) would let a model pushed
# into a call pad it with spaces and newlines up to max_tokens, a call that
# never closes; a response_format's JSON keeps llguidance's defaults.
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The internal chat body's list of the tools strict by their API's default
# (the Responses API's function tools that leave strict out): held to their
# schemas where the model writes json_tools calls, left free elsewhere (an
# explicit strict: true there is a 400).
STRICT_DEFAULT = "strict_default"


def request_format(body: dict, tokenizer, answers, state: str = "normal") -> Optional[dict]:
    """The response format a checked chat (or text) completions body asks
    for, None for free text; checked against the tokenizer (a
    :class:`RequestError` naming the field, before any work). ``state``: where
    the prompt leaves the answer (``reasoning``: inside an open think block,
    which the format then lets the model close first)."""
    try:
        form = chat_format(body, tokenizer, answers)
        if form is not None and grammar_of(form) is None:  # (text)
            return None
        if form is not None and state == "header":
            raise RequestError("structured outputs are not available for harmony (gpt-oss) answers", "response_format")
        if form is not None and state == "reasoning":
            form = after_reasoning(form, answers.think_end, tokenizer)
        if form is not None:
            constraint_from_response_format(form, tokenizer)  # llguidance's checks, with the tokenizer
    except ArgumentError as e:
        param = "response_format" if own_fault(body.get("response_format"), tokenizer) else "tools"
        raise RequestError(f"{param}: {e}", param) from None
    return form


def own_fault(response_format, tokenizer) -> bool:
    """Whether ``response_format`` alone is refused (so a refused format
    built with strict tools is the tools' fault when it is not)."""
    if response_format is None:
        return False
    try:
        constraint_from_response_format(response_format, tokenizer)
    except ArgumentError:
        return True
    return False


def chat_format(body: dict, tokenizer, answers) -> Optional[dict]:
    """:func:`request_format` before the tokenizer's check."""
    response_format = body.get("response_format")
    check_chat_tools(body.get("tools"))  # (a text completion's tools are read here only)
    choice = openai_tool_choice(body.get("tool_choice"))
    tools = [] if choice == "none" else [t["function"] for t in body.get("tools") or [] if t.get("type") == "function"]
    defaults = set(body.get(STRICT_DEFAULT) or ())
    if defaults and answers.tool_parser is json_tools.parse_tool_call:  # (elsewhere calls cannot be held: free)
        tools = [dict(t, strict=True) if t["name"] in defaults else t for t in tools]
    forced = choice in ("required", "named")
    if forced and not tools:
        raise RequestError(f"tool_choice {choice!r} needs tools to call", "tool_choice")
    if choice == "named":
        name = named_tool(body["tool_choice"])
        tools = [t for t in tools if t["name"] == name]
        if not tools:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not forced and not any(t.get("strict") is True for t in tools):
        return response_format  # (checked with the tokenizer by the caller)
    grammar_of(response_format)  # (its own errors first, named as its own)
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if forced and kind not in (None, "text"):
        raise RequestError("a forced tool call and a response_format cannot both hold: send one", "response_format")
    return {"type": "grammar", "lark": tool_call_grammar(tools, forced, response_format, tokenizer, answers, parallel)}


def after_reasoning(form: dict, think_end: str, tokenizer) -> dict:
    """``form`` after free reasoning that ends with ``think_end``: the answer
    held, the thinking not (llguidance's Lark embeds the other grammars)."""
    grammar_of(form)  # (its own errors first, named as its own)
    kind = form["type"]
    if kind == "json_object":
        body = f"%json {json.dumps(JSON_OBJECT)}"
    elif kind == "json_schema":
        body = f"%json {json.dumps(form['json_schema']['schema'])}"
    elif kind == "regex":
        body = "/" + regex_to_lark(form["pattern"], "") + "/"
    else:
        body = "%lark {\n" + form["lark"] + "\n}"
    end = literal(think_end, tokenizer)
    if end.startswith('"'):
        head = ["start: reasoning answer", f"reasoning[stop={end}]: /(?s:.*)/"]
    else:
        head = [f"start: REASONING? {end} answer", "REASONING: /(?s:.+)/"]
    return {"type": "grammar", "lark": "\n".join([*head, f"answer: {body}"])}


def named_tool(choice: dict) -> str:
    """The function a named tool choice names (chat's ``{"function": {"name"}}`` or Responses' ``{"name"}``)."""
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else choice.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("a named tool_choice needs the function's name", "tool_choice")
    return name


def call_schema(tools: List[dict]) -> dict:
    """The JSON schema of one call of ``tools``: the name, then the
    arguments (a strict tool's its parameters' schema, another's any object;
    its local ``$ref``s re-pointed to where it sits in this schema)."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                "arguments": rooted(t.get("parameters") or ANY_OBJECT, ("" if len(tools) == 1 else f"/anyOf/{i}") + "/properties/arguments")
                if t.get("strict") is True else ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


# Keywords whose value maps names to schemas, and those whose value is data (never a schema).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_DATA = ("const", "enum", "default", "examples")


def rooted(schema, at: str):
    """``schema`` placed at JSON pointer ``at`` inside a larger schema: its
    local references (``#/$defs/...``, ``#``) re-pointed below ``at``, as they
    resolve against the document's root (JSON Schema's ``$ref``)."""
    if isinstance(schema, list):
        return [rooted(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):  # (not an anchor: #name)
            out[key] = "#" + at + value[1:]
        elif key in SCHEMA_DATA:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rooted(s, at) for name, s in value.items()}
        else:
            out[key] = rooted(value, at)
    return out


def literal(text: str, tokenizer) -> str:
    """A marker in Lark: a special token by its name (its bytes never match a
    string), anything else as a string."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and bridge(tokenizer).is_special_token(ids[0]):
        return text
    return json.dumps(text)


def tool_call_grammar(tools: List[dict], forced: bool, response_format, tokenizer, answers, parallel: bool = True) -> str:
    """A Lark grammar of an answer in the ``json_tools`` call format: one or
    more calls (``forced``); or else free text, optionally followed by calls;
    or, with a JSON ``response_format``, that JSON or calls. Without
    ``parallel`` (``parallel_tool_calls: false``) calls are one call."""
    if answers.tool_parser is not json_tools.parse_tool_call:
        raise RequestError(
            "strict tools and forced tool calls need a model whose tool calls are <tool_call>{json}</tool_call> "
            "(mlx-lm's json_tools format); this model writes them in another format: send tool_choice auto "
            "and tools without strict",
            "tools",
        )
    start, end = literal(json_tools.tool_call_start, tokenizer), literal(json_tools.tool_call_end, tokenizer)
    lines = [
        f'calls: "\\n" call "\\n" {end}' + (f' ("\\n" {start} "\\n" call "\\n" {end})*' if parallel else ""),
        f"call: %json {json.dumps({**call_schema(tools), 'x-guidance': CALL_JSON})}",
    ]
    if forced:
        return "\n".join([f"start: {start} calls", *lines])
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind in ("json_object", "json_schema"):  # the JSON answer, or calls
        schema = ANY_OBJECT if kind == "json_object" else response_format["json_schema"]["schema"]
        return "\n".join([f"start: answer | {start} calls", f"answer: %json {json.dumps(schema)}", *lines])
    if kind not in (None, "text"):
        raise RequestError(f"a {kind} response_format cannot be combined with strict tools: send one", "response_format")
    if start.startswith('"'):  # the marker spelled in text: the prose before a call ends at it
        return "\n".join([
            f"start: TEXT? | prose calls | {start} calls",
            f"prose[stop={start}]: /(?s:.*)/",
            f"TEXT: /(?s:.+)/ & ~/(?s:.*{regex_to_lark(re.escape(json_tools.tool_call_start))}.*)/",
            *lines,
        ])
    return "\n".join([f"start: TEXT? | TEXT? {start} calls", "TEXT: /(?s:.+)/", *lines])


# The Responses API's text.format types (OpenAI's three, and this server's regex and grammar in chat's shape).
TEXT_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")


def responses_text_format(text) -> Optional[dict]:
    """The Responses API's ``text.format`` as chat's ``response_format``,
    its own shape checked here (errors name ``text.format``)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError("text must be an object, e.g. {\"format\": {\"type\": \"json_schema\", ...}}", "text")
    form = text.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") not in TEXT_FORMAT_TYPES:
        raise RequestError(
            "text.format must be an object whose type is one of " + ", ".join(TEXT_FORMAT_TYPES)
            + ', e.g. {"type": "json_schema", "name": "answer", "schema": {...}}', "text.format")
    if form["type"] != "json_schema":
        return form  # (text, json_object; regex and grammar as chat's, checked by the chat check)
    if not isinstance(form.get("schema"), dict):
        raise RequestError('a json_schema text.format needs "schema": a JSON schema object, e.g. '
                           '{"type": "json_schema", "name": "answer", "schema": {...}}', "text.format")
    spec = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
    return {"type": "json_schema", "json_schema": spec}


def output_format_field(body: dict) -> str:
    """The field a Messages request asks for its output format with:
    ``output_config.format``, or the beta ``output_format``."""
    config = body.get("output_config")
    if "output_format" in body and not (isinstance(config, dict) and "format" in config):
        return "output_format"
    return "output_config.format"


def messages_output_format(body: dict) -> Optional[dict]:
    """Anthropic's ``output_config.format`` (or the beta ``output_format``),
    ``{"type": "json_schema", "schema": {...}}``, as chat's ``response_format``
    (errors name the field the client sent)."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError("output_config must be an object", "output_config")
    form = (config or {}).get("format", body.get("output_format"))
    if form is None:
        return None
    field = output_format_field(body)
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise RequestError(f'{field} must be {{"type": "json_schema", "schema": {{...}}}}', field)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
