"""Property-based fuzzing of every parser that reads user files or requests.

Each input gets one of the package's errors (a ``DFlashError``) or a 4xx
answer, never another exception, a hang or a crash, and a refused conversion
leaves nothing at its destination. Hypothesis runs with a fixed seed and no
example database, so every run draws the same inputs; ``max_examples`` bounds
each property (``DFLASH_FUZZ_EXAMPLES`` scales them all for a longer run).
"""

import copy
import http.client
import json
import os
import shutil
import struct
import threading

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tiny_gguf import MIXED, make_fixture

import dflash_mlx
from dflash_mlx.convert import convert
from dflash_mlx.errors import DFlashError

SEED = 29
SCALE = float(os.environ.get("DFLASH_FUZZ_EXAMPLES", "1"))


def fuzz(examples: int):
    """The settings every property here runs under, ``examples`` inputs each."""
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        derandomize=False,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


# JSON values of every type, including the hostile ones: huge and negative
# numbers, non-finite floats (json.dumps writes them as NaN/Infinity), empty
# and deep containers.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


def tally(seen: dict, attempt) -> None:
    """Run ``attempt``: a package error counts as "refused", success as
    "loaded"; anything else fails the property."""
    try:
        attempt()
    except DFlashError:
        seen["refused"] += 1
    else:
        seen["loaded"] += 1


def leftovers(dst):
    return [p.name for p in dst.parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}.")]


# ---------------------------------------------------------------------------
# GGUF headers and tensor tables


@pytest.fixture(scope="module")
def gguf_fixture(tmp_path_factory):
    from gguf import GGUFReader

    fx = make_fixture(tmp_path_factory.mktemp("gguf"))
    fx["bytes"] = fx["f32"].read_bytes()
    fx["header_end"] = GGUFReader(fx["f32"]).data_offset  # header, metadata, tensor table
    return fx


def gguf_mutation(header_end: int, size: int):
    """Truncations anywhere, byte flips and hostile 64-bit counts, lengths
    and offsets in the header and tensor table."""
    flip = st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, header_end - 1), st.integers(0, 255)), min_size=1, max_size=4))
    word = st.tuples(
        st.just("u64"),
        st.integers(0, (header_end - 8) // 4).map(lambda i: i * 4),
        st.sampled_from([0, 1, 7, 2**31, 2**32 + 5, 2**62, 2**63 - 1, 2**64 - 1]),
    )
    cut = st.tuples(st.just("cut"), st.integers(0, size - 1))
    return st.one_of(flip, word, cut)


def mutate(data: bytes, how) -> bytes:
    out = bytearray(data)
    if how[0] == "cut":
        return bytes(out[: how[1]])
    if how[0] == "flip":
        for pos, byte in how[1]:
            out[pos] = byte
    else:
        out[how[1] : how[1] + 8] = struct.pack("<Q", how[2])
    return bytes(out)


def test_gguf_mutations_get_package_errors_and_leave_nothing(gguf_fixture, tmp_path):
    fx = gguf_fixture
    seen = {"refused": 0, "converted": 0}

    @fuzz(40)
    @seed(SEED)
    @given(gguf_mutation(fx["header_end"], len(fx["bytes"])))
    def check(how):
        src, dst = tmp_path / "bad.gguf", tmp_path / "out"
        src.write_bytes(mutate(fx["bytes"], how))
        try:
            convert(str(src), str(dst), kind="gguf", dtype="float32")
        except DFlashError:
            seen["refused"] += 1
            assert leftovers(dst) == []
        else:  # a flip that changes nothing the importer reads (a name's letter, say)
            seen["converted"] += 1
            shutil.rmtree(dst)

    check()
    print(f"seed {SEED}: {seen}")
    assert seen["refused"] > seen["converted"]


# ---------------------------------------------------------------------------
# Tokenizers rebuilt from GGUF metadata

TOKENIZER_KEYS = [
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
]  # fmt: skip


def tokenizer_edit(md: dict):
    """Replace, drop or damage one tokenizer key (lists get edited items)."""
    key = st.sampled_from(TOKENIZER_KEYS)
    replace = st.tuples(st.just("set"), key, JSON)
    drop = st.tuples(st.just("drop"), key, st.none())
    item = st.tuples(
        st.just("item"),
        st.sampled_from(["tokenizer.ggml.tokens", "tokenizer.ggml.merges"]),
        st.tuples(st.integers(0, 399), SCALARS),
    )
    cut = st.tuples(st.just("cut"), st.sampled_from(["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"]), st.integers(0, 50))
    ids = st.tuples(
        st.just("set"),
        st.sampled_from([k for k in TOKENIZER_KEYS if k.endswith("_id")]),
        st.sampled_from([-1, 400, 2**32 - 1]).map(lambda v: mx.array(v, dtype=mx.int64)),
    )
    return st.lists(st.one_of(replace, drop, item, cut, ids), min_size=1, max_size=3)


def apply_edits(md: dict, edits) -> dict:
    md = dict(md)
    for op, key, arg in edits:
        if op == "set":
            md[key] = arg
        elif op == "drop":
            md.pop(key, None)
        elif key in md:
            values = md[key].tolist() if isinstance(md[key], mx.array) else list(md[key])
            if op == "cut":
                values = values[: arg]
            elif arg[0] < len(values):
                values[arg[0]] = arg[1]
            md[key] = values
    return md


def test_damaged_tokenizer_metadata_gets_package_errors(gguf_fixture, tmp_path):
    from dflash_mlx.gguf import build_tokenizer

    md = gguf_fixture["md"]
    seen = {"refused": 0, "built": 0}

    @fuzz(60)
    @seed(SEED)
    @given(tokenizer_edit(md))
    def check(edits):
        try:
            tokenizer = build_tokenizer(apply_edits(md, edits), "llama")
        except DFlashError:
            seen["refused"] += 1
            return
        seen["built"] += 1
        tokenizer.save_pretrained(str(tmp_path / "tok"))  # what the converter does next
        tokenizer(MIXED)

    check()
    print(f"seed {SEED}: {seen}")
    assert seen["refused"] and seen["built"]


# ---------------------------------------------------------------------------
# Drafter checkpoints: config.json values and the safetensors header


@pytest.fixture(scope="module")
def drafter(qwen3_pair, tmp_path_factory):
    path = qwen3_pair.make_draft(tmp_path_factory.mktemp("drafter") / "d", block_size=4)
    return {
        "path": path,
        "config": json.loads((path / "config.json").read_text()),
        "weights": (path / "model.safetensors").read_bytes(),
    }


def config_edit(cfg: dict):
    """Replace or drop a top-level or ``dflash_config`` value, or add a
    ``quantization`` entry, with any JSON."""
    keys = sorted(cfg) + [f"dflash_config.{k}" for k in sorted(cfg.get("dflash_config", {}))] + ["quantization", "text_config"]
    quant = st.fixed_dictionaries({"group_size": JSON | st.sampled_from([32, 64, 0, -64]), "bits": JSON | st.sampled_from([4, 0, -4, 3, 99])})
    return st.lists(
        st.tuples(st.sampled_from(keys), st.one_of(JSON, st.just(KeyError), quant)), min_size=1, max_size=3
    )


def edited_config(cfg: dict, edits) -> dict:
    cfg = copy.deepcopy(cfg)
    for key, v in edits:
        where, name = (cfg.setdefault("dflash_config", {}), key.split(".", 1)[1]) if key.startswith("dflash_config.") else (cfg, key)
        if not isinstance(where, dict):
            continue
        if v is KeyError:
            where.pop(name, None)
        else:
            where[name] = v
    return cfg


def test_drafter_config_values_get_package_errors(drafter, qwen3_pair, tmp_path):
    seen = {"refused": 0, "loaded": 0}
    path = tmp_path / "d"
    shutil.copytree(drafter["path"], path)

    @fuzz(60)
    @seed(SEED)
    @given(config_edit(drafter["config"]))
    def check(edits):
        (path / "config.json").write_text(json.dumps(edited_config(drafter["config"], edits)))
        tally(seen, lambda: dflash_mlx.load_draft(path, qwen3_pair.model))

    check()
    print(f"seed {SEED}: {seen}")
    assert seen["refused"] and seen["loaded"]


def safetensors_edit(weights: bytes):
    """Structured edits of the JSON header (dtype, shape, offsets, the header
    length) and raw flips and truncations."""
    (n,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    field = st.tuples(
        st.just("field"),
        st.sampled_from(names),
        st.sampled_from(["dtype", "shape", "data_offsets"]),
        JSON
        | st.sampled_from(["F64", "I8", "BOOL", "F8_E4M3", "nope"])
        | st.lists(st.integers(-(2**40), 2**40), max_size=4)
        | st.lists(st.integers(0, 64), min_size=1, max_size=3),
    )
    length = st.tuples(st.just("length"), st.sampled_from([0, 1, n - 1, n + 1, 2**40, 2**64 - 1]), st.none(), st.none())
    flip = st.tuples(st.just("flip"), st.integers(0, 8 + n - 1), st.integers(0, 255), st.none())
    cut = st.tuples(st.just("cut"), st.integers(0, len(weights) - 1), st.none(), st.none())
    return st.lists(st.one_of(field, length, flip, cut), min_size=1, max_size=3)


def edited_weights(weights: bytes, edits) -> bytes:
    (n,) = struct.unpack("<Q", weights[:8])
    header, data = json.loads(weights[8 : 8 + n]), weights[8 + n :]
    raw_edits = []
    for op, a, b, c in edits:
        if op == "field":
            header[a][b] = c
        else:
            raw_edits.append((op, a, b))
    text = json.dumps(header).encode()
    out = bytearray(struct.pack("<Q", len(text)) + text + data)
    for op, a, b in raw_edits:
        if op == "length":
            out[:8] = struct.pack("<Q", a)
        elif op == "flip" and a < len(out):
            out[a] = b
        elif op == "cut":
            out = out[:a]
    return bytes(out)


def test_drafter_safetensors_headers_get_package_errors(drafter, qwen3_pair, tmp_path):
    seen = {"refused": 0, "loaded": 0}
    path = tmp_path / "d"
    shutil.copytree(drafter["path"], path)
    (path / "model.safetensors").write_bytes(edited_weights(drafter["weights"], []))
    dflash_mlx.load_draft(path, qwen3_pair.model)  # the rewriting alone is faithful

    @fuzz(60)
    @seed(SEED)
    @given(safetensors_edit(drafter["weights"]))
    def check(edits):
        (path / "model.safetensors").write_bytes(edited_weights(drafter["weights"], edits))
        tally(seen, lambda: dflash_mlx.load_draft(path, qwen3_pair.model))

    check()
    print(f"seed {SEED}: {seen}")
    assert seen["refused"]


# ---------------------------------------------------------------------------
# Target config.json


def test_target_config_values_get_package_errors(qwen3_pair, tmp_path):
    path = tmp_path / "t"
    shutil.copytree(qwen3_pair.path, path)
    cfg = json.loads((path / "config.json").read_text())
    keys = sorted(cfg) + ["quantization", "rope_scaling", "text_config"]
    seen = {"refused": 0, "loaded": 0}

    @fuzz(40)
    @seed(SEED)
    @given(st.lists(st.tuples(st.sampled_from(keys), st.one_of(JSON, st.just(KeyError))), min_size=1, max_size=3))
    def check(edits):
        (path / "config.json").write_text(json.dumps(edited_config(cfg, edits)))
        tally(seen, lambda: dflash_mlx.load(path))

    check()
    print(f"seed {SEED}: {seen}")
    assert seen["refused"] and seen["loaded"]


# ---------------------------------------------------------------------------
# Prompt cache files (save_prompt_cache; the server's --prompt-cache-dir)


def test_prompt_cache_file_mutations_are_refused_or_read_exactly(qwen3_pair, drafter, tmp_path):
    """A changed byte anywhere (header, JSON, data), a hostile length or a
    cut: one ArgumentError, or (a change JSON does not see, such as its
    padding) the very cache that was saved."""
    from dflash_mlx.cache import load_prompt_cache, save_prompt_cache

    draft = dflash_mlx.load_draft(drafter["path"], qwen3_pair.model)
    cache = dflash_mlx.make_prompt_cache(qwen3_pair.model, draft)
    list(dflash_mlx.stream_generate(qwen3_pair.model, draft, qwen3_pair.tokenizer, [5, 6, 7, 8] * 5, max_tokens=6, prompt_cache=cache))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), cache)
    data, want = path.read_bytes(), mx.load(str(path))
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    seen = {"refused": 0, "loaded": 0}

    @fuzz(40)
    @seed(SEED)
    @given(gguf_mutation(header_end, len(data)))
    def check(how):
        path.write_bytes(mutate(data, how))
        try:
            loaded = load_prompt_cache(str(path), draft)
        except DFlashError:
            seen["refused"] += 1
        else:
            seen["loaded"] += 1
            assert loaded.tokens == cache.tokens and loaded.pending == cache.pending
            got = mx.load(str(path))
            assert got.keys() == want.keys() and all(mx.array_equal(got[k], want[k]) for k in want)

    check()
    print(f"seed {SEED}: {seen}")
    assert seen["refused"] > seen["loaded"]


# ---------------------------------------------------------------------------
# Request bodies, over HTTP. One row per endpoint: its path and a minimal
# valid body, which the fuzzer edits; a new endpoint is one more row.

# (path, a minimal valid body, what the last line of a whole stream holds)
ENDPOINTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def f(x):"}]}, b"data: [DONE]"),
    ("/v1/completions", {"prompt": "def f(x):"}, b"data: [DONE]"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "def f(x):"}]}, b"message_stop"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "def f(x):"}]}, None),  # never streams
    ("/v1/responses", {"input": "def f(x):"}, b'"response.'),
]
# Fields any of the served APIs reads (OpenAI chat and completions, Anthropic
# Messages, OpenAI Responses), so each endpoint also meets the others'.
FIELDS = [
    "messages", "prompt", "input", "instructions", "system", "model", "max_tokens", "max_completion_tokens",
    "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "stream", "stream_options", "stop",
    "stop_sequences", "seed", "logprobs", "top_logprobs", "logit_bias", "n", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "num_draft_tokens", "tools", "tool_choice",
    "chat_template_kwargs", "role_mapping", "response_format", "metadata", "adapters", "draft_model",
    "xtc_probability", "xtc_threshold", "repetition_context_size",
]  # fmt: skip
# Content parts and blocks of every dialect (OpenAI chat, Anthropic, Responses).
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_text", "thinking", "tool_use", "tool_result", "reasoning_text"]) | SCALARS},
    optional={"text": SCALARS, "image_url": JSON, "thinking": SCALARS, "id": SCALARS, "name": SCALARS, "input": JSON,
              "tool_use_id": SCALARS, "content": JSON},
)
# A chat message, an Anthropic message or a Responses input item.
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer"]) | SCALARS},
    optional={
        "type": st.sampled_from(["message", "reasoning", "function_call", "function_call_output"]) | SCALARS,
        "content": JSON | st.lists(PART, max_size=3),
        "tool_calls": JSON,
        "name": SCALARS,
        "call_id": SCALARS,
        "arguments": JSON,
        "output": JSON,
    },
)
# Token-id prompts: ids inside the vocabulary, negative, past it and past any integer MLX takes.
TOKEN_IDS = st.lists(st.integers(0, 60) | st.integers(-(2**70), 2**70) | st.sampled_from([-1, 10**9, 2**31, 2**63]), min_size=1, max_size=4)
FIELD_VALUES = {
    "prompt": TOKEN_IDS | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "input": st.lists(MESSAGE, max_size=3) | JSON,
    # Valid ones stay small: a request the server accepts is generated in full.
    "max_tokens": JSON.filter(lambda v: not (isinstance(v, int) and v > 4)),
    "max_completion_tokens": JSON.filter(lambda v: not (isinstance(v, int) and v > 4)),
    "max_output_tokens": JSON.filter(lambda v: not (isinstance(v, int) and v > 4)),
}


def request_body(base: dict):
    edit = st.sampled_from(FIELDS).flatmap(lambda k: st.tuples(st.just(k), FIELD_VALUES.get(k, JSON)))
    return st.lists(st.one_of(edit, st.tuples(st.sampled_from(FIELDS), st.just(KeyError))), max_size=4).map(
        lambda edits: edited_config(base, edits)
    )


@pytest.fixture(scope="module")
def tiny_server(qwen3_pair, tmp_path_factory):
    """The server over the tiny Qwen3 pair, in this process, answering at
    most 4 tokens unless a request asks for fewer."""
    from dflash_mlx.server import make_server, setup_arg_parser

    model, tokenizer = dflash_mlx.load(qwen3_pair.path)  # its own: the server sets the chat template
    draft_dir = qwen3_pair.make_draft(tmp_path_factory.mktemp("srv") / "d", block_size=4)
    draft = dflash_mlx.load_draft(draft_dir, model)
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    args = setup_arg_parser().parse_args(
        ["--model", str(qwen3_pair.path), "--port", "0", "--max-tokens", "4", "--chat-template", template, "--log-level", "ERROR"]
    )
    server = make_server(args, model, tokenizer, draft, str(draft_dir))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()
        server.generator.stop_and_join()


def error_of(path: str, raw: bytes) -> dict:
    """The error object of an error answer, checked for its dialect's shape
    (mlx-lm's own chat-completions errors may be a bare string)."""
    answer = json.loads(raw)
    error = answer["error"]
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error" and isinstance(error["type"], str), answer
    if path.startswith(("/v1/messages", "/v1/responses")):
        assert isinstance(error["message"], str) and error["message"], answer
    assert error
    return error


def post_raw(address, path, raw: bytes):
    conn = http.client.HTTPConnection(*address, timeout=120)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path, base, stream_end", ENDPOINTS, ids=[p for p, _, _ in ENDPOINTS])
def test_request_bodies_get_answers_or_4xx(tiny_server, path, base, stream_end):
    seen = {"4xx": 0, "200": 0}

    @fuzz(60)
    @seed(SEED)
    @given(request_body(base) | JSON)
    def check(body):
        status, raw = post_raw(tiny_server, path, json.dumps(body).encode())
        assert status == 200 or 400 <= status < 500, (status, raw[:300])
        if status == 200:
            seen["200"] += 1
            if raw.startswith((b"data: ", b"event: ", b": ")):  # a whole stream
                assert stream_end is not None and stream_end in raw.rstrip().splitlines()[-1], raw[-300:]
            else:
                assert json.loads(raw)
        else:
            seen["4xx"] += 1
            error_of(path, raw)

    check()
    print(f"seed {SEED}: {seen}")
    assert seen["4xx"] and seen["200"]
    status, _ = post_raw(tiny_server, path, json.dumps(base).encode())
    assert status == 200


# ---------------------------------------------------------------------------
# What the fuzzers found, one regression test each (see docs/robustness.md)


def raw_bodies(base: dict):
    """Bodies that are not UTF-8 JSON or hold what a JSON parser chokes on:
    invalid bytes anywhere in a valid body, integers of thousands of digits
    in any field, deep nesting."""
    valid = json.dumps(base).encode()
    invalid = st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=3).filter(lambda b: not is_utf8(b))).map(
        lambda at: valid[: at[0]] + at[1] + valid[at[0] :]
    )
    def with_huge(k):  # the field last, its value an integer of 5,000 digits
        last = {**{f: v for f, v in base.items() if f != k}, k: 0}
        return json.dumps(last).encode()[: -len(b"0}")] + b"1" + b"0" * 5000 + b"}"

    huge = st.sampled_from(FIELDS).map(with_huge)
    deep = st.integers(1000, 100_000).map(lambda n: b"[" * n + b"]" * n)
    return invalid | huge | deep


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("path, base, stream_end", ENDPOINTS, ids=[p for p, _, _ in ENDPOINTS])
def test_raw_bodies_get_400_in_the_dialect(tiny_server, path, base, stream_end):
    @fuzz(20)
    @seed(SEED)
    @given(raw_bodies(base))
    def check(raw):
        status, answer = post_raw(tiny_server, path, raw)
        assert status == 400, (status, answer[:300])
        error_of(path, answer)

    check()
    assert post_raw(tiny_server, path, json.dumps(base).encode())[0] == 200


def test_gguf_errors_are_package_errors():
    from dflash_mlx.gguf import GGUFError

    assert issubclass(GGUFError, DFlashError)


@pytest.mark.parametrize("merges", [["zz qq"], ["a"]])
def test_gguf_merges_outside_the_vocabulary_are_refused(gguf_fixture, merges):
    from dflash_mlx.gguf import GGUFError, build_tokenizer

    with pytest.raises(GGUFError, match="(?s)tokenizer.ggml.*damaged"):
        build_tokenizer({**gguf_fixture["md"], "tokenizer.ggml.merges": merges}, "llama")


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("tokenizer.ggml.tokens", None, "tokenizer.ggml.tokens is not a list of strings"),
        ("tokenizer.ggml.bos_token_id", 400, "bos_token_id is 400, not a token id below"),
        ("tokenizer.ggml.token_type", [1, 2], "token_type is not 400 integers"),
    ],
)
def test_gguf_tokenizer_metadata_is_checked(gguf_fixture, key, value, match):
    from dflash_mlx.gguf import GGUFError, build_tokenizer

    with pytest.raises(GGUFError, match=match):
        build_tokenizer({**gguf_fixture["md"], key: value}, "llama")


def test_gguf_tensor_name_not_utf8_is_refused(gguf_fixture, tmp_path):
    data = bytearray(gguf_fixture["bytes"])
    data[data.find(b"token_embd")] = 0x80
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(DFlashError, match="download it again"):
        convert(str(tmp_path / "bad.gguf"), str(tmp_path / "out"), kind="gguf", dtype="float32")
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("dflash_config.target_layer_ids", {"": None}, "target_layer_ids must be a non-empty list"),
        ("dflash_config.target_layer_ids", ["1"], "target_layer_ids must be an integer, not '1'"),
        ("rope_theta", {"a": 1}, "rope_theta must be a finite number"),
        ("head_dim", [1], "head_dim must be an integer"),
        ("head_dim", 536870912, "head_dim must be from 1 to"),
        ("num_key_value_heads", [None], "num_key_value_heads must be an integer"),
        ("num_key_value_heads", 3, "num_key_value_heads 3 does not divide"),
        ("vocab_size", "", "vocab_size must be an integer"),
        ("architectures", {"": None}, "architectures must be a list of class names"),
        ("architectures", ["LlamaForCausalLM"], "architecture 'LlamaForCausalLM' is not a DFlash drafter"),
        ("quantization", {"bits": -4, "group_size": 64}, "quantization .* needs bits in"),
        ("intermediate_size", KeyError, "lacks intermediate_size"),
    ],
)
def test_drafter_config_values_are_named(drafter, tmp_path, key, value, match):
    path = tmp_path / "d"
    shutil.copytree(drafter["path"], path)
    (path / "config.json").write_text(json.dumps(edited_config(drafter["config"], [(key, value)])))
    with pytest.raises(DFlashError, match=match):
        dflash_mlx.load_draft(path)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("vocab_size", False, "vocab_size must be an integer, not False"),
        ("rms_norm_eps", False, "rms_norm_eps must be a finite number"),
        ("hidden_size", -1, "hidden_size must be from 1"),
        ("head_dim", 536870912, "head_dim must be from 1"),
        ("model_type", None, "model_type must name an mlx-lm model family"),
        ("num_key_value_heads", None, "mlx-lm cannot build the model its config.json describes"),
        ("max_position_embeddings", None, "mlx-lm cannot build the model its config.json describes"),
    ],
)
def test_target_config_values_are_named(qwen3_pair, tmp_path, key, value, match):
    path = tmp_path / "t"
    shutil.copytree(qwen3_pair.path, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edited_config(cfg, [(key, value)])))
    with pytest.raises(DFlashError, match=match):
        dflash_mlx.load(path)


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"num_draft_tokens": 2**63}, "num_draft_tokens"),  # crashed the server
        ("/v1/completions", {"num_draft_tokens": 2**31}, "num_draft_tokens"),
        ("/v1/completions", {"seed": -1}, "seed"),
        ("/v1/chat/completions", {"chat_template_kwargs": []}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"tools": [None]}, "tools"),
        ("/v1/chat/completions", {"temperature": 2**63}, "temperature"),  # std::bad_cast in MLX's sampler
        ("/v1/chat/completions", {"temperature": float("nan")}, "temperature"),  # sampled from NaN probabilities
        ("/v1/completions", {"top_p": float("inf")}, "top_p"),
        ("/v1/completions", {"prompt": [1000000000]}, "prompt"),  # a segfault in MLX's embedding gather
        ("/v1/completions", {"prompt": [5, -3]}, "prompt"),  # answered from memory before the table
        ("/v1/completions", {"prompt": [5], "max_tokens": 10**12}, "max_tokens"),  # dropped the connection
        ("/v1/chat/completions", {"max_completion_tokens": 10**12}, "max_tokens"),
    ],
)
def test_requests_the_fuzzer_broke_the_server_with(tiny_server, path, fields, param):
    base = next(body for p, body, _ in ENDPOINTS if p == path)
    status, raw = post_raw(tiny_server, path, json.dumps({**base, **fields}).encode())
    assert status == 400 and json.loads(raw)["error"]["param"] == param
    assert post_raw(tiny_server, path, json.dumps(base).encode())[0] == 200


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "path, fields, message",
    [
        ("/v1/messages", {"chat_template_kwargs": []}, "chat_template_kwargs must be an object"),  # each dropped the connection
        ("/v1/messages/count_tokens", {"chat_template_kwargs": 1}, "chat_template_kwargs must be an object"),
        ("/v1/responses", {"chat_template_kwargs": True}, "chat_template_kwargs must be an object"),
        ("/v1/responses", {"previous_response_id": ["x"]}, "previous_response_id must be a string"),
        ("/v1/messages", {"messages": [USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}, USER]},
         "messages.1.content.0.thinking must be a string"),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
         "input.0.content.0.text must be a string"),
        ("/v1/responses", {"input": [{"type": "reasoning", "content": [{"text": 5}]}, USER]}, "input.0.content.0.text must be a string"),
        ("/v1/responses", {"input": [{"type": "reasoning", "content": 5}, USER]}, "input.0 (reasoning): content must be a list"),
        ("/v1/responses", {"previous_response_id": 7}, "previous_response_id must be a string"),  # a 400 that named no type
        ("/v1/messages", {"temperature": 2**70}, "temperature must be at most"),  # a 500: std::bad_cast in MLX's sampler
        ("/v1/responses", {"temperature": 2**63}, "temperature must be at most"),
        ("/v1/messages", {"max_tokens": 10**12}, "max_tokens is 1000000000000, but the model's context"),
        ("/v1/responses", {"max_output_tokens": 10**12}, "max_output_tokens is 1000000000000, but the model's context"),
    ],
)
def test_agent_requests_the_fuzzer_broke_the_server_with(tiny_server, path, fields, message):
    base = next(body for p, body, _ in ENDPOINTS if p == path)
    status, raw = post_raw(tiny_server, path, json.dumps({**base, **fields}).encode())
    assert status == 400 and error_of(path, raw)["message"].startswith(message), raw
    assert post_raw(tiny_server, path, json.dumps(base).encode())[0] == 200


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/v1/messages", {"temperature": None}),  # a 500: null reached the sampler
        ("/v1/responses", {"temperature": None, "top_p": None}),
        ("/v1/chat/completions", {"chat_template_kwargs": {"tools": 1}}),  # dropped the connection
        ("/v1/messages", {"chat_template_kwargs": {"tools": 1}}),
    ],
)
def test_requests_the_fuzzer_broke_the_server_with_are_served(tiny_server, path, fields):
    base = next(body for p, body, _ in ENDPOINTS if p == path)
    status, raw = post_raw(tiny_server, path, json.dumps({**base, **fields}).encode())
    assert status == 200, raw
    assert json.loads(raw)["usage"]["output_tokens" if path != "/v1/chat/completions" else "completion_tokens"] > 0


@pytest.mark.parametrize("path", [p for p, _, _ in ENDPOINTS])
def test_a_bug_while_serving_answers_500_in_the_dialect(tiny_server, monkeypatch, path):
    """An unexpected exception in a handler (injected where every route
    checks its request) is a 500 in the request's dialect, not a dropped connection."""
    import dflash_mlx.server

    def broken(*args):
        raise RuntimeError("injected fault")

    base = next(body for p, body, _ in ENDPOINTS if p == path)
    monkeypatch.setattr(dflash_mlx.server, "prepare", broken)
    status, raw = post_raw(tiny_server, path, json.dumps(base).encode())
    assert status == 500 and "injected fault" in error_of(path, raw)["message"], raw
    monkeypatch.undo()
    assert post_raw(tiny_server, path, json.dumps(base).encode())[0] == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [p for p, _, end in ENDPOINTS if end is not None])
def test_a_generation_error_answers_in_the_dialect(tiny_server, monkeypatch, path, stream):
    """An exception on the generation thread (injected where the batched
    loop decodes) ends the request with an error in its dialect, a 500 or,
    once a stream is under way, an error event; never a dropped connection;
    the next request is served by a fresh batch."""
    from dflash_mlx.decode import Decoder

    def broken(*args, **kwargs):
        raise RuntimeError("injected generation fault")

    base = next(body for p, body, _ in ENDPOINTS if p == path)
    monkeypatch.setattr(Decoder, "step", broken)
    status, raw = post_raw(tiny_server, path, json.dumps({**base, "stream": stream}).encode())
    if stream:
        assert status == 200 and b"injected generation fault" in raw and b"error" in raw.rstrip().splitlines()[-1], raw
    else:
        assert status == 500 and "injected generation fault" in error_of(path, raw)["message"], raw
    monkeypatch.undo()
    assert post_raw(tiny_server, path, json.dumps(base).encode())[0] == 200


def test_the_library_refuses_token_ids_outside_the_vocabulary(qwen3_pair, drafter, monkeypatch):
    """One clear error before any forward (past the table, MLX's gather crashed the process)."""
    from dflash_mlx.errors import ArgumentError

    draft = dflash_mlx.load_draft(drafter["path"], qwen3_pair.model)
    forwards = []
    monkeypatch.setattr(type(draft.target), "forward", lambda self, tokens, *a, **kw: forwards.append(tokens))
    vocab = qwen3_pair.vocab
    for prompt in ([1, 10**9], [-3], [vocab]):
        with pytest.raises(ArgumentError, match=f"outside the target's vocabulary \\(0..{vocab - 1}\\)"):
            dflash_mlx.generate(qwen3_pair.model, draft, qwen3_pair.tokenizer, prompt, max_tokens=2)
    assert forwards == []


def test_the_library_takes_a_huge_max_tokens(qwen3_pair, drafter):
    """max_tokens of 10^12 took a draft tree's slots past MLX's 32-bit slice indices (ValueError)."""
    import itertools

    draft = dflash_mlx.load_draft(drafter["path"], qwen3_pair.model)
    steps = dflash_mlx.stream_generate(qwen3_pair.model, draft, qwen3_pair.tokenizer, [1, 2, 3, 4, 5], max_tokens=10**12)
    assert sum(len(r.tokens) for r in itertools.islice(steps, 12)) >= 12
    steps.close()


def test_absurd_block_sizes_are_refused(qwen3_pair, drafter):
    from dflash_mlx.errors import ArgumentError

    draft = dflash_mlx.load_draft(drafter["path"], qwen3_pair.model)
    with pytest.raises(ArgumentError, match="block_size must be from 1 to 256"):
        dflash_mlx.generate(qwen3_pair.model, draft, qwen3_pair.tokenizer, [1, 2, 3], block_size=2**31)
