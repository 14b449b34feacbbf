"""Checkpoint converter: drafters natively, targets through mlx-lm, all or nothing."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import dflash_mlx
import tiny
from dflash_mlx.cli import main as cli_main
from dflash_mlx.convert import main as convert_main


def run(capsys, *args):
    """The CLI as users call it: exit code and stderr."""
    capsys.readouterr()
    rc = cli_main(["convert", *map(str, args)])
    return rc, capsys.readouterr().err


def leftovers(dst: Path):
    """Anything at DST or a staging directory beside it."""
    return [p.name for p in dst.parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}.")]


def call(draft):
    """Low-level drafter call on a fixed block and context."""
    hidden = mx.random.normal((1, 5, draft.config.fc_input_size), key=mx.random.key(0))
    block = mx.array([[7, draft.mask_token_id, draft.mask_token_id, draft.mask_token_id]])
    return draft(block, hidden, draft.make_cache()).astype(mx.float32)


def logits(draft_dir, pair, **kw):
    draft = dflash_mlx.load_draft(draft_dir, pair.model, **kw)
    return call(draft), draft


@pytest.fixture
def draft_src(qwen3_pair, tmp_path):
    """A float32 drafter written as two shards, with a model card and tokenizer files."""
    path = tiny.make_draft(tmp_path / "src", qwen3_pair.draft_config(torch_dtype="float32"), shards=2)
    (path / "README.md").write_text("---\nlicense: mit\n---\n# tiny drafter\n")
    tiny.write_tokenizer(path)
    return path


def test_float32_conversion_is_exact(qwen3_pair, draft_src, tmp_path, capsys):
    dst = tmp_path / "f32"
    rc, err = run(capsys, "--hf-path", draft_src, "--mlx-path", dst, "--dtype", "float32")
    assert rc == 0, err
    a, _ = logits(draft_src, qwen3_pair)
    b, _ = logits(dst, qwen3_pair)
    assert mx.abs(a - b).max().item() <= 1e-5
    for name in ("README.md", "tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (draft_src / name).read_bytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_within_its_precision(qwen3_pair, draft_src, tmp_path, capsys, dtype):
    """Only the weights are rounded (the drafter computes in float32): a few
    units of the dtype's roundoff."""
    dst = tmp_path / dtype
    assert run(capsys, "--hf-path", draft_src, "--mlx-path", dst, "--dtype", dtype)[0] == 0
    a, _ = logits(draft_src, qwen3_pair)
    b, draft = logits(dst, qwen3_pair)
    assert draft.fc.weight.dtype == getattr(mx, dtype)
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == dtype
    assert tiny.scaled_error(b, a) < 16 * tiny.EPS[getattr(mx, dtype)]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_drafter_stays_lossless(pair, tmp_path, capsys, bits):
    src = tiny.make_draft(tmp_path / "src", pair.draft_config())
    dst = tmp_path / f"q{bits}"
    rc, err = run(capsys, "--hf-path", src, "--mlx-path", dst, "-q", "--q-bits", bits, "--q-group-size", 32)
    assert rc == 0, err
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    assert cfg["quantization_config"] == cfg["quantization"]
    ref, float_draft = logits(src, pair)
    got, draft = logits(dst, pair)  # no quantization flag needed
    assert isinstance(draft.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(draft.fc, nn.QuantizedLinear)
    assert isinstance(draft.norm, nn.RMSNorm) and draft.norm.weight.dtype == mx.float32
    # Exactly the float drafter quantized in memory...
    nn.quantize(float_draft, 32, bits, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    assert mx.array_equal(call(float_draft), got)
    # ...and 8 bits stay close to float (random tiny weights make 4-bit drift large).
    if bits == 8:
        assert (mx.linalg.norm(ref - got) / mx.linalg.norm(ref)).item() < 0.05
    prompt = list(range(40, 90))
    assert pair.dflash(draft, prompt, max_tokens=40)[0] == pair.reference(prompt, 40)


def test_layers_the_group_size_does_not_divide_stay_float(qwen3_pair, draft_src, tmp_path, capsys):
    dst = tmp_path / "g64"
    capsys.readouterr()
    assert convert_main(["--hf-path", str(draft_src), "--mlx-path", str(dst), "-q"]) == 0
    out = capsys.readouterr().out
    assert "kept 2 linear layer(s) in float" in out and "layers.0.mlp.down_proj" in out  # 96 % 64 != 0
    _, draft = logits(dst, qwen3_pair)
    assert type(draft.layers[1].mlp.down_proj) is nn.Linear
    assert isinstance(draft.layers[1].mlp.up_proj, nn.QuantizedLinear)


def test_sharded_output_index_and_config(draft_src, tmp_path, capsys):
    dst = tmp_path / "sharded"
    rc, err = run(capsys, "--hf-path", draft_src, "--mlx-path", dst, "-q", "--q-group-size", 32, "--max-shard-size", 2e-5)
    assert rc == 0, err
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    stored = {}
    for f in files:
        stored.update(mx.load(str(dst / f)))
    assert set(stored) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in stored.values())
    assert not any(k.startswith("model.") for k in stored)  # z-lab layout
    original = json.loads((draft_src / "config.json").read_text())
    converted = json.loads((dst / "config.json").read_text())
    assert {k: converted[k] for k in original} == original


def test_alternative_names_come_out_in_zlab_layout(qwen3_pair, tmp_path, capsys):
    cfg = qwen3_pair.draft_config(layers=1, taps=[2])
    src = tiny.make_draft(tmp_path / "orig", cfg)
    alt = tmp_path / "alt"
    alt.mkdir()
    weights = mx.load(str(src / "model.safetensors"))
    renamed = {
        k.replace("layers.0.", "midlayer.").replace("fc.", "encoder.fc.").replace("hidden_norm.", "model.hidden_norm."): v
        for k, v in weights.items()
    }
    mx.save_safetensors(str(alt / "model.safetensors"), renamed)
    (alt / "config.json").write_text((src / "config.json").read_text())
    dst = tmp_path / "out"
    assert run(capsys, "--hf-path", alt, "--mlx-path", dst)[0] == 0
    assert set(mx.load(str(next(dst.glob("*.safetensors"))))) == set(weights)
    assert mx.array_equal(logits(src, qwen3_pair)[0], logits(dst, qwen3_pair)[0])


@pytest.mark.parametrize(
    "damage,kind,message",
    [
        ("missing-tensor", "auto", f"missing ['{tiny.MISSING}']"),
        ("extra-tensor", "auto", f"unexpected ['{tiny.EXTRA}']"),
        ("wrong-shape", "auto", f"{tiny.RESHAPED} has shape (64, 100)"),
        ("truncated", "auto", "truncated or corrupt"),
        ("no-config", "auto", "has no config.json"),
        ("wrong-arch", "draft", "'MysteryDraftModel' is not a DFlash drafter"),
        ("wrong-arch", "auto", "mystery not supported"),  # mlx-lm's own message
    ],
)
def test_bad_inputs_fail_cleanly(qwen3_pair, tmp_path, capsys, damage, kind, message):
    src = tiny.damage(tiny.make_draft(tmp_path / "src", qwen3_pair.draft_config()), damage)
    dst = tmp_path / "out"
    rc, err = run(capsys, "--hf-path", src, "--mlx-path", dst, "--kind", kind, "-q", "--q-group-size", 32)
    assert rc != 0
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert leftovers(dst) == []


def test_existing_destination(qwen3_pair, draft_src, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    rc, err = run(capsys, "--hf-path", draft_src, "--mlx-path", dst)
    assert rc != 0 and "already exists: pass --force" in err
    assert (dst / "keep.txt").exists()
    # --force replaces it only after a successful conversion...
    bad = tiny.make_draft(tmp_path / "bad", qwen3_pair.draft_config())
    tiny.damage(bad, "truncated")
    assert run(capsys, "--hf-path", bad, "--mlx-path", dst, "--force")[0] != 0
    assert (dst / "keep.txt").exists() and leftovers(dst) == ["out"]
    # ...and then completely.
    assert run(capsys, "--hf-path", draft_src, "--mlx-path", dst, "--force")[0] == 0
    assert not (dst / "keep.txt").exists() and (dst / "config.json").exists()
    assert leftovers(dst) == ["out"]


def test_errors_without_traceback_from_the_module_entry_point(tmp_path):
    dst = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.convert", "--hf-path", str(tmp_path), "--mlx-path", str(dst)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path} has no config.json: not a Hugging Face checkpoint"]
    assert leftovers(dst) == []


def test_target_goes_through_mlx_lm(qwen3_pair, tmp_path, capsys):
    from mlx_lm import load

    dst = tmp_path / "target-4bit"
    rc, err = run(capsys, "--hf-path", qwen3_pair.path, "--mlx-path", dst, "-q", "--q-group-size", 32)
    assert rc == 0, err
    model, _ = load(str(dst))
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert json.loads((dst / "config.json").read_text())["quantization"]["bits"] == 4
    assert leftovers(dst) == ["target-4bit"]


def test_pair_in_one_go_is_all_or_nothing(qwen3_pair, tmp_path, capsys):
    draft = tiny.make_draft(tmp_path / "draft", qwen3_pair.draft_config())
    t_dst, d_dst = tmp_path / "t-8bit", tmp_path / "d-8bit"
    args = ["--hf-path", qwen3_pair.path, "--mlx-path", t_dst, "--draft-hf-path", draft, "--draft-mlx-path", d_dst]
    tiny.damage(draft, "truncated")
    rc, err = run(capsys, *args, "-q", "--q-bits", 8, "--q-group-size", 32)
    assert rc != 0 and "truncated" in err
    assert leftovers(t_dst) == [] and leftovers(d_dst) == []
    draft = tiny.make_draft(tmp_path / "draft", qwen3_pair.draft_config())
    assert run(capsys, *args, "-q", "--q-bits", 8, "--q-group-size", 32)[0] == 0
    target, tokenizer = dflash_mlx.load(t_dst)
    drafter = dflash_mlx.load_draft(d_dst, target)
    assert isinstance(drafter.fc, nn.QuantizedLinear)
    prompt = list(range(40, 90))
    got, _ = tiny.dflash_tokens(target, drafter, tokenizer, prompt, max_tokens=20)
    assert got == tiny.reference_tokens(target, tokenizer, prompt, 20)


def test_dflash2_conversion(qwen3_pair, tmp_path, capsys):
    src = tiny.make_draft(tmp_path / "src", qwen3_pair.dflash2_config(conv_kernel_size=3, selector_top_k=4))
    f32 = tmp_path / "f32"
    assert run(capsys, "--hf-path", src, "--mlx-path", f32)[0] == 0
    assert mx.abs(logits(src, qwen3_pair)[0] - logits(f32, qwen3_pair)[0]).max().item() <= 1e-5
    q4 = tmp_path / "q4"
    rc, err = run(capsys, "--hf-path", src, "--mlx-path", q4, "-q", "--q-group-size", 32)
    assert rc == 0, err
    stored = mx.load(str(next(q4.glob("*.safetensors"))))
    # Codebooks keep the z-lab bare names; they and the conv base kernels stay float.
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.base_kernel"):
        assert stored[name].dtype == mx.float32, name
        assert f"{name}.scales" not in stored
    assert "layers.0.attention_conv.kernel_projection.scales" in stored
    assert "candidate_selector.hidden_projection.scales" in stored
    _, draft = logits(q4, qwen3_pair)
    half = tmp_path / "f16"
    assert run(capsys, "--hf-path", src, "--mlx-path", half, "--dtype", "float16")[0] == 0
    stored = mx.load(str(next(half.glob("*.safetensors"))))
    assert stored["candidate_selector.successor_codebook"].dtype == mx.float32
    assert stored["layers.0.attention_conv.base_kernel"].dtype == mx.float16
    prompt = list(range(40, 90))
    assert qwen3_pair.dflash(draft, prompt, max_tokens=40)[0] == qwen3_pair.reference(prompt, 40)


def test_quantization_options_need_quantize(draft_src, tmp_path, capsys):
    rc, err = run(capsys, "--hf-path", draft_src, "--mlx-path", tmp_path / "out", "--q-bits", 8)
    assert rc == 1 and err.strip() == "error: --q-bits / --q-group-size need -q/--quantize"
    assert leftovers(tmp_path / "out") == []
