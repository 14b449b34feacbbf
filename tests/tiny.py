"""Tiny seeded targets and drafters written in real Hugging Face layout.

Tests load them back through the same code users run (mlx_lm.load,
dflash_mlx.load_draft), so the loaders are exercised, not bypassed.
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

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


QWEN3 = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)

QWEN3_5 = dict(
    model_type="qwen3_5",
    architectures=["Qwen3_5ForConditionalGeneration"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    full_attention_interval=2,
    # More value heads than key heads, as real Qwen3.5 checkpoints have.
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)

LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=500000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _seeded_init(model: nn.Module, seed: int, scale: float = 1.0):
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
    """Write a tiny random target (float32) + tokenizer to ``path``."""
    from mlx_lm.utils import _get_classes as get_model_classes

    path = Path(path)
    vocab = write_tokenizer(path)
    cfg = {**base, "vocab_size": vocab, **overrides}
    model_cls, args_cls = get_model_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    _seeded_init(model, seed, scale=1.5)
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
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def draft_config(target_cfg: dict, vocab: int, *, layers=2, taps=None, block_size=8, **extra) -> dict:
    n_target = target_cfg["num_hidden_layers"]
    cfg = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        hidden_size=target_cfg["hidden_size"],
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        attention_bias=False,
        tie_word_embeddings=False,
        num_target_layers=n_target,
        block_size=block_size,
        dflash_config={
            "target_layer_ids": taps if taps is not None else [0, n_target - 1],
            "mask_token_id": vocab - 1,
        },
    )
    cfg.update(extra)
    return cfg


def make_draft(path: Path, cfg: dict, seed: int = 1, dtype=mx.float32, shards: int = 1) -> Path:
    """Write a random drafter in z-lab layout (no ``model.`` prefix)."""
    from dflash_mlx.loading import build_draft
    from dflash_mlx.models.dflash import DFlashConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_draft(DFlashConfig.from_hf(cfg))
    _seeded_init(model, seed)
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


# ---------------------------------------------------------------------------
# Gemma-4 targets (mlx-lm gemma4_text / gemma4) and their drafters

SLIDING, FULL = "sliding_attention", "full_attention"

GEMMA4_TEXT = dict(
    model_type="gemma4_text",
    architectures=["Gemma4ForCausalLM"],
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,  # the full-attention layers' own head size
    rms_norm_eps=1e-6,
    sliding_window=8,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    num_kv_shared_layers=2,  # layers 4 and 5 reuse layers 3 and 2
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,  # per-layer inputs, as E2B/E4B have
    rope_parameters={
        FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
    },
    final_logit_softcapping=30.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)

# The 26B-A4B's kind of layer: a dense MLP plus routed experts, full layers
# with K = V and their own kv-head count; no KV sharing, no per-layer inputs.
GEMMA4_MOE = dict(
    GEMMA4_TEXT,
    sliding_window=12,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
)


def gemma4_multimodal(text: dict, **fields) -> dict:
    """A Gemma-4 checkpoint's config: the text model nested under text_config."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    return dict(
        model_type="gemma4",
        architectures=["Gemma4ForConditionalGeneration"],
        text_config=text,
        vision_config={"model_type": "gemma4_vision", "hidden_size": 8},
        eos_token_id=[1, 106],
        **fields,
    )


def to_gemma4_hf_layout(weights: dict, multimodal: bool) -> dict:
    """mlx-lm parameter names -> Hugging Face checkpoint names (what
    mlx-lm's sanitize maps back): experts' gate and up fused into one
    tensor, the text model under ``model.language_model`` in the multimodal
    wrapper, next to a vision tower that loading must drop."""
    out = {}
    for name, value in weights.items():
        if name.endswith("switch_glu.up_proj.weight"):
            continue
        if name.endswith("switch_glu.gate_proj.weight"):
            base = name[: -len("switch_glu.gate_proj.weight")]
            up = weights[base + "switch_glu.up_proj.weight"]
            name, value = base + "gate_up_proj", mx.concatenate([value, up], axis=-2)
        elif name.endswith("switch_glu.down_proj.weight"):
            name = name[: -len("switch_glu.down_proj.weight")] + "down_proj"
        if multimodal:
            name = name.replace("language_model.model.", "model.language_model.")
        out[name] = value
    if multimodal:
        out["model.vision_tower.patch_embedder.weight"] = mx.zeros((8, 8))
    return out


def make_gemma4_target(path: Path, base: dict, seed: int = 0, vocab_size=None) -> Path:
    """Write a tiny random Gemma-4 target (float32, HF layout) + tokenizer.

    ``base`` is a text config (GEMMA4_TEXT) or a multimodal one
    (:func:`gemma4_multimodal`); ``vocab_size`` defaults to the tokenizer's.
    """
    from mlx_lm.utils import _get_classes as get_model_classes

    path = Path(path)
    vocab = vocab_size or write_tokenizer(path)
    if vocab_size:  # a smaller model vocabulary over the same tokenizer
        write_tokenizer(path)
    cfg = json.loads(json.dumps(base))
    text = cfg.get("text_config", cfg)
    text.update(vocab_size=vocab, vocab_size_per_layer_input=vocab)
    cfg["vocab_size"] = vocab
    model_cls, args_cls = get_model_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    _seeded_init(model, seed, scale=1.5)
    rng = np.random.default_rng(seed)
    weights = {
        # a positive per-layer output scale, as trained checkpoints have
        k: mx.array(rng.uniform(0.7, 1.2, v.shape), dtype=mx.float32) if k.endswith("layer_scalar") else v
        for k, v in tree_flatten(model.parameters())
    }
    weights = to_gemma4_hf_layout(weights, multimodal="text_config" in cfg)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def zlab_gemma4_draft_config(name: str, hidden: int, vocab: int) -> dict:
    """z-lab's published Gemma-4 drafter configs (the 31B-it and 26B-A4B-it
    DFlash drafters), every field as published except the widths, shrunk to
    ``hidden`` (the tiny target's) and a 2-head attention."""
    shapes = {
        "gemma-4-31B-it": dict(num_target_layers=60, target_layer_ids=[1, 12, 23, 35, 46, 57]),
        "gemma-4-26B-A4B-it": dict(num_target_layers=30, target_layer_ids=[1, 6, 11, 17, 22, 27]),
    }[name]
    return dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        hidden_size=hidden,
        num_hidden_layers=5,
        intermediate_size=2 * hidden,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=vocab,
        num_target_layers=shapes["num_target_layers"],
        block_size=16,
        dflash_config={"target_layer_ids": shapes["target_layer_ids"], "mask_token_id": 4},
        layer_types=[SLIDING] * 4 + [FULL],
        sliding_window=2048,
        use_sliding_window=True,
        final_logit_softcapping=30.0,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=False,
        tie_word_embeddings=True,
        hidden_act="silu",
    )
