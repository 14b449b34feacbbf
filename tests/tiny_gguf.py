"""Tiny models written as llama.cpp writes GGUF files, for the import tests.

The model is an HF-layout llama (or qwen2 / qwen3) with a trained byte-level BPE tokenizer and a
chat template. Its GGUF has llama.cpp's tensor names and Q/K row permutation
(mlx-lm's own GGUF exporter functions) and the tokenizer as vocabulary,
merges and token types. Float32 files go through ``mx.save_gguf``; Q4_0/Q8_0
files (which MLX cannot write) through llama.cpp's ``gguf`` package and its
reference quantizer.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.gguf import permute_weights, translate_weight_names

import tiny

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


def gguf_metadata(src: Path, arch: str = "llama") -> dict:
    """llama.cpp's metadata for the fixture (config + tokenizer)."""
    cfg = json.loads((src / "config.json").read_text())
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    model_keys = {
        "context_length": u32(cfg["max_position_embeddings"]),
        "embedding_length": u32(cfg["hidden_size"]),
        "block_count": u32(cfg["num_hidden_layers"]),
        "feed_forward_length": u32(cfg["intermediate_size"]),
        "rope.dimension_count": u32(head_dim),
        "attention.head_count": u32(cfg["num_attention_heads"]),
        "attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        "attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"], dtype=mx.float32),
        "rope.freq_base": mx.array(cfg["rope_theta"], dtype=mx.float32),
    }
    if arch == "qwen3":
        model_keys["attention.key_length"] = u32(head_dim)
    return {
        "general.architecture": arch,
        "general.name": "tiny",
        **{f"{arch}.{k}": v for k, v in model_keys.items()},
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


def llama_cpp_tensors(src: Path, permute: bool = True) -> dict:
    """The fixture's weights under llama.cpp's names, Q/K rows permuted as
    llama.cpp's converter does for llama (not for the Qwen families)."""
    cfg = json.loads((src / "config.json").read_text())
    weights = mx.load(str(src / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {}
    for name, w in weights.items():
        if permute and "self_attn.q_proj.weight" in name:
            w = permute_weights(w, heads, heads)
        elif permute and "self_attn.k_proj.weight" in name:
            w = permute_weights(w, heads, kv_heads)
        name = name.replace("self_attn.q_norm", "attn_q_norm").replace("self_attn.k_norm", "attn_k_norm")
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

    shutil.copytree(src, dst)
    t = getattr(GGMLQuantizationType, qtype)
    weights = {
        k: (mx.array(quants.dequantize(quants.quantize(np.array(v), t), t)) if v.ndim == 2 else v)
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


QWEN2 = dict(
    tiny.QWEN3, model_type="qwen2", architectures=["Qwen2ForCausalLM"], head_dim=None, tie_word_embeddings=False
)


def make_fixture(root: Path, arch: str = "llama") -> dict:
    """The HF model at root/hf and its float32 GGUF at root/tiny-f32.gguf."""
    base = {"llama": tiny.LLAMA, "qwen2": QWEN2, "qwen3": tiny.QWEN3}[arch]
    src = root / "hf"
    src.mkdir()
    vocab = write_fixture_tokenizer(src)
    tiny.make_target(src / "model", {k: v for k, v in base.items() if v is not None}, seed=3, vocab_size=vocab)
    for f in ("config.json", "model.safetensors"):
        (src / "model" / f).rename(src / f)
    md = gguf_metadata(src, arch)
    tensors = llama_cpp_tensors(src, permute=arch == "llama")
    f32 = root / "tiny-f32.gguf"
    mx.save_gguf(str(f32), tensors, md)
    return {"root": root, "src": src, "md": md, "tensors": tensors, "f32": f32, "vocab": vocab}
