"""gpt-oss's harmony format through the server: reasoning (the analysis
channel) and the answer (the final channel) split, tool calls (commentary
to=functions.NAME) structured, on chat completions, Anthropic Messages and
OpenAI Responses, with the official clients.

The target is tests/tiny_chat.py's harmony one: a tiny gpt-oss trained in
the module's setup to answer its scripted conversations greedily. The
references are mlx-lm's own greedy decodes of the same templated prompts.
"""

import json

import pytest
from mlx_lm import load
from test_agent_server import (
    ANTHROPIC_TOOL, MAX_TOKENS, RESPONSES_TOOL, assert_reasoning_split, live_server, reference,
)
from tiny_chat import ASK, HARMONY_CHAT, THINK, WEATHER_TOOL, make_chat_draft, make_chat_target

import dflash_mlx
from dflash_mlx.api.harmony import HarmonyFormat, parse_tool_call, text_format


@pytest.fixture(scope="module")
def harmony_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony")
    target = make_chat_target(root, chat=HARMONY_CHAT, max_steps=800)
    draft_dir = make_chat_draft(root, target, chat=HARMONY_CHAT)
    model, tokenizer = load(str(target))
    return target, draft_dir, model, tokenizer, dflash_mlx.load_draft(draft_dir, model)


@pytest.fixture(scope="module")
def served(harmony_pair):
    with live_server(harmony_pair, "--max-tokens", str(MAX_TOKENS)) as base:
        yield base, harmony_pair[2], harmony_pair[3]


@pytest.fixture(scope="module")
def clients(served):
    import anthropic
    import openai

    return (openai.OpenAI(base_url=served[0] + "/v1", api_key="not-needed", max_retries=0, timeout=300),
            anthropic.Anthropic(base_url=served[0], api_key="not-needed", max_retries=0, timeout=300))


def channels(raw: str):
    """(reasoning, answer) of mlx-lm's raw harmony text, read by hand."""
    head, _, rest = raw.partition("<|channel|>analysis<|message|>")
    reasoning, _, rest = rest.partition("<|end|><|start|>assistant<|channel|>final<|message|>")
    assert head == "" and reasoning and rest, raw
    return reasoning, rest


def test_the_harmony_format_is_chosen_by_the_vocabulary(harmony_pair, qwen3_pair):
    assert text_format(harmony_pair[3]) is HarmonyFormat
    assert text_format(qwen3_pair.tokenizer) is qwen3_pair.tokenizer  # mlx-lm's own handling


@pytest.mark.parametrize(
    "text",
    [
        'get_weather <|constrain|>json<|message|>{"city": "Paris"}',  # the recipient after the channel
        'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',  # in the role part
    ],
)
def test_tool_calls_parse_in_either_header_form(text):
    assert parse_tool_call(text) == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_a_truncated_call_is_refused():
    with pytest.raises(ValueError, match="not a harmony tool call"):
        parse_tool_call("get_weather <|constrain|>json")


def test_reasoning_and_answer_are_split_on_every_dialect(served, clients):
    oai, claude = clients
    raw, _ = reference(served, THINK)
    reasoning, answer = channels(raw)
    assert (reasoning, answer) == ("Add.", "5.")  # the trained answer
    assert_reasoning_split(oai, claude, reasoning, answer)


def test_tool_calls_are_structured_on_every_dialect(served, clients):
    oai, claude = clients
    raw, _ = reference(served, ASK, [WEATHER_TOOL])
    reasoning, _, call = raw.partition("<|end|><|start|>assistant<|channel|>commentary to=functions.")
    want = parse_tool_call(call)
    assert want == {"name": "get_weather", "arguments": {"city": "Paris"}}  # the trained call
    reasoning = reasoning.removeprefix("<|channel|>analysis<|message|>")

    r = oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], max_tokens=MAX_TOKENS)
    (tool_call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert r.choices[0].message.model_extra["reasoning"] == reasoning
    assert {"name": tool_call.function.name, "arguments": json.loads(tool_call.function.arguments)} == want

    m = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=ASK, tools=[ANTHROPIC_TOOL],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["thinking", "tool_use"]
    assert (m.content[1].name, m.content[1].input) == (want["name"], want["arguments"])

    r = oai.responses.create(model="m", input=ASK[0]["content"], tools=[RESPONSES_TOOL], max_output_tokens=MAX_TOKENS)
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == (want["name"], want["arguments"])
