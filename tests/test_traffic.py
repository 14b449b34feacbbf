"""Recorded traffic (dflash_mlx.traffic) and ``mlx-dflash train --from-traffic``:
what is stored, within what bound, what is refused, and that an adapted
drafter is written only when it beats the one it started from."""

import errno
import json
import os
import stat

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx import train as T
from dflash_mlx import traffic
from dflash_mlx.batch import batch_generate
from dflash_mlx.cache import make_prompt_cache
from dflash_mlx.targets import adapter_for
from dflash_mlx.traffic import Recorder, TrafficError, read_traffic

import tiny


def records_in(path):
    return sorted((path / traffic.RECORDS).glob("*.npz"))


def test_a_record_is_the_conversation_and_its_answer_marks(tmp_path):
    rec = Recorder(tmp_path / "t")
    rec.record([1, 2, 3], [4, 5])
    (r,) = read_traffic(tmp_path / "t")
    assert r.tokens.tolist() == [1, 2, 3, 4, 5] and r.answer.tolist() == [False] * 3 + [True] * 2
    f = records_in(tmp_path / "t")[0]
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "t").stat().st_mode) == 0o700
    # A later turn replaces its conversation's record and keeps the first answer's marks.
    rec.record([1, 2, 3, 4, 5, 6], [7])
    (r,) = read_traffic(tmp_path / "t")
    assert r.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert r.answer.tolist() == [False] * 3 + [True] * 2 + [False, True]
    rec.record([9, 9], [8])  # another conversation: a record of its own, after the first
    assert [x.tokens.tolist()[0] for x in read_traffic(tmp_path / "t")] == [1, 9]
    assert not [p for p in (tmp_path / "t" / traffic.RECORDS).iterdir() if p.suffix != ".npz"]  # no temporaries


def test_the_byte_bound_holds_oldest_out_first(tmp_path):
    one = len(traffic.encode_record(np.arange(100), np.ones(100, bool)))
    rec = Recorder(tmp_path / "t", max_bytes=3 * one + 10)
    for i in range(7):
        rec.record([1000 + i], np.arange(99))
        assert sum(f.stat().st_size for f in records_in(tmp_path / "t")) <= 3 * one + 10
    assert [r.tokens[0] for r in read_traffic(tmp_path / "t")] == [1004, 1005, 1006]
    again = Recorder(tmp_path / "t", max_bytes=one + 10)  # a new session counts what is there
    again.record([2000], np.arange(99))
    assert [r.tokens[0] for r in read_traffic(tmp_path / "t")] == [2000]


def test_bad_directories_and_files(tmp_path, caplog):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(TrafficError, match="not a traffic directory"):
        Recorder(other)
    with pytest.raises(TrafficError, match="not a traffic directory"):
        read_traffic(other)
    with pytest.raises(TrafficError, match="holds no recorded traffic"):
        read_traffic(tmp_path / "missing")
    rec = Recorder(tmp_path / "t")
    rec.record([1, 2], [3])
    rec.record([4, 5], [6])
    bad = records_in(tmp_path / "t")[0]
    bad.write_bytes(bad.read_bytes()[:40])  # a truncated record: skipped, with a warning
    assert [r.tokens.tolist() for r in read_traffic(tmp_path / "t")] == [[4, 5, 6]]
    assert "corrupt traffic record" in caplog.text
    for f in records_in(tmp_path / "t"):
        f.write_bytes(b"junk")
    with pytest.raises(TrafficError, match="no readable recorded conversation"):
        read_traffic(tmp_path / "t")


def test_a_full_disk_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    rec = Recorder(tmp_path / "t")
    rec.record([1], [2])

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(TrafficError, match="disk is full"):
        rec.record([5], [6])
    traffic.record_safely(rec, [5], [6])  # a serving loop logs it and goes on
    assert "disk is full" in caplog.text
    monkeypatch.undo()
    assert [r.tokens.tolist() for r in read_traffic(tmp_path / "t")] == [[1, 2]]
    assert len(list((tmp_path / "t" / traffic.RECORDS).iterdir())) == 1


def test_recording_changes_no_output_and_needs_asking(qwen3_pair, tmp_path):
    """stream_generate(record=...) yields what it yields without, which is
    mlx-lm's greedy text; each turn of a conversation on one prompt cache
    extends one record. Without ``record`` nothing is written anywhere."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    before = set(tmp_path.rglob("*"))
    plain, _ = pair.dflash(draft, "def f(x):", max_tokens=12)
    assert set(tmp_path.rglob("*")) == before
    rec = Recorder(tmp_path / "t")
    recorded, _ = pair.dflash(draft, "def f(x):", max_tokens=12, record=rec)
    assert recorded == plain == pair.reference("def f(x):", 12)
    (r,) = read_traffic(tmp_path / "t")
    prompt = pair.tokenizer.encode("def f(x):")
    assert r.tokens.tolist()[: len(prompt)] == prompt and r.answer.sum() == len(r.tokens) - len(prompt)
    cache = make_prompt_cache(pair.model, draft)
    for turn in ("import os\n", "x = 1\n"):
        list(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, turn, max_tokens=6, prompt_cache=cache, record=rec))
    conv = read_traffic(tmp_path / "t")[-1]
    assert len(read_traffic(tmp_path / "t")) == 2 and conv.answer.sum() >= 10  # both answers, one record


def test_batch_generate_records_each_request(qwen3_pair, tmp_path):
    """batch_generate(record=...): one record per request, its prompt and
    its answer (mlx-lm's greedy tokens), the output unchanged."""
    pair = qwen3_pair
    draft = dflash_mlx.load_draft(pair.make_draft(tmp_path / "d", block_size=4), pair.model)
    prompts = ["def f(x):", "import os\n"]
    rec = Recorder(tmp_path / "t")
    result = batch_generate(pair.model, draft, pair.tokenizer, prompts, max_tokens=10, record=rec)
    assert result.tokens == [pair.reference(p, 10) for p in prompts]
    records = read_traffic(tmp_path / "t")
    assert len(records) == 2
    for p, answer in zip(prompts, result.tokens):
        prompt = pair.tokenizer.encode(p)
        (r,) = [r for r in records if r.tokens.tolist()[: len(prompt)] == prompt]
        assert r.tokens.tolist()[len(prompt) :][: len(answer)] == answer and r.answer.sum() == len(r.tokens) - len(prompt)


# --------------------------------------------------------------- --from-traffic


@pytest.fixture(scope="module")
def recorded(qwen3_pair, tmp_path_factory):
    """A traffic directory of 24 greedy conversations of the tiny target."""
    return tiny.recorded_traffic(qwen3_pair, tmp_path_factory.mktemp("traffic")).root


def adapt_argv(pair, traffic_dir, init, out, *extra):
    return [
        "--model", str(pair.path), "--from-traffic", str(traffic_dir), "--init-from", str(init), "--draft-model", str(out),
        "--seq-len", "48", "--batch-size", "4", "--anchors-per-seq", "8", "--warmup", "2", "--eval-every", "100", *extra,
    ]  # fmt: skip


def test_adapting_writes_only_a_better_drafter(qwen3_pair, recorded, tmp_path, capsys):
    """A random drafter fine-tuned on the traffic beats itself on the held-out
    tenth: written, with its scores, and it decodes losslessly. A run that
    wrecks it (a huge learning rate) scores worse: refused, nothing written."""
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    good = tmp_path / "good"
    assert cli.run(T.main, adapt_argv(pair, recorded, init, good, "--steps", "60", "--learning-rate", "2e-2")) == 0
    out = capsys.readouterr().out
    result = json.loads((good / traffic.ADAPT_RESULT).read_text())
    assert result["written"] and result["after"] > result["before"] and "held-out tokens per cycle" in out
    assert sorted(p.name for p in good.iterdir()) == ["adapt.json", "config.json", "model.safetensors"]
    assert not (tmp_path / ("good" + traffic.ADAPTING)).exists()
    adapted = dflash_mlx.load_draft(good, pair.model)
    got, _ = pair.dflash(adapted, "def f(x):", eos_ids=[], max_tokens=24)
    assert got == pair.reference("def f(x):", 24, eos_ids=[])
    bad = tmp_path / "bad"
    assert cli.run(T.main, adapt_argv(pair, recorded, good, bad, "--steps", "6", "--learning-rate", "5")) == 0
    assert "does not beat" in capsys.readouterr().out
    assert not bad.exists() and not (tmp_path / ("bad" + traffic.ADAPTING)).exists()


def old_rows(tmp_path):
    """Replay data: 40 rows of 48 counting tokens, unlike any recorded
    conversation, each starting at a token of its own."""
    np.save(tmp_path / "old.npy", (5 * np.arange(40, dtype=np.int32)[:, None] + np.arange(48)) % 200)
    return str(tmp_path / "old.npy")


def test_replay_rows_are_drawn_at_their_share_and_some_are_held_out(qwen3_pair, recorded, tmp_path):
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    args = T.TrainConfig(**{**vars(T.setup_arg_parser().parse_args(
        adapt_argv(pair, recorded, init, tmp_path / "o", "--data", old_rows(tmp_path), "--replay-share", "0.5"))),
        "taps": None})  # fmt: skip
    T.check_args(args)
    docs, answers, held_out, written, weights = T.traffic_data(args, pair.tokenizer, pair.vocab)
    old = [d for d in docs if d.max() < 200 and (np.diff(d) == 1).sum() > 40]
    assert len(old) == 40 - T.REPLAY_HELD_OUT and all(len(d) == 48 for d in docs)  # every row the run may draw
    new = len(docs) - len(old)
    assert weights[:new].sum() == pytest.approx(0.5) and weights[new:].sum() == pytest.approx(0.5)
    assert len(held_out["eval"][0]) == 2 and answers.shape == (48 * len(docs),)
    replay, marks = held_out["eval_replay"]
    assert len(replay) == T.REPLAY_HELD_OUT and all(m.all() for m in marks)  # no --answer-mask: every token
    assert not {r[0] for r in replay} & {d[0] for d in old}  # held out: never trained on
    records = read_traffic(recorded)[:-2]
    assert written.tolist() == sorted({int(t) for r in records for t in r.tokens[r.answer]})


def test_a_candidate_must_beat_on_the_traffic_and_keep_the_replayed_data():
    better = {"before": 1.5, "after": 1.8}
    assert traffic.refusal(better) is None
    assert "does not beat" in traffic.refusal({"before": 1.5, "after": 1.5})
    assert traffic.refusal({**better, "replay": {"before": 2.0, "after": 2.0 * traffic.KEEP_SHARE}}) is None
    assert "forgets" in traffic.refusal({**better, "replay": {"before": 2.0, "after": 2.0 * traffic.KEEP_SHARE - 0.01}})


def test_a_candidate_that_forgets_the_replayed_data_is_refused(qwen3_pair, recorded, tmp_path, capsys, monkeypatch):
    """With --data the run scores the held-out replay rows before and after
    and prints both; a candidate below the kept share of them is refused
    (here every candidate: the share is set out of reach), nothing written."""
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    monkeypatch.setattr(traffic, "KEEP_SHARE", 100.0)
    out = tmp_path / "o"
    argv = adapt_argv(pair, recorded, init, out, "--steps", "4", "--learning-rate", "3e-3", "--data", old_rows(tmp_path))
    assert cli.run(T.main, argv) == 0
    printed = capsys.readouterr().out
    assert "held-out replay rows" in printed and "forgets" in printed and "not written" in printed
    assert not out.exists() and not (tmp_path / ("o" + traffic.ADAPTING)).exists()


def test_the_draft_vocabulary_takes_in_the_traffic_and_the_start_is_the_drafter_as_it_is(qwen3_pair, recorded, tmp_path, capsys):
    """A drafter scoring a draft vocabulary learns the ids the target wrote
    in the traffic (it could never propose the others); the score it is
    compared with is its own, with the vocabulary it had."""
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    cfg = json.loads((init / "config.json").read_text())
    cfg["dflash_config"]["draft_vocab"] = list(range(0, pair.vocab, 7))
    (init / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o"
    assert cli.run(T.main, adapt_argv(pair, recorded, init, out, "--steps", "60", "--learning-rate", "2e-2")) == 0
    result = json.loads((out / traffic.ADAPT_RESULT).read_text())
    held, adapter = read_traffic(recorded)[-2:], adapter_for(pair.model)
    draft = dflash_mlx.load_draft(init, pair.model, dtype=mx.float32)
    taps = [T.target_pass(adapter, mx.array(r.tokens[None]), draft.config.target_layer_ids)[0] for r in held]
    own = T.held_out_cycles(draft, adapter, [r.tokens for r in held], [r.answer for r in held], taps)
    assert result["before"] == round(float(np.mean(own)), 4)
    ids = json.loads((out / "config.json").read_text())["dflash_config"]["draft_vocab"]
    written = {int(t) for r in read_traffic(recorded)[:-2] for t in r.tokens[r.answer]}
    assert ids == sorted(set(cfg["dflash_config"]["draft_vocab"]) | written) and len(ids) > len(cfg["dflash_config"]["draft_vocab"])
    got, _ = pair.dflash(dflash_mlx.load_draft(out, pair.model), "def f(x):", eos_ids=[], max_tokens=24)
    assert got == pair.reference("def f(x):", 24, eos_ids=[])


@pytest.mark.parametrize("case", ["not-traffic", "no-init", "eval-data", "cache-bytes", "cache-dir"])
def test_bad_adapt_input_is_one_line(case, qwen3_pair, recorded, tmp_path, capsys):
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8)
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("x")
    argv = adapt_argv(pair, other if case == "not-traffic" else recorded, init, tmp_path / "o")
    if case == "no-init":
        argv[argv.index("--init-from") + 1] = str(tmp_path / "nothing")
    if case == "eval-data":
        argv += ["--eval-data", str(other / "x")]
    argv += {"cache-bytes": ["--cache-max-bytes", "0"], "cache-dir": ["--no-cache-target", "--cache-dir", str(tmp_path / "c")]}.get(case, [])
    try:
        code = cli.run(T.main, argv)
    except SystemExit as e:  # argparse's own check of a flag's value
        code = e.code
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    words = {"not-traffic": "not a traffic directory", "no-init": "--init-from", "eval-data": "--eval-data",
             "cache-bytes": "--cache-max-bytes", "cache-dir": "--cache-dir"}  # fmt: skip
    assert words[case] in err


# ------------------------------------------- a fine-tune's defaults (issue 62)


def traffic_config(pair, traffic_dir, init, out, *extra):
    """The TrainConfig of ``train --from-traffic`` with the user's defaults
    (no --anchors-per-seq, no lever flags), checked and its defaults filled."""
    argv = [
        "--model", str(pair.path), "--from-traffic", str(traffic_dir), "--init-from", str(init), "--draft-model", str(out),
        "--seq-len", "48", "--steps", "3", *extra,
    ]  # fmt: skip
    args = T.TrainConfig(**{**vars(T.setup_arg_parser().parse_args(argv)), "taps": None})
    T.check_args(args)
    return args


def counted_target_passes(monkeypatch):
    """The tap passes a run makes (the target's outputs for a batch or a cache fill)."""
    calls = []
    real = T.target_pass
    monkeypatch.setattr(T, "target_pass", lambda adapter, tokens, taps: calls.append(tokens.shape[0]) or real(adapter, tokens, taps))
    return calls


def test_a_fine_tune_takes_the_benchs_levers_by_default(qwen3_pair, recorded, tmp_path, monkeypatch):
    """With no flag, --from-traffic keeps the traffic's target outputs (the
    target runs once per row, not once per step), runs the target in
    float32 through the approximate fused exp and the drafter's softmax
    approximately (its first-batch check passes on this CPU), with the
    recipes' 16 anchors; a run from scratch keeps every lever off."""
    from dflash_mlx.targets.approximate import ApproxAttention

    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    args = traffic_config(pair, recorded, init, tmp_path / "o", "--steps", "12")
    assert (args.cache_target, args.anchors_per_seq, args.target_dtype) == (True, T.FINE_TUNE_ANCHORS, "float32")
    assert args.approximate_target is None and args.approximate_softmax is None  # left to their checks
    calls = counted_target_passes(monkeypatch)
    state = T.train(args)
    assert state["run"]["approximate_target"] is True and state["run"]["approximate_softmax"] is True
    rows = len(T.pack(read_traffic(recorded)[:-2], 48)[0])
    assert sum(calls) <= rows + 2 * len(read_traffic(recorded))  # each row once, the held-out rows twice
    assert sum(calls) < 12 * 4  # the target did not run for every window of every step
    model = T.prepare(traffic_config(pair, recorded, init, tmp_path / "p"))[0]
    assert isinstance(model.model.layers[0].self_attn, ApproxAttention)
    scratch = T.TrainConfig(model=str(pair.path), data=["x"], draft_model=str(tmp_path / "s"))
    T.fill_defaults(scratch)
    assert (scratch.cache_target, scratch.approximate_target, scratch.approximate_softmax) == (False, False, False)
    assert (scratch.anchors_per_seq, scratch.target_dtype) == (T.ANCHORS, None)


@pytest.mark.parametrize("flag", ["--no-cache-target", "--no-approximate-target", "--no-approximate-softmax"])
def test_each_default_lever_has_a_flag_that_turns_it_off(flag, qwen3_pair, recorded, tmp_path, monkeypatch):
    from dflash_mlx.targets.approximate import ApproxAttention

    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    args = traffic_config(pair, recorded, init, tmp_path / "o", flag, "--steps", "6")
    calls = counted_target_passes(monkeypatch)
    state = T.train(args)
    if flag == "--no-cache-target":
        assert calls.count(4) >= 6  # the batch's four windows through the target at every step
    else:
        key = flag[len("--no-") :].replace("-", "_")
        assert state["run"][key] is False and calls.count(4) < 6
    if flag == "--no-approximate-target":
        assert not isinstance(T.prepare(args)[0].model.layers[0].self_attn, ApproxAttention)
    explicit = traffic_config(pair, recorded, init, tmp_path / "e", "--target-dtype", "bfloat16", "--anchors-per-seq", "8")
    assert (explicit.target_dtype, explicit.anchors_per_seq) == ("bfloat16", 8)


def test_the_softmax_check_turns_the_approximation_off_when_it_is_not_close(qwen3_pair, recorded, tmp_path, monkeypatch, capsys):
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    monkeypatch.setattr(T, "SOFTMAX_TOLERANCE", -1.0)  # nothing is close enough
    assert T.train(traffic_config(pair, recorded, init, tmp_path / "o"))["run"]["approximate_softmax"] is False
    assert "approximate softmax off" in capsys.readouterr().err
    forced = traffic_config(pair, recorded, init, tmp_path / "f", "--approximate-softmax")
    assert T.train(forced)["run"]["approximate_softmax"] is True


def test_the_cache_keeps_within_its_memory_bound(qwen3_pair, recorded, tmp_path, capsys):
    """--cache-max-bytes bounds the rows kept; the others run the target
    when drawn, and every row's outputs are the target's own."""
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    _, adapter, docs, data, *_ = T.prepare(traffic_config(pair, recorded, init, tmp_path / "o"))
    args = traffic_config(pair, recorded, init, tmp_path / "o", "--steps", "100")
    width = len(args.taps) * adapter.hidden_size
    row = 48 * (4 * width + 4) + 1
    args.cache_max_bytes = 2 * row
    cached = T.TargetOutputs(adapter, args, len(docs), width)
    assert cached.arrays["taps"].shape[0] == 2 and "keeps 2 of the" in capsys.readouterr().err
    plain = T.TargetOutputs(adapter, T.TrainConfig(**{**vars(args), "cache_target": False}), len(docs), width)
    flat = np.concatenate(docs)
    starts = np.array([0, 1, 2, len(docs) - 1]) * 48
    windows = np.stack([flat[s : s + 48] for s in starts])
    (taps, greedy), (want, labels) = cached(starts, windows), plain(starts, windows)
    np.testing.assert_allclose(np.array(taps), np.array(want), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.array(greedy), np.array(labels))


def test_the_expected_end_is_the_steps_left_or_max_minutes():
    import time

    args = T.TrainConfig(model="m", draft_model="o", max_minutes=10.0)
    clock = lambda s: time.strftime("%H:%M", time.localtime(time.time() + s))  # noqa: E731
    assert T.expected_end(args, 100, 3.0, 0.0) == clock(300)  # 5 minutes of steps, inside the 10
    assert T.expected_end(args, 1000, 3.0, 420.0) == clock(180)  # --max-minutes first: 3 minutes left
    assert T.expected_end(T.TrainConfig(model="m", draft_model="o"), 1000, 3.0, 0.0) == clock(3000)


def test_the_bar_shows_seconds_a_step_and_the_end(qwen3_pair, recorded, tmp_path, capsys):
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    assert cli.run(T.main, adapt_argv(pair, recorded, init, tmp_path / "o", "--steps", "3", "--max-minutes", "5")) == 0
    err = capsys.readouterr().err
    assert "3/3" in err and "ends=" in err and ("s/step" in err or "step/s" in err)


def test_max_minutes_ends_the_run_with_its_checkpoint(qwen3_pair, recorded, tmp_path, capsys):
    pair = qwen3_pair
    init = pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    argv = adapt_argv(pair, recorded, init, tmp_path / "o", "--steps", "50", "--max-minutes", "1e-9")
    assert cli.run(T.main, argv) == 0
    out, err = capsys.readouterr()
    assert "adapted (1 steps, " in out and "1/50" in err
