"""The server's agent dialects, driven by the official anthropic and openai
clients against a live server on loopback: /v1/messages, /v1/responses and
/v1/chat/completions give the same turn, with tool calls and reasoning split
by mlx-lm's parsers, through the DFlash loop.

The target is tests/tiny_chat.py's: trained in the session's setup to
answer its scripted conversations greedily (a tool call, an answer to the
tool's result, a reasoned answer). The references are mlx-lm's own greedy
decodes of the same templated prompts, in this process.
"""

import copy
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import anthropic
import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.server import process_message_content
from prometheus_client.parser import text_string_to_metric_families
from tiny import reference_steps, reference_text
from tiny_chat import ASK, CALLED, RESULT, THINK, WEATHER_TOOL, make_chat_draft, make_chat_target

import dflash_mlx
from dflash_mlx.api.harmony import text_format
from dflash_mlx.server import make_server, prepare, setup_arg_parser
from dflash_mlx.targets import adapter_for

MAX_TOKENS = 96
# The Anthropic and Responses forms of the weather tool.
ANTHROPIC_TOOL = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
                  "input_schema": WEATHER_TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
                  "parameters": WEATHER_TOOL["function"]["parameters"]}

# The tool round trip (ASK, CALLED, RESULT) in each dialect's own form.
ARGUMENTS = json.loads(CALLED["tool_calls"][0]["function"]["arguments"])
ANTHROPIC_ROUND_TRIP = ASK + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGUMENTS}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT["content"]}]},
]
RESPONSES_ROUND_TRIP = [
    {"role": "user", "content": ASK[0]["content"]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
    {"type": "function_call_output", "call_id": "call_1", "output": RESULT["content"]},
]


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """(target dir, drafter dir, target, tokenizer, drafter) of the trained chat target."""
    root = tmp_path_factory.mktemp("agents")
    target = make_chat_target(root)
    draft_dir = make_chat_draft(root, target)
    model, tokenizer = load(str(target))
    return target, draft_dir, model, tokenizer, dflash_mlx.load_draft(draft_dir, model)


@contextmanager
def live_server(chat_pair, *flags):
    """The base URL of a server over the chat pair, run with ``flags``."""
    target, draft_dir, model, tokenizer, draft = chat_pair
    args = setup_arg_parser().parse_args(["--model", str(target), "--port", "0", *flags])
    server = make_server(args, model, tokenizer, draft, str(draft_dir))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        server.generator.stop_and_join()


@pytest.fixture(scope="module")
def served(chat_pair):
    """(base URL, target, tokenizer) of the live server the tests share."""
    with live_server(chat_pair, "--prefill-step-size", "64", "--max-tokens", str(MAX_TOKENS)) as base:
        yield base, chat_pair[2], chat_pair[3]


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="not-needed", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served[0], api_key="not-needed", max_retries=0, timeout=300)


def reference(served, messages, tools=None, logits_processors=None, **template):
    """mlx-lm's greedy text for a chat conversation, templated as the server
    does (``logits_processors``: mlx-lm's, as its server builds them from a request's fields)."""
    _, model, tokenizer = served
    messages = copy.deepcopy(messages)
    process_message_content(messages)
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **template)
    return reference_text(model, tokenizer, ids, MAX_TOKENS, logits_processors=logits_processors), len(ids)


def split_tool_call(raw: str) -> dict:
    """The call in mlx-lm's raw text (its markers, then one JSON object)."""
    head, _, rest = raw.partition("<tool_call>")
    body, _, tail = rest.partition("</tool_call>")
    assert head == "" and tail == "", raw
    return json.loads(body)


def split_reasoning(raw: str):
    """(reasoning, answer) of mlx-lm's raw text: between the think markers, and after."""
    head, _, rest = raw.partition("<think>")
    reasoning, _, answer = rest.partition("</think>")
    assert head == "" and reasoning and answer, raw
    return reasoning, answer


def strip_ids(blocks):
    return [{k: v for k, v in b.items() if k not in ("id", "call_id")} for b in blocks]


def test_tool_call_is_structured_on_every_dialect(served, oai, claude):
    raw, _ = reference(served, ASK, [WEATHER_TOOL])
    want = split_tool_call(raw)  # the target's own answer is a call
    assert want["name"] == "get_weather"

    # chat completions, whole and streamed
    r = oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], max_tokens=MAX_TOKENS)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert {"name": call.function.name, "arguments": json.loads(call.function.arguments)} == want
    chunks = list(oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], max_tokens=MAX_TOKENS, stream=True))
    (streamed,) = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == (want["name"], want["arguments"])

    # Anthropic Messages
    m = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=ASK, tools=[ANTHROPIC_TOOL])
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    assert (m.content[0].name, m.content[0].input) == (want["name"], want["arguments"]) and m.content[0].id
    with claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=ASK, tools=[ANTHROPIC_TOOL]) as s:
        final = s.get_final_message()
    assert strip_ids(b.model_dump() for b in final.content) == strip_ids(b.model_dump() for b in m.content)
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == m.usage.output_tokens

    # OpenAI Responses
    r = oai.responses.create(model="m", input=ASK[0]["content"], tools=[RESPONSES_TOOL, {"type": "web_search"}],
                             max_output_tokens=MAX_TOKENS)  # a hosted tool, as Codex sends: left out
    (item,) = r.output
    assert item.type == "function_call" and r.status == "completed"
    assert (item.name, json.loads(item.arguments)) == (want["name"], want["arguments"])
    events = list(oai.responses.create(model="m", input=ASK[0]["content"], tools=[RESPONSES_TOOL],
                                       max_output_tokens=MAX_TOKENS, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [want["arguments"]]
    assert strip_ids(i.model_dump() for i in events[-1].response.output) == strip_ids(i.model_dump() for i in r.output)


def test_tool_results_are_templated_and_answered(served, oai, claude):
    want, _ = reference(served, ASK + [CALLED, RESULT], [WEATHER_TOOL])
    assert want and "<tool_call>" not in want

    r = oai.chat.completions.create(model="m", messages=ASK + [CALLED, RESULT], tools=[WEATHER_TOOL], max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"

    messages = ANTHROPIC_ROUND_TRIP
    m = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=messages, tools=[ANTHROPIC_TOOL])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want and m.stop_reason == "end_turn"
    with claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=messages, tools=[ANTHROPIC_TOOL]) as s:
        assert "".join(s.text_stream) == want

    items = RESPONSES_ROUND_TRIP
    r = oai.responses.create(model="m", input=items, tools=[RESPONSES_TOOL], max_output_tokens=MAX_TOKENS)
    assert r.output_text == want
    events = list(oai.responses.create(model="m", input=items, tools=[RESPONSES_TOOL], max_output_tokens=MAX_TOKENS, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want


def test_stop_sequences_and_max_tokens_end_the_turn(served, oai, claude):
    want, _ = reference(served, ASK + [CALLED, RESULT], [WEATHER_TOOL])
    stop = want[2:4]
    kw = dict(model="m", messages=ANTHROPIC_ROUND_TRIP, tools=[ANTHROPIC_TOOL])
    m = claude.messages.create(max_tokens=MAX_TOKENS, stop_sequences=[stop], **kw)
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", stop, want[: want.find(stop)])
    with claude.messages.stream(max_tokens=MAX_TOKENS, stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (m.stop_reason, m.stop_sequence, m.content[0].text)
    m = claude.messages.create(max_tokens=3, **kw)
    assert (m.stop_reason, m.content[0].text, m.usage.output_tokens) == ("max_tokens", want[:3], 3)
    r = oai.responses.create(model="m", input=RESPONSES_ROUND_TRIP, tools=[RESPONSES_TOOL], max_output_tokens=3)
    assert (r.status, r.incomplete_details.reason, r.output_text) == ("incomplete", "max_output_tokens", want[:3])


def test_previous_response_id_continues_a_stored_response(oai, served):
    want, _ = reference(served, ASK + [CALLED, RESULT], [WEATHER_TOOL])
    first = oai.responses.create(model="m", input=ASK[0]["content"], tools=[RESPONSES_TOOL], max_output_tokens=MAX_TOKENS)
    (call,) = first.output
    second = oai.responses.create(
        model="m", previous_response_id=first.id, tools=[RESPONSES_TOOL], max_output_tokens=MAX_TOKENS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT["content"]}],
    )
    assert second.output_text == want and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the stored turn, reused
    # a thinking turn, continued: the stored conversation templates as it was generated, reasoning included
    first = oai.responses.create(model="m", input=THINK[0]["content"], max_output_tokens=MAX_TOKENS)
    second = oai.responses.create(model="m", previous_response_id=first.id, input="Again?", max_output_tokens=2)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model="m", previous_response_id="resp_unknown", input="hi", max_output_tokens=4)


def test_reasoning_is_split_on_every_dialect(served, oai, claude):
    raw, _ = reference(served, THINK)
    reasoning, answer = split_reasoning(raw)
    assert_reasoning_split(oai, claude, reasoning, answer)


def assert_reasoning_split(oai, claude, reasoning, answer):
    """THINK's reasoning and answer come back apart in every dialect, whole and streamed."""
    r = oai.chat.completions.create(model="m", messages=THINK, max_tokens=MAX_TOKENS)
    message = r.choices[0].message
    assert (message.model_extra["reasoning"], message.content) == (reasoning, answer)
    chunks = list(oai.chat.completions.create(model="m", messages=THINK, max_tokens=MAX_TOKENS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == answer

    m = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=THINK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", reasoning), ("text", answer)]
    with claude.messages.stream(model="m", max_tokens=MAX_TOKENS, messages=THINK) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]

    r = oai.responses.create(model="m", input=THINK[0]["content"], max_output_tokens=MAX_TOKENS)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == reasoning and r.output_text == answer
    events = list(oai.responses.create(model="m", input=THINK[0]["content"], max_output_tokens=MAX_TOKENS, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer


def test_earlier_reasoning_is_templated_alike_in_every_dialect(served, oai, claude):
    raw, _ = reference(served, THINK)
    reasoning, answer = split_reasoning(raw)
    again = {"role": "user", "content": "Again?"}
    _, plain = reference(served, THINK + [{"role": "assistant", "content": answer}, again])
    r = oai.chat.completions.create(model="m", max_tokens=2, messages=THINK + [
        {"role": "assistant", "content": answer, "reasoning_content": reasoning}, again])
    n = r.usage.prompt_tokens
    assert n > plain  # the template shows the reasoning again
    count = claude.messages.count_tokens(model="m", messages=THINK + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": reasoning, "signature": ""},
                                          {"type": "text", "text": answer}]}, again])
    assert count.input_tokens == n
    r = oai.responses.create(model="m", max_output_tokens=2, input=THINK + [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": reasoning}]},
        {"role": "assistant", "content": answer}, again])
    assert r.usage.input_tokens == n


def test_thinking_switch_reaches_the_template(served, oai, claude):
    """Anthropic's thinking and chat_template_kwargs set the template's
    enable_thinking; the answer is then the target's to that prompt."""
    want, n_off = reference(served, THINK, enable_thinking=False)
    _, n_on = reference(served, THINK)
    assert n_off > n_on  # the template writes an empty think block
    count = claude.messages.count_tokens(model="m", messages=THINK, thinking={"type": "disabled"})
    assert count.input_tokens == n_off
    m = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=THINK, thinking={"type": "disabled"})
    assert "".join(b.text for b in m.content if b.type == "text") == want
    r = oai.chat.completions.create(model="m", messages=THINK, max_tokens=MAX_TOKENS,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == n_off and (r.choices[0].message.content or "") == want


def test_server_wide_thinking_switch(chat_pair, served):
    """--chat-template-args sets the default that a request's own switch overrides."""
    _, n_off = reference(served, THINK, enable_thinking=False)
    _, n_on = reference(served, THINK)
    with live_server(chat_pair, "--chat-template-args", '{"enable_thinking": false}') as base:
        claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300)
        assert claude.messages.count_tokens(model="m", messages=THINK).input_tokens == n_off
        assert claude.messages.count_tokens(model="m", messages=THINK, thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens == n_on


def test_count_tokens_matches_usage(served, claude):
    _, n = reference(served, ASK, [WEATHER_TOOL])
    server_tool = {"type": "web_search_20250305", "name": "web_search"}  # hosted by Anthropic: left out
    count = claude.messages.count_tokens(model="m", messages=ASK, tools=[ANTHROPIC_TOOL, server_tool],
                                         extra_query={"beta": "true"})  # as Claude Code asks
    m = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=ASK, tools=[ANTHROPIC_TOOL])
    assert count.input_tokens == n == m.usage.input_tokens + m.usage.cache_read_input_tokens
    system = claude.messages.count_tokens(model="m", messages=ASK, system="Be terse.")
    assert system.input_tokens > claude.messages.count_tokens(model="m", messages=ASK).input_tokens


def long_conversation(tag: str, target_tokens: int = 2000) -> list:
    """A conversation of about ``target_tokens`` byte tokens, its own by ``tag``."""
    lines = [f"{tag}: note {i} on the build, the cache and the drafter." for i in range(target_tokens // 50)]
    half = len(lines) // 2
    return [
        {"role": "system", "content": f"You review {tag} code."},
        {"role": "user", "content": "\n".join(lines[:half])},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "\n".join(lines[half:])},
    ]


def raw_post(base: str, path: str, body: dict):
    """(status, raw text) of a POST, read whole."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read().decode()


def test_resent_long_conversation_is_mostly_cached_in_each_dialect(served, oai, claude):
    base = served[0]
    # Anthropic: the first turn streams raw, to see the pings of its long prefill
    convo = long_conversation("anthropic")
    system, turns = convo[0]["content"], convo[1:]
    status, raw = raw_post(base, "/v1/messages", {"model": "m", "max_tokens": 4, "system": system,
                                                 "messages": turns, "stream": True})
    assert status == 200 and raw.count("event: ping") >= 8 and raw.rstrip().endswith('data: {"type": "message_stop"}')
    first_text = "".join(json.loads(line[6:])["delta"].get("text", "") for line in raw.splitlines()
                         if line.startswith("data: ") and '"content_block_delta"' in line)
    resent = turns + [{"role": "assistant", "content": first_text}, {"role": "user", "content": "And then?"}]
    m = claude.messages.create(model="m", max_tokens=4, system=system, messages=resent)
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert total >= 2000 and m.usage.cache_read_input_tokens >= 0.8 * total

    convo = long_conversation("responses")
    first = oai.responses.create(model="m", input=convo, max_output_tokens=4)
    assert first.usage.input_tokens >= 2000 and first.usage.input_tokens_details.cached_tokens < 0.2 * first.usage.input_tokens
    resent = convo + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}]
    r = oai.responses.create(model="m", input=resent, max_output_tokens=4)
    assert r.usage.input_tokens_details.cached_tokens >= 0.8 * r.usage.input_tokens

    convo = long_conversation("chat")
    first = oai.chat.completions.create(model="m", messages=convo, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens < 0.2 * first.usage.prompt_tokens
    resent = convo + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    r = oai.chat.completions.create(model="m", messages=resent, max_tokens=4)
    assert r.usage.prompt_tokens >= 2000 and r.usage.prompt_tokens_details.cached_tokens >= 0.8 * r.usage.prompt_tokens


def post(base: str, path: str, body: dict):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


USER = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/messages", {"model": "m", "messages": USER}, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "name": "get_weather", "input": {}}]}]}, "needs an id"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER, "tools": [ANTHROPIC_TOOL],
                      "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ("/v1/messages", {"model": "m", "max_tokens": 0, "messages": USER}, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER, "top_k": -1}, "top_k"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ("/v1/responses", {"model": "m", "input": [{"role": "robot", "content": "x"}]}, "role"),
    ("/v1/responses", {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ("/v1/responses", {"model": "m", "input": "hi", "tool_choice": "required"}, "needs tools"),
    ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "tools": [WEATHER_TOOL], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "cannot both hold"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "response_format": {"type": "json_schema",
                              "json_schema": {"name": "a", "schema": {"type": "strin"}}}}, "JSON schema is invalid"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "response_format": {"type": "regex", "pattern": "(("}},
     "regular expression is invalid"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "tools": [WEATHER_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ("/v1/responses", {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "a",
                                                                     "schema": {"type": "strin"}}}}, "JSON schema is invalid"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER,
                      "output_config": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}}, "JSON schema is invalid"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER, "output_config": {"format": {"type": "xml"}}},
     "output_config"),
    # tool definitions, checked before the template reads them
    ("/v1/chat/completions", {"model": "m", "messages": USER, "tools": [{"type": "function", "function": {"name": 5}}]},
     "tools.0.function needs a name (a non-empty string), not 5"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "city"}}]}, "schema must be a JSON object"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "tools": [{"name": "f"}]}, "tools.0 must be"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER, "tools": [{"name": 7, "input_schema": {}}]},
     "needs a name"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": [1]}]},
     "schema must be a JSON object"),
    ("/v1/responses", {"model": "m", "input": "hi", "tools": [{"type": "bogus", "name": "f"}]}, "type 'bogus'"),
    ("/v1/responses", {"model": "m", "input": "hi", "tools": [{"type": "function", "name": 3}]}, "needs a name"),
    # mlx-lm's controls, out of range
    ("/v1/chat/completions", {"model": "m", "messages": USER, "repetition_context_size": -1}, "repetition_context_size"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "presence_context_size": 1.5}, "presence_context_size"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "repetition_penalty": -1}, "repetition_penalty"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "logit_bias": {"100000": 1}}, "outside the vocabulary"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "logit_bias": {"x": 1}}, "not a token id"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "logit_bias": {"3": "up"}}, "logit_bias[3] must be a finite number"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "top_logprobs": 12}, "top_logprobs must be at most 11"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "xtc_threshold": 0.7}, "xtc_threshold must be a finite number in [0.0, 0.5]"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "xtc_probability": 2}, "xtc_probability"),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "n": 2}, "n must be 1"),
]


@pytest.mark.parametrize("path, body, says", BAD, ids=[f"{p}-{s}" for p, _, s in BAD])
def test_malformed_requests_get_4xx_in_their_dialect_and_the_server_goes_on(served, oai, path, body, says):
    status, answer = post(served[0], path, body)
    assert 400 <= status < 500
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    else:
        assert answer["error"]["type"] == "invalid_request_error"
    assert says in answer["error"]["message"]
    assert oai.chat.completions.create(model="m", messages=USER, max_tokens=2).usage.completion_tokens == 2


def test_anthropic_client_raises_bad_request(claude):
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        claude.messages.create(model="m", max_tokens=4, messages=USER, tools=[ANTHROPIC_TOOL],
                               tool_choice={"type": "tool", "name": "get_time"})


def metrics(base: str) -> dict:
    """{(name, labels): value} of /metrics, parsed as Prometheus text."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_move(served, claude):
    before = metrics(served[0])
    m = claude.messages.create(model="m", max_tokens=8, messages=USER)
    after = metrics(served[0])
    assert after[("dflash_requests_total", (("endpoint", "/v1/messages"),))] == \
        before.get(("dflash_requests_total", (("endpoint", "/v1/messages"),)), 0) + 1
    gained = {name: after[(name, ())] - before[(name, ())] for name in (
        "dflash_generations_total", "dflash_prompt_tokens_total", "dflash_generated_tokens_total",
        "dflash_cached_prompt_tokens_total")}
    assert gained == {
        "dflash_generations_total": 1,
        "dflash_prompt_tokens_total": m.usage.input_tokens + m.usage.cache_read_input_tokens,
        "dflash_generated_tokens_total": m.usage.output_tokens,
        "dflash_cached_prompt_tokens_total": m.usage.cache_read_input_tokens,
    }
    cycles = after[("dflash_cycles_total", ())] - before[("dflash_cycles_total", ())]
    blocks = sum(v for (name, _), v in after.items() if name == "dflash_verify_blocks_total") - sum(
        v for (name, _), v in before.items() if name == "dflash_verify_blocks_total")
    trees = sum(v for (name, _), v in after.items() if name == "dflash_verify_trees_total") - sum(
        v for (name, _), v in before.items() if name == "dflash_verify_trees_total")
    assert trees == sum(m.usage.model_extra["dflash"]["tree_sizes"].values())
    assert cycles == m.usage.model_extra["dflash"]["cycles"] == blocks + trees  # each cycle a chain or a tree
    assert after[("dflash_queued_requests", ())] == 0 and after[("dflash_generating", ())] in (0, 1)


def test_metrics_show_requests_decoded_together(served, oai):
    """Two long prompts at once decode in one batch: /metrics counts cycles
    that verified both, and shows nothing queued once they are done."""
    key = ("dflash_batch_cycles_total", (("batch_size", "2"),))
    before = metrics(served[0]).get(key, 0)
    threads = [threading.Thread(target=oai.chat.completions.create,
                                kwargs=dict(model="m", messages=long_conversation(tag, 600), max_tokens=48))
               for tag in ("batch-a", "batch-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = metrics(served[0])
    assert after.get(key, 0) > before
    assert after[("dflash_queued_requests", ())] == 0 and after[("dflash_generating", ())] == 0


KEY = "sk-test-7f3c9a"


def raw_request(base, method, path, body=b"", headers=None):
    """(status, answer: JSON, or text where it is none) of one request with exactly ``headers``."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if resp.getheader("Content-Type") == "application/json" else raw
    finally:
        conn.close()


# Every route but /health, with a body it would serve, and the dialect of its errors.
KEYED_ROUTES = [
    ("POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 4}, "openai"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4}, "openai"),
    ("POST", "/v1/messages", {"messages": ASK, "max_tokens": 4}, "anthropic"),
    ("POST", "/v1/messages/count_tokens", {"messages": ASK}, "anthropic"),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 4}, "openai"),
    ("GET", "/v1/models", None, "openai"),
    ("GET", "/metrics", None, "openai"),
]


def assert_error_shape(answer, dialect, kind):
    if dialect == "anthropic":
        assert answer["type"] == "error" and answer["error"]["type"] == kind and answer["error"]["message"], answer
    else:
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"], answer


@pytest.fixture(scope="module")
def keyed(chat_pair, tmp_path_factory):
    """(base URL, server log) of a server with --api-key, a body limit and a prompt limit."""
    log = tmp_path_factory.mktemp("keyed") / "server.log"
    handler, root = logging.FileHandler(log), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # everything the server logs, request bodies included
    flags = ["--api-key", KEY, "--max-request-bytes", "4000", "--max-prompt-tokens", "200"]
    try:
        with live_server(chat_pair, *flags) as base:
            yield base, log
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.mark.parametrize("method, path, body, dialect", KEYED_ROUTES, ids=[r[1] for r in KEYED_ROUTES])
def test_a_missing_or_wrong_key_gets_401_in_the_dialect(keyed, method, path, body, dialect):
    raw = json.dumps(body).encode() if body is not None else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}, {"Authorization": KEY}):
        status, answer = raw_request(keyed[0], method, path, raw, headers)
        assert status == 401, (headers, answer)
        assert_error_shape(answer, dialect, "authentication_error")
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert raw_request(keyed[0], method, path, raw, headers)[0] == 200
    assert raw_request(keyed[0], "GET", "/health")[0] == 200  # no key needed


def test_official_clients_work_with_the_key_which_stays_out_of_logs_and_metrics(keyed, served):
    base, log = keyed
    oai = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=300)
    _, model, tokenizer = served
    want = reference_text(model, tokenizer, "def f(x):", 8)
    assert oai.completions.create(model="m", prompt="def f(x):", max_tokens=8).choices[0].text == want
    assert oai.chat.completions.create(model="m", messages=ASK, max_tokens=8).usage.completion_tokens > 0
    assert claude.messages.create(model="m", max_tokens=8, messages=ASK).usage.output_tokens > 0
    assert oai.responses.create(model="m", input=ASK[0]["content"], max_output_tokens=8).usage.output_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(model="m", max_tokens=4, messages=ASK)
    metrics = urllib.request.urlopen(urllib.request.Request(base + "/metrics", headers={"x-api-key": KEY}), timeout=30).read()
    assert KEY.encode() not in metrics and b"dflash_requests_total" in metrics
    assert "Incoming Request Body" in log.read_text() and KEY not in log.read_text()


@pytest.mark.parametrize("path, dialect", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
                                           ("/v1/responses", "openai")])
def test_limits_get_413_and_400_in_the_dialect_and_the_server_goes_on(keyed, path, dialect):
    auth = {"x-api-key": KEY}
    long = {"messages": [{"role": "user", "content": "x" * 5000}], "input": "x" * 5000, "max_tokens": 4}
    status, answer = raw_request(keyed[0], "POST", path, json.dumps(long).encode(), auth)
    assert status == 413 and "--max-request-bytes" in json.dumps(answer)
    assert_error_shape(answer, dialect, "request_too_large")
    wordy = {"messages": [{"role": "user", "content": "def f(x): " * 150}], "input": "def f(x): " * 150, "max_tokens": 4}
    status, answer = raw_request(keyed[0], "POST", path, json.dumps(wordy).encode(), auth)
    assert status == 400 and "--max-prompt-tokens" in json.dumps(answer)
    assert_error_shape(answer, dialect, "invalid_request_error")
    short = {"messages": ASK, "input": "hi", "max_tokens": 4}
    assert raw_request(keyed[0], "POST", path, json.dumps(short).encode(), auth)[0] == 200


def urllib_post(base, body: bytes, headers):
    """(status, JSON answer) of a POST sent with Python's urllib, which sends its whole body before reading."""
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("size", [4001, 16 << 20])
def test_a_body_over_the_limit_gets_a_413_the_client_reads(keyed, size):
    """The refused body is read (and dropped) before the answer: a client
    still sending meets the 413, not a reset connection."""
    body = json.dumps({"messages": [{"role": "user", "content": ""}], "max_tokens": 4}).encode()
    body = body[:-1] + b" " * (size - len(body)) + b"}"
    assert len(body) == size
    status, answer = urllib_post(keyed[0], body, {"x-api-key": KEY})
    assert status == 413 and "--max-request-bytes" in answer["error"]["message"]
    assert urllib_post(keyed[0], json.dumps({"messages": ASK, "max_tokens": 2}).encode(), {"x-api-key": KEY})[0] == 200


def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(served, oai):
    """A message of many megabytes: refused from its length in characters
    (its tokens bounded below by the longest token's length), never
    tokenized whole; the message says "at least", the bound's word."""
    from dflash_mlx.server import longest_token

    _, model, tokenizer = served
    context = model.args.max_position_embeddings
    content = "x" * max(8 << 20, (context + 1) * longest_token(tokenizer))
    status, answer = urllib_post(served[0], json.dumps({"messages": [{"role": "user", "content": content}]}).encode(), {})
    assert status == 400 and answer["error"]["param"] == "messages"
    least = int(answer["error"]["message"].split("at least ")[1].split()[0])
    assert least >= len(content) // longest_token(tokenizer) > context
    assert f"context is {context}" in answer["error"]["message"]
    assert oai.chat.completions.create(model="m", messages=USER, max_tokens=2).usage.completion_tokens == 2


def test_controls_are_parsed_for_the_loop(served):
    """A request's penalties, logit bias and XTC become mlx-lm's processors
    and XTC keywords on the prepared request, as mlx-lm's server builds them."""
    from mlx_lm.sample_utils import make_logits_processors

    tokenizer, target = served[2], adapter_for(served[1])
    body = {"messages": USER, "repetition_penalty": 1.5, "logit_bias": {"5": 3}, "frequency_penalty": 0.5,
            "frequency_context_size": 4, "xtc_probability": 0.25}
    prepared = prepare(tokenizer, target, body, "chat", None, {}, text_format(tokenizer))
    (processors,) = prepared.controls.pop("logits_processors")
    want = make_logits_processors({5: 3.0}, 1.5, 20, None, 20, 0.5, 4)
    tokens, logits = mx.array(prepared.tokens), mx.random.normal((1, target.vocab_size), key=mx.random.key(2))
    a, b = processors(tokens, logits), mx.array(logits.tolist())
    for q in want:
        b = q(tokens, b)
    assert mx.array_equal(a, b)
    assert prepared.controls == {"xtc_probability": 0.25, "xtc_threshold": 0.1,
                                 "xtc_special_tokens": tokenizer.encode("\n") + list(tokenizer.eos_token_ids)}
    assert prepare(tokenizer, target, {"messages": USER}, "chat", None, {}, text_format(tokenizer)).controls == {}


def test_penalty_fields_end_to_end_are_mlx_lms_decode(served, oai):
    """An openai-client request with repetition_penalty (a frequency penalty
    and a logit bias too) answers mlx-lm's decode with the processors
    mlx-lm's server builds from those fields, logprobs included (1e-4)."""
    from mlx_lm.sample_utils import make_logits_processors

    _, model, tokenizer = served
    messages = ASK + [CALLED, RESULT]
    templated = copy.deepcopy(messages)
    process_message_content(templated)  # as the server and reference() template them
    ids = tokenizer.apply_chat_template(templated, tools=[WEATHER_TOOL], add_generation_prompt=True)
    plain, plain_lps = reference_steps(model, tokenizer, ids, MAX_TOKENS)
    for fields, processors in (
        ({"repetition_penalty": 1.3}, make_logits_processors(None, 1.3, 20)),
        ({"repetition_penalty": 1.2, "frequency_penalty": 0.3, "logit_bias": {str(plain[0]): -50}},
         make_logits_processors({plain[0]: -50.0}, 1.2, 20, None, 20, 0.3, 20)),
    ):
        want, _ = reference(served, messages, [WEATHER_TOOL], logits_processors=processors)
        r = oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL], max_tokens=MAX_TOKENS,
                                        logprobs=True, extra_body=fields)
        assert r.choices[0].message.content == want
        tokens, lps = reference_steps(model, tokenizer, ids, MAX_TOKENS, logits_processors=processors)
        got = [c.logprob for c in r.choices[0].logprobs.content]
        assert len(got) >= 2
        assert max(abs(g - lps[i, t].item()) for i, (g, t) in enumerate(zip(got, tokens))) < 1e-4
        # the check can fail: the fields change the logprobs (and the bias the answer)
        assert max(abs(g - plain_lps[i, t].item()) for i, (g, t) in enumerate(zip(got[: len(plain)], tokens))) > 1e-3
    assert tokens != plain


def test_kv_cache_flags_serve_mlx_lms_decode(chat_pair):
    """--max-kv-size: every request's caches are mlx-lm's rotating ones
    (served one at a time: a batch's rows share plain caches); its answer and
    a second turn that reuses the cached prefix are mlx-lm's decode with the
    same setting, and so are two requests sent at once (the second waits in
    the scheduler's queue). With --tree-budget too: every cycle a tree."""
    _, _, model, tokenizer, _ = chat_pair
    messages = ASK + [CALLED, RESULT]
    templated = copy.deepcopy(messages)
    process_message_content(templated)
    ids = tokenizer.apply_chat_template(templated, tools=[WEATHER_TOOL], add_generation_prompt=True)
    size = len(ids) - 8  # the prompt alone fills the ring
    want = reference_text(model, tokenizer, ids, MAX_TOKENS, max_kv_size=size)
    tokens, lps = reference_steps(model, tokenizer, ids, MAX_TOKENS, max_kv_size=size)
    plain, plain_lps = reference_steps(model, tokenizer, ids, MAX_TOKENS)
    with live_server(chat_pair, "--max-kv-size", str(size), "--tree-budget", "4") as base:
        oai = openai.OpenAI(base_url=base + "/v1", api_key="not-needed", max_retries=0, timeout=300)

        def ask(_=None):
            return oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL], max_tokens=MAX_TOKENS,
                                               logprobs=True)

        for r in [ask(), *ThreadPoolExecutor(2).map(ask, range(2))]:  # the later ones from the prompt cache
            assert r.choices[0].message.content == want
            got = [c.logprob for c in r.choices[0].logprobs.content]
            assert max(abs(g - lps[i, t].item()) for i, (g, t) in enumerate(zip(got, tokens))) < 1e-4
            stats = r.usage.model_extra["dflash"]
            assert set(stats["tree_sizes"]) == {"4"} and stats["tree_sizes"]["4"] >= stats["cycles"] - 1  # (the last: room for one)
    # the check can fail: the ring changes the logprobs
    assert tokens != plain or max(abs(g - plain_lps[i, t].item()) for i, (g, t) in enumerate(zip(got, tokens))) > 1e-3


def answer_tokens(tokenizer, tokens, answer: str):
    """The last tokens of ``tokens`` whose text is ``answer`` (the answer after a turn's reasoning)."""
    k = next(k for k in range(len(tokens) + 1) if tokenizer.decode(tokens[k:]) == answer)
    return list(range(k, len(tokens)))


def assert_output_text_logprobs(scored, tokenizer, tokens, lps, positions, top: int):
    """Responses output-text logprobs (OpenAI's shape) are mlx-lm's for its
    tokens at ``positions`` (1e-4), each with its ``top`` most likely, best first."""
    assert [s["token"] for s in scored] == [tokenizer.decode([tokens[i]]) for i in positions]
    assert all(s["bytes"] == list(s["token"].encode()) for s in scored)
    assert max(abs(s["logprob"] - lps[i, tokens[i]].item()) for s, i in zip(scored, positions)) < 1e-4
    for s, i in zip(scored, positions):
        best = mx.argsort(-lps[i])[:top].tolist()
        assert [t["token"] for t in s["top_logprobs"]] == [tokenizer.decode([b]) for b in best]
        assert max([abs(t["logprob"] - lps[i, b].item()) for t, b in zip(s["top_logprobs"], best)] + [0]) < 1e-4


def test_responses_output_text_logprobs_are_mlx_lms(served, oai):
    """include message.output_text.logprobs (and top_logprobs): the answer's
    tokens only (not the reasoning's, nor the end token), each with mlx-lm's
    decode logprob and its most likely alternatives, whole and streamed
    alike; none unless asked."""
    _, model, tokenizer = served
    ids = tokenizer.apply_chat_template(THINK, add_generation_prompt=True)
    tokens, lps = reference_steps(model, tokenizer, ids, MAX_TOKENS)
    _, answer = split_reasoning(tokenizer.decode(tokens))
    positions = answer_tokens(tokenizer, tokens, answer)
    assert 0 < len(positions) < len(tokens)  # the check can fail: reasoning tokens come first
    kw = dict(model="m", input=THINK[0]["content"], max_output_tokens=MAX_TOKENS)
    for top in (0, 3):
        r = oai.responses.create(include=["message.output_text.logprobs"], top_logprobs=top, **kw)
        (part,) = r.output[-1].content
        assert part.text == answer
        whole = [lp.model_dump() for lp in part.logprobs]
        assert_output_text_logprobs(whole, tokenizer, tokens, lps, positions, top)
        events = list(oai.responses.create(include=["message.output_text.logprobs"], top_logprobs=top, stream=True, **kw))
        streamed = [lp.model_dump(exclude_none=True) for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        (done,) = [e for e in events if e.type == "response.output_text.done"]
        assert streamed == whole == [lp.model_dump(exclude_none=True) for lp in done.logprobs]
    assert oai.responses.create(**kw).output[-1].content[0].logprobs == []
    status, body = post(served[0], "/v1/responses", {"input": "hi", "top_logprobs": 12})
    assert status == 400 and body["error"]["param"] == "top_logprobs"


def templated_text(tokenizer) -> str:
    """The tool round trip templated, as text: a completions prompt the tiny chat target answers."""
    return tokenizer.apply_chat_template(ASK + [CALLED, RESULT], tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)


def test_completions_logprobs_are_the_processed_distributions(served, oai):
    """/v1/completions with logprobs (and top_logprobs) and a repetition
    penalty: mlx-lm's server's shape (``logprobs.content``), each token's
    logprob and the top alternatives those of mlx-lm's decode with the
    penalty's processors (1e-4), not the unpenalised ones."""
    from mlx_lm.sample_utils import make_logits_processors

    _, model, tokenizer = served
    prompt = templated_text(tokenizer)
    ids = tokenizer.encode(prompt)
    processors = make_logits_processors(None, 1.3, 20)
    tokens, lps = reference_steps(model, tokenizer, ids, MAX_TOKENS, logits_processors=processors)
    _, plain_lps = reference_steps(model, tokenizer, ids, MAX_TOKENS)
    fields = {"repetition_penalty": 1.3}
    r = oai.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, logprobs=True, extra_body=fields)
    content = r.choices[0].logprobs.model_extra["content"][: len(tokens)]
    assert [c["id"] for c in content] == tokens and len(tokens) >= 2
    assert max(abs(c["logprob"] - lps[i, t].item()) for i, (c, t) in enumerate(zip(content, tokens))) < 1e-4
    assert max(abs(c["logprob"] - plain_lps[i, t].item()) for i, (c, t) in enumerate(zip(content, tokens))) > 1e-3
    r = oai.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, extra_body={**fields, "top_logprobs": 3})
    for i, c in enumerate(r.choices[0].logprobs.model_extra["content"][: len(tokens)]):
        best = set(mx.argsort(-lps[i])[:3].tolist())
        assert {t["id"] for t in c["top_logprobs"]} == best
        assert max(abs(t["logprob"] - lps[i, t["id"]].item()) for t in c["top_logprobs"]) < 1e-4


@contextmanager
def mlx_lm_server(model_dir, max_tokens: int):
    """The base URL of mlx-lm's own server (``python -m mlx_lm.server``, a
    process of its own) over ``model_dir``, on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port), "--max-tokens", str(max_tokens)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base, deadline = f"http://127.0.0.1:{port}", time.time() + 300
    try:
        while True:
            assert proc.poll() is None and time.time() < deadline, "mlx_lm.server did not start"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def server_logprobs(base: str, prompt: str, messages: list, fields: dict, max_tokens: int):
    """A server's greedy completion of ``prompt`` (logprobs) and chat turn
    (top 3 logprobs), with the request ``fields``, as mlx-lm's answer shape
    gives them: (text, logprobs entries) each."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="not-needed", max_retries=0, timeout=600)
    kw = dict(model="default_model", max_tokens=max_tokens, temperature=0, extra_body=fields)
    r = client.completions.create(prompt=prompt, logprobs=True, **kw)
    c = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, **kw)
    return ((r.choices[0].text, r.choices[0].logprobs.model_extra["content"]),
            (c.choices[0].message.content, [e.model_dump() for e in c.choices[0].logprobs.content]))


def assert_logprobs_equal_mlx_lm_servers(pair, prompt: str, messages: list, max_tokens: int, fields: dict):
    """This server (``pair`` as :func:`live_server` takes it) and mlx-lm's
    own over the same target directory answer the same greedy completion and
    chat turn with ``fields``: the same text and tokens, each logprob within
    1e-4, the same top alternatives within 1e-4; and the fields change
    mlx-lm's logprobs (so the check can fail)."""
    with live_server(pair, "--max-tokens", str(max_tokens)) as base:
        ours = server_logprobs(base, prompt, messages, fields, max_tokens)
    with mlx_lm_server(pair[0], max_tokens) as base:
        theirs = server_logprobs(base, prompt, messages, fields, max_tokens)
        plain = server_logprobs(base, prompt, messages, {}, max_tokens)
    (text, got), (chat, got_top) = ours
    (want_text, want), (want_chat, want_top) = theirs
    assert (text, [e["id"] for e in got]) == (want_text, [e["id"] for e in want]) and len(want) >= 2
    assert max(abs(g["logprob"] - w["logprob"]) for g, w in zip(got, want)) < 1e-4
    assert chat == want_chat and len(got_top) == len(want_top) >= 2
    for g, w in zip(got_top, want_top):
        g, w = ({t["id"]: t["logprob"] for t in e["top_logprobs"]} for e in (g, w))
        assert g.keys() == w.keys() and max(abs(g[k] - w[k]) for k in g) < 1e-4
    unprocessed = plain[0][1]
    assert [e["id"] for e in unprocessed] != [e["id"] for e in want] or max(
        abs(p["logprob"] - w["logprob"]) for p, w in zip(unprocessed, want)) > 1e-3


def test_logprobs_equal_mlx_lm_servers_on_the_tiny_pair(chat_pair):
    """The SmolLM2 check below, on the tiny chat pair (it runs in every suite)."""
    assert_logprobs_equal_mlx_lm_servers(chat_pair, templated_text(chat_pair[3]), THINK, 32, {"repetition_penalty": 1.3})


@pytest.mark.skipif(os.environ.get("DFLASH_MLX_SMOLLM2") != "1", reason="downloads SmolLM2 (set DFLASH_MLX_SMOLLM2=1)")
def test_smollm2_server_logprobs_equal_mlx_lm_servers():
    """SmolLM2: the same greedy completion and chat turn, with a repetition
    penalty, from this server and from mlx-lm's own server (``python -m
    mlx_lm.server`` over the same target directory): same tokens, logprobs
    within 1e-4."""
    from pathlib import Path

    from dflash_mlx.pair import load_pair, resolve_pair

    model, tokenizer, draft, draft_dir = load_pair("smollm2")
    target, _ = resolve_pair("smollm2")
    messages = [{"role": "user", "content": "Write a short list of three tips for keeping a houseplant alive."}]
    assert_logprobs_equal_mlx_lm_servers((Path(target), draft_dir, model, tokenizer, draft),
                                         "The three most common houseplants are", messages, 96, {"repetition_penalty": 1.2})


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, True), ("0.0.0.0", KEY, False), ("127.0.0.1", None, False)])
def test_listening_beyond_loopback_without_a_key_warns(capsys, monkeypatch, host, key, warned):
    from dflash_mlx.server import listen

    monkeypatch.delenv("MLX_DFLASH_API_KEY", raising=False)
    args = setup_arg_parser().parse_args(["--host", host, "--port", "0"] + (["--api-key", key] if key else []))
    listen(args).server_close()
    err = capsys.readouterr().err
    assert (err.count("warning: listening on 0.0.0.0 without --api-key") == 1) == warned and KEY not in err


# Structured outputs: the answer held to a schema, through the DFlash loop
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}, "high": {"type": "integer", "minimum": -40, "maximum": 50}},
    "required": ["city", "sunny", "high"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # (a tiny target could pad with whitespace to max_tokens)
}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"], "additionalProperties": False}}}


def valid_weather(answer: dict) -> bool:
    """WEATHER_SCHEMA checked by hand (jsonschema is not a dependency)."""
    return (set(answer) == {"city", "sunny", "high"} and answer["city"] in ("Paris", "Rome")
            and isinstance(answer["sunny"], bool) and isinstance(answer["high"], int) and -40 <= answer["high"] <= 50)


def masked_reference_text(served, messages, form, tools=None):
    """mlx-lm's greedy text with the format's llguidance mask as a logits processor."""
    from dflash_mlx.structured import constraint_from_response_format

    _, model, tokenizer = served
    ids = tokenizer.apply_chat_template(copy.deepcopy(messages), tools=tools, add_generation_prompt=True)
    c = constraint_from_response_format(form, tokenizer)
    return reference_text(model, tokenizer, ids, MAX_TOKENS, logits_processors=[c.processor()])


def test_structured_outputs_validate_through_the_openai_client(served, oai, chat_pair):
    form = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True}}
    want = masked_reference_text(served, ASK, form)
    r = oai.chat.completions.create(model="m", messages=ASK, response_format=form, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    assert valid_weather(json.loads(want))
    assert 0 < r.usage.model_extra["dflash"]["forced_tokens"] < r.usage.completion_tokens + 1  # (the eos is one)
    chunks = list(oai.chat.completions.create(model="m", messages=ASK, response_format=form, max_tokens=MAX_TOKENS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    with live_server(chat_pair, "--tree-budget", "3") as lone:  # a request alone: generate_step's path
        alone = openai.OpenAI(base_url=lone + "/v1", api_key="x", max_retries=0, timeout=300)
        lone_answer = alone.chat.completions.create(model="m", messages=ASK, response_format=form, max_tokens=MAX_TOKENS)
        assert lone_answer.choices[0].message.content == want
        assert lone_answer.usage.model_extra["dflash"]["forced_tokens"] == r.usage.model_extra["dflash"]["forced_tokens"]

    # a strict tool, its call forced: the arguments hold to its parameters
    r = oai.chat.completions.create(model="m", messages=ASK, tools=[STRICT_WEATHER], max_tokens=MAX_TOKENS,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert r.choices[0].finish_reason == "tool_calls"

    # a forced call in the other dialects: the call the target makes unforced
    want_call = split_tool_call(reference(served, ASK, [WEATHER_TOOL])[0])
    r = oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=MAX_TOKENS)
    (call,) = r.choices[0].message.tool_calls
    assert {"name": call.function.name, "arguments": json.loads(call.function.arguments)} == want_call
    claude = anthropic.Anthropic(base_url=served[0], api_key="x", max_retries=0, timeout=300)
    m = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=ASK, tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use" and (m.content[-1].name, m.content[-1].input) == (want_call["name"], want_call["arguments"])
    r = oai.responses.create(model="m", input=ASK[0]["content"], tools=[RESPONSES_TOOL], tool_choice="required", max_output_tokens=MAX_TOKENS)
    (item,) = r.output
    assert item.type == "function_call" and (item.name, json.loads(item.arguments)) == (want_call["name"], want_call["arguments"])

    # Responses' text.format, the same answer
    r = oai.responses.create(model="m", input=ASK[0]["content"], max_output_tokens=MAX_TOKENS,
                             text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}})
    assert r.output_text == want


# SmolLM2 held to the JSON-extraction set's schemas, through the library and the openai client.
SMOLLM2_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You call functions. A call is <tool_call>
{"name": <the function's name>, "arguments": <its arguments as a JSON object>}
</tool_call>
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0]['role'] != 'system' %}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}
{% if message.tool_calls %}{% for tool_call in message.tool_calls %}<tool_call>
{"name": "{{ tool_call.name if tool_call.name is defined else tool_call.function.name }}", "arguments": {{ tool_call.function.arguments }}}
</tool_call>{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def bounded(schema, items: int = 4, length: int = 96, most: int = 10**9):
    """``schema`` with every array held to ``items`` items, every free
    string to ``length`` characters and every number to ``most``, where it
    sets no bound: SmolLM2 repeats an array's item, a phrase or a digit
    without end (the structured bench's answers cut at 256 tokens), and
    bounds are how a user keeps a small model's answer finite. An answer
    valid here is valid under ``schema``."""
    if isinstance(schema, list):
        return [bounded(s, items, length, most) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v, items, length, most) for k, v in schema.items()}
    if out.get("type") == "array":
        out.setdefault("maxItems", items)
    if out.get("type") == "string" and not {"enum", "const", "pattern", "format"} & set(out):
        out.setdefault("maxLength", length)
    if out.get("type") in ("number", "integer"):
        out.setdefault("maximum", most)
    return out


@pytest.mark.skipif(os.environ.get("DFLASH_MLX_SMOLLM2") != "1", reason="downloads SmolLM2 (set DFLASH_MLX_SMOLLM2=1)")
def test_smollm2_answers_validate_through_the_library_and_the_openai_client(tmp_path):
    """Issue 60's validity on the SmolLM2 pair: each request of the
    ``json_extract`` set (nested objects, arrays, enums, bounded numbers,
    optional fields, ``additionalProperties: false``), its schema bounded
    (:func:`bounded`), answered greedily through ``stream_generate`` with
    ``response_format``, through the server with the openai client's strict
    ``json_schema``, and as a strict tool's one forced call (SmolLM2's template
    has no tools: the same weights with a template that has, as a user would
    give them): every answer ends by itself and validates; the library's and
    the server's are the same text."""
    from pathlib import Path

    import jsonschema

    from dflash_mlx import stream_generate
    from dflash_mlx.pair import load_pair, resolve_pair, structured_set

    model, tokenizer, draft, draft_dir = load_pair("smollm2")
    target = Path(resolve_pair("smollm2")[0])
    tools_dir = tmp_path / "smollm2-tools"
    tools_dir.mkdir()
    for f in target.iterdir():
        if f.name != "chat_template.jinja":
            (tools_dir / f.name).symlink_to(f)
    (tools_dir / "chat_template.jinja").write_text(SMOLLM2_TOOLS_TEMPLATE)
    tool_model, tool_tokenizer = load(str(tools_dir))
    assert tool_tokenizer.has_tool_calling
    tool_draft = dflash_mlx.load_draft(draft_dir, tool_model)
    budget = 1024
    with live_server((target, draft_dir, model, tokenizer, draft), "--max-tokens", str(budget)) as base, \
            live_server((tools_dir, draft_dir, tool_model, tool_tokenizer, tool_draft), "--max-tokens", str(budget)) as tools:
        oai = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
        tool_oai = openai.OpenAI(base_url=tools + "/v1", api_key="x", max_retries=0, timeout=600)
        for entry in structured_set("json_extract"):
            schema, messages = bounded(entry["schema"]), [{"role": "user", "content": entry["request"]}]
            form = {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": schema, "strict": True}}
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            out = list(stream_generate(model, draft, tokenizer, ids, max_tokens=budget, response_format=form))
            text = "".join(r.text for r in out)
            assert out[-1].finish_reason == "stop", (entry["name"], text)
            jsonschema.validate(json.loads(text), entry["schema"])
            jsonschema.validate(json.loads(text), schema)

            r = oai.chat.completions.create(model="m", messages=messages, response_format=form, max_tokens=budget)
            assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text, entry["name"]

            tool = {"type": "function", "function": {"name": "record", "description": "Record what the text says.",
                                                     "parameters": schema, "strict": True}}
            r = tool_oai.chat.completions.create(model="m", messages=messages, tools=[tool], max_tokens=budget, parallel_tool_calls=False,
                                                 tool_choice={"type": "function", "function": {"name": "record"}})
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name == "record" and r.choices[0].finish_reason == "tool_calls", entry["name"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
