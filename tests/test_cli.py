"""Command-line entry points: generate, chat, bench, and the dispatcher."""

import importlib
import json
import subprocess
import sys

import pytest

from dflash_mlx import benchmark, chat, cli

# the package exports a generate() function under the module's name
generate = importlib.import_module("dflash_mlx.generate")


@pytest.fixture(scope="module")
def tiny_dirs(qwen3_5_pair, tmp_path_factory):
    draft = qwen3_5_pair.make_draft(tmp_path_factory.mktemp("cli") / "draft", block_size=4)
    return str(qwen3_5_pair.path), str(draft)


def test_generate_streams_and_reports(tiny_dirs, capsys):
    model, draft = tiny_dirs
    rc = generate.main(["--model", model, "--draft-model", draft, "--prompt", "def f(x):", "-m", "24"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("def f(x):")
    for line in ("Prompt:", "Generation: 24 tokens", "Mean tokens per cycle:", "Peak memory:"):
        assert line in out


def test_generate_matches_library_text(tiny_dirs, qwen3_5_pair, capsys):
    import dflash_mlx

    model, draft_dir = tiny_dirs
    generate.main(["--model", model, "--draft-model", draft_dir, "--prompt", "abc", "-m", "16", "--block-size", "2"])
    out = capsys.readouterr().out
    draft = dflash_mlx.load_draft(draft_dir, qwen3_5_pair.model)
    text = dflash_mlx.generate(qwen3_5_pair.model, draft, qwen3_5_pair.tokenizer, "abc", max_tokens=16)
    assert out.startswith("abc" + text)


def test_generate_bad_paths_fail_cleanly(tiny_dirs, tmp_path, capsys):
    model, _ = tiny_dirs
    assert generate.main(["--model", model, "--draft-model", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "neither an existing directory" in err
    assert generate.main(["--model", model]) == 1
    assert "--draft-model is required" in capsys.readouterr().err


def test_chat_turns(tiny_dirs, capsys):
    model, draft = tiny_dirs
    answers = iter(["hello", "r", "again", "q"])
    assert chat.main(["--model", model, "--draft-model", draft, "-m", "8"], input_fn=lambda _: next(answers)) == 0
    out = capsys.readouterr().out
    assert out.count("tokens/cycle]") == 2


def test_bench_json_and_plot(tiny_dirs, tmp_path, capsys):
    model, draft = tiny_dirs
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["def a():", "x = 1"]))
    rc = benchmark.main([
        "--model", model, "--draft-model", draft, "--prompts", str(prompts), "--max-tokens", "12",
        "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
        "--ar-draft-model", model, "--sampling-temp", "0.7",  # the target drafting itself
    ])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["outputs_identical"] is True and report["repeats"] == 2
    assert set(report["phase_ms_per_cycle"]) == {"draft", "verify", "rollback", "host"}
    assert sum(report["acceptance_histogram"].values()) > 0
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "trimmable" in report["speculative_unavailable"]  # mlx-lm cannot for hybrid targets
    assert set(report["sampled_tokens_per_cycle"]) == {"speculative", "exact-match"}
    assert "speedup" in capsys.readouterr().out


def test_repeated_4gram_share():
    assert benchmark.repeated_4gram_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 8)
    assert benchmark.repeated_4gram_share([1, 2, 3, 4, 5]) == 0


def test_dispatcher(capsys):
    assert cli.main([]) == 2
    assert cli.main(["nope"]) == 2
    assert "unknown command" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "dflash_mlx.generate", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--draft-model" in done.stdout


def test_speculative_baseline_on_attention_target(qwen3_pair):
    pair = qwen3_pair
    prompts = ["def a():", "x = 1"]
    ar = [benchmark.run_autoregressive(pair.model, pair.tokenizer, p, 12) for p in prompts]
    r = benchmark.speculative_baseline(pair.model, pair.model, pair.tokenizer, prompts, 12, ar, 3)
    assert r["speculative_outputs_identical"] is True and r["speculative_tps"] > 0


# ---------------------------------------------------------------------------
# One error path for every command (cli.run)


@pytest.mark.parametrize("flag", ["--max-tokens", "--block-size"])
def test_bad_values_through_the_dispatcher_are_one_line(tiny_dirs, flag):
    """`mlx-dflash generate --max-tokens 0` (or --block-size 0) once ended in a traceback."""
    model, draft = tiny_dirs
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "generate", "--model", model, "--draft-model", draft,
         "--prompt", "x", flag, "0"],
        capture_output=True, text=True,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "at least 1" in lines[0], done.stderr


def test_run_turns_user_errors_into_one_line(capsys):
    from dflash_mlx.errors import CheckpointNotFoundError, DFlashError

    def fails(error):
        def main(argv):
            assert argv == ["--x"]
            raise error
        return main

    for error in (DFlashError("bad thing: do this"), CheckpointNotFoundError("nothing at p"), ValueError("bad value")):
        assert cli.run(fails(error), ["--x"]) == 1
        assert capsys.readouterr().err == f"error: {error}\n"
    assert cli.run(lambda argv: 0, ["--x"]) == 0
    with pytest.raises(RuntimeError):  # a bug keeps its traceback
        cli.run(fails(RuntimeError("bug")), ["--x"])


def test_argument_parser_rejects_bad_values_in_one_line(capsys):
    p = cli.ArgumentParser(prog="x")
    p.add_argument("--max-tokens", type=cli.positive_int, default=4)
    assert p.parse_args(["--max-tokens", "3"]).max_tokens == 3
    for bad, why in (("0", "must be at least 1, got 0"), ("-2", "must be at least 1, got -2"), ("a", "expected an integer")):
        with pytest.raises(SystemExit) as stop:
            p.parse_args(["--max-tokens", bad])
        assert stop.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error: argument --max-tokens:") and why in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as stop:
        p.parse_args(["--unknown"])
    assert stop.value.code == 1 and capsys.readouterr().err.startswith("error: unrecognized arguments")
