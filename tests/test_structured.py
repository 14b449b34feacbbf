"""The constraint layer against llguidance itself: masks, block and tree
masks, forced tokens, constrained drafting and the logits processor, on a
tiny byte tokenizer and the bundled pair's; and the response formats'
checks. The loop's use of it is tested with the loop."""

import copy
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tiny import LOOP_FAMILIES, QWEN3, V, ScriptedSizer, eos_set, make_target, pit_check, prompt_of, sampled_runs, small_pair
from tiny_chat import format_of

import dflash_mlx

from dflash_mlx.adaptive import BlockSizer, CycleCosts
from dflash_mlx.errors import ArgumentError
from dflash_mlx.sampling import processed_probs
from dflash_mlx.structured import BRIDGES, Constraint, allowed, bridge, constraint_from_response_format, grammar_of
from dflash_mlx.tree import build_tree

DEFAULT_TARGET = Path(__file__).parent.parent / "dflash_mlx" / "default_pair" / "target"

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny seeded target over the byte tokenizer (258 ids), its vocabulary padded to 300."""
    from mlx_lm import load

    return load(str(make_target(tmp_path_factory.mktemp("structured") / "target", QWEN3, seed=5, vocab_size=300)))


@pytest.fixture(scope="module", params=["tiny", "default_pair"])
def tokenizer(request, tiny_target):
    return tiny_target[1] if request.param == "tiny" else load_tokenizer(DEFAULT_TARGET)


def reference_words(matcher: LLMatcher, words: int) -> np.ndarray:
    """llguidance's own mask of a matcher's state, as ``words`` int32 words
    (its buffer may run a word longer, with nothing set there)."""
    full = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
    assert not full[words:].any()
    return full[:words]


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_masks_are_llguidances_own(tokenizer):
    c = constraint_from_response_format(json_schema(SCHEMA), tokenizer)
    ref = LLMatcher(bridge(tokenizer), LLMatcher.grammar_from_json_schema(SCHEMA), log_level=0)
    for t in encode(tokenizer, '{"ok": true, "color": "red", "n": 3}'):
        want = reference_words(ref, len(c.words()))
        assert np.array_equal(c.words(), want)
        bits = np.unpackbits(want.view(np.uint8), bitorder="little")[: c.vocab].astype(bool)
        got = np.array(c.mask(c.vocab + 40))
        assert np.array_equal(got[: c.vocab], bits) and not got[c.vocab:].any()
        assert got[t], "the answer's own token is allowed"
        c.commit([t])
        assert ref.consume_token(t)
    assert c.is_accepting() and c.finished
    assert np.flatnonzero(np.array(c.mask())).tolist() == sorted(c.eos), "only eos once the answer is complete"


def test_block_masks_equal_step_by_step_masks_and_leave_the_state(tokenizer):
    c = constraint_from_response_format(json_schema(SCHEMA), tokenizer)
    answer = encode(tokenizer, '{"ok": false, "color": "green", "n": 7}')
    c.commit(answer[:3])
    before = c.words()
    drafts = answer[3:9]
    rows, valid = c.block_masks(drafts)
    assert valid == len(drafts)
    for i in range(len(drafts) + 1):
        assert np.array_equal(np.array(rows[i]), np.array(c.mask())), f"row {i}"
        if i < len(drafts):
            c.commit([drafts[i]])
    c.rollback(len(drafts))
    assert np.array_equal(c.words(), before) and c.committed == 3
    refused = drafts[:2] + encode(tokenizer, "}")[:1] + drafts[3:]  # a brace where a value's text goes on
    rows, valid = c.block_masks(refused)
    assert valid == 2
    c.commit(refused[:2])
    assert np.array_equal(np.array(rows[2]), np.array(c.mask()))
    assert np.array(rows[3:]).all(), "rows past the refused draft are never used"
    c.rollback(2)
    assert np.array_equal(c.words(), before)
    for drafts in ([], refused[2:]):  # none, and the first refused
        rows, valid = c.block_masks(drafts)
        assert valid == 0 and np.array_equal(np.array(rows[0]), np.array(c.mask())) and np.array(rows[1:]).all()


def test_eos_is_taken_once_the_grammar_is_complete(tokenizer):
    c = constraint_from_response_format({"type": "regex", "pattern": "ab"}, tokenizer)
    eos = sorted(c.eos)[0]
    ab = encode(tokenizer, "ab")
    rows, valid = c.block_masks(ab + [eos])
    assert valid == len(ab) + 1 and np.flatnonzero(np.array(rows[len(ab)])).tolist() == sorted(c.eos)
    logits = mx.zeros((len(ab) + 3, c.vocab))
    tokens, _ = c.draft_block(len(ab) + 3, lambda: logits, c.vocab)
    assert tokens[len(ab)] == eos and tokens[len(ab):] == [eos] * 3, "drafting ends with the eos (repeated after it)"
    c.commit(ab + [eos])
    assert c.finished and c.committed == len(ab) + 1


def test_tree_masks_mask_each_node_by_its_own_path(tokenizer):
    c = constraint_from_response_format({"type": "regex", "pattern": "(cat|car|dog)s?"}, tokenizer)
    ids = {ch: encode(tokenizer, ch)[0] for ch in "cadrtsx"}
    #        root  c       a     t     r     s     x     d
    tokens = [0, ids["c"], ids["a"], ids["t"], ids["r"], ids["s"], ids["x"], ids["d"]]
    parents = [-1, 0, 1, 2, 2, 3, 1, 0]
    rows, valid = c.tree_masks(tokens, parents)
    assert valid.tolist() == [True, True, True, True, True, True, False, True]
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.insert(0, tokens[j])
            j = parents[j]
        if valid[i]:
            chain, ok = c.block_masks(path)
            assert ok == len(path) and np.array_equal(np.array(rows[i]), np.array(chain[-1])), f"node {i}"
    assert np.array_equal(np.array(rows[0]), np.array(c.mask())) and c.committed == 0


def test_a_held_rows_tree_holds_only_paths_its_grammar_takes(tokenizer):
    """A node the grammar refuses could never be accepted: the tree leaves
    it out and spends its budget on the next best candidates."""
    c = constraint_from_response_format({"type": "regex", "pattern": "(cat|car|dog)s?"}, tokenizer)
    t = {ch: encode(tokenizer, ch)[0] for ch in "cadortx"}
    ids = np.array([[t["x"], t["c"], t["d"]], [t["a"], t["o"], t["x"]], [t["x"], t["t"], t["r"]]])
    logprobs = np.array([[-0.1, -0.5, -1.0]] * 3)
    free = build_tree(t["x"], ids, logprobs, 6)
    assert t["x"] in [free.tokens[i] for i in range(1, len(free.tokens)) if free.depths[i] == 1]
    held = build_tree(t["x"], ids, logprobs, 6, lambda path: c.takes(path) == len(path))
    _, valid = c.tree_masks(held.tokens, held.parents)
    assert valid.all() and len(held.tokens) == 7  # c, d, ca, do, cat, car: every path the grammar takes

    def path(i):
        return path(held.parents[i]) + (held.tokens[i],) if i else ()

    assert {path(i) for i in range(1, 7)} == {tuple(t[ch] for ch in w) for w in ("c", "d", "ca", "do", "cat", "car")}
    assert c.committed == 0


def test_forced_tokens_are_the_only_allowed_ones(tokenizer):
    c = constraint_from_response_format({"type": "regex", "pattern": "The answer is (yes|no)\\."}, tokenizer)
    forced = c.forced(64)
    assert forced, "a fixed prefix is forced"
    assert c.committed == 0 and len(c.forced(64)) == len(forced), "forced() leaves the state"
    for t in forced:
        allowed_ids = np.flatnonzero(np.array(c.mask()))
        assert allowed_ids.tolist() == [t]
        c.commit([t])
    assert np.array(c.mask()).sum() > 1, "forcing stops where the grammar gives a choice"
    assert "The answer is ".startswith(tokenizer.decode(forced))


def test_rollback_restores_the_state(tokenizer):
    c = constraint_from_response_format({"type": "json_object"}, tokenizer)
    answer = encode(tokenizer, '{"a": [1, 2, {"b": null}]}')
    states = []
    for t in answer:
        states.append(c.words())
        c.commit([t])
    for k in range(len(answer), 0, -1):
        c.rollback(1)
        assert np.array_equal(c.words(), states[k - 1])
    with pytest.raises(ValueError):
        c.rollback(1)
    with pytest.raises(ValueError, match="refuses"):
        c.commit(encode(tokenizer, "x"))


def test_constrained_drafting_is_the_masked_argmax_along_its_own_choices(tokenizer):
    c = constraint_from_response_format(json_schema(SCHEMA), tokenizer)
    vocab = c.vocab + 7
    logits = mx.random.normal((8, vocab), key=mx.random.key(3))
    tokens, q = c.draft_block(8, lambda: logits, vocab)
    assert q is None and c.committed == 0
    want = []
    for j in range(len(tokens)):  # the plain way: a full mask per slot
        want.append(int(mx.argmax(c.apply(logits[j]))))
        c.commit(want[-1:])
    c.rollback(len(want))
    assert tokens == want and len(tokens) == 8
    assert c.block(mx.zeros((9, vocab)), mx.array(tokens)).shape == (9, vocab) and c.plan is None, "the verify took the drafted masks"

    sampling = dict(temperature=0.7, top_p=0.0, top_k=0, min_p=0.0)
    sampled, q = c.draft_block(8, lambda: logits, vocab, sampling, key=mx.random.key(4))
    assert q.shape == (8, vocab) and c.committed == 0
    for j, t in enumerate(sampled):
        allow = np.array(c.mask(vocab))
        assert np.array_equal(np.array(q[j]) > 0, allow & (np.array(q[j]) > 0)) and q[j, t] > 0, "q: masked, and holds its token"
        if allow.sum() == 1:
            assert float(q[j, t]) == 1.0, "a forced slot's q is its point mass"
        else:
            want = processed_probs(c.apply(logits[j]), **sampling)
            assert np.allclose(np.array(q[j]), np.array(want)), "q is the masked drafter's processed distribution"
        c.commit([t])


def test_a_forced_block_needs_no_drafter(tokenizer):
    c = constraint_from_response_format({"type": "regex", "pattern": "The answer is (yes|no)\\."}, tokenizer)
    forced = c.forced(64)

    def no_drafter():
        raise AssertionError("the drafter ran for a forced block")

    tokens, q = c.draft_block(len(forced), no_drafter, c.vocab, dict(temperature=1.0, top_p=0.0, top_k=0, min_p=0.0))
    assert tokens == forced and np.array_equal(np.array(q.argmax(axis=-1)), forced) and float(q.sum()) == len(forced)
    c.block(mx.zeros((len(forced) + 1, c.vocab)), mx.array(tokens))
    assert c.commit(forced[:2]) == 2 and c.forced_count == 2, "committed forced tokens are counted"


def test_the_processor_makes_mlx_lms_greedy_decode_valid_json(tiny_target):
    model, tokenizer = tiny_target
    # (a random target would pad with whitespace forever: the schema turns it off, as a client may)
    c = constraint_from_response_format(json_schema({**SCHEMA, "x-guidance": {"whitespace_flexible": False}}), tokenizer)
    out = []
    steps = generate_step(mx.array(encode(tokenizer, "Answer in JSON: ")), model, max_tokens=120, logits_processors=[c.processor()])
    for token, _ in steps:
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    else:
        pytest.fail("the answer did not end within max_tokens")
    answer = json.loads(tokenizer.decode(out))
    assert set(answer) == {"ok", "color", "n"} and isinstance(answer["ok"], bool)
    assert answer["color"] in ("red", "green") and answer["n"] in range(10)
    unmasked = [t for t, _ in generate_step(mx.array(encode(tokenizer, "Answer in JSON: ")), model, max_tokens=len(out))]
    assert unmasked != out, "the mask changed what the target says"


def test_a_padded_vocabulary_never_allows_the_padding(tiny_target):
    model, tokenizer = tiny_target
    c = constraint_from_response_format({"type": "json_object"}, tokenizer)
    logits = mx.zeros((1, 300))
    assert not np.isfinite(np.array(c.apply(logits))[0, c.vocab:]).any()
    assert allowed(np.full((2, 1), -1, dtype=np.int32), 40).tolist() == [[True] * 32 + [False] * 8] * 2


@pytest.mark.parametrize(
    "response_format, problem",
    [
        (json_schema({"type": "strin"}), "JSON schema is invalid"),
        (json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "JSON schema is invalid"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
        ({"type": "regex", "pattern": "a(b"}, "regular expression is invalid"),
        ({"type": "regex"}, "needs"),
        ({"type": "grammar", "lark": "start: missing_rule"}, "Lark grammar is invalid"),
        ({"type": "xml"}, "type is one of"),
        ("json", "type is one of"),
    ],
)
def test_bad_formats_are_refused_before_any_work(response_format, problem):
    with pytest.raises(ArgumentError, match=problem):
        grammar_of(response_format)


def test_text_is_no_constraint_and_the_bridge_is_built_once(tiny_target):
    _, tokenizer = tiny_target
    assert constraint_from_response_format({"type": "text"}, tokenizer) is None
    assert constraint_from_response_format(None, tokenizer) is None
    assert bridge(tokenizer) is bridge(tokenizer)
    assert isinstance(constraint_from_response_format({"type": "grammar", "lark": 'start: "a" | "b"'}, tokenizer), Constraint)
    with pytest.raises(ArgumentError, match="fast Hugging Face tokenizer"):
        bridge(object.__new__(type("SlowTokenizer", (), {"eos_token_id": 0})))


# ---------------------------------------------------------------------------
# Requests: every dialect's structured-output fields, read into one format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
    },
}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def takes(form, tokenizer, text) -> bool:
    """Whether the format's grammar takes ``text`` whole and may end there."""
    c = constraint_from_response_format(form, tokenizer)
    ids = encode(tokenizer, text)
    return c.take(ids) == len(ids) and c.is_accepting()


def test_a_forced_call_is_a_call_of_the_tools_with_strict_arguments(chat_tokenizer):
    tok = chat_tokenizer
    form = format_of({"tools": [WEATHER, OTHER], "tool_choice": "required"}, tok)
    assert form["type"] == "grammar"
    assert takes(form, tok, CALL)
    assert takes(form, tok, '<tool_call>\n{"name": "get_time", "arguments": {"any": 1}}\n</tool_call>'), "not strict: any object"
    assert takes(form, tok, CALL + "\n" + CALL), "parallel calls"
    assert not takes(form, tok, "Sure, " + CALL), "no text before a forced call"
    assert not takes(form, tok, CALL.replace("city", "town")), "strict arguments"
    named = format_of({"tools": [WEATHER, OTHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, tok)
    assert not takes(named, tok, CALL) and takes(named, tok, CALL.replace("get_weather", "get_time").replace('"city": "Paris"', ""))


def test_parallel_tool_calls_false_holds_a_constrained_answer_to_one_call(chat_tokenizer):
    from dflash_mlx.api import messages, responses
    from dflash_mlx.errors import RequestError

    tok = chat_tokenizer
    for body in ({"tools": [WEATHER], "tool_choice": "required"}, {"tools": [WEATHER]}):
        one = format_of({**body, "parallel_tool_calls": False}, tok)
        assert takes(one, tok, CALL) and not takes(one, tok, CALL + "\n" + CALL), body
        assert takes(format_of({**body, "parallel_tool_calls": True}, tok), tok, CALL + "\n" + CALL), body
    chat = messages.to_chat({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                             "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                             "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert chat["parallel_tool_calls"] is False
    assert not takes(format_of(chat, tok), tok, CALL + "\n" + CALL) and takes(format_of(chat, tok), tok, CALL)
    with pytest.raises(RequestError, match="disable_parallel_tool_use must be true or false") as e:
        messages.to_chat({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                          "tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}})
    assert e.value.param == "tool_choice" and e.value.status == 400
    chat, _ = responses.to_chat({"input": "hi", "parallel_tool_calls": False, "tool_choice": "required",
                                 "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]}, [])
    assert chat["parallel_tool_calls"] is False and not takes(format_of(chat, tok), tok, CALL + "\n" + CALL)


def test_strict_tools_under_auto_leave_text_free_and_hold_calls(chat_tokenizer):
    tok = chat_tokenizer
    form = format_of({"tools": [WEATHER]}, tok)
    assert takes(form, tok, "It is sunny, no call needed.")
    assert takes(form, tok, "Let me look. " + CALL)
    assert not takes(form, tok, "Let me look. " + CALL.replace("city", "town"))
    assert format_of({"tools": [OTHER]}, tok) is None, "no strict tool, no forced call: free"
    assert format_of({"tools": [WEATHER], "tool_choice": "none"}, tok) is None
    both = format_of({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}, tok)
    assert takes(both, tok, '{"ok": true, "color": "red", "n": 1}') and takes(both, tok, CALL)
    assert not takes(both, tok, "It is sunny.")


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "send one"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}}, "response_format", "JSON schema is invalid"),
        ({"response_format": {"type": "regex", "pattern": "(("}}, "response_format", "regular expression"),
        ({"tools": [WEATHER], "response_format": {"type": "regex", "pattern": "a"}}, "response_format", "cannot be combined"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ],
)
def test_bad_structured_requests_name_their_field(chat_tokenizer, body, param, says):
    from dflash_mlx.errors import RequestError

    with pytest.raises(RequestError, match=says) as e:
        format_of(body, chat_tokenizer)
    assert e.value.param == param and e.value.status == 400


def test_calls_spelled_in_text_end_the_prose_before_them(tiny_target):
    from types import SimpleNamespace

    from dflash_mlx.api.formats import request_format
    from mlx_lm.tool_parsers import json_tools

    tok = tiny_target[1]  # bytes only: the marker is spelled out
    form = request_format({"tools": [WEATHER]}, tok, SimpleNamespace(tool_parser=json_tools.parse_tool_call))
    assert '"<tool_call>"' in form["lark"]
    assert takes(form, tok, "It is sunny.") and takes(form, tok, "Let me look. " + CALL) and takes(form, tok, CALL)
    assert not takes(form, tok, "Let me look. " + CALL.replace("city", "town"))
    assert not takes(form, tok, "Let me look. <tool_call>\nnot a call")


def test_forced_calls_need_the_json_tool_call_format(tiny_target):
    from dflash_mlx.errors import RequestError

    with pytest.raises(RequestError, match="json_tools"):
        format_of({"tools": [WEATHER], "tool_choice": "required"}, tiny_target[1])
    assert format_of({"response_format": {"type": "json_object"}}, tiny_target[1]) == {"type": "json_object"}


def test_the_dialects_formats_read_as_chats(chat_tokenizer):
    from dflash_mlx.api import messages, responses
    from dflash_mlx.errors import RequestError

    chat, _ = responses.to_chat({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}},
                                 "tools": [{"type": "function", "name": "get_weather", "parameters": {}, "strict": True}],
                                 "tool_choice": {"type": "function", "name": "get_weather"}}, [])
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    assert chat["tools"][0]["function"]["strict"] is True and chat["tool_choice"]["name"] == "get_weather"
    chat = messages.to_chat({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                             "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
                             "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"], "strict": True}],
                             "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert chat["response_format"]["json_schema"]["schema"] == SCHEMA
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert takes(format_of({**chat, "response_format": None}, chat_tokenizer), chat_tokenizer, CALL)
    with pytest.raises(RequestError, match="^output_format must be"):
        messages.to_chat({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "output_format": {"type": "regex"}})


def test_the_cli_flags_give_the_response_format(tmp_path):
    from dflash_mlx import cli

    parser = cli.ArgumentParser()
    cli.add_structured_arguments(parser)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    assert cli.response_format(parser.parse_args([])) is None
    assert cli.response_format(parser.parse_args(["--json-schema", str(schema)])) == {
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    assert cli.response_format(parser.parse_args(["--regex", "[0-9]+"])) == {"type": "regex", "pattern": "[0-9]+"}
    lark = tmp_path / "g.lark"
    lark.write_text('start: "yes" | "no"')
    assert cli.response_format(parser.parse_args(["--grammar", str(lark)]))["lark"] == 'start: "yes" | "no"'
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    for argv, says in ([["--json-schema", str(bad)], "not JSON"], [["--json-schema", str(tmp_path / "none.json")], "cannot read"],
                       [["--regex", "(("], "regular expression is invalid"]):
        with pytest.raises(ArgumentError, match=says):
            cli.response_format(parser.parse_args(argv))
    with pytest.raises(SystemExit):
        parser.parse_args(["--regex", "a", "--grammar", str(lark)])


def test_a_batch_masks_each_row_by_its_own_constraint(tokenizer):
    from dflash_mlx.structured import batch_masks

    a = constraint_from_response_format({"type": "regex", "pattern": "[0-9]+"}, tokenizer)
    b = constraint_from_response_format({"type": "json_object"}, tokenizer)
    rows = batch_masks([a, None, b], a.vocab + 3)
    assert rows.shape == (3, a.vocab + 3)
    assert np.array_equal(np.array(rows[0]), np.array(a.mask(a.vocab + 3))) and np.array(rows[1]).all()
    assert np.array_equal(np.array(rows[2]), np.array(b.mask(a.vocab + 3)))


def test_an_open_think_block_is_closed_freely_before_the_held_answer(chat_tokenizer, tiny_target):
    from types import SimpleNamespace

    from dflash_mlx.api.formats import request_format
    from dflash_mlx.api.harmony import text_format
    from dflash_mlx.errors import RequestError

    answer = '{"ok": true, "color": "red", "n": 1}'
    body = {"response_format": json_schema(SCHEMA)}
    for tok, answers in ((chat_tokenizer, text_format(chat_tokenizer)), (tiny_target[1], SimpleNamespace(think_end="</think>"))):
        form = request_format(body, tok, answers, "reasoning")  # </think> one token, then spelled in bytes
        assert takes(form, tok, "Red, I think.</think>" + answer) and takes(form, tok, "</think>" + answer)
        assert not takes(form, tok, answer) and not takes(form, tok, "Hm.</think>Red.")
        regex = request_format({"response_format": {"type": "regex", "pattern": "[0-9]+"}}, tok, answers, "reasoning")
        assert takes(regex, tok, "Count.</think>42") and not takes(regex, tok, "Count.</think>4a")
    tools = request_format({"tools": [WEATHER], "tool_choice": "required"}, chat_tokenizer, text_format(chat_tokenizer), "reasoning")
    assert takes(tools, chat_tokenizer, "Weather?</think>" + CALL) and not takes(tools, chat_tokenizer, CALL)
    assert request_format({"response_format": {"type": "text"}}, chat_tokenizer, text_format(chat_tokenizer), "header") is None
    with pytest.raises(RequestError, match="harmony"):
        request_format(body, chat_tokenizer, text_format(chat_tokenizer), "header")


# ---------------------------------------------------------------------------
# Through the decode loop: mlx-lm's masked decode is the reference

# (a random target would pad with whitespace forever: the schema turns it off, as a client may)
TIGHT = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
FORMS = [json_schema(TIGHT), {"type": "regex", "pattern": "(yes|no), because [a-z ]{3,12}\\."}, {"type": "json_object"}]


def masked_reference(model, tokenizer, prompt, form, max_tokens):
    """mlx-lm's own greedy decode with the format's mask as a logits
    processor (a fresh constraint), to the eos (kept) or ``max_tokens``."""
    c = constraint_from_response_format(form, tokenizer)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=[c.processor()]):
        out.append(token)
        if token in tokenizer.eos_token_ids:
            break
    return out


def structured_run(model, draft, tokenizer, prompt, form, max_tokens, **kw):
    """DFlash's tokens (the eos kept) and its responses."""
    responses = list(dflash_mlx.stream_generate(model, draft, tokenizer, mx.array(prompt), max_tokens=max_tokens, response_format=form, **kw))
    tokens = [t for r in responses for t in r.tokens]
    return tokens + ([next(iter(tokenizer.eos_token_ids))] if responses[-1].finish_reason == "stop" else []), responses


@pytest.mark.parametrize("family", LOOP_FAMILIES)
def test_each_kind_of_target_decodes_its_masked_greedy_answer_exactly(make_pair, family, tmp_path):
    """A real (random) drafter, constrained drafting, forced blocks: every
    token mlx-lm's masked decode's, on a tiny seeded target of each kind
    (tiny.LOOP_FAMILIES)."""
    pair = make_pair(family)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    special = [e for e in pair.tokenizer.eos_token_ids if e >= 256]  # (the tiny Gemma's stops include byte tokens: a quote)
    BRIDGES.pop(pair.tokenizer, None)
    with eos_set(pair.tokenizer, special):
        for i, form in enumerate(FORMS[:2]):
            prompt = prompt_of(9 + 7 * i, seed=i)
            want = masked_reference(pair.model, pair.tokenizer, prompt, form, 48)
            for kw in ({}, {"block_size": 6}):
                got, responses = structured_run(pair.model, draft, pair.tokenizer, prompt, form, 48, **kw)
                assert got == want, (family, form["type"], kw)
                assert sum(r.forced for r in responses) > 0, "forced tokens are counted"
    BRIDGES.pop(pair.tokenizer, None)


def test_the_bundled_pair_and_draft_trees_decode_exactly(tokenizer, tmp_path):
    from dflash_mlx.pair import load_pair

    if not hasattr(tokenizer, "eos_token_ids"):  # (only the bundled pair's tokenizer)
        pytest.skip("the tiny byte tokenizer's pair is covered above")
    model, tok, draft, _ = load_pair(DEFAULT_TARGET)
    prompt = tok.encode("Answer in JSON: is the sky blue?")
    for form in FORMS:
        want = masked_reference(model, tok, prompt, form, 40)
        for kw in ({}, {"block_size": 8}, {"tree_budget": 6}):
            got, responses = structured_run(model, draft, tok, prompt, form, 40, **kw)
            assert got == want, (form["type"], kw)
        if form is FORMS[0] and want[-1] in tok.eos_token_ids:
            assert json.loads(tok.decode(want[:-1]))["color"] in ("red", "green")


def test_a_grammar_that_cannot_end_in_time_ends_with_length(make_pair, tmp_path):
    pair = make_pair("qwen3")
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    got, responses = structured_run(pair.model, draft, pair.tokenizer, prompt_of(8), FORMS[0], 5)
    assert len(got) == 5 and responses[-1].finish_reason == "length"
    assert got == masked_reference(pair.model, pair.tokenizer, prompt_of(8), FORMS[0], 5)


def test_batched_rows_with_different_formats_each_equal_their_lone_run(make_pair, tmp_path):
    pair = make_pair("qwen3_5")
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    prompts = [prompt_of(n, seed=n) for n in (6, 23, 11, 40)]
    forms = FORMS + [None]
    for kw in ({}, {"block_size": 5}):
        res = dflash_mlx.batch_generate(pair.model, draft, pair.tokenizer, prompts, max_tokens=40, response_format=forms, **kw)
        for p, f, text, tokens, stats in zip(prompts, forms, res.texts, res.tokens, res.stats):
            lone = masked_reference(pair.model, pair.tokenizer, p, f, 40) if f else pair.reference(p, 40)
            assert tokens == [t for t in lone if t not in pair.tokenizer.eos_token_ids], (f, kw)
            assert (stats["forced"] > 0) == (f is not None)
    with pytest.raises(ArgumentError, match="JSON schema is invalid"):
        dflash_mlx.batch_generate(pair.model, draft, pair.tokenizer, prompts[:2], max_tokens=4, response_format=[None, json_schema({"type": "strin"})])


def test_bad_formats_are_refused_by_the_library_before_any_work(make_pair, tmp_path):
    pair = make_pair("qwen3")
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    with pytest.raises(ArgumentError, match="regular expression is invalid"):
        dflash_mlx.generate(pair.model, draft, pair.tokenizer, prompt_of(5), response_format={"type": "regex", "pattern": "a(("})
    with pytest.raises(ArgumentError, match="tokenizer"):
        next(dflash_mlx.generate_step(prompt_of(5), pair.model, draft, response_format=FORMS[2]))
    c = constraint_from_response_format(FORMS[2], pair.tokenizer)
    gen = dflash_mlx.BatchGenerator(pair.model, draft)
    with pytest.raises(ArgumentError, match="of its own"):
        gen.insert([prompt_of(5), prompt_of(6)], 4, response_format=c)
    gen.close()


def test_sampled_structured_rows_follow_the_masked_distribution(tmp_path):
    """Speculative sampling with a masked target and a masked drafter: the
    committed tokens are distributed as mlx-lm's masked sampler draws them
    (probability-integral check over many seeded runs, as test_sampling's)."""
    small = small_pair(tmp_path, QWEN3)
    # ids 0..15 of the byte tokenizer are the characters ! to 0: a forced
    # token after each "%", choices elsewhere, and never an end (eos is id 256)
    form = {"type": "regex", "pattern": "(%&[!-$]{1,3}[*+,])*"}

    def allow(tokens):
        c = constraint_from_response_format(form, small.tokenizer)
        rows = []
        for t in tokens:
            rows.append(c.mask(V))
            c.commit([t])
        return mx.stack(rows)

    for kw in (dict(block_size=4), {}):
        tokens, accepted = sampled_runs(small, small.draft, 4, dict(temperature=1.0), response_format=form, **kw)
        ks, bound, outside = pit_check(small.model, tokens, dict(temperature=1.0), np.random.default_rng(0), allow)
        assert outside == 0 and ks < bound, kw
        assert max(accepted) >= 2, "drafts were accepted"
    ks, bound, _ = pit_check(small.model, tokens, dict(temperature=1.0), np.random.default_rng(0))
    assert ks > bound, "the check tells the unmasked target's distribution from what was sampled"


def test_forced_text_is_verified_in_one_cycle_without_drafting(make_pair, tmp_path):
    pair = make_pair("qwen3")
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=16), pair.model)
    form = {"type": "regex", "pattern": "The answer is (yes|no)\\."}
    got, responses = structured_run(pair.model, draft, pair.tokenizer, prompt_of(8), form, 30)
    assert got == masked_reference(pair.model, pair.tokenizer, prompt_of(8), form, 30)
    assert responses[0].forced == 1 and responses[1].forced == len("he answer is ")
    assert responses[1].committed == len("he answer is ") + 1, "the forced run and the target's choice after it, in one cycle"


def test_a_held_row_keeps_its_acceptance_to_itself(make_pair, tmp_path):
    """Tokens a grammar forces are accepted whatever the drafter proposes: a
    structured request's cycles leave the pair's acceptance (where every
    request starts) as it was, and a free request's feed it."""
    pair = make_pair("qwen3")
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=16), pair.model)
    sizer = BlockSizer(16, CycleCosts({1: 1.0, 2: 1.2, 16: 1.5}))
    before = copy.deepcopy(vars(sizer.acceptance))
    form = {"type": "regex", "pattern": "The answer is (yes|no)\\. I said (yes|no), the answer is (yes|no)\\."}
    got, responses = structured_run(pair.model, draft, pair.tokenizer, prompt_of(8), form, 60, sizer=sizer)
    assert got == masked_reference(pair.model, pair.tokenizer, prompt_of(8), form, 60)
    assert sum(r.forced for r in responses) > 20 and max(r.block_size for r in responses) > 1
    assert vars(sizer.acceptance) == before
    list(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, mx.array(prompt_of(8)), max_tokens=30, sizer=sizer))
    assert vars(sizer.acceptance) != before
    scripted = ScriptedSizer([5])  # a stand-in sizer chooses a held row's blocks too (from its rooms and its own acceptance)
    got, responses = structured_run(pair.model, draft, pair.tokenizer, prompt_of(8), form, 60, sizer=scripted)
    assert got == masked_reference(pair.model, pair.tokenizer, prompt_of(8), form, 60) and scripted.asked


def test_a_dflash2_drafter_drafts_held_blocks_exactly(make_pair, tmp_path):
    """A grammar row drafts from the drafter's slot logits (DFlash2's
    selector walk is its unconstrained rows' path): exact all the same."""
    from dflash_mlx.random_pair import make_draft

    pair = make_pair("qwen3")
    draft = dflash_mlx.load_draft(str(make_draft(tmp_path / "d2", pair.dflash2_config(), seed=2)), pair.model)
    for form in FORMS[:2]:
        want = masked_reference(pair.model, pair.tokenizer, prompt_of(9), form, 40)
        assert structured_run(pair.model, draft, pair.tokenizer, prompt_of(9), form, 40, block_size=8)[0] == want


# ---------------------------------------------------------------------------
# Issue 60's instrument: the json_extract set and examples/structured_bench.py

BENCH = Path(__file__).resolve().parents[1] / "examples" / "structured_bench.py"


def schema_features(schema: dict, found: set) -> set:
    """The JSON Schema features a schema uses, walked through its objects and arrays."""
    if schema.get("type") == "object":
        found.add("closed" if schema.get("additionalProperties") is False else "open")
        found.update({"optional"} if set(schema["properties"]) - set(schema.get("required", [])) else set())
        found.update({"nested"} if any(s.get("type") == "object" for s in schema["properties"].values()) else set())
        for s in schema["properties"].values():
            schema_features(s, found)
    found.update({"array"} if schema.get("type") == "array" else set())
    found.update({"enum"} if "enum" in schema else set())
    found.update({"bounds"} if {"minimum", "maximum", "exclusiveMinimum"} & set(schema) else set())
    if "items" in schema:
        schema_features(schema["items"], found)
    return found


def test_the_json_extract_set_loads_and_every_schema_compiles(tokenizer):
    from dflash_mlx.pair import benchmark_prompts, structured_set

    entries = structured_set("json_extract")
    assert 10 <= len(entries) <= 12 and len({e["name"] for e in entries}) == len(entries)
    found = set()
    for e in entries:
        assert e["prompt"].startswith(e["request"]) and e["prompt"].endswith(json.dumps(e["schema"], separators=(",", ":")))
        grammar = grammar_of(json_schema(e["schema"]))
        assert LLMatcher.validate_grammar(grammar, bridge(tokenizer)) == ""
        assert e["schema"]["additionalProperties"] is False
        found |= schema_features(e["schema"], set())
    assert {"nested", "array", "enum", "bounds", "optional", "closed"} <= found
    assert benchmark_prompts(DEFAULT_TARGET, tokenizer, "json_extract") == [e["prompt"] for e in entries]  # (no chat template)


def test_the_bench_validates_by_jsonschema_where_installed_else_by_completion():
    import runpy

    bench = runpy.run_path(str(BENCH))
    error = bench["schema_error"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"], "additionalProperties": False}
    assert error('{"n": 2', "length", schema, None) == "cut at --max-tokens"
    assert error("{n: 2}", "stop", schema, None).startswith("not JSON")
    assert error('{"n": 2}', "length", schema, None) == "the grammar did not end"
    assert error('{"n": 2}', "stop", schema, None) == ""
    pytest.importorskip("jsonschema")
    name, validate = bench["validator"]()
    assert name.startswith("jsonschema")
    assert error('{"n": 2}', "stop", schema, validate) == ""
    assert "maximum" in error('{"n": 5}', "stop", schema, validate)
    assert "Additional properties" in error('{"n": 2, "x": 1}', "stop", schema, validate)


def test_the_structured_bench_runs_on_the_bundled_pair_and_reports(tmp_path, capsys):
    import runpy

    out = tmp_path / "structured.json"
    main = runpy.run_path(str(BENCH))["main"]
    assert main(["--num-prompts", "1", "--max-tokens", "6", "--no-schema-in-prompt", "--json", str(out)]) == 0
    assert not json.loads(out.read_text())["schema_in_prompt"]
    assert main(["--num-prompts", "2", "--max-tokens", "10", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 2 and report["outputs_identical"]
    for key in ("tokens_per_cycle", "free_tokens_per_cycle", "tokens_per_cycle_ratio", "wall_speedup", "decode_speedup",
                "forced_share", "mask_ms_per_cycle", "cycle_ms", "mask_share", "valid", "free_valid", "validator", "bars_met",
                "verify_only_tokens_per_cycle", "same_text_ratio", "ended", "same_text_ratio_ended"):
        assert key in report, key
    for row in report["rows"]:
        assert row["identical"] and 0 < row["tokens"] <= 10 and row["produced"] >= row["tokens"]
        assert 0 <= row["forced"] <= row["produced"] and 0 < row["mask_s"] < row["decode_s"]
        assert row["tokens_per_cycle"] >= 1 and row["free_tokens_per_cycle"] >= 1 and row["verify_only_tokens_per_cycle"] >= 1
        assert row["schema_error"] == ("" if row["finish"] == "stop" else "cut at --max-tokens")  # (a complete answer validates)
    assert 0 < report["mask_share"] < 1 and report["cycle_ms"] > report["mask_ms_per_cycle"] > 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:2] == ["request", "tokens"] and "bars (issue 60)" in table


ADAPTATION = Path(__file__).resolve().parents[1] / "examples" / "structured_adaptation.py"


def test_the_structured_adaptation_serves_other_kinds_held_to_their_schemas(tmp_path):
    """The traffic examples/structured_adaptation.py serves: seeded, none of
    the bench's kinds, every schema llguidance compiles, the schema shown in
    half the prompts; served on the bundled pair, each answer recorded."""
    import runpy

    from dflash_mlx.pair import structured_set
    from dflash_mlx.traffic import read_traffic

    tokenizer = load_tokenizer(DEFAULT_TARGET)
    example = runpy.run_path(str(ADAPTATION))
    entries = example["served_requests"](0, 20)
    assert entries == example["served_requests"](0, 20) and entries != example["served_requests"](1, 20)
    assert not {e["name"] for e in entries} & {e["name"] for e in structured_set("json_extract")}
    assert len({e["request"] for e in entries}) == len(entries)
    found = set()
    for e in entries:
        assert LLMatcher.validate_grammar(grammar_of(json_schema(e["schema"])), bridge(tokenizer)) == ""
        found |= schema_features(e["schema"], set())
    assert {"nested", "array", "enum", "bounds", "optional", "closed"} <= found
    work = tmp_path / "work"
    for stage in ("requests", "serve"):
        example["main"](["--stage", stage, "--model", str(DEFAULT_TARGET), "--served", "2", "--max-tokens", "6", "--work", str(work)])
    requests = json.loads((work / "requests.json").read_text())
    assert [e["show_schema"] for e in requests] == [True, False]
    served = json.loads((work / "served.json").read_text())
    assert len(served) == 2 and all(0 < s["tokens"] <= 6 for s in served)
    records = read_traffic(work / "traffic")
    assert sorted(int(r.answer.sum()) for r in records) == sorted(s["tokens"] for s in served)


def test_a_held_call_is_written_as_the_templates_write_calls(chat_tokenizer):
    """A forced (or strict) call's JSON had llguidance's flexible whitespace:
    a model pushed into a call could pad it with spaces and newlines up to
    max_tokens. It is held to json.dumps' separators, the json_tools
    templates' own (tests/tiny_chat.py's renders calls with them), with no
    other whitespace; the arguments string mlx-lm's parser returns is
    json.dumps of the parsed call either way (no padding reaches a client)."""
    tok = chat_tokenizer
    for body in ({"tools": [WEATHER, OTHER], "tool_choice": "required"},
                 {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                 {"tools": [WEATHER]}):
        form = format_of(body, tok)
        assert takes(form, tok, CALL)
        call = json.loads(CALL.split("\n")[1])
        assert CALL.split("\n")[1] == json.dumps(call)  # (the templates' separators)
        for padded in ('{"name": "get_weather", "arguments": {"city": "Paris"} }',
                       '{"name": "get_weather",\n"arguments": {"city": "Paris"}}',
                       '{ "name": "get_weather", "arguments": {"city": "Paris"}}',
                       '{"name":"get_weather","arguments":{"city":"Paris"}}'):
            assert not takes(form, tok, f"<tool_call>\n{padded}\n</tool_call>"), (body, padded)
