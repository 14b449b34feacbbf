"""mlx-dflash server, driven by the official openai client on a free port.

One server (the bundled hybrid pair) serves every test of the module; the
references are mlx-lm's own greedy decodes in this process.
"""

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
from mlx_lm.server import convert_chat
from tiny import reference_responses, reference_text

import dflash_mlx
from dflash_mlx.defaults import MAX_BLOCK_SIZE
from dflash_mlx.pair import DEFAULT_TARGET, default_prompts


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_mlx", "server", "--port", "0", "--prefill-step-size", "512", "--max-tokens", "32"],
            stdout=subprocess.DEVNULL, stderr=err,
        )
    try:
        deadline = time.time() + 120
        while not (m := re.search(r"listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        yield m.group(1), log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="not-needed", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def bundled():
    return dflash_mlx.load(str(DEFAULT_TARGET))


def mlx_lm_text(bundled, prompt, max_tokens):
    return reference_text(*bundled, prompt, max_tokens)


def test_completion_equals_mlx_lm_and_reports_dflash_usage(client, bundled):
    prompt = default_prompts()[1]
    r = client.completions.create(model="default", prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"num_draft_tokens": 15})  # the trained block, fixed
    assert r.choices[0].text == mlx_lm_text(bundled, prompt, 40)
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    stats = r.usage.model_extra["dflash"]
    sizes = {int(b): k for b, k in stats["block_sizes"].items()}
    assert max(sizes) == 16 and sum(sizes.values()) == stats["cycles"] and stats["tokens_per_cycle"] > 1.5
    assert stats["cycles"] + stats["accepted_draft_tokens"] == 40 - 1


def test_num_draft_tokens_fixes_the_block(client, bundled):
    """The server is adaptive unless a request (or --block-size) fixes the block."""
    prompt = default_prompts()[2]
    r = client.completions.create(model="default", prompt=prompt, max_tokens=30, temperature=0)
    assert r.choices[0].text == mlx_lm_text(bundled, prompt, 30)
    stats = r.usage.model_extra["dflash"]
    # the drafter's blocks are 16 at most; a span copied from the context may verify more (its
    # tokens are verified whether or not they are accepted), never past the loop's largest block
    assert max(int(b) for b in stats["block_sizes"]) <= MAX_BLOCK_SIZE
    assert sum(stats["block_sizes"].values()) + sum(stats["tree_sizes"].values()) == stats["cycles"]
    r = client.completions.create(model="default", prompt=prompt, max_tokens=30, temperature=0,
                                  extra_body={"num_draft_tokens": 3})
    assert r.choices[0].text == mlx_lm_text(bundled, prompt, 30)
    sizes = {int(b): k for b, k in r.usage.model_extra["dflash"]["block_sizes"].items()}
    assert max(sizes) == 4 and sizes[4] >= sum(sizes.values()) - 3  # only the last cycles cut to the tokens left
    assert r.usage.model_extra["dflash"]["tree_sizes"] == {}  # num_draft_tokens fixes a chain


def test_chat_stream_deltas_concatenate_to_mlx_lm_text(client, bundled):
    messages = [{"role": "user", "content": "Write a function that parses a date."}]
    want = mlx_lm_text(bundled, bundled[1].encode(convert_chat(messages)), 24)
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=24)
    assert whole.choices[0].message.content == want
    chunks = list(client.chat.completions.create(
        model="default", messages=messages, max_tokens=24, stream=True, stream_options={"include_usage": True},
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert usage.completion_tokens == 24 and usage.prompt_tokens_details.cached_tokens > 0


def test_two_clients_at_once_are_both_exact(client, bundled):
    prompts = default_prompts()[2:4]
    got = {}

    def ask(p):
        got[p] = client.completions.create(model="default", prompt=p, max_tokens=30).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[p] for p in prompts] == [mlx_lm_text(bundled, p, 30) for p in prompts]


def test_long_prefix_is_reused_and_still_exact(server, client, bundled):
    first = "\n".join(default_prompts()) + "\n"
    second = first + "# the next function\ndef"
    tokenizer = bundled[1]
    n_first = len(tokenizer.encode(first))
    assert n_first > 2000 and tokenizer.encode(second)[:n_first] == tokenizer.encode(first)
    # the first request streams raw, to see the keep-alives of its long prefill
    host, port = server[0].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": first, "max_tokens": 4, "stream": True}),
                 {"Content-Type": "application/json"})
    raw = conn.getresponse().read().decode()
    assert raw.count(": keepalive") >= 4 and raw.rstrip().endswith("data: [DONE]")
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(r=client.completions.create(model="default", prompt=second, max_tokens=12)))
    thread.start()
    want = mlx_lm_text(bundled, second, 12)  # computed while the server answers
    thread.join()
    r = answer["r"]
    assert r.usage.prompt_tokens_details.cached_tokens >= 0.8 * n_first
    assert r.choices[0].text == want


def post(server, path, body: bytes):
    req = urllib.request.Request(server[0] + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/chat/completions", b'{"max_tokens": 5}', "messages"),
        ("/v1/completions", b'{"prompt": ""}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "temperature": -1}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 2}', "top_p"),
        ("/v1/completions", b'{"prompt": "x", "presence_context_size": -1}', "presence_context_size"),
        ("/v1/completions", b'{"prompt": "x", "logit_bias": {"99999999": 1}}', "logit_bias"),
        ("/v1/completions", b'{"prompt": "x", "top_logprobs": 12}', "top_logprobs"),
        ("/v1/completions", json.dumps({"prompt": "def f():\n    pass\n" * 1200}).encode(), "prompt"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client, path, body, param):
    status, answer = post(server, path, body)
    assert 400 <= status < 500
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    assert answer["error"]["param"] == param
    assert client.completions.create(model="default", prompt="import os\n", max_tokens=3).usage.completion_tokens == 3


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="default", prompt="x", max_tokens=-5)


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [str(DEFAULT_TARGET)]
    assert models[0].model_extra["draft_model"].endswith("draft")
    with urllib.request.urlopen(server[0] + "/health", timeout=30) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}


def test_generation_stops_when_the_client_disconnects(server, client):
    host, port = server[0].removeprefix("http://").split(":")
    body = json.dumps({"prompt": "class A:\n", "max_tokens": 3000, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=300) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        seen = b""
        while b"data: " not in seen:  # until the first token is out
            seen += sock.recv(4096)
    deadline = time.time() + 120
    while not (m := re.search(r"stopped by the client after (\d+) tokens", server[1].read_text())):
        assert time.time() < deadline
        time.sleep(0.2)
    assert int(m.group(1)) < 3000
    assert client.completions.create(model="default", prompt="x = ", max_tokens=2).usage.completion_tokens == 2


def test_stop_words_end_the_text(client, bundled):
    model, tokenizer = bundled
    prompt = default_prompts()[1]
    tokens = [r.token for r in reference_responses(model, tokenizer, prompt, 30)]
    stop = tokenizer.decode(tokens[8:10])
    assert tokenizer.encode(stop) == tokens[8:10]
    r = client.completions.create(model="default", prompt=prompt, max_tokens=30, stop=[stop])
    text = tokenizer.decode(tokens[:8])  # what came before the stop word
    want = text[: text.find(stop)] if stop in text else text
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


HEAD = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]  # a chat's first turn


def exact_chat(client, model, tokenizer, messages):
    """One chat turn through the server, checked against mlx-lm's greedy
    decode of the templated conversation: (answer, cached prompt tokens)."""
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert r.choices[0].message.content == reference_text(model, tokenizer, ids, 8)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_hybrid_snapshots_at_message_boundaries(qwen3_5_pair, tmp_path):
    """A hybrid cache cannot trim: an edited last message reuses the snapshot
    taken where the previous message ended, and the answer stays exact."""
    from mlx_lm import load

    from dflash_mlx.server import make_server, setup_arg_parser

    model, tokenizer = load(str(qwen3_5_pair.path))
    draft_dir = qwen3_5_pair.make_draft(tmp_path / "draft", block_size=4)
    draft = dflash_mlx.load_draft(draft_dir, model)
    args = setup_arg_parser().parse_args(["--model", str(qwen3_5_pair.path), "--port", "0", "--chat-template", TEMPLATE])
    server = make_server(args, model, tokenizer, draft, str(draft_dir))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0, timeout=300)

        def chat(messages):
            return exact_chat(client, model, tokenizer, messages)

        first, cached = chat(HEAD)
        assert cached == 0
        head = HEAD + [{"role": "assistant", "content": first}]
        _, cached = chat(head + [{"role": "user", "content": "and g?"}])
        assert cached >= len(tokenizer.apply_chat_template(head[:2], add_generation_prompt=True))
        _, cached = chat(head + [{"role": "user", "content": "or h?"}])
        assert cached == len(tokenizer.apply_chat_template(head, add_generation_prompt=False))
    finally:
        server.shutdown()
        server.server_close()
        server.generator.stop_and_join()


def disconnecting_client(base: str, prompt: str, after_chunks: int = 3) -> None:
    """A streaming completion whose client goes away after a few chunks."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"prompt": prompt, "max_tokens": 3000, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=300) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        seen = b""
        while seen.count(b"data: ") < after_chunks:
            seen += sock.recv(4096)


@pytest.mark.parametrize("concurrency", [1, 2, 4, 8])
def test_concurrent_requests_are_each_exact(server, client, bundled, concurrency):
    """``concurrency`` requests at once, decoded in one batch: prompts of
    different lengths, two sharing a prefix, staggered arrivals, their own
    max_tokens and stop strings, and (from 4 on) a client that disconnects
    mid-stream. Every answer is mlx-lm's own greedy text for its prompt."""
    model, tokenizer = bundled
    base = default_prompts()
    prompts = [base[i % len(base)][: 40 + 37 * i] for i in range(concurrency)]
    if concurrency > 1:
        prompts[1] = prompts[0] + "\n    # shared prefix, then more\n"
    limits = [48 + 7 * i for i in range(concurrency)]  # long enough that the requests overlap
    stops = [None] * concurrency
    if concurrency > 2:  # a stop string from the reference's own tokens, one the tokenizer reads back
        tokens = [r.token for r in reference_responses(model, tokenizer, prompts[2], limits[2])]
        at = next(i for i in range(4, len(tokens) - 2) if tokenizer.encode(tokenizer.decode(tokens[i : i + 2])) == tokens[i : i + 2])
        stops[2] = tokenizer.decode(tokens[at : at + 2])
    got, before = {}, batched_cycles(server[0])

    def ask(i):
        time.sleep(0.01 * i)  # staggered: later requests join a running batch
        kw = {} if stops[i] is None else {"stop": [stops[i]]}
        got[i] = client.completions.create(model="default", prompt=prompts[i], max_tokens=limits[i], temperature=0, **kw)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(concurrency)]
    if concurrency >= 4:
        threads.append(threading.Thread(target=disconnecting_client, args=(server[0], base[0])))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(concurrency):
        want = mlx_lm_text(bundled, prompts[i], limits[i])
        if stops[i] is not None:
            assert got[i].choices[0].finish_reason == "stop"
            want = want[: want.find(stops[i])]
        assert got[i].choices[0].text == want, i
    if concurrency > 1:  # some cycles verified several requests together
        assert batched_cycles(server[0]) > before
    assert client.completions.create(model="default", prompt="x = ", max_tokens=2).usage.completion_tokens == 2


def batched_cycles(base: str) -> float:
    """Cycles that verified two requests or more, from /metrics."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = re.findall(r'^dflash_batch_cycles_total\{batch_size="(\d+)"\} (\S+)$', text, re.M)
    return sum(float(n) for b, n in found if int(b) >= 2)
