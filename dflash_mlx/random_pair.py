"""Tiny seeded random targets and DFlash drafters, written in real Hugging
Face layout, so that the code users run loads them (``mlx_lm.load``,
:func:`dflash_mlx.load_draft`).

The tests build their models with these, and the benchmarks use a random
drafter as the worst case: one that never agrees with its target.
"""

import json
from pathlib import Path
from typing import Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import load_model

from .errors import ArgumentError

EOS, MASK = "<|endoftext|>", "<|mask|>"


def write_tokenizer(path: Path) -> int:
    """Byte-level BPE with no merges: 256 byte tokens + eos + mask."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, MASK])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "model_max_length": 4096,
            }
        )
    )
    return tok.get_vocab_size()


def family_config(model_type: str, architecture: str, **fields) -> dict:
    """A tiny target config of one mlx-lm family: a 4-layer, 64-wide decoder
    every family shares, its model type and Hugging Face architecture, and
    ``fields`` of its own (which may resize the shared decoder)."""
    decoder = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
    )  # fmt: skip
    return {**decoder, "model_type": model_type, "architectures": [architecture], **fields}


QWEN3 = family_config("qwen3", "Qwen3ForCausalLM", head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)

QWEN3_5 = family_config(
    "qwen3_5",
    "Qwen3_5ForConditionalGeneration",
    head_dim=16,
    tie_word_embeddings=False,
    full_attention_interval=2,
    # More value heads than key heads, as real Qwen3.5 checkpoints have; key
    # head dim 32, the smallest mlx-lm's fused GatedDeltaNet kernel takes.
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)

LLAMA = family_config("llama", "LlamaForCausalLM", num_hidden_layers=3, rope_theta=500000.0, tie_word_embeddings=False)

FAMILIES = {"qwen3": QWEN3, "qwen3_5": QWEN3_5, "llama": LLAMA}


def seeded_init(model: nn.Module, seed: int, scale: float = 1.0):
    """Replace every parameter with seeded random values (norms near 1)."""
    rng = np.random.default_rng(seed)

    def init(path, p):
        if path.endswith("norm.weight"):
            return mx.ones(p.shape) + 0.1 * mx.array(rng.standard_normal(p.shape), dtype=mx.float32)
        if "A_log" in path or "dt_bias" in path:
            return mx.array(rng.uniform(-1, 1, p.shape), dtype=mx.float32)
        fan_in = p.shape[-1] if p.ndim > 1 else 1
        std = scale / np.sqrt(fan_in)
        return mx.array(rng.standard_normal(p.shape) * std, dtype=mx.float32)

    flat = tree_flatten(model.parameters())
    model.load_weights([(k, init(k, v)) for k, v in flat])


def make_target(path: Path, base: dict, seed: int = 0, **overrides) -> Path:
    """Write a tiny random target (float32) + tokenizer to ``path``.

    mlx-lm builds the model from the config (its loader, with no weights
    yet); the seeded weights are then saved under the names HF uses."""
    path = Path(path)
    vocab = write_tokenizer(path)
    cfg = {**base, **overrides}
    if "text_config" in cfg:
        cfg["text_config"] = {"vocab_size": vocab, **cfg["text_config"]}
    else:
        cfg = {"vocab_size": vocab, **cfg}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    model, _ = load_model(path, strict=False)
    seeded_init(model, seed, scale=1.5)
    weights = dict(tree_flatten(model.parameters()))
    if cfg["model_type"].startswith("qwen3_5"):
        # HF layout: mlx-lm's sanitize maps these names back.
        weights = {
            k.replace("language_model.model.", "model.language_model.").replace(
                "language_model.lm_head", "lm_head"
            ): v
            for k, v in weights.items()
        }
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def draft_config(target_cfg: dict, vocab: int, *, layers=2, taps=None, block_size=8, **extra) -> dict:
    """A z-lab DFlashDraftModel config for ``target_cfg``: the tiny Qwen3
    decoder, as wide as the target, reading its taps (default: first and last
    layer); ``extra`` fields override any of it."""
    n_target = target_cfg["num_hidden_layers"]
    cfg = family_config(
        "qwen3",
        "DFlashDraftModel",
        # Its own decoder, as wide as the target.
        hidden_size=target_cfg["hidden_size"], intermediate_size=96, num_hidden_layers=layers, head_dim=16,
        vocab_size=vocab, rope_theta=10000.0, attention_bias=False, tie_word_embeddings=False,
        # What it drafts from and how: the target's taps, blocks, the mask token.
        num_target_layers=n_target, block_size=block_size,
        dflash_config={"target_layer_ids": taps if taps is not None else [0, n_target - 1], "mask_token_id": vocab - 1},
    )  # fmt: skip
    return {**cfg, **extra}


def make_draft(path: Path, cfg: dict, seed: int = 1, dtype=mx.float32, shards: int = 1) -> Path:
    """Write a random drafter in z-lab layout (no ``model.`` prefix)."""
    from .loading import build_draft
    from .models.dflash import DFlashConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_draft(DFlashConfig.from_hf(cfg))
    seeded_init(model, seed)
    weights = tree_map(lambda p: p.astype(dtype), dict(tree_flatten(model.parameters())))
    for name in list(weights):  # DFlash2 stores codebooks as bare tensors
        if name.endswith("_codebook.weight"):
            weights[name[: -len(".weight")]] = weights.pop(name)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights)
        return path
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), {k: weights[k] for k in part})
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return path


def write_random_pair(directory: Path, family: str, seed: int = 0, block_size: int = 16) -> Tuple[Path, Path]:
    """A tiny random target of ``family`` (qwen3, qwen3_5, llama) and a random
    drafter for it, under ``directory``; returns (target dir, drafter dir)."""
    if family not in FAMILIES:
        raise ArgumentError(f"unknown family {family!r}: choose one of {sorted(FAMILIES)}")
    directory = Path(directory)
    base = FAMILIES[family]
    target = make_target(directory / f"{family}-target", base, seed=seed)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    cfg = draft_config(base, vocab, block_size=block_size)
    return target, make_draft(directory / f"{family}-draft", cfg, seed=seed + 1)
