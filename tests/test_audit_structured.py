"""Structured outputs' edge cases found by an adversarial audit: each test
is a bug that was, against the behaviour the docs promise (one clear
error before any work for bad input; masked output equal to mlx-lm's)."""

import http.client
import json
import threading
from pathlib import Path

import pytest
from tiny_chat import format_of

from dflash_mlx.errors import ArgumentError, RequestError

DEFAULT_TARGET = Path(__file__).parent.parent / "dflash_mlx" / "default_pair" / "target"


def tool(**function):
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, **function}}


@pytest.mark.parametrize("tools", [[5], [{"type": "function", "function": {}}], [{"type": "function", "function": {"name": 3}}]])
def test_malformed_tools_of_a_text_completion_are_a_400(chat_tokenizer, tools):
    """/v1/completions reads tools only for the format: a malformed list was a 500 (AttributeError, KeyError)."""
    with pytest.raises(RequestError) as e:
        format_of({"prompt": "hi", "tools": tools, "tool_choice": "required"}, chat_tokenizer)
    assert e.value.param == "tools"


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": 5},
    {"type": "json_schema", "json_schema": {"name": "a"}},
    {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}},
    {"type": "json_schema", "json_schema": {"strict": "yes", "schema": {}}},
    "x",
    "text",
])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_malformed_response_format_beside_strict_tools_or_a_forced_call_is_a_400(chat_tokenizer, response_format, choice):
    """The same response_format is refused with and without strict tools: beside them
    it was a 500 (KeyError, TypeError) or read as no format at all."""
    with pytest.raises(RequestError) as alone:
        format_of({"response_format": response_format}, chat_tokenizer)
    with pytest.raises(RequestError) as e:
        format_of({"tools": [tool(strict=True)], "tool_choice": choice, "response_format": response_format}, chat_tokenizer)
    assert e.value.param == "response_format" and str(e.value) == str(alone.value)


@pytest.mark.parametrize("strict", ["yes", 1, "true"])
def test_a_chat_tools_strict_that_is_not_a_bool_is_a_400(chat_tokenizer, strict):
    """Responses' and Messages' tools refuse a non-bool strict; chat's read it as not strict, silently."""
    with pytest.raises(RequestError, match="strict must be true or false") as e:
        format_of({"tools": [tool(strict=strict)]}, chat_tokenizer)
    assert e.value.param == "tools"


def strict_json(text: str):
    """``text`` read as RFC 8259 JSON (Python's reader takes -Infinity and NaN; other clients' do not)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_tokens_a_format_refuses_are_json(tmp_path):
    """A held answer's top_logprobs list tokens its format refuses: their -inf
    was written as -Infinity, which no strict JSON reader takes; OpenAI's -9999.0 now."""
    from dflash_mlx.pair import load_pair
    from dflash_mlx.server import make_server, setup_arg_parser

    model, tokenizer, draft, _ = load_pair(DEFAULT_TARGET)
    args = setup_arg_parser().parse_args(["--model", str(DEFAULT_TARGET), "--port", "0"])
    server = make_server(args, model, tokenizer, draft, "default")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    form = {"type": "regex", "pattern": "(yes|no)!"}
    asks = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Sky blue?"}], "response_format": form, "logprobs": True, "top_logprobs": 4}),
            ("/v1/responses", {"input": "Sky blue?", "text": {"format": form}, "top_logprobs": 4, "include": ["message.output_text.logprobs"]})]
    try:
        for path, body in asks:
            for stream in (False, True):
                c = http.client.HTTPConnection(host, port, timeout=120)
                c.request("POST", path, json.dumps({**body, "max_tokens": 8, "max_output_tokens": 8, "stream": stream}), {"Content-Type": "application/json"})
                r = c.getresponse()
                text = r.read().decode()
                assert r.status == 200, text
                assert stream or "Infinity" in text.replace("-9999.0", "Infinity"), "the case: refused tokens among the top ones"
                for line in text.splitlines() if stream else [text]:
                    if line.startswith("data: {") or not stream:
                        strict_json(line[len("data: "):] if stream else line)
    finally:
        server.shutdown()
        server.server_close()
        server.generator.stop_and_join()


@pytest.mark.parametrize("schema", [None, 5, "x", True])
def test_a_dialects_json_schema_format_without_a_schema_names_its_own_field(schema):
    """Responses' text.format and Messages' output_config.format without a schema object
    were refused as chat's response_format, naming fields the client never sent."""
    from dflash_mlx.api import messages, responses

    with pytest.raises(RequestError, match='a json_schema text.format needs "schema"') as e:
        responses.to_chat({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}}, [])
    assert e.value.param == "text.format"
    with pytest.raises(RequestError, match='output_config.format must be .*"schema"') as e:
        messages.to_chat({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                          "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert e.value.param == "output_config.format"


CITY_DEFS = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False}},
             "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "additionalProperties": False}
ZIP_DEFS = {"$defs": {"City": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "type": "object", "properties": {"zip": {"$ref": "#/$defs/City"}}, "required": ["zip"], "additionalProperties": False}
TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"], "additionalProperties": False}


def call(name, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def takes(form, tokenizer, text) -> bool:
    from dflash_mlx.structured import constraint_from_response_format

    c = constraint_from_response_format(form, tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return c.take(ids) == len(ids) and c.is_accepting()


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_strict_tools_whose_parameters_use_local_refs_hold_calls_to_them(chat_tokenizer, choice):
    """A strict tool's parameters with $defs and $ref (as Pydantic writes them) were a 400
    ("Pointer '/$defs/City' does not exist"): the call's schema nests them, so their refs resolved against its root."""
    tools = [tool(name="weather", strict=True, parameters=CITY_DEFS), tool(name="post", strict=True, parameters=ZIP_DEFS),
             tool(name="tree", strict=True, parameters=TREE)]
    for some in (tools[:1], tools):
        form = format_of({"tools": some, "tool_choice": choice}, chat_tokenizer)
        assert takes(form, chat_tokenizer, call("weather", '{"city": {"name": "Paris"}}'))
        assert not takes(form, chat_tokenizer, call("weather", '{"city": "Paris"}'))
    assert takes(form, chat_tokenizer, call("post", '{"zip": "75001"}'))
    assert not takes(form, chat_tokenizer, call("post", '{"zip": {"name": "Paris"}}')), "each tool's own $defs"
    assert takes(form, chat_tokenizer, call("tree", '{"kids": [{"kids": []}]}'))
    assert not takes(form, chat_tokenizer, call("tree", '{"kids": [{"kids": [1]}]}')), "a ref to the parameters' root"


@pytest.mark.parametrize("flag,text,says", [("--json-schema", "[1]", "holds a JSON list, not a schema"), ("--json-schema", '"x"', "holds a JSON str, not a schema"),
                                            ("--grammar", "\n", "is empty: write the Lark grammar"), ("--json-schema", "", "is empty: write the JSON schema")])
def test_the_cli_names_a_structured_file_that_holds_no_schema_or_grammar(tmp_path, flag, text, says):
    """A --json-schema file holding a list, or an empty --grammar file, was refused as a
    response_format ('a json_schema response_format needs "json_schema": ...'), which the CLI user never wrote."""
    from dflash_mlx import cli

    parser = cli.ArgumentParser()
    cli.add_structured_arguments(parser)
    path = tmp_path / "f"
    path.write_text(text)
    with pytest.raises(ArgumentError, match=says):
        cli.response_format(parser.parse_args([flag, str(path)]))


def test_rooted_re_points_pointers_only():
    """An anchor (#name) resolves by name wherever it sits; data (const, enum) is no schema; a property may be named enum."""
    from dflash_mlx.api.formats import rooted

    schema = {"$ref": "#city", "items": {"$ref": "#/$defs/b"}, "enum": [{"$ref": "#"}], "properties": {"enum": {"$ref": "#"}}}
    assert rooted(schema, "/p") == {"$ref": "#city", "items": {"$ref": "#/p/$defs/b"}, "enum": [{"$ref": "#"}], "properties": {"enum": {"$ref": "#/p"}}}
