"""GGUF import: a llama.cpp model file to an MLX directory mlx-lm opens as it is.

    mlx-dflash convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --mlx-path smollm2 --dtype float32

The metadata becomes ``config.json``; the vocabulary, merges and token types
become ``tokenizer.json`` / ``tokenizer_config.json`` through transformers'
GGUF tokenizer builders; tensors get their Hugging Face names back, with the
Q/K rows llama.cpp permuted for its interleaved RoPE restored
(``convert_hf_to_gguf.py``'s ``LlamaModel.permute``, undone). MLX reads
GGUF tensors (``mx.load``); the ``gguf`` package (llama.cpp's gguf-py) reads
the header so that bad files are refused, naming the problem, before any work.
"""

import json
import re
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from .defaults import DTYPES
from .errors import CheckpointError
from .shards import shard_units, write_shards

# llama.cpp architecture -> (mlx-lm model_type, HF class, Q/K permuted by llama.cpp)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}
PERMUTED_QK = {model_type: permuted for model_type, _, permuted in ARCHITECTURES.values()}
# The GGUF tensor types mx.load reads (others fail inside MLX); it gives
# quantized ones as MLX affine (packed weight, float16 scales and biases) and
# BF16 as float16.
READABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
# Quantized GGUF types all use blocks of 32 weights.
GGUF_GROUP_SIZE = 32
TENSOR_NAMES = [
    (r"token_embd", "model.embed_tokens"),
    (r"output_norm", "model.norm"),
    (r"output", "lm_head"),
    (r"blk\.(\d+)\.attn_norm", r"model.layers.\1.input_layernorm"),
    (r"blk\.(\d+)\.ffn_norm", r"model.layers.\1.post_attention_layernorm"),
    (r"blk\.(\d+)\.attn_q", r"model.layers.\1.self_attn.q_proj"),
    (r"blk\.(\d+)\.attn_k", r"model.layers.\1.self_attn.k_proj"),
    (r"blk\.(\d+)\.attn_v", r"model.layers.\1.self_attn.v_proj"),
    (r"blk\.(\d+)\.attn_output", r"model.layers.\1.self_attn.o_proj"),
    (r"blk\.(\d+)\.attn_q_norm", r"model.layers.\1.self_attn.q_norm"),
    (r"blk\.(\d+)\.attn_k_norm", r"model.layers.\1.self_attn.k_norm"),
    (r"blk\.(\d+)\.ffn_gate", r"model.layers.\1.mlp.gate_proj"),
    (r"blk\.(\d+)\.ffn_up", r"model.layers.\1.mlp.up_proj"),
    (r"blk\.(\d+)\.ffn_down", r"model.layers.\1.mlp.down_proj"),
]
# Pre-tokenizers transformers has no split for. SmolLM splits digits one by
# one before GPT-2's byte-level regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM;
# the tokenizer.json of HuggingFaceTB/SmolLM2-135M-Instruct).
DIGIT_SPLIT_PRE = ("smollm",)


class GGUFError(CheckpointError):
    """A GGUF file that cannot be imported; the message is shown as is."""


DAMAGED = "the file is damaged; download it again"


def value(v):
    """A metadata value as plain Python (mx.load gives scalars as arrays)."""
    return v.item() if isinstance(v, mx.array) and v.ndim == 0 else (v.tolist() if isinstance(v, mx.array) else v)


def check_file(path: Path) -> str:
    """The file's architecture, after refusing what cannot be imported.

    Reads only the header: not a GGUF, truncated, an architecture or a tensor
    type this importer (or MLX) does not handle.
    """
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFError(f"{path} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise GGUFError(f"{path} is truncated or corrupt: {e}; download it again") from e
    if path.stat().st_size < max((t.data_offset + t.n_bytes for t in reader.tensors), default=0):
        raise GGUFError(f"{path} is truncated: its tensors extend past the end of the file; download it again")
    arch = reader.fields["general.architecture"].contents()
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported; GGUF import handles {', '.join(ARCHITECTURES)}"
        )
    bad = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type.name not in READABLE_TYPES]
    if bad:
        listed = ", ".join(f"{n} ({t})" for n, t in bad[:3]) + (" ..." if len(bad) > 3 else "")
        raise GGUFError(
            f"{path}: tensor type not supported: {listed}; MLX reads {', '.join(READABLE_TYPES)} "
            "(re-quantize with llama.cpp's llama-quantize, or take an F16/Q8_0/Q4_0/Q4_1 file)"
        )
    return arch


def hf_config(md: dict, arch: str, tensors: Dict[str, mx.array]) -> dict:
    """config.json (Hugging Face names) from llama.cpp's metadata keys."""
    model_type, hf_class, _ = ARCHITECTURES[arch]

    def key(name, default=None):
        v = md.get(f"{arch}.{name}", default)
        if v is None:
            raise GGUFError(f"the GGUF metadata lacks {arch}.{name}")
        return value(v)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    if "rope_freqs.weight" in tensors or key("rope.scaling.type", "none") not in ("none", "linear"):
        raise GGUFError("this GGUF uses a RoPE scaling the importer does not support (only none and linear)")
    cfg = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        # float32 metadata, written as its shortest decimal (1e-05, not 9.99...e-06)
        "rms_norm_eps": float(str(np.float32(key("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(str(np.float32(key("rope.freq_base", 10000.0)))),
        "max_position_embeddings": key("context_length"),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        # llama.cpp writes output.weight only when it is not the embedding
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if key("rope.scaling.type", "none") == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": key("rope.scaling.factor")}
    for name in ("bos", "eos", "pad"):
        token_id = md.get(f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id")
        if token_id is not None:
            cfg[f"{name}_token_id"] = value(token_id)
    return cfg


def build_tokenizer(md: dict, arch: str):
    """A transformers fast tokenizer rebuilt from the GGUF vocabulary."""
    import transformers
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError as e:
        raise GGUFError(
            f"transformers {transformers.__version__} lacks the GGUF tokenizer builders "
            f"(transformers.integrations.gguf): upgrade it with `pip install -U transformers`"
        ) from e

    spec = {
        name: value(md[f"tokenizer.{k}"])
        for k, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{k}" in md
    }
    if "tokens" not in spec:
        raise GGUFError("the GGUF metadata has no tokenizer.ggml.tokens: no tokenizer to rebuild")
    check_tokenizer_spec({f"tokenizer.{k}": spec[name] for k, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if name in spec})
    for key in ("tokenizer.chat_template", f"{arch}.context_length"):
        if key in md and not isinstance(value(md[key]), str if key.endswith("template") else int):
            raise GGUFError(f"the GGUF metadata's {key} is {value(md[key])!r}: {DAMAGED}")
    try:
        backend, _ = convert_gguf_tokenizer(arch, spec)
    except Exception as e:  # tokenizers reports a bad vocabulary as a bare Exception
        raise GGUFError(f"cannot rebuild the tokenizer from tokenizer.ggml.*: {e}; {DAMAGED}") from e
    if spec.get("pre_tokenizer_type") in DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tokens = spec["tokens"]
    named = {
        f"{role}_token": tokens[spec[f"{role}_token_id"]]
        for role in ("bos", "eos", "unk", "pad")
        if spec.get(f"{role}_token_id") is not None
    }
    extra = {}
    if f"{arch}.context_length" in md:
        extra["model_max_length"] = value(md[f"{arch}.context_length"])
    if "tokenizer.chat_template" in md:
        extra["chat_template"] = value(md["tokenizer.chat_template"])
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in md:
            extra[flag] = bool(value(md[f"tokenizer.ggml.{flag}"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **named, **extra)


def check_tokenizer_spec(md: dict) -> None:
    """Refuse tokenizer metadata the builders would fail on inside, naming
    the key: string lists that are not, token ids outside the vocabulary."""
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model", "tokenizer.ggml.pre"):
        v = md.get(key)
        is_list = key.endswith(("tokens", "merges"))
        if (v is not None or key.endswith("tokens")) and not (
            isinstance(v, list) and all(isinstance(t, str) for t in v) if is_list else isinstance(v, str)
        ):
            raise GGUFError(f"the GGUF metadata's {key} is not {'a list of strings' if is_list else 'a string'}: {DAMAGED}")
    n = len(md["tokenizer.ggml.tokens"])
    types = md.get("tokenizer.ggml.token_type")
    if types is not None and not (isinstance(types, list) and len(types) == n and all(type(t) is int for t in types)):
        raise GGUFError(f"the GGUF metadata's tokenizer.ggml.token_type is not {n} integers, one per token: {DAMAGED}")
    for key, v in md.items():
        if key.endswith("_token_id") and not (type(v) is int and 0 <= v < n):
            raise GGUFError(f"the GGUF metadata's {key} is {v!r}, not a token id below the vocabulary size {n}: {DAMAGED}")


def hf_name(gguf_base: str) -> str:
    """``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``."""
    for pattern, repl in TENSOR_NAMES:
        if re.fullmatch(pattern, gguf_base):
            return re.sub(pattern, repl, gguf_base)
    raise GGUFError(f"GGUF tensor {gguf_base!r} has no Hugging Face counterpart this importer knows")


def restore_qk_rows(x: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation: per head (hd/2, 2) -> (2, hd/2).

    A pure row permutation, so it applies as is to packed quantized rows and
    their per-row scales and biases.
    """
    return x.reshape(heads, -1, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def group_tensors(tensors: Dict[str, mx.array]) -> Dict[str, Dict[str, mx.array]]:
    """``{base: {"weight"|"bias"|"scales"|"biases": array}}`` as mx.load names them."""
    groups: Dict[str, Dict[str, mx.array]] = {}
    for name, arr in tensors.items():
        base, leaf = name.rsplit(".", 1)
        groups.setdefault(base, {})[leaf] = arr
    return groups


def packed_bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per weight of a quantized tensor as mx.load returns it."""
    return weight.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)


def unit_arrays(parts: Dict[str, mx.array], cfg: dict, base: str, dtype) -> Dict[str, mx.array]:
    """One GGUF tensor's output arrays, by leaf name: dequantized to ``dtype``
    (float32 arithmetic) when one is given, else as stored."""
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(base.split(".")[-1])
    if not PERMUTED_QK[cfg["model_type"]]:
        heads = None
    if "scales" in parts and dtype is not None:
        w, s, b = parts.pop("weight"), parts.pop("scales"), parts.pop("biases")
        parts["weight"] = mx.dequantize(
            w, s.astype(mx.float32), b.astype(mx.float32), group_size=GGUF_GROUP_SIZE, bits=packed_bits(w, s)
        )
    out = {}
    for leaf, arr in parts.items():
        if heads is not None:
            arr = restore_qk_rows(arr, heads)
        if dtype is not None and mx.issubdtype(arr.dtype, mx.floating):
            arr = arr.astype(dtype)
        out[leaf] = arr
    return out


def quantization_config(groups: Dict[str, Dict[str, mx.array]]) -> Optional[dict]:
    """mlx-lm's ``quantization`` entry for tensors kept quantized: the most
    common bit width as the default, per-layer entries for the others."""
    bits = {}
    for base, parts in groups.items():
        if "scales" in parts:
            bits[hf_name(base)] = packed_bits(parts["weight"], parts["scales"])
    if not bits:
        return None
    default = max(set(bits.values()), key=list(bits.values()).count)
    q = {"group_size": GGUF_GROUP_SIZE, "bits": default, "mode": "affine"}
    for path, b in sorted(bits.items()):
        if b != default:
            q[path] = {"group_size": GGUF_GROUP_SIZE, "bits": b, "mode": "affine"}
    return q


def read_gguf(path: Path):
    """Metadata, architecture and tensors (lazy) of a checked GGUF file."""
    arch = check_file(path)
    try:
        tensors, md = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:  # ValueError: a name or string that is not UTF-8
        raise GGUFError(f"{path}: MLX cannot read it: {e}; {DAMAGED}") from e
    return arch, md, tensors


def plan_units(groups, cfg: dict, dtype) -> list:
    """Lazy output units (lists of (HF name, array)), one per GGUF tensor."""
    units = []
    for base in sorted(groups):
        name = hf_name(base)
        arrays = unit_arrays(dict(groups[base]), cfg, base, dtype)
        units.append([(f"{name}.{leaf}", arr) for leaf, arr in arrays.items()])
    return units


def write_gguf_model(path: Path, loaded, out: Path, *, dtype: Optional[str], max_shard_bytes: int) -> dict:
    """Config, tokenizer and weights of the GGUF at ``path`` (``loaded`` by
    ``read_gguf``), written to ``out``."""
    arch, md, tensors = loaded
    cfg = hf_config(md, arch, tensors)
    tokenizer = build_tokenizer(md, arch)
    groups = group_tensors(tensors)
    mx_dtype = DTYPES[dtype] if dtype else None
    if mx_dtype is None:
        q = quantization_config(groups)
        if q:
            cfg["quantization"] = q
            cfg["quantization_config"] = dict(q)
    else:
        cfg["torch_dtype"] = dtype
    units = plan_units(groups, cfg, mx_dtype)
    size_before = path.stat().st_size
    del tensors, groups
    out.mkdir()
    n_out, size_after, n_shards = write_shards(out, shard_units(units, max_shard_bytes))
    tokenizer.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return {
        "tensors": (len(units), n_out),
        "bytes": (size_before, size_after),
        "shards": n_shards,
        "kept_float": [],
    }
