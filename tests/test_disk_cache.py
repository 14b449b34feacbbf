"""The prompt cache's disk tier (--prompt-cache-dir): conversations served
from disk after a restart and after the memory tier evicted them, exact,
with the files bounded; damaged, stale and foreign files skipped.

Servers run in this process over tiny pairs of the three cache kinds
(attention, hybrid recurrent, Gemma-4's rotating window); the references
are mlx-lm's own greedy decodes.
"""

import json
import logging
import os
import threading
import urllib.request
from contextlib import contextmanager

import pytest
from tiny import prompt_of, reference_responses

import dflash_mlx
from dflash_mlx.cache import load_prompt_cache, save_prompt_cache
from dflash_mlx.disk_cache import SUFFIX
from dflash_mlx.errors import ArgumentError
from dflash_mlx.server import make_server, setup_arg_parser

MAX_TOKENS = 6


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5", "gemma4_text"])
def served_pair(request, make_pair, tmp_path_factory):
    """(pair, drafter dir, drafter) of each cache kind."""
    pair = make_pair(request.param)
    draft_dir = pair.make_draft(tmp_path_factory.mktemp("d") / "d", block_size=4, taps=[0, 2])
    return pair, draft_dir, dflash_mlx.load_draft(draft_dir, pair.model)


@contextmanager
def serving(served_pair, *flags):
    """A server over the pair with ``flags``; yields (post, generator)."""
    pair, draft_dir, draft = served_pair
    args = setup_arg_parser().parse_args(["--model", str(pair.path), "--port", "0", *flags])
    server = make_server(args, pair.model, pair.tokenizer, draft, str(draft_dir))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]

    def post(prompt):
        body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://{host}:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            r = json.loads(resp.read())
        return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        yield post, server.generator
    finally:
        server.shutdown()
        server.server_close()
        server.generator.stop_and_join()  # the pending writes land


def turn(pair, prompt):
    """mlx-lm's text for ``prompt`` and the conversation after it (the
    prompt and every token yielded, as the prompt cache holds it)."""
    responses = reference_responses(pair.model, pair.tokenizer, prompt, MAX_TOKENS)
    return "".join(r.text for r in responses), prompt + [r.token for r in responses]


def cache_files(folder):
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))


def test_a_restarted_server_serves_the_conversation_from_disk(served_pair, tmp_path):
    pair = served_pair[0]
    first = prompt_of(300, seed=1)
    want, held = turn(pair, first)
    second = held + prompt_of(12, seed=2)
    with serving(served_pair, "--prompt-cache-dir", str(tmp_path)) as (post, _):
        assert post(first) == (want, 0)
    assert cache_files(tmp_path)
    with serving(served_pair, "--prompt-cache-dir", str(tmp_path)) as (post, generator):
        text, cached = post(second)
        assert text == turn(pair, second)[0]
        assert cached >= 0.9 * len(second)
    assert generator.disk.nbytes == sum(p.stat().st_size for p in cache_files(tmp_path))


def test_conversations_evicted_from_memory_come_back_from_disk(served_pair, tmp_path):
    """Three conversations alternate with room for one in memory: each
    returns from disk, cached and exact, and the files stay in their bound."""
    pair = served_pair[0]
    firsts = [prompt_of(200, seed=10 + i) for i in range(3)]
    helds = [turn(pair, p)[1] for p in firsts]
    bound = 3 * 200_000 * len(pair.model.layers)  # room for the conversations' files, not for every snapshot
    flags = ["--prompt-cache-dir", str(tmp_path), "--prompt-cache-size", "1", "--prompt-cache-disk-bytes", str(bound)]
    with serving(served_pair, *flags) as (post, generator):
        for p in firsts:
            post(p)
        for i, held in enumerate(helds):
            second = held + prompt_of(8, seed=20 + i)
            generator.disk.flush()
            text, cached = post(second)
            assert text == turn(pair, second)[0] and cached >= len(held) - 1, i
        generator.disk.flush()
        assert sum(p.stat().st_size for p in cache_files(tmp_path)) <= bound


DAMAGES = ("truncated", "bit-flipped", "wrong-version", "other-pair", "not-a-cache")


def damage(path, how, other):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "bit-flipped":
        data[len(data) - 100] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "wrong-version":
        path.write_bytes(bytes(data).replace(b'"dflash_mlx_format": "1"', b'"dflash_mlx_format": "9"'))
    elif how == "other-pair":
        path.write_bytes(other.read_bytes())
    else:
        path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_files_are_skipped_with_a_warning(qwen3_pair, tmp_path, caplog, how):
    pair = qwen3_pair
    draft_dir = pair.make_draft(tmp_path / "d", block_size=4, taps=[0, 2])
    served = (pair, draft_dir, dflash_mlx.load_draft(draft_dir, pair.model))
    other_dir = pair.make_draft(tmp_path / "d2", block_size=4, taps=[0, 2], seed=5)  # another drafter: another pair
    other = (pair, other_dir, dflash_mlx.load_draft(other_dir, pair.model))
    first = prompt_of(100, seed=3)
    _, held = turn(pair, first)
    second = held + prompt_of(5, seed=4)
    with serving(other, "--prompt-cache-dir", str(tmp_path / "other")) as (post, _):
        post(first)
    with serving(served, "--prompt-cache-dir", str(tmp_path / "c")) as (post, _):
        post(first)
    for path in cache_files(tmp_path / "c"):
        damage(path, how, cache_files(tmp_path / "other")[0])
    with caplog.at_level(logging.WARNING), serving(served, "--prompt-cache-dir", str(tmp_path / "c")) as (post, _):
        assert post(second) == (turn(pair, second)[0], 0)
        assert post(second)[0] == turn(pair, second)[0]  # and it goes on serving
    assert "prompt cache file skipped" in caplog.text


def test_files_are_written_whole_and_checked(qwen3_pair, tmp_path):
    """save_prompt_cache leaves no temporary file; load_prompt_cache refuses
    a file with any byte changed, header or data, with one clear error."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    list(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, prompt_of(40), max_tokens=4, prompt_cache=cache))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), cache)
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors", "d"]
    assert load_prompt_cache(str(path), draft).tokens == cache.tokens
    data = path.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    for at in (data.index(b"tokens") + 12, header_end + 3, len(data) - 1):
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(ArgumentError, match="not a whole prompt cache file"):
            load_prompt_cache(str(path), draft)


@contextmanager
def server_process(log, *flags):
    """A server in its own process (a real restart); yields its OpenAI client."""
    import re
    import subprocess
    import sys
    import time

    import openai

    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_mlx", "server", "--port", "0", *flags],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.time() + 600
        while not (m := re.search(r"listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        yield openai.OpenAI(base_url=m.group(1) + "/v1", api_key="x", max_retries=0, timeout=1800)
    finally:
        proc.terminate()  # as Ctrl-C: the pending cache files are written first
        proc.wait(timeout=600)


def timed_chat(client, messages):
    """(answer, seconds to the first token, cached prompt tokens, prompt tokens) of a streamed greedy chat."""
    import time

    tic, first, text, usage = time.perf_counter(), None, "", None
    for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=64, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - tic
        text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        usage = chunk.usage or usage
    return text, first, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens


@pytest.mark.skipif(os.environ.get("DFLASH_MLX_SMOLLM2") != "1", reason="downloads SmolLM2 (set DFLASH_MLX_SMOLLM2=1)")
def test_smollm2_restart_serves_a_long_conversation_from_disk(tmp_path):
    """A 6,000-token conversation, the server restarted, the conversation
    and one more turn: read from disk, at least 90% of the prompt cached,
    the first token in at most 0.2x a cold run's time, the cold run's answer."""
    from dflash_mlx.benchmark import documentation_text
    from dflash_mlx.pair import load_pair

    tokenizer = load_pair("smollm2")[1]
    document = tokenizer.decode(tokenizer.encode(documentation_text(), add_special_tokens=False)[:5900])
    messages = [{"role": "user", "content": f"{document}\n\nWhat is this text about?"}]
    flags = ["--model", "smollm2", "--prompt-cache-dir", str(tmp_path / "cache")]
    with server_process(tmp_path / "first.log", *flags) as client:
        answer, cold_first, _, prompt_tokens = timed_chat(client, messages)
    assert prompt_tokens >= 5900
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say it in one sentence."}]
    with server_process(tmp_path / "second.log", *flags) as client:
        warm = timed_chat(client, messages)
    with server_process(tmp_path / "cold.log", "--model", "smollm2") as client:
        cold = timed_chat(client, messages)
    print(f"turn 1: ttft {cold_first:.2f}s over {prompt_tokens} tokens; after the restart: ttft {warm[1]:.2f}s, "
          f"{warm[2]} of {warm[3]} tokens cached; cold: ttft {cold[1]:.2f}s; ratio {warm[1] / cold[1]:.3f}")
    assert warm[0] == cold[0]
    assert warm[2] >= 0.9 * warm[3]
    assert warm[1] <= 0.2 * cold[1]
