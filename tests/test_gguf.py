"""GGUF import: a tiny llama written in llama.cpp's layout comes back exactly
(the fixture: tests/tiny_gguf.py)."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load

from test_convert import leftovers, run
from tiny_gguf import MIXED, make_fixture, reference_dequantized, write_with_gguf_package


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return make_fixture(tmp_path_factory.mktemp("gguf"))


def logits_of(path: Path, tokens) -> mx.array:
    model, _ = mlx_lm_load(str(path))
    return model(mx.array([tokens])).astype(mx.float32)


TOKENS = list(range(3, 60, 2)) + [1, 2, 0, 399, 200]


def test_float32_gguf_gives_the_original_logits(fixture, tmp_path, capsys):
    dst = tmp_path / "out"
    rc, err = run(capsys, "--gguf", fixture["f32"], "--mlx-path", dst, "--dtype", "float32")
    assert rc == 0, err
    assert mx.abs(logits_of(dst, TOKENS) - logits_of(fixture["src"], TOKENS)).max().item() <= 1e-5
    cfg = json.loads((dst / "config.json").read_text())
    src_cfg = json.loads((fixture["src"] / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps", "rope_theta", "tie_word_embeddings", "intermediate_size"):
        assert cfg[key] == src_cfg[key], key
    assert "quantization" not in cfg


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_families(tmp_path, capsys, arch):
    """Same layout, no Q/K permutation; qwen2's projection biases, qwen3's
    q/k norms, tied and untied embeddings."""
    (tmp_path / "fx").mkdir()
    fx = make_fixture(tmp_path / "fx", arch)
    dst = tmp_path / "out"
    rc, err = run(capsys, "--gguf", fx["f32"], "--mlx-path", dst, "--dtype", "float32")
    assert rc == 0, err
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert mx.abs(logits_of(dst, TOKENS) - logits_of(fx["src"], TOKENS)).max().item() <= 1e-5


def test_qk_rows_really_were_permuted(fixture):
    """The fixture is not trivially symmetric: without the restore, Q differs."""
    src = mx.load(str(fixture["src"] / "model.safetensors"))
    q = src["model.layers.0.self_attn.q_proj.weight"]
    assert mx.abs(fixture["tensors"]["blk.0.attn_q.weight"] - q).max().item() > 0.1


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_dequantizes_exactly(fixture, tmp_path, capsys, qtype):
    gguf_file = tmp_path / f"tiny-{qtype}.gguf"
    write_with_gguf_package(gguf_file, fixture["md"], fixture["tensors"], qtype=qtype)
    ref = reference_dequantized(fixture["src"], tmp_path / "ref", qtype)
    dst = tmp_path / "f32"
    rc, err = run(capsys, "--gguf", gguf_file, "--mlx-path", dst, "--dtype", "float32")
    assert rc == 0, err
    expected = logits_of(ref, TOKENS)
    assert mx.abs(logits_of(dst, TOKENS) - expected).max().item() <= 1e-5
    # Kept quantized (the default): MLX's quantized layers, the same numbers up
    # to the float16 scales' products.
    kept = tmp_path / "kept"
    rc, err = run(capsys, "--gguf", gguf_file, "--mlx-path", kept)
    assert rc == 0, err
    cfg = json.loads((kept / "config.json").read_text())
    assert cfg["quantization"]["group_size"] == 32 and cfg["quantization"]["bits"] == int(qtype[1])
    got = logits_of(kept, TOKENS)
    assert mx.abs(got - expected).max().item() <= 1e-2 * mx.abs(expected).max().item()


def test_requantize_through_mlx_lm(fixture, tmp_path, capsys):
    dst = tmp_path / "q8"
    rc, err = run(capsys, "--gguf", fixture["f32"], "--mlx-path", dst, "-q", "--q-bits", "8", "--q-group-size", "32")
    assert rc == 0, err
    assert json.loads((dst / "config.json").read_text())["quantization"]["bits"] == 8
    a, b = logits_of(dst, TOKENS), logits_of(fixture["src"], TOKENS)
    assert mx.abs(a - b).max().item() <= 0.05 * mx.abs(b).max().item()
    assert leftovers(dst) == ["q8"]


def test_tokenizer_and_chat_template_round_trip(fixture, tmp_path, capsys):
    dst = tmp_path / "out"
    rc, err = run(capsys, "--gguf", fixture["f32"], "--mlx-path", dst, "--dtype", "float32")
    assert rc == 0, err
    _, ours = mlx_lm_load(str(dst))
    _, theirs = mlx_lm_load(str(fixture["src"]))
    ids = theirs.encode(MIXED)
    assert ids.count(fixture["md"]["tokenizer.ggml.bos_token_id"].item()) == 1  # specials stay whole
    assert ours.encode(MIXED) == ids
    assert ours.decode(ids) == theirs.decode(ids) == MIXED
    assert ours.eos_token_ids == theirs.eos_token_ids
    chat = [{"role": "user", "content": "Hi 12345 ü"}, {"role": "assistant", "content": "Hello!"}]
    for gen in (False, True):
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == theirs.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=gen
        )
        assert ours.apply_chat_template(chat, add_generation_prompt=gen) == theirs.apply_chat_template(
            chat, add_generation_prompt=gen
        )


def truncated(fixture, path: Path):
    data = fixture["f32"].read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def other_architecture(fixture, path: Path):
    md = {k.replace("llama.", "mamba."): v for k, v in fixture["md"].items()}
    mx.save_gguf(str(path), fixture["tensors"], {**md, "general.architecture": "mamba"})


def unsupported_type(fixture, path: Path):
    write_with_gguf_package(path, fixture["md"], fixture["tensors"],
                            tensor_qtype=lambda n: "Q5_0" if n.endswith("ffn_up.weight") else None)


def unknown_tensor(fixture, path: Path):
    mx.save_gguf(str(path), {**fixture["tensors"], "blk.0.attn_sinks.weight": mx.zeros((4,))}, fixture["md"])


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda fx, p: p.write_text("definitely not a model\n" * 10), "is not a GGUF file"),
        (truncated, "truncated"),
        (other_architecture, "architecture 'mamba' is not supported; GGUF import handles llama, qwen2, qwen3"),
        (unsupported_type, "tensor type not supported: blk.0.ffn_up.weight (Q5_0)"),
        (unknown_tensor, "'blk.0.attn_sinks' has no Hugging Face counterpart"),
    ],
)
def test_bad_gguf_fails_cleanly(fixture, tmp_path, capsys, damage, message):
    bad = tmp_path / "bad.gguf"
    damage(fixture, bad)
    dst = tmp_path / "out"
    rc, err = run(capsys, "--gguf", bad, "--mlx-path", dst)
    assert rc == 1
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert leftovers(dst) == []


def test_existing_destination_is_refused(fixture, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("x")
    rc, err = run(capsys, "--gguf", fixture["f32"], "--mlx-path", dst)
    assert rc == 1 and "already exists" in err
    assert [p.name for p in dst.iterdir()] == ["keep"]


def test_module_entry_point_reports_without_traceback(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("nope")
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.convert", "--gguf", str(bad), "--mlx-path", str(tmp_path / "o")],
        capture_output=True, text=True,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in done.stderr
