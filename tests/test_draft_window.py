"""The draft window: a drafter reading only the first S and the last W
context positions decodes exactly what mlx-lm decodes, and keeps no more."""

import functools
import importlib
import json
import os
import threading
import time

import mlx.core as mx
import numpy as np
import openai
import pytest
from test_prompt_cache import dflash_conversation, mlx_lm_conversation, random_turns, tokens_of, without_eos
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache
from tiny import FULL, SLIDING, Pair, ScriptedSizer, prompt_of, reference_responses

import dflash_mlx
from dflash_mlx import benchmark
from dflash_mlx import cache as cache_module
from dflash_mlx import server as dserver
from dflash_mlx.cache import load_prompt_cache, save_prompt_cache
from dflash_mlx.defaults import DEFAULT_DRAFT_SINK, DEFAULT_DRAFT_WINDOW
from dflash_mlx.errors import ArgumentError
from dflash_mlx.generate import encode_prompt
from dflash_mlx.prefill import feed
from dflash_mlx.random_pair import LLAMA

FAMILIES = ["qwen3", "qwen3_5", "llama", "gemma4_text", "gpt_oss", "qwen3_next", "kimi_k25"]
PROMPT = prompt_of(200)


def held_positions(cache):
    return [c.positions().tolist() for c in cache.draft]


def window_rows(offset, window, sink):
    """Positions a full-attention layer holds after ``offset`` positions."""
    return sorted(set(range(min(sink, offset))) | set(range(max(0, offset - window), offset)))


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_with_a_window_on_every_family(make_pair, tmp_path, family):
    """Windows 1, 16 and 1,024 on each family, the sinks 0 and 64 taking
    turns (every pairing happens across the families)."""
    pair = make_pair(family)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    want = pair.reference(PROMPT, 16)
    turn = FAMILIES.index(family) % 2
    for window, sink in ((1, 64 * turn), (16, 64 * (1 - turn)), (1024, 64 * turn)):
        cache = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=window, draft_sink=sink)
        # a fixed block drafts every cycle; small prefill chunks drop tap states chunk by chunk
        got, _ = pair.dflash(draft, PROMPT, max_tokens=16, block_size=4, prefill_step_size=64, prompt_cache=cache)
        assert got == want, (window, sink)
        offset = cache.draft[0].offset
        assert offset > len(PROMPT) and all(p == window_rows(offset, window, sink) for p in held_positions(cache))


def test_rows_held_are_the_full_contexts_at_their_positions(qwen3_pair, tmp_path):
    """A sliding layer keeps its trained window, the full layer the sink and
    window; each row is the unwindowed drafter's row at the same absolute
    position (RoPE included), whatever the prefill's chunking."""
    pair = qwen3_pair
    path = pair.make_draft(tmp_path / "d", block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    draft = dflash_mlx.load_draft(path, pair.model)
    runs = {}
    for name, window, step in (("full", 0, 512), ("windowed", 16, 512), ("chunked", 16, 7)):
        cache = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=window, draft_sink=3)
        tokens, _ = pair.dflash(draft, PROMPT, max_tokens=20, block_size=4, prefill_step_size=step, prompt_cache=cache)
        runs[name] = tokens, cache
    assert runs["full"][0] == runs["windowed"][0] == runs["chunked"][0] == pair.reference(PROMPT, 20)
    full, windowed, chunked = (runs[k][1] for k in ("full", "windowed", "chunked"))
    offset = full.draft[0].offset
    assert held_positions(windowed) == held_positions(chunked) == [
        list(range(offset - 5, offset)), window_rows(offset, 16, 3)
    ]
    assert held_positions(full)[1] == list(range(offset))
    for cache in (windowed, chunked):
        for c, ref in zip(cache.draft, full.draft):
            at = c.positions()
            for got, want in zip(c.fetch(), ref.fetch()):
                want = want[:, :, at] if ref.window is None else want
                np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family,window,sink", [("qwen3", 1, 0), ("qwen3_5", 16, 64), ("llama", 16, 0)])
def test_three_turns_with_a_window_equal_mlx_lm(make_pair, tmp_path, family, window, sink):
    pair = make_pair(family)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    turns = random_turns((90, 20, 7), seed=3)
    want, offset = mlx_lm_conversation(pair.model, pair.tokenizer, turns, 12)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=window, draft_sink=sink)
    got, cache = dflash_conversation(pair.model, draft, pair.tokenizer, turns, 12, cache=cache, block_size=4)
    for w, g in zip(want, got):
        assert tokens_of(g) == without_eos(w, pair.tokenizer)
    assert cache.offset == offset
    assert all(c.size <= window + sink for c in cache.draft)


def test_trim_back_past_evicted_rows(qwen3_pair, tmp_path):
    """Trimming into rows the window evicted leaves the drafter's context
    without them: the output stays exact, and what it holds is what a fresh
    prefill with the same window holds at those positions. Trimming within
    the rows still held leaves the state a fresh prefill's."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    first, second = random_turns((80, 9), seed=5)

    def fresh(tokens):
        cache = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=16, draft_sink=4)
        out, _ = pair.dflash(draft, tokens, max_tokens=8, block_size=4, eos_ids=[], prompt_cache=cache)
        return out, cache

    for trim in (3, 40):
        _, cache = fresh(first)
        assert cache.is_trimmable() and cache.trim(trim) == trim
        prefix = list(cache.tokens)
        got, _ = pair.dflash(draft, second, max_tokens=8, block_size=4, eos_ids=[], prompt_cache=cache)
        want, ref = fresh(prefix + second)
        assert got == want == pair.reference(prefix + second, 8, eos_ids=[])
        assert cache.tokens == ref.tokens
        for c, r in zip(cache.draft, ref.draft):
            held, fresh_held = c.positions().tolist(), r.positions().tolist()
            if trim == 3:  # all of the window after the trim was still held
                assert held == fresh_held
            else:
                assert set(held) < set(fresh_held)
            same = [fresh_held.index(p) for p in held]
            np.testing.assert_allclose(np.array(c.fetch()[0]), np.array(r.fetch()[0][:, :, same]), rtol=1e-4, atol=1e-5)


def test_trim_into_dropped_tap_states_then_save_and_load(qwen3_pair, tmp_path):
    """Tap states dropped at prefill (the hole) survive a trim into them and
    a save/load: the next turn is exact."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    prompt, more = random_turns((200, 6), seed=8)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=8, draft_sink=2)
    feed(draft.target, cache, prompt, 50)  # the target runs all but the last; the drafter has taken nothing
    assert cache.hole == (2, len(prompt) - 1 - 8) and cache.lag_rows() == 2 + 8
    assert cache.trim(20) == 20  # into the hole: only the sink's tap states stay
    assert cache.hole == (2, len(prompt) - 20) and cache.lag_rows() == 2
    prompt = prompt[:-20]
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path, draft)
    assert (loaded.hole, loaded.draft_window, loaded.draft_sink) == (cache.hole, 8, 2)
    assert [c.skipped for c in loaded.draft] == [cache.hole] * len(loaded.draft)
    got, _ = pair.dflash(draft, more, max_tokens=10, block_size=4, eos_ids=[], prompt_cache=loaded)
    assert got == pair.reference(prompt + more, 10, eos_ids=[])


def test_the_default_window_and_the_whole_context(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    assert (cache.draft_window, cache.draft_sink) == (DEFAULT_DRAFT_WINDOW, DEFAULT_DRAFT_SINK)
    assert {c.window for c in cache.draft} == {DEFAULT_DRAFT_WINDOW}
    whole = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=0, draft_sink=5)
    assert (whole.draft_window, whole.draft_sink) == (None, 0) and {c.window for c in whole.draft} == {None}


@pytest.mark.parametrize("window,sink", [(0, 0), (16, 4)])
def test_a_long_plain_run_then_a_draft_reads_what_it_would_unjoined(qwen3_pair, tmp_path, monkeypatch, window, sink):
    """Plain steps leave one tap row each; they are joined every
    ``JOIN_CHUNKS`` steps, so a long plain run holds a few arrays. After 70
    plain steps and two drafts the drafter's context (its cache and what it
    is still to inject) is what it is when they are never joined, bit for
    bit, and the output is mlx-lm's."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    prompt, runs, every = prompt_of(30), {}, cache_module.JOIN_CHUNKS
    plain = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=window, draft_sink=sink)
    pair.dflash(draft, prompt, max_tokens=80, sizer=ScriptedSizer([4] + [1] * 100, max_block=4), prompt_cache=plain)
    assert len(plain.hidden_chunks) <= every and plain.lag_rows() >= (70 if not window else window)
    for name, join in (("joined", every), ("apart", 10**9)):
        monkeypatch.setattr(cache_module, "JOIN_CHUNKS", join)
        cache = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=window, draft_sink=sink)
        sizer = ScriptedSizer([4] + [1] * 70 + [4, 4] + [1] * 100, max_block=4)
        tokens, _ = pair.dflash(draft, prompt, max_tokens=90, sizer=sizer, prompt_cache=cache)
        runs[name] = tokens, cache
    (joined, a), (apart, b) = runs["joined"], runs["apart"]
    assert joined == apart == pair.reference(prompt, 90)
    assert mx.array_equal(a.target_hidden, b.target_hidden) and a.hole == b.hole
    for x, y in zip(a.draft, b.draft):
        assert all(mx.array_equal(u, v) for u, v in zip(x.state, y.state))


@pytest.mark.parametrize("window,sink", [(0, 0), (300, 8)])
def test_plain_rows_are_joined_by_size_class_and_cut_every_join(qwen3_pair, tmp_path, window, sink):
    """2,000 one-row tap chunks (a long run of plain steps): the pending
    rows stay few arrays, in order and unchanged; with a window, fewer than
    ``JOIN_CHUNKS`` unreadable rows wait between two cuts, and a read cuts
    them first."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=window, draft_sink=sink)
    every, n = cache_module.JOIN_CHUNKS, 2000
    rows = mx.arange(n * 3, dtype=mx.float32).reshape(1, n, 3)
    for i in range(n):
        cache.add_hidden(rows[:, i : i + 1])
        if window:
            assert cache.lag_rows() < sink + window + every
    assert len(cache.hidden_chunks) <= 3 * every  # a few size classes, not one array per row
    if not window:  # the rows climbed two classes (a window cuts them before)
        assert max(c.shape[1] for c in cache.hidden_chunks) >= every * every
    kept = np.arange(n) if not window else np.r_[0:sink, n - window : n]
    assert np.array_equal(np.array(cache.target_hidden), np.array(rows)[:, kept])
    assert cache.lag_rows() == len(kept) and (cache.hole == (sink, n - window) if window else cache.hole is None)


def test_bad_windows_are_one_clear_error(qwen3_pair, tmp_path):
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d"), pair.model)
    for kw, what in ((dict(draft_window=-1), "draft_window"), (dict(draft_window=8, draft_sink=-1), "draft_sink"),
                     (dict(draft_window=True), "draft_window")):
        with pytest.raises(ArgumentError, match=what):
            dflash_mlx.make_prompt_cache(pair.model, draft, **kw)
        with pytest.raises(ArgumentError, match=what):
            next(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, [1, 2], **kw))
    cache = dflash_mlx.make_prompt_cache(pair.model, draft, draft_window=16, draft_sink=4)
    with pytest.raises(ArgumentError, match="made with draft_window=16, draft_sink=4"):
        next(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, [1, 2], prompt_cache=cache, draft_window=32))
    assert cache.offset == 0  # refused before any work
    # the cache's own window, asked for or left out, is fine
    for kw in ({}, dict(draft_window=16), dict(draft_sink=4)):
        next(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, [1, 2], prompt_cache=cache, max_tokens=1, **kw))


@pytest.mark.parametrize("name", ["generate", "chat", "server", "benchmark"])
def test_cli_rejects_bad_windows(name, capsys):
    command = importlib.import_module(f"dflash_mlx.{name}")
    for flags, message in ((["--draft-window", "-1"], "--draft-window: must be at least 0, got -1"),
                           (["--draft-sink", "-1"], "--draft-sink: must be at least 0, got -1")):
        with pytest.raises(SystemExit) as stop:
            command.setup_arg_parser().parse_args(flags)
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err.startswith("error: ") and err.strip().endswith(message), err
    args = command.setup_arg_parser().parse_args(["--draft-window", "8", "--draft-sink", "2"])
    assert (args.draft_window, args.draft_sink) == ([8] if command is benchmark else 8, 2)


def test_long_prompt_keeps_the_bound_in_the_server_and_its_snapshots(tmp_path):
    """After a 6,000-token prompt through the server (W 64, S 16), every
    stored entry's drafter side holds at most S + W rows: its context caches
    and the tap states not yet injected. The answers are mlx-lm's. The
    target (a sliding layer and a full one) cannot trim once its window
    slid, so the server snapshots the second prompt's end."""
    base = dict(LLAMA, max_position_embeddings=8192, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=1, num_hidden_layers=2, layer_types=[SLIDING, FULL], sliding_window=32)
    pair = Pair(tmp_path / "t", base)
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    window, sink = 64, 16
    args = dserver.setup_arg_parser().parse_args(
        ["--port", "0", "--draft-window", str(window), "--draft-sink", str(sink), "--block-size", "4"]
    )
    srv = dserver.make_server(args, pair.model, pair.tokenizer, draft, "tiny-draft")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="x", max_retries=0, timeout=600)
        lm_cache = mlx_lm_make_prompt_cache(pair.model)
        keys, prompt = [], []  # the entries' tokens: the cache after each answer, the second prompt's snapshot
        for turn, new in enumerate((np.random.default_rng(0).integers(0, 256, 6000).tolist(), [10, 11, 12])):
            prompt = prompt + new
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            want = reference_responses(pair.model, pair.tokenizer, new, 8, prompt_cache=lm_cache)
            assert r.choices[0].text == "".join(w.text for w in want)
            keys += [prompt] * turn + [prompt + [w.token for w in want]]
            prompt = keys[-1]
        assert r.usage.prompt_tokens_details.cached_tokens >= 6000
    finally:
        srv.shutdown()
        srv.server_close()
        srv.generator.stop_and_join()
    lru = srv.generator.prompt_cache
    entries = [lru.fetch_nearest_cache(srv.generator.key, k) for k in keys]
    assert len(lru) == len(entries) and all(rest == [] for _, rest in entries)
    assert lru.nbytes == sum(e.nbytes for (e,), _ in entries)  # every entry is checked
    row_bytes = None
    for (cache,), _ in entries:
        assert cache.draft_window == window and (cache.hole is None or cache.hole[0] == sink)
        assert cache.lag_rows() <= sink + window
        for c in cache.draft:
            assert c.size <= sink + window
            row_bytes = row_bytes or (c.size and c.nbytes // c.size)
    assert entries[-1][0][0].draft[0].offset >= 6000  # the drafter did read the long context
    # a few rows per layer, against the 6,000 an unwindowed drafter keeps in each
    drafter_bytes = sum(c.nbytes for (cache,), _ in entries for c in cache.draft)
    assert row_bytes and drafter_bytes <= len(entries) * len(draft.layers) * (sink + window) * row_bytes


@pytest.fixture(scope="module")
def smollm2_long():
    """SmolLM2, a 6,000-token prompt and mlx-lm's 64 greedy tokens after it
    (computed once: a 6,000-token prefill is minutes on a CPU)."""
    from dflash_mlx.benchmark import long_prompt
    from dflash_mlx.pair import load_pair
    from tiny import reference_tokens

    model, tokenizer, draft, _ = load_pair("smollm2")
    prompt = tokenizer.encode(long_prompt(tokenizer, 6000), add_special_tokens=False)
    assert len(prompt) >= 5900
    return model, tokenizer, draft, prompt, reference_tokens(model, tokenizer, prompt, 64)


@pytest.mark.skipif(os.environ.get("DFLASH_MLX_SMOLLM2") != "1", reason="downloads SmolLM2 (set DFLASH_MLX_SMOLLM2=1)")
@pytest.mark.parametrize("window,sink", [(0, 0), (1024, 64), (16, 0)])
def test_smollm2_six_thousand_token_prompt_is_exact(smollm2_long, window, sink):
    model, tokenizer, draft, prompt, want = smollm2_long
    cache = dflash_mlx.make_prompt_cache(model, draft, draft_window=window, draft_sink=sink)
    got = [t for r in dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=64, prompt_cache=cache) for t in r.tokens]
    assert got == want
    if window:
        assert all(c.size <= window + sink for c in cache.draft) and cache.lag_rows() <= window + sink


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_long_prompt_rounds_continue_as_a_fresh_run(request, tmp_path, family):
    """The long-prompt bench's rounds decode in lockstep from a copy of each
    decoder's prefilled state (the last prompt token fed alone): every
    round writes what a fresh run writes, for mlx-lm and DFlash alike, and
    keeps DFlash's cycles; a hybrid target, whose caches cannot trim,
    keeps no state and prefills each round."""
    from mlx_lm.models.cache import make_prompt_cache as lm_cache

    pair = request.getfixturevalue(f"{family}_pair")
    model, tok = pair.model, pair.tokenizer
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), model)
    ids = encode_prompt(tok, benchmark.long_prompt(tok, 200)).tolist()
    fresh = benchmark.run_autoregressive(model, tok, ids, 12)["tokens"]
    decoders = {
        "mlx-lm": benchmark.LongPromptDecoder(
            lambda i, n, c, responses: benchmark.mlx_lm_tokens(model, tok, i, n, c, responses),
            lambda: benchmark.MlxLmCache(lm_cache(model))),
        "dflash": benchmark.LongPromptDecoder(
            lambda i, n, c, responses: benchmark.dflash_tokens(model, draft, tok, i, n, None, responses, prompt_cache=c),
            lambda: dflash_mlx.make_prompt_cache(model, draft, draft_window=16, draft_sink=4)),
    }
    for d in decoders.values():
        d.prefill(ids, 0)
        assert d.ttft_s > 0 and d.peak_gb > 0 and (d.state is None) == (family == "qwen3_5")
    streams = {name: functools.partial(d.stream, ids, 12) for name, d in decoders.items()}
    runs = benchmark.lockstep(streams, 12, 5, 2, untimed=0, held=lambda name: 0)
    for name, d in decoders.items():
        assert [r["tokens"] for r in runs[name]] == [fresh, fresh]
        assert all(r["tps"] > 0 and r["peak_memory"] > 0 for r in runs[name])
        assert len(d.responses) == 2 and d.live is not None  # the last round ran on it
    responses = decoders["dflash"].responses[0]
    assert [t for r in responses for t in r.tokens] == fresh
    # every token after the prefill's in a cycle (and an eos that ends it early)
    assert sum(benchmark.cycle_record(responses)["committed"]) - (len(fresh) - 1) == (len(fresh) < 12)


def test_a_separate_drafter_shares_the_weights_not_what_the_loop_learns(qwen3_pair, tmp_path):
    """The long-prompt bench gives each DFlash decoder a drafter of its own:
    the same weight arrays (no copy, no memory), the same tokens, and a
    calibration and block sizer of its own, so that decoders taking turns
    never mix their cycles into one sizer."""
    from mlx.utils import tree_flatten

    from dflash_mlx.calibration import calibrate
    from dflash_mlx.prefill import prefill

    model, tok = qwen3_pair.model, qwen3_pair.tokenizer
    draft = dflash_mlx.load_draft(qwen3_pair.make_draft(tmp_path / "d", block_size=4), model)
    first = benchmark.run_dflash(model, draft, tok, PROMPT, 12, None)["tokens"]
    twin = benchmark.separate_drafter(draft)
    pairs = zip(tree_flatten(draft.parameters()), tree_flatten(twin.parameters()))
    assert all(a is b for (_, a), (_, b) in pairs)
    active = mx.get_active_memory()
    assert benchmark.run_dflash(model, twin, tok, PROMPT, 12, None)["tokens"] == first
    mx.clear_cache()
    assert mx.get_active_memory() - active < 1_000_000  # no second copy of anything the drafter holds
    cache = dflash_mlx.make_prompt_cache(model, draft)
    prefill(draft.target, cache, prompt_of(9), 2048)
    ours, theirs = (calibrate(d.target, d, cache.target, cache.target_hidden, 4) for d in (draft, twin))
    assert ours is not theirs and ours.sizer is not theirs.sizer
    assert calibrate(twin.target, twin, cache.target, cache.target_hidden, 4) is theirs  # its own, kept


def test_lockstep_takes_turns_and_times_all_but_the_first_token():
    """Turns rotate: the prefill's token first (untimed), then ``chunk``
    tokens a turn; a stream that ends early (an eos) leaves the others
    going; the untimed round is dropped."""
    order = []

    def stream(name, n):
        def tokens():
            for t in range(n):
                order.append(name)
                yield t
        return tokens

    runs = benchmark.lockstep({"a": stream("a", 9), "b": stream("b", 4)}, 9, 3, repeats=2)
    assert [r["tokens"] for r in runs["a"]] == [list(range(9))] * 2 and [r["tokens"] for r in runs["b"]] == [list(range(4))] * 2
    assert all(r["tps"] > 0 and "peak_memory" not in r for r in runs["a"] + runs["b"])
    # per round: a's first token, b's; then b leads the next turn (3 of b, 3 of a); then a (3), b is done
    assert order[-13:] == ["a", "b"] + ["b"] * 3 + ["a"] * 3 + ["a"] * 3 + ["a"] * 2
    assert len(order) == 3 * 13  # one untimed round and two kept
    order.clear()

    def slow():  # 0.02 s a token: past turn_s after 2 tokens
        for t in stream("a", 9)():
            time.sleep(0.02)
            yield t

    runs = benchmark.lockstep({"a": slow, "b": stream("b", 9)}, 9, 4, repeats=1, untimed=0, turn_s=0.03)
    assert [r[0]["tokens"] for r in runs.values()] == [list(range(9))] * 2
    assert order[:12] == ["a", "b"] + ["b"] * 4 + ["a"] * 2 + ["a"] * 2 + ["b"] * 2


def test_bench_long_prompts(qwen3_pair, tmp_path, capsys):
    draft = qwen3_pair.make_draft(tmp_path / "d", block_size=4)
    out = tmp_path / "r.json"
    rc = benchmark.main(["--model", str(qwen3_pair.path), "--draft-model", str(draft), "--prompt-lengths", "150", "400",
                         "--max-tokens", "4", "--draft-window", "16", "--draft-sink", "4", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["prompt_length"] for r in report["lengths"]] == [150, 400] and report["rounds"] == 2
    for row in report["lengths"]:
        assert abs(row["prompt_tokens"] - row["prompt_length"]) <= 2 and row["autoregressive"]["ttft_s"] > 0
        assert list(row["dflash"]) == ["full context", "window 16 + sink 4"]
        for d in row["dflash"].values():
            assert d["outputs_identical"] and d["tokens_per_cycle"] >= 1 and 0 < d["drafter_share"] < 1
            assert 0 <= d["drafting_cycles"] <= 3  # the cycles after the prefill's token
            assert d["peak_memory_gb"] > 0 and d["ttft_s"] > 0 and d["paired_speedup"] > 0
    assert "window 16 + sink 4" in capsys.readouterr().out
    with pytest.raises(ArgumentError, match="--prompt-lengths"):
        benchmark.main(["--model", str(qwen3_pair.path), "--draft-model", str(draft), "--draft-window", "16"])


def test_a_window_keeps_no_prefill_chunk_alive_for_its_few_rows():
    """Cutting a prompt's tap states to the sink and the window copies the
    few rows it keeps of a large chunk: the chunk's memory is freed."""
    import gc

    from dflash_mlx.cache import rows_of

    chunk = mx.random.normal((1, 4096, 512))
    mx.eval(chunk)
    gc.collect()
    before = mx.get_active_memory()
    kept = rows_of([chunk], 0, 64) + rows_of([chunk], 4096 - 1024, 4096)
    mx.eval(kept)
    del chunk
    gc.collect()
    freed = before - mx.get_active_memory()
    assert freed >= 4096 * 512 * 4 - (64 + 1024) * 512 * 4 * 1.01  # only the kept rows stay
    assert [k.shape[1] for k in kept] == [64, 1024]
