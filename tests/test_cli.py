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
    for line in ("Prompt:", "Generation: 24 tokens", "Mean tokens per cycle:", "Block sizes", "Peak memory:"):
        assert line in out


def test_generate_with_trees_reports_them(tiny_dirs, qwen3_5_pair, capsys):
    import dflash_mlx

    model, draft_dir = tiny_dirs
    assert generate.main(["--model", model, "--draft-model", draft_dir, "--prompt", "abc", "-m", "16", "--tree-budget", "6"]) == 0
    out = capsys.readouterr().out
    assert "Draft trees (nodes:cycles): 6:" in out
    draft = dflash_mlx.load_draft(draft_dir, qwen3_5_pair.model)
    assert out.startswith("abc" + dflash_mlx.generate(qwen3_5_pair.model, draft, qwen3_5_pair.tokenizer, "abc", max_tokens=16))


def test_generate_matches_library_text(tiny_dirs, qwen3_5_pair, capsys):
    import dflash_mlx

    model, draft_dir = tiny_dirs
    generate.main(["--model", model, "--draft-model", draft_dir, "--prompt", "abc", "-m", "16", "--block-size", "2"])
    out = capsys.readouterr().out
    draft = dflash_mlx.load_draft(draft_dir, qwen3_5_pair.model)
    text = dflash_mlx.generate(qwen3_5_pair.model, draft, qwen3_5_pair.tokenizer, "abc", max_tokens=16)
    assert out.startswith("abc" + text)


def test_generate_holds_its_answer_to_a_regex(tiny_dirs, qwen3_5_pair, capsys):
    import dflash_mlx

    model, draft_dir = tiny_dirs
    pattern = "(yes|no), because [a-z]{2,8}[.]"
    assert generate.main(["--model", model, "--draft-model", draft_dir, "--prompt", "abc", "-m", "24", "--regex", pattern]) == 0
    out = capsys.readouterr().out
    draft = dflash_mlx.load_draft(draft_dir, qwen3_5_pair.model)
    text = dflash_mlx.generate(qwen3_5_pair.model, draft, qwen3_5_pair.tokenizer, "abc", max_tokens=24, response_format={"type": "regex", "pattern": pattern})
    assert out.startswith("abc" + text) and text.startswith(("yes, because ", "no, because "))
    assert "Forced by the response format:" in out
    assert cli.run(generate.main, ["--model", model, "--draft-model", draft_dir, "--regex", "a(("]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the regular expression is invalid") and err.count("\n") == 1


def test_generate_bad_paths_fail_cleanly(tiny_dirs, tmp_path, capsys):
    model, _ = tiny_dirs
    assert cli.run(generate.main, ["--model", model, "--draft-model", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "neither an existing directory" in err
    assert cli.run(generate.main, ["--model", model]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no known drafter") and "--draft-model" in err and err.count("\n") == 1


def test_chat_turns(tiny_dirs, capsys):
    model, draft = tiny_dirs
    answers = iter(["hello", "r", "again", "q"])
    assert chat.main(["--model", model, "--draft-model", draft, "-m", "8"], input_fn=lambda _: next(answers)) == 0
    out = capsys.readouterr().out
    assert out.count("tokens/cycle]") == 2


def test_bench_of_the_plain_step(tiny_dirs, tmp_path):
    """--block-size 1 benches plain decoding (its forwards time no drafter)."""
    model, draft = tiny_dirs
    rc = benchmark.main(["--model", model, "--draft-model", draft, "--num-prompts", "1", "--max-tokens", "8",
                         "--repeats", "1", "--block-size", "1", "--tree-budgets", "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and report["outputs_identical"] is True and report["mean_tokens_per_cycle"] == 1.0


def test_bench_repetition_penalty_on_both_sides(tiny_dirs, qwen3_5_pair, tmp_path, capsys):
    """--repetition-penalty: mlx-lm and DFlash both penalised, in the same run
    as the unpenalised pair: both speedups and their ratio; the penalised
    DFlash output is mlx-lm's penalised one, which the penalty changes."""
    model, draft = tiny_dirs
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["x = 1"]))
    rc = benchmark.main(["--model", model, "--draft-model", draft, "--prompts", str(prompts), "--max-tokens", "16", "--repeats", "1",
                         "--tree-budgets", "--repetition-penalty", "1.5", "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and report["outputs_identical"] is True
    assert (report["repetition_penalty"], report["repetition_context_size"]) == (1.5, 20)
    assert report["penalised_speedup"] == pytest.approx(report["penalised_dflash_tps"] / report["penalised_autoregressive_tps"])
    assert report["penalised_speedup_ratio"] == pytest.approx(report["penalised_speedup"] / report["speedup"])
    assert "repetition penalty 1.5" in capsys.readouterr().out
    # the check can fail: unpenalised DFlash would not give mlx-lm's penalised output
    penalty = benchmark.Penalty.of(1.5, 20, None)
    plain = benchmark.run_autoregressive(qwen3_5_pair.model, qwen3_5_pair.tokenizer, "x = 1", 16)["tokens"]
    penalised = benchmark.run_autoregressive(qwen3_5_pair.model, qwen3_5_pair.tokenizer, "x = 1", 16, logits_processors=penalty.mlx_lm)
    assert penalised["tokens"] != plain
    for bad in (["--repetition-penalty", "-1"], ["--repetition-penalty", "1.1", "--repetition-context-size", "0"]):
        with pytest.raises(SystemExit):
            benchmark.setup_arg_parser().parse_args(bad)


def test_bench_json_and_plot(tiny_dirs, tmp_path, capsys):
    model, draft = tiny_dirs
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["def a():", "x = 1"]))
    rc = benchmark.main([
        "--model", model, "--draft-model", draft, "--prompts", str(prompts), "--max-tokens", "12",
        "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
        "--ar-draft-model", model, "--temp", "0.7",  # the target drafting itself
        "--tree-budgets", "3", "6",
    ])
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["outputs_identical"] is True and report["repeats"] == 2
    assert set(report["phase_ms_per_cycle"]) == {"draft", "verify", "rollback", "host"}
    cycles = sum(report["acceptance_histogram"].values())
    assert cycles > 0 and sum(report["block_size_histogram"].values()) + sum(report["tree_size_histogram"].values()) == cycles
    assert report["adaptive"] and report["fixed_block_tps"] > 0 and report["fixed_block_speedup"] > 0
    assert len(report["trace"]["committed"]) == len(report["trace"]["block_size"]) > 0
    assert report["phase_ms_per_cycle"]["verify"] > 0  # the timed drafter times its target
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "trimmable" in report["speculative_unavailable"]  # mlx-lm cannot for hybrid targets
    assert set(report["sampled_tokens_per_cycle"]) == {"speculative", "exact-match"}
    configs = report["configurations"]  # chains, trees and the adaptive loop side by side
    assert list(configs) == ["dflash", "no_copy", "fixed", "chain", "tree_3", "tree_6"]
    assert report["no_copy_tps"] > 0 and report["copy_speedup"] > 0  # copy drafts on and off, in one run
    committed = sum(int(k) * v for k, v in report["acceptance_histogram"].items())
    assert report["accepted_from_drafter"] >= 0 <= report["accepted_from_copies"]
    assert report["accepted_from_drafter"] + report["accepted_from_copies"] < committed
    assert configs["tree_6"]["mean_tree_size"] == pytest.approx(6, abs=3) and configs["chain"]["mean_tree_size"] == 0
    for c in configs.values():
        assert c["tps"] > 0 and c["ms_per_cycle"] > 0 and 1 <= c["tokens_per_cycle"] <= 4
        assert sum(c["path_length_histogram"].values()) > 0
    out = capsys.readouterr().out
    assert "speedup" in out and "tree 6" in out and "chain, adaptive" in out and "from the drafter" in out


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


COMMANDS = ["generate", "chat", "benchmark", "server"]


def run_module(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)


@pytest.fixture
def run_here(capsys):
    """``run_here(module, *args)``: ``python -m module args`` in this
    process, as a CompletedProcess: the module's ``main`` under cli.run, as
    its ``__main__`` block runs it, without a fresh interpreter's imports.
    test_every_command_reports_a_missing_model_in_one_line runs each
    command's real ``python -m``."""

    def run(module, *args):
        main = importlib.import_module(module).main
        capsys.readouterr()
        try:
            rc = cli.run(main, list(args))
        except SystemExit as stop:  # the parser's
            rc = stop.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([module, *args], rc, out, err)

    return run


def assert_one_error_line(done, *needles):
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "args, needles",
    [
        (["--max-tokens", "0"], ["--max-tokens", "at least 1, got 0"]),
        (["--block-size", "0"], ["--block-size", "at least 1, got 0"]),
        (["--max-tokens", "-5"], ["--max-tokens", "at least 1, got -5"]),
        (["--block-size", "-2"], ["--block-size", "at least 1, got -2"]),
        (["--max-tokens", "many"], ["--max-tokens", "expected an integer"]),
        (["--tree-budget", "-1"], ["--tree-budget", "at least 0, got -1"]),
    ],
)
def test_every_command_rejects_bad_counts_in_one_line(run_here, command, args, needles):
    """`python -m dflash_mlx.<command>` with a zero or negative count: one `error:`
    line and exit code 1 (once a traceback, or argparse's exit 2)."""
    assert_one_error_line(run_here(f"dflash_mlx.{command}", *args), *needles)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_reports_a_missing_model_in_one_line(command, tmp_path):
    missing = str(tmp_path / "no-such-model")
    port = ["--port", "0"] if command == "server" else []  # whatever holds 8080 on this machine
    done = run_module(f"dflash_mlx.{command}", "--model", missing, "--draft-model", missing, *port)
    assert_one_error_line(done, "no-such-model")


def test_server_rejects_a_bad_port_in_one_line(run_here):
    for port in ("-1", "70000", "http"):
        assert_one_error_line(run_here("dflash_mlx.server", "--port", port), "--port", "0 to 65535")


def test_server_reports_a_taken_port_in_one_line_before_loading(tmp_path, capsys):
    import socket

    from dflash_mlx import server

    missing = str(tmp_path / "no-such-model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the port is checked before the (missing) model is loaded
        rc = cli.run(server.main, ["--model", missing, "--draft-model", missing, "--port", str(port)])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["generate", "chat", "server"])
def test_prefill_step_size_must_be_positive(run_here, command):
    assert_one_error_line(run_here(f"dflash_mlx.{command}", "--prefill-step-size", "0"), "--prefill-step-size")


def test_bench_checks_its_files_before_loading(run_here, tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text('{"not": "a list"}')
    assert_one_error_line(run_here("dflash_mlx.benchmark", "--prompts", str(bad)), "JSON list of strings")
    assert_one_error_line(run_here("dflash_mlx.benchmark", "--prompts", str(tmp_path / "none.json")), "none.json")
    done = run_here("dflash_mlx.benchmark", "--json", str(tmp_path / "no" / "dir" / "r.json"))
    assert_one_error_line(done, "--json", "does not exist")


def test_bench_temp_and_its_old_spelling():
    parser = benchmark.setup_arg_parser()
    assert parser.parse_args(["--temp", "0.5"]).temp == 0.5
    assert parser.parse_args(["--sampling-temp", "0.6"]).temp == 0.6  # hidden alias
    assert parser.parse_args([]).temp is None
    assert "--sampling-temp" not in parser.format_help() and "--temp" in parser.format_help()


def test_plot_prints_nothing(tmp_path, capsys):
    report = {
        "max_tokens": 8, "acceptance_histogram": {"1": 2, "2": 3}, "mean_tokens_per_cycle": 1.6, "autoregressive_tps": 10.0,
        "dflash_tps": 15.0, "speedup": 1.5, "speculative_unavailable": "cannot trim",
        "trace": {"committed": [1, 2, 2, 1, 2], "block_size": [2, 2, 4, 1, 2]},
    }
    benchmark.plot([report], str(tmp_path / "r.png"))
    assert capsys.readouterr().out == ""
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_position_buckets_follow_the_answer():
    assert benchmark.position_buckets(128) == [(0, 128)]
    assert benchmark.position_buckets(1024) == [(0, 256), (256, 512), (512, 1024)]
    assert benchmark.position_buckets(300) == [(0, 256), (256, 300)]
    # Cycles start at positions 1 (after the prefill's token), 256 and 260.
    runs = [{"committed": [255, 4, 10]}, {"committed": [2]}]
    assert benchmark.tokens_per_cycle_by_position(runs, 300) == {"0-256": 128.5, "256-300": 7.0}


@pytest.mark.parametrize("flag", ["--max-tokens", "--block-size"])
def test_bad_values_through_the_dispatcher_are_one_line(run_here, tiny_dirs, flag):
    """`mlx-dflash generate --max-tokens 0` (or --block-size 0) once ended in a traceback."""
    model, draft = tiny_dirs
    done = run_here("dflash_mlx.cli", "generate", "--model", model, "--draft-model", draft, "--prompt", "x", flag, "0")
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


@pytest.mark.parametrize("command", ["generate", "chat", "server"])
@pytest.mark.parametrize(
    "args, needles",
    [
        (["--kv-bits", "7"], ["--kv-bits", "kv_bits must be one of 1, 2, 3, 4, 5, 6, 8"]),
        (["--kv-group-size", "100"], ["--kv-group-size", "32, 64, 128"]),
        (["--quantized-kv-start", "-4"], ["--quantized-kv-start", "at least 0"]),
        (["--max-kv-size", "0"], ["--max-kv-size", "at least 5"]),
    ],
)
def test_mlx_lm_cache_flags_refuse_bad_values_in_one_line(run_here, command, args, needles):
    """mlx-lm's KV-cache flags are refused by the parser, before any model loads."""
    assert_one_error_line(run_here(f"dflash_mlx.{command}", *args), *needles)


def test_chat_takes_mlx_lms_flags(tiny_dirs, capsys):
    """chat with mlx-lm's XTC, template and eos flags runs (the greedy default leaves XTC aside)."""
    model, draft = tiny_dirs
    answers = iter(["hello", "q"])
    flags = ["--xtc-threshold", "0.2", "--chat-template-config", '{"x": 1}', "--extra-eos-token", "7"]
    assert chat.main(["--model", model, "--draft-model", draft, "-m", "8", *flags], input_fn=lambda _: next(answers)) == 0
    assert capsys.readouterr().out.count("tokens/cycle]") == 1
    assert_one_error_line(run_module("dflash_mlx.chat", "--model", model, "--chat-template-config", "[1]"), "must be a JSON object")


def test_generate_takes_mlx_lms_control_flags(qwen3_5_pair, tiny_dirs, tmp_path, capsys):
    """generate's mlx-lm flags reach the loop: a rotating KV cache and a
    prompt cache file give the library's text with the same settings."""
    import dflash_mlx

    model, draft_dir = tiny_dirs
    pair = qwen3_5_pair
    draft = dflash_mlx.load_draft(draft_dir, pair.model)
    flags = ["--model", model, "--draft-model", draft_dir, "-m", "16", "--block-size", "2"]
    assert generate.main([*flags, "--prompt", "abc", "--max-kv-size", "8", "--xtc-threshold", "0.2"]) == 0
    want = dflash_mlx.generate(pair.model, draft, pair.tokenizer, "abc", max_tokens=16, block_size=2, max_kv_size=8)
    assert capsys.readouterr().out.startswith("abc" + want)
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    dflash_mlx.generate(pair.model, draft, pair.tokenizer, "abc", max_tokens=4, prompt_cache=cache)
    path = str(tmp_path / "cache.safetensors")
    dflash_mlx.save_prompt_cache(path, cache)
    assert generate.main([*flags, "--prompt", "def", "--prompt-cache-file", path]) == 0
    saved = dflash_mlx.load_prompt_cache(path, draft)
    want = dflash_mlx.generate(pair.model, draft, pair.tokenizer, "def", max_tokens=16, block_size=2, prompt_cache=saved)
    assert capsys.readouterr().out.startswith("def" + want)
