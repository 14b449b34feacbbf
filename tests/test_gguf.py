"""GGUF import: a tiny llama written in llama.cpp's layout comes back exactly.

The fixture is an HF-layout llama with a trained byte-level BPE tokenizer and
a chat template. It is written as a GGUF the way llama.cpp's converter writes
one: tensor names translated and Q/K rows permuted by mlx-lm's own GGUF
exporter functions, the tokenizer as vocabulary, merges and token types. The
float32 file goes through ``mx.save_gguf``; Q4_0/Q8_0 files (which MLX cannot
write) through llama.cpp's ``gguf`` package and its reference quantizer.
"""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.gguf import permute_weights, translate_weight_names

import tiny
from dflash_mlx.cli import main as cli_main

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Numbers like 12345 and 3.14 matter too!",
    "import os\nfor root, dirs, files in os.walk('.'):\n    print(root, len(files))\n",
    "Héllo wörld, naïve café; 日本語のテキスト and emoji 🙂 in one line.",
] * 20
MIXED = "<|im_start|>user\nWrite def f(x): return x ** 2  # ünïcode 日本 🙂 12345<|im_end|>\n<|endoftext|>  tabs\tand\n\nnewlines"


def write_fixture_tokenizer(path: Path) -> int:
    """A byte-level BPE with real merges, special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|im_end|>",
                "chat_template": TEMPLATE,
            }
        )
    )
    return tok.get_vocab_size()


def gguf_metadata(src: Path) -> dict:
    """llama.cpp's metadata for the fixture (config + tokenizer)."""
    cfg = json.loads((src / "config.json").read_text())
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    return {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.context_length": u32(cfg["max_position_embeddings"]),
        "llama.embedding_length": u32(cfg["hidden_size"]),
        "llama.block_count": u32(cfg["num_hidden_layers"]),
        "llama.feed_forward_length": u32(cfg["intermediate_size"]),
        "llama.rope.dimension_count": u32(cfg["hidden_size"] // cfg["num_attention_heads"]),
        "llama.attention.head_count": u32(cfg["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(cfg["rope_theta"], dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array([3 if t in SPECIALS else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": u32(vocab["<|im_start|>"]),
        "tokenizer.ggml.eos_token_id": u32(vocab["<|im_end|>"]),
        "tokenizer.ggml.unknown_token_id": u32(vocab["<|endoftext|>"]),
        "tokenizer.ggml.padding_token_id": u32(vocab["<|im_end|>"]),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": TEMPLATE,
    }


def llama_cpp_tensors(src: Path) -> dict:
    """The fixture's weights under llama.cpp's names, Q/K rows permuted."""
    cfg = json.loads((src / "config.json").read_text())
    weights = mx.load(str(src / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {}
    for name, w in weights.items():
        if "self_attn.q_proj" in name:
            w = permute_weights(w, heads, heads)
        elif "self_attn.k_proj" in name:
            w = permute_weights(w, heads, kv_heads)
        out[translate_weight_names(name)] = w
    return out


def write_with_gguf_package(path: Path, md: dict, tensors: dict, qtype=None, tensor_qtype=None):
    """A GGUF written by llama.cpp's gguf package: 2-D weights as ``qtype``."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

    w = GGUFWriter(str(path), md["general.architecture"])
    for key, v in md.items():
        if key == "general.architecture":
            continue
        if isinstance(v, mx.array):
            v = v.tolist()
            vtype = {int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32, bool: GGUFValueType.BOOL}.get(type(v))
            if isinstance(v, list):
                w.add_array(key, v)
                continue
            w.add_key_value(key, v, vtype)
        elif isinstance(v, list):
            w.add_array(key, v)
        elif isinstance(v, bool):
            w.add_bool(key, v)
        else:
            w.add_string(key, v)
    for name, arr in tensors.items():
        a = np.array(arr, dtype=np.float32)
        t = tensor_qtype(name) if tensor_qtype else (qtype if a.ndim == 2 else None)
        if t is None:
            w.add_tensor(name, a)
        else:
            q = quants.quantize(a, getattr(GGMLQuantizationType, t))
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=getattr(GGMLQuantizationType, t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_dequantized(src: Path, dst: Path, qtype: str) -> Path:
    """The fixture with each 2-D weight replaced by llama.cpp's own
    dequantization of its quantized rows (what a lossless import must give)."""
    from gguf import GGMLQuantizationType, quants

    import shutil

    shutil.copytree(src, dst)
    t = getattr(GGMLQuantizationType, qtype)
    weights = {
        k: (mx.array(quants.dequantize(quants.quantize(np.array(v), t), t)) if v.ndim == 2 else v)
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    src = root / "hf"
    src.mkdir()
    vocab = write_fixture_tokenizer(src)
    tiny.make_target(src / "model", tiny.LLAMA, seed=3, vocab_size=vocab)
    for f in ("config.json", "model.safetensors"):
        (src / "model" / f).rename(src / f)
    md = gguf_metadata(src)
    tensors = llama_cpp_tensors(src)
    f32 = root / "tiny-f32.gguf"
    mx.save_gguf(str(f32), tensors, md)
    return {"root": root, "src": src, "md": md, "tensors": tensors, "f32": f32}


def run(capsys, *args):
    capsys.readouterr()
    rc = cli_main(["convert", *map(str, args)])
    return rc, capsys.readouterr().err


def leftovers(dst: Path):
    return [p.name for p in dst.parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}.")]


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
