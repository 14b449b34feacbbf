"""Audit of the learning and conversion tools (train, --from-traffic,
convert): bad input that once ran long or ended in a traceback."""


import pytest

from dflash_mlx import cli
from dflash_mlx import train as T
from dflash_mlx.cli import main as cli_main

import tiny


@pytest.fixture(scope="module")
def traffic(qwen3_pair, tmp_path_factory):
    return tiny.recorded_traffic(qwen3_pair, tmp_path_factory.mktemp("traffic"), conversations=6)


def one_error_line(capsys, words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and words in err, err
    return err


@pytest.mark.parametrize("where", ["a file", "under a file"])
@pytest.mark.parametrize("kind", ["train", "from traffic", "convert"])
def test_an_output_path_blocked_by_a_file_is_one_error_before_any_work(qwen3_pair, traffic, tmp_path, capsys, kind, where):
    """A --draft-model (--mlx-path) that is a file, or lies under one, was a
    NotADirectoryError traceback, or trained the whole run and then failed
    at its first checkpoint with FileExistsError."""
    (tmp_path / "f").write_text("not a directory")
    out = tmp_path / "f" if where == "a file" else tmp_path / "f" / "out"
    init = qwen3_pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    if kind == "convert":
        if where == "a file":
            pytest.skip("convert replaces an existing destination with --force, and refuses it without")
        capsys.readouterr()
        assert cli_main(["convert", "--hf-path", str(init), "--mlx-path", str(out)]) == 1
        one_error_line(capsys, f"{tmp_path / 'f'} is a file")
        assert (tmp_path / "f").read_text() == "not a directory"
        return
    (tmp_path / "c.txt").write_text(tiny.seeded_source(functions=20))
    data = ["--data", str(tmp_path / "c.txt")] if kind == "train" else ["--from-traffic", str(traffic.root), "--init-from", str(init)]
    argv = ["--model", str(qwen3_pair.path), "--draft-model", str(out), "--block-size", "8", "--seq-len", "32",
            "--anchors-per-seq", "2", "--steps", "2", *data]  # fmt: skip
    capsys.readouterr()
    assert cli.run(T.main, argv) == 1
    one_error_line(capsys, f"{tmp_path / 'f'} is a file")
    assert (tmp_path / "f").read_text() == "not a directory"


@pytest.mark.parametrize("adapt_args, words", [("--steps x", "--steps"), ("--no-such-flag 3", "--no-such-flag"), ('--steps "5', "quotation")])
def test_bad_adapt_args_are_one_error_when_the_server_starts(qwen3_pair, tmp_path, adapt_args, words):
    """server --adapt-args was split and parsed only by each round's child,
    after --adapt-every conversations: every round then failed into its log
    and serving went on, adapting nothing (an unbalanced quote was a bare
    "No closing quotation")."""
    import subprocess
    import sys

    draft = qwen3_pair.make_draft(tmp_path / "d", block_size=8)
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "server", "--model", str(qwen3_pair.path), "--port", "0", "--draft-model", str(draft),
         "--learn", str(tmp_path / "t"), "--adapt", "--adapt-args", adapt_args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and done.stderr.startswith("error: --adapt-args") and words in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


def test_traffic_of_another_vocabulary_is_one_error_naming_it(qwen3_pair, tmp_path, capsys):
    """Traffic recorded with a larger-vocabulary target printed a warning per
    record, then said the directory held nothing and to serve requests with
    --learn first: the wrong fix, for a directory full of conversations."""
    from dflash_mlx.traffic import Recorder

    rec = Recorder(tmp_path / "t")
    for i in range(4):
        rec.record([qwen3_pair.vocab + 7, 1, 2], [qwen3_pair.vocab + i])
    init = qwen3_pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    argv = ["--model", str(qwen3_pair.path), "--from-traffic", str(tmp_path / "t"), "--init-from", str(init),
            "--draft-model", str(tmp_path / "out"), "--seq-len", "32", "--steps", "2"]  # fmt: skip
    capsys.readouterr()
    assert cli.run(T.main, argv) == 1
    err = one_error_line(capsys, f"ids outside the target's vocabulary (0..{qwen3_pair.vocab - 1})")
    assert "4 records" in err and "another" in err and "--learn" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["arrays missing", "arrays truncated", "state not json"])
def test_resume_from_a_damaged_training_state_is_one_error(qwen3_pair, tmp_path, capsys, damage):
    """--resume over a checkpoint whose training state was damaged (a copy
    cut short, a disk error) was a RuntimeError traceback from mx.load, or
    a bare JSON parser message naming no file."""
    (tmp_path / "c.txt").write_text(tiny.seeded_source(functions=40))
    out = tmp_path / "out"
    argv = ["--model", str(qwen3_pair.path), "--data", str(tmp_path / "c.txt"), "--draft-model", str(out),
            "--block-size", "8", "--seq-len", "32", "--anchors-per-seq", "2", "--intermediate-size", "96", "--steps", "2"]  # fmt: skip
    assert cli.run(T.main, argv) == 0
    state = out / T.STATE_DIR
    arrays, saved = state / "training_state.safetensors", state / "training_state.json"
    if damage == "arrays missing":
        arrays.unlink()
    elif damage == "arrays truncated":
        arrays.write_bytes(arrays.read_bytes()[:100])
    else:
        saved.write_text("{")
    capsys.readouterr()
    assert cli.run(T.main, [*argv, "--resume"]) == 1
    one_error_line(capsys, f"--resume: the training state in {out} is damaged")


def test_a_recorder_over_a_traffic_dir_whose_records_were_cleared_records(tmp_path):
    """Clearing old traffic (rm -r DIR/records) and restarting left every
    later record failing with "No such file or directory": the marker was
    there, so the records' directory was never made again."""
    import shutil

    from dflash_mlx.traffic import RECORDS, Recorder, read_traffic

    Recorder(tmp_path / "t").record([1, 2], [3])
    shutil.rmtree(tmp_path / "t" / RECORDS)
    Recorder(tmp_path / "t").record([4, 5], [6, 7])
    assert [r.tokens.tolist() for r in read_traffic(tmp_path / "t")] == [[4, 5, 6, 7]]
    assert (tmp_path / "t" / RECORDS).stat().st_mode & 0o777 == 0o700


def test_convert_never_replaces_a_directory_that_holds_its_source(qwen3_pair, tmp_path, capsys):
    """convert --hf-path DIR/src --mlx-path DIR --force converted, then
    replaced DIR with the result: the source checkpoint was deleted."""
    src = qwen3_pair.make_draft(tmp_path / "box" / "src", block_size=8)
    before = sorted(p.name for p in src.iterdir())
    capsys.readouterr()
    assert cli_main(["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "box"), "--force"]) == 1
    one_error_line(capsys, "holds the source checkpoint")
    assert sorted(p.name for p in src.iterdir()) == before


def test_a_recorder_clears_the_temporary_files_of_a_killed_writer(tmp_path):
    """A recorder killed between writing a record's temporary file and its
    rename left the file for good: never read, never counted against
    --learn-max-bytes, never removed, one more for every kill."""
    import subprocess
    import sys

    from dflash_mlx.traffic import RECORDS, Recorder

    Recorder(tmp_path / "t").record([1, 2], [3])
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    records = tmp_path / "t" / RECORDS
    stale = records / f".0001-x.npz.{int(gone.stdout)}.7.tmp"
    live = records / f".0002-x.npz.{__import__('os').getpid()}.7.tmp"  # a writer still at work
    for f in (stale, live):
        f.write_bytes(b"half a record")
    Recorder(tmp_path / "t")
    assert not stale.exists() and live.exists()


@pytest.mark.parametrize("kind", ["train", "from traffic"])
def test_a_quantized_init_from_is_one_error_naming_the_float_checkpoint(qwen3_pair, traffic, tmp_path, capsys, kind):
    """--init-from a quantized drafter (convert -q) loaded the target and
    the traffic, then failed with "tensors do not match the config:
    unexpected ['fc.biases', ...]", which says neither what nor what to do."""
    init = qwen3_pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    assert cli_main(["convert", "--hf-path", str(init), "--mlx-path", str(tmp_path / "q"), "-q", "--q-group-size", "32"]) == 0
    (tmp_path / "c.txt").write_text(tiny.seeded_source(functions=20))
    data = ["--data", str(tmp_path / "c.txt"), "--intermediate-size", "96"] if kind == "train" else ["--from-traffic", str(traffic.root)]
    argv = ["--model", str(qwen3_pair.path), "--draft-model", str(tmp_path / "out"), "--init-from", str(tmp_path / "q"),
            "--block-size", "8", "--seq-len", "32", "--anchors-per-seq", "2", "--steps", "2", *data]  # fmt: skip
    capsys.readouterr()
    assert cli.run(T.main, argv) == 1
    one_error_line(capsys, "is quantized")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--draft-model elsewhere", "--out elsewhere", "--init-from d", "--from-traffic t", "--model m", "--resume"])
def test_adapt_args_may_not_set_what_each_round_is(qwen3_pair, tmp_path, flag):
    """--adapt-args come last in a round's flags, so "--draft-model X" (or
    the traffic, the drafter, the target) replaced the server's: the round
    wrote X, the server looked for its drafter in drafters/v<N>, and every
    round was logged as not beating the drafter in use."""
    from dflash_mlx.adapt import Adaptation
    from dflash_mlx.errors import ArgumentError
    from dflash_mlx.traffic import Recorder

    draft = qwen3_pair.make_draft(tmp_path / "d", block_size=8)
    with pytest.raises(ArgumentError, match=f"--adapt-args .*{flag.split()[0]}.* is the server's"):
        Adaptation(Recorder(tmp_path / "t"), qwen3_pair.path, draft, train_args=f"--steps 3 {flag}")


def test_a_resumed_fine_tune_scores_its_start_on_the_held_out_traffic_of_now(qwen3_pair, tmp_path, monkeypatch):
    """A --from-traffic run resumed after the traffic grew (the server kept
    recording) kept the score of --init-from on the held-out rows of its
    first start, and compared it with the adapted drafter's score on the
    rows of now, other conversations: the gate that writes OUT compared
    two different tests."""
    import dflash_mlx

    rec = tiny.recorded_traffic(qwen3_pair, tmp_path, conversations=10)
    init = qwen3_pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)

    def config(out, **kw):
        return T.TrainConfig(model=str(qwen3_pair.path), from_traffic=str(rec.root), init_from=str(init), draft_model=str(out),
                             seq_len=48, steps=4, save_every=2, **kw)  # fmt: skip

    real = tiny.interrupt_sampling_at(monkeypatch, 4)  # the approximate softmax's first batch, then steps 1, 2, 3
    with pytest.raises(KeyboardInterrupt):
        T.adapt(config(tmp_path / "out"))
    monkeypatch.setattr(T, "sample_batch", real)
    draft = dflash_mlx.load_draft(init, qwen3_pair.model)
    for i in range(10):  # the traffic grows: its most recent tenth is other conversations
        list(dflash_mlx.stream_generate(qwen3_pair.model, draft, qwen3_pair.tokenizer, tiny.prompt_of(30, seed=100 + i), max_tokens=40, record=rec))
    resumed = T.adapt(config(tmp_path / "out", resume=True))
    fresh = T.adapt(config(tmp_path / "fresh"))
    assert (resumed["before"], resumed["held_out_cycles"]) == (fresh["before"], fresh["held_out_cycles"])


@pytest.mark.parametrize("adapt_args, words", [("--data nowhere.npy", "not found"), ("--replay-share 2", "--replay-share"),
                                               ("--learning-rate nan", "--learning-rate"), ("--eval-data x.npy", "--eval-data")])  # fmt: skip
def test_adapt_args_a_round_would_refuse_are_refused_when_the_server_starts(qwen3_pair, tmp_path, adapt_args, words):
    """Flags that parse but that train --from-traffic refuses (a missing
    --data, a share past 1, a NaN rate, --eval-data) failed every round
    into its log, after --adapt-every conversations each."""
    from dflash_mlx.adapt import Adaptation
    from dflash_mlx.errors import ArgumentError
    from dflash_mlx.traffic import Recorder

    draft = qwen3_pair.make_draft(tmp_path / "d", block_size=8)
    with pytest.raises(ArgumentError, match="--adapt-args") as refused:
        Adaptation(Recorder(tmp_path / "t"), qwen3_pair.path, draft, train_args=adapt_args)
    assert words in str(refused.value)


def test_an_interrupted_fine_tune_names_where_its_checkpoint_is(qwen3_pair, traffic, tmp_path, monkeypatch, capsys):
    """Ctrl-C in train --from-traffic said its last checkpoint was in
    --draft-model, which a fine-tune writes only at its end, if at all:
    the checkpoint is beside it, in OUT.adapting."""
    init = qwen3_pair.make_draft(tmp_path / "init", block_size=8, intermediate_size=96)
    tiny.interrupt_sampling_at(monkeypatch, 4)
    out = tmp_path / "out"
    argv = ["--model", str(qwen3_pair.path), "--from-traffic", str(traffic.root), "--init-from", str(init),
            "--draft-model", str(out), "--seq-len", "32", "--steps", "4", "--save-every", "2"]  # fmt: skip
    capsys.readouterr()
    assert cli.run(T.main, argv) == 130
    assert f"the last checkpoint in {out}.adapting resumes" in capsys.readouterr().err
    assert (tmp_path / "out.adapting" / T.STATE_DIR).is_dir()
