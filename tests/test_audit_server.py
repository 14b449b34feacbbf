"""An adversarial audit of the server's dialects and the command lines:
each test is a bug found once (a 500 or a traceback where a clear 4xx or
one ``error:`` line belongs, a bad value taken), fixed or marked.

The server is tests/test_agent_server.py's live one over the tiny chat pair.
"""

import http.client
import json
import threading
import time
from contextlib import contextmanager

import pytest
from test_agent_server import chat_pair  # noqa: F401 (the module's fixture)
from test_cli import assert_one_error_line, run_here  # noqa: F401 (the module's fixture)
from tiny_chat import ASK, CALLED, RESULT, WEATHER_TOOL

from dflash_mlx.api import messages, responses
from dflash_mlx.api.turn import Turn
from dflash_mlx.errors import RequestError
from dflash_mlx.server import make_server, prepare, setup_arg_parser
from dflash_mlx.api.harmony import text_format


@contextmanager
def live_server(chat_pair, *flags):  # noqa: F811
    """(base URL, server) of a server over the chat pair, run with ``flags``."""
    target, draft_dir, model, tokenizer, draft = chat_pair
    server = make_server(setup_arg_parser().parse_args(["--model", str(target), "--port", "0", *flags]),
                         model, tokenizer, draft, str(draft_dir))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    try:
        yield f"http://{host}:{port}", server
    finally:
        server.shutdown()
        server.server_close()
        server.generator.stop_and_join()


@pytest.fixture(scope="module")
def served(chat_pair):  # noqa: F811
    with live_server(chat_pair, "--max-tokens", "24") as both:
        yield both


@pytest.fixture(scope="module")
def base(served):
    return served[0]


def post(base: str, path: str, body: dict):
    """(status, body text) of a POST."""
    host, port = base.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read().decode()


def events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]


CHAT = {"messages": ASK + [CALLED, RESULT], "tools": [WEATHER_TOOL]}


def test_stream_options_without_include_usage_streams_the_answer(base):
    """OpenAI's stream_options may leave include_usage out (false): mlx-lm's
    handler read it as a key and failed with a KeyError after the whole
    answer was decoded (an error event in a 200 stream). A stream_options
    that is no object is a 400 before any work."""
    status, whole = post(base, "/v1/chat/completions", CHAT)
    assert status == 200
    want = json.loads(whole)["choices"][0]["message"]["content"]
    status, text = post(base, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {}})
    chunks = events(text)
    assert status == 200 and text.rstrip().endswith("data: [DONE]") and not any("error" in c for c in chunks), text
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == want
    assert not any("usage" in c and not c["choices"] for c in chunks)  # include_usage: false
    for bad in ("yes", {"include_usage": "yes"}, [True]):
        status, text = post(base, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": bad})
        assert status == 400 and json.loads(text)["error"]["param"] == "stream_options", text
    status, text = post(base, "/v1/chat/completions", CHAT)  # the server goes on, alike
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == want


@pytest.mark.parametrize("field, value", [("model", 5), ("adapters", "some/lora"), ("adapters", 5)])
def test_fields_mlx_lm_checks_get_openai_errors(base, field, value):
    """``model`` and ``adapters`` were left to mlx-lm's handler, whose 400 is
    ``{"error": "..."}`` (not OpenAI's shape), and a string ``adapters``
    (which mlx-lm's server loads) was ignored: the answer came from another model."""
    status, text = post(base, "/v1/chat/completions", {**CHAT, field: value})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"


def test_whole_number_xtc_settings_are_honoured(base):
    """``xtc_probability: 0`` (a JSON integer) passed dflash_mlx's checks but
    mlx-lm's handler refused every non-float with a non-OpenAI 400."""
    status, plain = post(base, "/v1/chat/completions", CHAT)
    status, text = post(base, "/v1/chat/completions", {**CHAT, "xtc_probability": 0, "xtc_threshold": 0})
    assert status == 200, text
    assert json.loads(text)["choices"] == json.loads(plain)["choices"]


# An answer the grammar holds to 1500 letters at least: a long generation from the tiny target.
LONG = {"type": "object", "properties": {"a": {"type": "string", "minLength": 1500, "pattern": "^[a-z]*$"}},
        "required": ["a"], "additionalProperties": False}


class GoneClient:
    """A streaming client that left once the request was read: every write fails."""

    def __init__(self, generator):
        self.generator, self.wfile = generator, self

    def start_events(self):
        pass

    def write(self, data):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


@pytest.mark.parametrize("endpoint, to_chat, body", [
    (responses.ResponsesEndpoint, lambda b: responses.to_chat(b, [])[0],
     {"input": "zz", "max_output_tokens": 3000, "stream": True,
      "text": {"format": {"type": "json_schema", "name": "long", "schema": LONG}}}),
    (messages.MessagesEndpoint, messages.to_chat,
     {"model": "m", "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": "zz"}],
      "output_config": {"format": {"type": "json_schema", "schema": LONG}}}),
])
def test_a_client_gone_before_the_first_event_stops_its_generation(served, endpoint, to_chat, body):
    """A streaming client gone before the first event (response.created,
    message_start) was written: that write was outside the guard that stops
    the turn, so the whole answer was decoded for no one, holding a batch slot."""
    base, server = served
    generator = server.generator

    def generated_when_idle() -> int:
        deadline = time.time() + 120
        while generator.serving or generator.queued() or generator.busy:
            assert time.time() < deadline
            time.sleep(0.05)
        return generator.metrics.totals["generated_tokens"]

    before = generated_when_idle()
    turn = Turn(generator, to_chat(body))
    endpoint(GoneClient(generator)).stream(turn, {"id": "x", "model": "m", "output": [], "content": []})
    assert turn.ctx.stopped
    assert generated_when_idle() - before < 100
    status, text = post(base, "/v1/chat/completions", CHAT)  # the server goes on
    assert status == 200


def test_context_check_reads_max_completion_tokens_first(chat_pair):  # noqa: F811
    """mlx-lm's server decodes ``max_completion_tokens`` when both are given;
    the context check read ``max_tokens``, so a request asking past the
    context passed it."""
    _, _, model, tokenizer, draft = chat_pair
    context = model.args.max_position_embeddings
    body = {"messages": ASK, "max_tokens": 1, "max_completion_tokens": context}
    with pytest.raises(RequestError) as e:
        prepare(tokenizer, draft.target, body, "chat", None, {}, text_format(tokenizer))
    assert e.value.param == "max_tokens"
    prepare(tokenizer, draft.target, {**body, "max_tokens": context, "max_completion_tokens": 1}, "chat", None, {},
            text_format(tokenizer))


@pytest.mark.parametrize("command", ["generate", "chat", "server"])
@pytest.mark.parametrize("args, needle", [
    (["--temp", "-1"], "--temp"), (["--temp", "nan"], "--temp"), (["--top-p", "2"], "--top-p"),
    (["--min-p", "1.5"], "--min-p"), (["--top-k", "-3"], "--top-k"),
])
def test_sampling_flags_refuse_bad_values_in_one_line(run_here, command, args, needle):  # noqa: F811
    """``--temp -1``/``nan``, ``--top-p 2`` were taken: generate sampled from
    them, and the server used them as every request's defaults, past the
    checks a request's own fields meet."""
    assert_one_error_line(run_here(f"dflash_mlx.{command}", *args, "--model", "/nonexistent"), needle)


def test_bench_temp_refuses_a_negative_value(run_here):  # noqa: F811
    assert_one_error_line(run_here("dflash_mlx.benchmark", "--temp", "-0.5", "--model", "/nonexistent"), "--temp")


def test_server_chat_template_args_must_be_an_object(run_here):  # noqa: F811
    """``--chat-template-args '[1]'`` was taken (json.loads), and every chat
    request then failed with a 500 (a list spread as keywords)."""
    assert_one_error_line(run_here("dflash_mlx.server", "--chat-template-args", "[1]", "--model", "/nonexistent"), "--chat-template-args", "object")
    assert setup_arg_parser().parse_args(["--chat-template-args", '{"enable_thinking": false}']).chat_template_args == {
        "enable_thinking": False}


def test_chat_seed_out_of_range_is_one_line(run_here):  # noqa: F811
    """``--seed -1`` reached mx.random.seed: a TypeError traceback."""
    assert_one_error_line(run_here("dflash_mlx.chat", "--seed", "-1", "--model", "/nonexistent"), "--seed")


def test_generate_seed_out_of_range_is_one_line(run_here, chat_pair):  # noqa: F811
    target, draft_dir = chat_pair[:2]
    done = run_here("dflash_mlx.generate", "--model", str(target), "--draft-model", str(draft_dir), "--prompt", "hi",
                    "--seed", "-1", "--max-tokens", "2")
    assert_one_error_line(done, "--seed")


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_convert_shard_size_is_a_positive_finite_number(run_here, value):  # noqa: F811
    """``--max-shard-size inf`` was an OverflowError traceback, ``nan`` an
    error naming no flag (``cannot convert float NaN to integer``)."""
    assert_one_error_line(run_here("dflash_mlx.convert", "--hf-path", "/nonexistent", "--mlx-path", "/tmp/unused",
                                   "--max-shard-size", value), "--max-shard-size")


@pytest.mark.parametrize("args, needle", [
    (["--learning-rate", "nan"], "--learning-rate"), (["--learning-rate", "-1"], "--learning-rate"),
    (["--gamma", "nan"], "--gamma"), (["--weight-decay", "nan"], "--weight-decay"), (["--grad-clip", "-1"], "--grad-clip"),
    (["--max-minutes", "nan"], "--max-minutes"), (["--warmup", "-1"], "--warmup"), (["--seed", "-1"], "--seed"),
])
def test_train_numbers_are_checked_before_any_work(run_here, tmp_path, args, needle):  # noqa: F811
    """A NaN learning rate or gamma trained and saved a NaN drafter (exit 0);
    --seed -1 was a traceback; --grad-clip -1 failed only once training ran."""
    data = tmp_path / "d.txt"
    data.write_text("hello world")
    out = tmp_path / "out"
    done = run_here("dflash_mlx.train", "--model", str(tmp_path), "--draft-model", str(out), "--data", str(data), *args)
    assert_one_error_line(done, needle)
    assert not out.exists()


@pytest.mark.parametrize("value", [0, 1 << 40, "many"])
def test_responses_errors_name_max_output_tokens(base, value):
    """A bad ``max_output_tokens`` was refused as ``max_tokens`` (param and
    message), a field the Responses client never sent."""
    status, text = post(base, "/v1/responses", {"input": "Paris?", "max_output_tokens": value})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "max_output_tokens", text
    assert "max_output_tokens" in error["message"] and "max_tokens" not in error["message"].replace("max_output_tokens", "")


def clients(base: str):
    """(openai, anthropic) clients of the server at ``base``."""
    import anthropic
    import openai

    return (openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120))


@pytest.mark.parametrize("form", [
    {"type": "json_schema", "name": "a", "schema": {"type": "strin"}},  # llguidance refuses the schema
    {"type": "xml"},
    {"type": "json_schema", "name": "a"},  # no schema
])
def test_responses_format_errors_name_text_format(base, form):
    """A bad ``text.format`` was refused as ``response_format`` (param and
    message), the chat-completions field a Responses client never sent."""
    import openai

    oai, _ = clients(base)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", input="Paris?", max_output_tokens=4, text={"format": form})
    assert e.value.param == "text.format", e.value.body
    assert "text.format" in e.value.message and "response_format" not in e.value.message


@pytest.mark.parametrize("field, extra", [
    ("output_config.format", {"output_config": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}}),
    ("output_config.format", {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
                              "tool_choice": {"type": "any"}}),  # a forced call beside it
    ("output_format", {"output_format": {"type": "json_schema", "schema": {"type": "strin"}}}),  # the beta field
    ("output_format", {"output_format": {"type": "json_schema"}}),  # no schema
])
def test_messages_format_errors_name_the_field_sent(base, field, extra):
    """A bad Messages output format was refused as ``response_format``;
    the error names the field the Anthropic client sent."""
    import anthropic

    _, claude = clients(base)
    tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=4, messages=ASK, tools=tools, extra_body=extra)
    message = e.value.body["error"]["message"]
    assert field in message and "response_format" not in message, message


def raw_request(base: str, head: bytes, wait: float) -> bytes:
    """What the server sends on a connection that sends ``head`` and then
    nothing, read until it closes (b"" if it says nothing in ``wait`` s)."""
    import socket

    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(head)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            return b"" if not got else got + b"<still open>"
        return got + b"<closed>"


def test_a_body_shorter_than_its_content_length_is_refused_after_the_read_timeout(chat_pair):  # noqa: F811
    """A Content-Length past the body held a handler thread forever (the
    read waited for bytes that never came). With the server's read timeout
    (set short on this instance) the client hears a 408 and the connection
    closes; a client silent before its headers is closed too; a slow client
    that keeps sending, and a stream after it, are served."""
    with live_server(chat_pair, "--max-tokens", "8") as (base, server):
        server.read_timeout = 0.5
        body = json.dumps({"messages": ASK, "max_tokens": 4}).encode()
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body) + 50}\r\n\r\n".encode()
            answer = raw_request(base, head + body, wait=10)
            assert answer.startswith(b"HTTP/1.") and b" 408 " in answer.split(b"\r\n")[0], (path, answer)
            assert answer.endswith(b"<closed>") and b"Content-Length of" in answer, answer
        assert raw_request(base, b"POST /v1/chat/com", wait=10) == b"<closed>"
        # an honest client, pausing under the bound between its pieces, streaming its answer
        import socket

        host, port = base.removeprefix("http://").split(":")
        streamed = json.dumps({"messages": ASK, "max_tokens": 4, "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(streamed)}\r\n\r\n".encode())
            for piece in (streamed[:10], streamed[10:]):
                time.sleep(0.3)
                s.sendall(piece)
            got = b""
            while b"data: [DONE]" not in got and (chunk := s.recv(65536)):
                got += chunk
        assert got.startswith(b"HTTP/1.") and b" 200 " in got.split(b"\r\n")[0] and b"data: [DONE]" in got, got


def test_responses_function_tools_are_strict_unless_they_say_strict_false(base):
    """A Responses function tool that leaves ``strict`` out is strict (the
    Responses API's default, unlike chat completions'): its call is held to
    its schema (the grammar forces tokens of the call); ``strict: false``
    leaves it free. Both make the call the target makes."""
    oai, _ = clients(base)
    tool = {"type": "function", "name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    forced = {}
    for strict in (None, False):
        r = oai.responses.create(model="m", input=ASK[0]["content"], max_output_tokens=96,
                                 tools=[tool if strict is None else dict(tool, strict=strict)])
        (item,) = r.output
        assert item.type == "function_call" and item.name == "get_weather", r.output
        assert json.loads(item.arguments) == json.loads(CALLED["tool_calls"][0]["function"]["arguments"])
        forced[strict] = r.usage.model_extra["dflash"]["forced_tokens"]
    assert forced[None] > 0 and forced[False] == 0, forced


def test_strict_by_default_tools_stay_free_where_the_model_cannot_hold_calls(chat_pair):  # noqa: F811
    """Where the model writes calls in a format other than json_tools (so
    none can be held), a Responses tool strict only by the API's default is
    left free, as before (Codex's requests go on); an explicit strict: true
    is still refused there."""
    from types import SimpleNamespace

    from dflash_mlx.api.formats import request_format

    tokenizer = chat_pair[3]
    other = SimpleNamespace(tool_parser=None)  # a model whose calls json_tools does not read
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    chat, _ = responses.to_chat({"input": "Paris?", "tools": [tool]}, [])
    assert request_format(chat, tokenizer, other) is None
    assert request_format(chat, tokenizer, text_format(tokenizer))["type"] == "grammar"  # (json_tools: held)
    chat, _ = responses.to_chat({"input": "Paris?", "tools": [dict(tool, strict=True)]}, [])
    with pytest.raises(RequestError, match="json_tools"):
        request_format(chat, tokenizer, other)
