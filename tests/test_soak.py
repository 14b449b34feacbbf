"""A soak of the server on loopback: concurrent clients, streamed and not,
clients that hang up mid-stream, malformed JSON, oversize prompts,
unsupported fields and shared prefixes, bounded in count.

Every well-formed request must get the text a lone run of it got (taken
before the soak, one request at a time; the completions are also checked
against mlx-lm's greedy decode), the server must stay up, and its resident
memory after the soak must stay within MEMORY_BOUND of what it was after the
warm-up. ``DFLASH_SOAK_REQUESTS`` sets the count (default 300) for a longer
run on demand.
"""

import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

REQUESTS = int(os.environ.get("DFLASH_SOAK_REQUESTS", "300"))
CLIENTS = 4
SEED = 29
# Resident memory may grow this much over the soak: the prompt cache is
# bounded (--prompt-cache-size 4) and everything else is per request.
MEMORY_BOUND = 64 << 20
MAX_TOKENS = 6


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) << 10


@pytest.fixture(scope="module")
def server(qwen3_pair, tmp_path_factory):
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads resident memory from /proc (Linux)")
    root = tmp_path_factory.mktemp("soak")
    draft = qwen3_pair.make_draft(root / "draft", block_size=4)
    log = root / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_mlx", "server", "--model", str(qwen3_pair.path), "--draft-model", str(draft),
             "--port", "0", "--max-tokens", str(MAX_TOKENS), "--prompt-cache-size", "4"],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (m := re.search(r"listening on http://([\d.]+):(\d+)", log.read_text())):
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        yield proc, (m.group(1), int(m.group(2))), log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def good_requests(rng):
    """Well-formed requests, many sharing prefixes: (kind, body)."""
    heads = [rng.randrange(3, 250, 1) for _ in range(40)]
    out = []
    for i in range(24):
        prefix = heads[: rng.choice([0, 10, 25, 40])]
        tail = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 12))]
        out.append(("completion", {"prompt": prefix + tail, "max_tokens": rng.randrange(1, MAX_TOKENS + 1)}))
    for i in range(8):
        text = "".join(rng.choice("abcdefgh ij\n") for _ in range(rng.randrange(4, 40)))
        messages = [{"role": "user", "content": "shared start " * 3 + text}]
        if i % 2:
            messages = [{"role": "system", "content": "be brief"}] + messages
        out.append(("chat", {"messages": messages, "max_tokens": MAX_TOKENS}))
    return out


BAD_BODIES = [
    b"{not json",
    b"",
    b"[1, 2]",
    b'{"prompt": "x", "max_tokens": "many"}',
    b'{"prompt": "x", "presence_context_size": -1}',
    b'{"prompt": "x", "logit_bias": {"99999999": 10}}',
    b'{"prompt": "x", "n": 3}',
    b'{"prompt": "x", "num_draft_tokens": 100000}',
    b'{"prompt": []}',
    json.dumps({"prompt": [5] * 5000}).encode(),  # over the 4096-token context
]


def ask(client, kind, body, stream):
    if kind == "completion":
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(model="m", stream=True, temperature=0, **body))
        return client.completions.create(model="m", temperature=0, **body).choices[0].text
    if stream:
        chunks = client.chat.completions.create(model="m", stream=True, temperature=0, **body)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(model="m", temperature=0, **body).choices[0].message.content


def post_raw(address, body: bytes):
    conn = http.client.HTTPConnection(*address, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def hang_up_mid_stream(address, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 200, "stream": True}).encode()
    with socket.create_connection(address, timeout=120) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        seen = b""
        while b"data: " not in seen:
            chunk = sock.recv(4096)
            assert chunk, "the server closed before streaming"
            seen += chunk


def test_soak(server, qwen3_pair):
    proc, address, log = server
    client = openai.OpenAI(base_url=f"http://{address[0]}:{address[1]}/v1", api_key="x", max_retries=0, timeout=300)
    rng = random.Random(SEED)
    good = good_requests(rng)
    # Warm-up: each good request alone, its text the reference.
    alone = [ask(client, kind, body, stream=False) for kind, body in good]
    for (kind, body), text in zip(good, alone):
        if kind == "completion":
            want = qwen3_pair.tokenizer.decode(qwen3_pair.reference(body["prompt"], body["max_tokens"]))
            assert text == want
    memory_warm = rss(proc.pid)

    plan = []
    for i in range(REQUESTS):
        r = rng.random()
        if r < 0.6:
            plan.append(("good", rng.randrange(len(good)), rng.random() < 0.5))
        elif r < 0.75:
            plan.append(("hang-up", rng.randrange(len(good)), None))
        else:
            plan.append(("bad", rng.randrange(len(BAD_BODIES)), None))
    counts = {"good": 0, "streamed": 0, "hang-up": 0, "bad": 0}
    failures, lock = [], threading.Lock()
    jobs = iter(enumerate(plan))

    def client_thread():
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            _, (what, k, stream) = job
            try:
                if what == "good":
                    kind, body = good[k]
                    text = ask(client, kind, body, stream)
                    if text != alone[k]:
                        raise AssertionError(f"request {k} ({kind}, stream={stream}): {text!r} != alone {alone[k]!r}")
                    with lock:
                        counts["good"] += 1
                        counts["streamed"] += stream
                elif what == "hang-up":
                    hang_up_mid_stream(address, [t for t in good[k][1].get("prompt", [7, 8, 9])])
                    with lock:
                        counts["hang-up"] += 1
                else:
                    status, raw = post_raw(address, BAD_BODIES[k])
                    if not (400 <= status < 500 and json.loads(raw)["error"]):
                        raise AssertionError(f"bad body {BAD_BODIES[k][:40]!r}: {status} {raw[:200]!r}")
                    with lock:
                        counts["bad"] += 1
            except Exception as e:  # collected, reported together
                with lock:
                    failures.append(repr(e))

    tic = time.perf_counter()
    threads = [threading.Thread(target=client_thread) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - tic
    assert failures == [], failures[:5]
    assert proc.poll() is None and client.with_options(max_retries=0).models.list().data
    # Each good request once more, alone: still its text (the cache is not corrupted).
    assert [ask(client, kind, body, stream=False) for kind, body in good] == alone
    memory_after = rss(proc.pid)
    print(
        f"soak (seed {SEED}): {REQUESTS} requests from {CLIENTS} clients in {seconds:.0f} s: {counts}; "
        f"resident memory {memory_warm >> 20} MiB after warm-up, {memory_after >> 20} MiB after the soak"
    )
    assert memory_after <= memory_warm + MEMORY_BOUND
    assert counts["good"] + counts["hang-up"] + counts["bad"] == REQUESTS
