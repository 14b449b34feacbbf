"""Test helpers, in one place: tiny seeded targets and drafters written in
real Hugging Face layout, damaged checkpoints, mlx-lm's reference decode and
the drafter test doubles.

Tests load the checkpoints back through the same code users run
(mlx_lm.load, dflash_mlx.load_draft), so the loaders are exercised, not
bypassed.
"""

import itertools
from types import SimpleNamespace
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.utils import load_model

import dflash_mlx
from dflash_mlx.adaptive import BlockSizer
from dflash_mlx.random_pair import (  # the builders the package ships, for benchmarks too
    LLAMA,
    MASK,
    QWEN3,
    QWEN3_5,
    draft_config,
    family_config,
    make_draft,
    make_target,
    seeded_init,
    write_tokenizer,
)
from dflash_mlx.models.dflash import DFlashConfig
from dflash_mlx.models.dflash2 import DFlash2DraftModel
from dflash_mlx.sampling import processed_probs, sample
from dflash_mlx.targets import adapter_for

# ---------------------------------------------------------------------------
# Target configs: one per family the README lists (qwen3, qwen3_5 and llama
# are dflash_mlx.random_pair's)

QWEN2 = family_config("qwen2", "Qwen2ForCausalLM", num_hidden_layers=3, rope_theta=10000.0, tie_word_embeddings=False)

QWEN3_MOE = dict(
    QWEN3, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
    num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], moe_intermediate_size=32,
    norm_topk_prob=True,
)

QWEN3_5_MOE = dict(
    QWEN3_5, model_type="qwen3_5_moe", num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
)


def multimodal(base: dict) -> dict:
    """Qwen3.5 checkpoints nest the text model under text_config."""
    text = {k: v for k, v in base.items() if k not in ("model_type", "architectures")}
    text["model_type"] = base["model_type"] + "_text"
    return {"model_type": base["model_type"], "architectures": base["architectures"],
            "text_config": text, "vision_config": {"depth": 1}}


# Gemma-4 (mlx-lm gemma4_text / gemma4)

SLIDING, FULL = "sliding_attention", "full_attention"

GEMMA4_TEXT = family_config(
    "gemma4_text",
    "Gemma4ForCausalLM",
    intermediate_size=96,
    num_hidden_layers=6,
    head_dim=16,
    global_head_dim=32,  # the full-attention layers' own head size
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


# The encoder-free export: mlx-lm loads it with its gemma4 model, keeping
# both model types (the text model's is gemma4_unified_text).
GEMMA4_UNIFIED = dict(
    gemma4_multimodal(dict(GEMMA4_TEXT, model_type="gemma4_unified_text")),
    model_type="gemma4_unified",
    architectures=["Gemma4UnifiedForConditionalGeneration"],
)

# The families of z-lab's other published drafters, shrunk: gpt-oss (sliding
# windows of 8 alternating with full attention, per-head sinks, MoE with the
# clamped SwiGLU, YaRN rope), Qwen3-Next (GatedDeltaNet x3 + gated attention,
# MoE with a shared expert) and DeepSeek-V3 / Kimi-K2.5 (multi-head latent
# attention, YaRN rope, MoE with a shared expert after a dense first layer).

GPT_OSS = family_config(
    "gpt_oss", "GptOssForCausalLM", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    experts_per_token=2, sliding_window=8, layer_types=[SLIDING, FULL] * 2, attention_bias=True,
    rope_theta=150000, swiglu_limit=7.0, tie_word_embeddings=False, initial_context_length=4096,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
)  # fmt: skip

QWEN3_NEXT = family_config(
    "qwen3_next", "Qwen3NextForCausalLM", head_dim=16, full_attention_interval=4,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
    moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True, rope_theta=10000.0,
    partial_rotary_factor=0.25, tie_word_embeddings=False,
)  # fmt: skip

DEEPSEEK_V3 = family_config(
    "deepseek_v3", "DeepseekV3ForCausalLM", num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    rope_theta=50000.0, tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
)  # fmt: skip

KIMI_K25 = {  # Kimi-K2.5: DeepSeek-V3's text model next to a vision tower
    "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
    "text_config": dict(DEEPSEEK_V3, model_type="kimi_k2"), "vision_config": {"model_type": "moonvit"},
}  # fmt: skip

FAMILIES = {  # every family the README lists, the multimodal wrappers too
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "qwen3_5": QWEN3_5,
    "qwen3_5_moe": QWEN3_5_MOE,
    "qwen3_5_multimodal": multimodal(QWEN3_5),
    "qwen3_5_moe_multimodal": multimodal(QWEN3_5_MOE),
    "gemma4_text": GEMMA4_TEXT,
    "gemma4": gemma4_multimodal(dict(GEMMA4_TEXT, sliding_window=16)),
    "gemma4_unified": GEMMA4_UNIFIED,
    "gpt_oss": GPT_OSS,
    "qwen3_next": QWEN3_NEXT,
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k25": KIMI_K25,
}

# One family per way the decode loop meets a target (tests of loop features
# -- processors, copy drafts, structured outputs -- run on these; every
# family's own forward and rollback: tests/test_lossless.py, test_targets.py):
# plain KV caches (qwen3; llama, qwen2 and qwen3_moe take the same adapter and
# caches), the hybrid recurrent caches (qwen3_5; its MoE and multimodal
# variants differ only inside mlx-lm's layers or at loading), Qwen3-Next's
# hybrid of its own, gpt-oss's sliding windows with sinks, Gemma-4's windows,
# shared KV and soft-capped logits (text, and the wrapped model with its own
# stop tokens; gemma4_unified loads as the same model), and multi-head latent
# attention under a wrapper (kimi_k25: DeepSeek-V3's model).
LOOP_FAMILIES = ["qwen3", "qwen3_5", "qwen3_next", "gpt_oss", "gemma4_text", "gemma4", "kimi_k25"]


# ---------------------------------------------------------------------------
# Checkpoint builders


def dflash2_config(target_cfg: dict, vocab: int, *, block_size=8, layers=2, **dflash) -> dict:
    """A tiny DFlash2 config shaped like the published ones."""
    cfg = draft_config(target_cfg, vocab, block_size=block_size, layers=layers)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(
        {
            "conv_kernel_size": 4,
            "conv_group_size": 16,
            "selector_rank": 8,
            "selector_top_k": 6,
            "input_embedding_scale": 1.5,
            "output_multiplier": 0.8,
            "final_logit_softcapping": 30.0,
            **dflash,
        }
    )
    cfg.update(is_causal=False, layer_types=["sliding_attention"] * layers, sliding_window=48)
    return cfg


class Pair:
    """A tiny target on disk, loaded through mlx-lm, plus its draft config."""

    def __init__(self, root: Path, base: dict, seed: int = 0):
        self.base = base.get("text_config", base)  # what the drafter sees
        build = make_gemma4_target if base["model_type"].startswith("gemma4") else make_hf_target
        self.path = build(root / base["model_type"], base, seed=seed)
        self.model, self.tokenizer = load(str(self.path))
        self.vocab = adapter_for(self.model).vocab_size

    def draft_config(self, **kw) -> dict:
        return draft_config(self.base, self.vocab, **kw)

    def dflash2_config(self, **kw) -> dict:
        return dflash2_config(self.base, self.vocab, **kw)

    def make_draft(self, path: Path, seed: int = 1, **kw) -> Path:
        return make_draft(path, self.draft_config(**kw), seed=seed)

    def reference(self, prompt, max_tokens, eos_ids=None, **kw):
        return reference_tokens(self.model, self.tokenizer, prompt, max_tokens, eos_ids, **kw)

    def reference_steps(self, prompt, max_tokens, eos_ids=None, **kw):
        return reference_steps(self.model, self.tokenizer, prompt, max_tokens, eos_ids, **kw)

    def dflash(self, draft, prompt, eos_ids=None, **kw):
        return dflash_tokens(self.model, draft, self.tokenizer, prompt, eos_ids, **kw)


def to_hf_layout(model_type: str, weights: dict, cfg: dict) -> dict:
    """mlx-lm parameter names -> the Hugging Face checkpoint's, for the
    families whose sanitize maps them back: experts one by one (mlx-lm
    stacks them), DeepSeek-V3's ``kv_b_proj`` (mlx-lm splits it per head),
    Qwen3-Next's norms stored as offsets from 1 and its conv kernels
    channel-first; Kimi-K2.5's vision tower, which loading drops. gpt-oss
    stays in mlx-lm's names, as its MLX exports are (its original MXFP4
    blocks are a quantization of their own)."""
    text = cfg.get("text_config", cfg)
    out = {}
    for name, value in weights.items():
        if ".switch_mlp." in name:
            for e in range(value.shape[0]):
                out[name.replace(".switch_mlp.", f".experts.{e}.")] = value[e]
        elif name.endswith("self_attn.embed_q.weight"):
            unembed = weights[name.replace("embed_q", "unembed_out")]
            kv_b = mx.concatenate([value.swapaxes(-1, -2), unembed], axis=1)
            out[name.replace("embed_q", "kv_b_proj")] = kv_b.reshape(-1, text["kv_lora_rank"])
        elif name.endswith("self_attn.unembed_out.weight"):
            continue
        elif model_type == "qwen3_next" and name.endswith("conv1d.weight"):
            out[name] = value.swapaxes(1, 2)
        elif model_type == "qwen3_next" and value.ndim == 1 and name.endswith(
            ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")
        ):
            out[name] = value - 1.0
        else:
            out[name] = value
    if model_type == "kimi_k25":
        out["vision_tower.patch_embed.proj.weight"] = mx.zeros((8, 8))
    return out


def make_hf_target(path: Path, base: dict, seed: int = 0, **overrides) -> Path:
    """:func:`make_target`; for the families :func:`to_hf_layout` knows, its
    weights then renamed as their Hugging Face checkpoints name them.
    Kimi-K2.5 is built as its text model (mlx-lm's loader cannot build the
    wrapper without weights; ``overrides`` apply to it), then wrapped."""
    if base["model_type"] not in ("qwen3_next", "deepseek_v3", "kimi_k25"):
        return make_target(path, base, seed=seed, **overrides)
    wrapped = base["model_type"] == "kimi_k25"
    text = dict(base["text_config"], model_type="deepseek_v3") if wrapped else base
    path = make_target(path, text, seed=seed, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    weights = mx.load(str(path / "model.safetensors"))
    if wrapped:
        cfg = dict(base, text_config=dict(cfg, model_type=base["text_config"]["model_type"]))
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        weights = {"language_model." + k: v for k, v in weights.items()}
    weights = to_hf_layout(cfg["model_type"], weights, cfg)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


# ---------------------------------------------------------------------------
# Damaged drafter checkpoints (one file, as make_draft writes by default)

DAMAGES = ("no-config", "bad-json", "no-weights", "truncated", "missing-tensor", "extra-tensor",
           "wrong-shape", "wrong-arch")
MISSING, EXTRA, RESHAPED = "layers.1.mlp.up_proj.weight", "layers.1.mlp.extra_proj.weight", "fc.weight"


def damage(path: Path, how: str) -> Path:
    """Damage the drafter checkpoint at ``path`` in one of DAMAGES' ways."""
    st, config = path / "model.safetensors", path / "config.json"
    if how == "no-config":
        config.unlink()
    elif how == "bad-json":
        config.write_text("{")
    elif how == "no-weights":
        st.unlink()
    elif how == "truncated":
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    elif how in ("missing-tensor", "extra-tensor", "wrong-shape"):
        w = mx.load(str(st))
        if how == "missing-tensor":
            w.pop(MISSING)
        elif how == "extra-tensor":
            w[EXTRA] = mx.zeros((4, 4))
        else:
            w[RESHAPED] = mx.zeros((64, 100))
        mx.save_safetensors(str(st), w)
    elif how == "wrong-arch":
        cfg = json.loads(config.read_text())
        cfg["architectures"], cfg["model_type"] = ["MysteryDraftModel"], "mystery"
        config.write_text(json.dumps(cfg))
    else:
        raise ValueError(f"unknown damage {how!r}")
    return path


# ---------------------------------------------------------------------------
# Decoding: mlx-lm's reference and DFlash's, over one tokenizer


class eos_set:
    """Temporarily replace the tokenizer's eos ids (None keeps them)."""

    def __init__(self, tokenizer, eos_ids):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids

    def __enter__(self):
        self.saved = set(self.tokenizer.eos_token_ids)
        if self.eos_ids is not None:
            self.tokenizer.eos_token_ids = set(self.eos_ids)

    def __exit__(self, *exc):
        self.tokenizer.eos_token_ids = self.saved


def reference_responses(model, tokenizer, prompt, max_tokens, eos_ids=None, **kw):
    """mlx-lm's own decode: its responses, the eos one included; ``kw`` go to
    mlx_lm.stream_generate (a ``sampler``, a ``prefill_step_size``, a ``prompt_cache``)."""
    with eos_set(tokenizer, eos_ids):
        return list(mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kw))


def reference_tokens(model, tokenizer, prompt, max_tokens, eos_ids=None, **kw):
    """mlx-lm's own tokens (eos excluded, as both generators report)."""
    responses = reference_responses(model, tokenizer, prompt, max_tokens, eos_ids, **kw)
    return [r.token for r in responses if r.finish_reason != "stop"]


def reference_steps(model, tokenizer, prompt, max_tokens, eos_ids=None, **kw):
    """mlx-lm's own tokens and the logprobs it yields with each ``[n, V]``
    (eos excluded); ``kw`` as :func:`reference_responses` takes them, a
    ``logits_processors`` list and a ``sampler`` included."""
    responses = [r for r in reference_responses(model, tokenizer, prompt, max_tokens, eos_ids, **kw) if r.finish_reason != "stop"]
    return [r.token for r in responses], mx.stack([r.logprobs for r in responses])


def reference_text(model, tokenizer, prompt, max_tokens, **kw):
    """mlx-lm's own text."""
    return "".join(r.text for r in reference_responses(model, tokenizer, prompt, max_tokens, **kw))


def dflash_tokens(model, draft, tokenizer, prompt, eos_ids=None, **kw):
    """DFlash's tokens and its responses."""
    with eos_set(tokenizer, eos_ids):
        responses = list(dflash_mlx.stream_generate(model, draft, tokenizer, prompt, **kw))
    return [t for r in responses for t in r.tokens], responses


def tokens_per_cycle(*runs) -> float:
    """Mean tokens committed per verify cycle, pooled over runs (each run's
    responses; the first of them is the prefill's token, not a cycle)."""
    cycles = [r for responses in runs for r in responses[1:]]
    return sum(r.committed for r in cycles) / max(len(cycles), 1)


def recorded_traffic(pair, root: Path, conversations: int = 24):
    """A Recorder over ``root / "t"`` holding greedy conversations of the
    tiny target (random prompts, 40 answer tokens each)."""
    from dflash_mlx.traffic import Recorder

    draft = dflash_mlx.load_draft(pair.make_draft(root / "d0", block_size=8), pair.model)
    rec = Recorder(root / "t")
    for i in range(conversations):
        list(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, prompt_of(12, seed=i), max_tokens=40, record=rec))
    return rec


def prompt_of(n, seed=0):
    rng = np.random.default_rng(seed + n)
    return rng.integers(0, 256, size=n).tolist()


NOUNS = "cache block draft target token layer window prefix state chunk row step sample verify stream tap head mask".split()
VERBS = "read keep drop join count build choose commit roll_back load save trim".split()


def seeded_source(seed: int = 0, functions: int = 1500) -> str:
    """Python-like source from a small seeded grammar: text for the trainer's
    tests, structured enough to learn from, and fixed, where this package's
    own source (their text once) moved their batches with every edit."""
    rng = np.random.default_rng(seed)

    def pick(words):
        return words[rng.integers(len(words))]

    out = []
    for _ in range(functions):
        verb, noun, other = pick(VERBS), pick(NOUNS), pick(NOUNS)
        k, limit = rng.integers(2, 9), rng.integers(10, 99)
        out.append(
            f"def {verb}_{noun}({noun}s, {other}):\n"
            f'    """{verb.replace("_", " ").capitalize()} the {noun} of every {other} in {noun}s."""\n'
            f"    total = len({noun}s) + {other} * {k}\n"
            f"    return total if total > {limit} else {other}\n\n\n"
        )
    return "".join(out)


# ---------------------------------------------------------------------------
# Statistics (see tests/test_sampling.py for the bounds)

DELTA = 5e-6  # false-failure probability of one statistical check


def tv_bound(exact: np.ndarray, n: int) -> float:
    """TV of n iid draws from ``exact`` stays below this with probability 1 - DELTA."""
    return 0.5 * np.sqrt(exact * (1 - exact) / n).sum() + np.sqrt(np.log(1 / DELTA) / (2 * n))


def tv(samples: np.ndarray, exact: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=exact.size)
    return 0.5 * np.abs(counts / samples.size - exact).sum()


# Unit roundoff of each float dtype (half the gap between 1 and the next value).
EPS = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


def scaled_error(got, want) -> float:
    """Largest difference, in units of the reference's root mean square."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / mx.sqrt(mx.mean(want * want))).item()


# ---------------------------------------------------------------------------
# Sampling checks through the real loop, on a target with a small vocabulary
# (see tests/test_sampling.py for the bounds)

V = 16  # small vocabulary: exact joint tables over a few tokens stay small
PROMPT = [1, 5, 3, 7]
TRUNCATED = dict(temperature=0.8, top_p=0.9, top_k=8)
REAL_TOKENS = 64


def draft_noise():
    """Fixed logit noise that keeps the double drafter's q close to, not equal to, p."""
    return mx.random.normal((V,), key=mx.random.key(7)) * 0.6


ANCHOR = 6  # the prefill token: the target's own sample, so the check conditions on it


def continuation_logits(model, depth: int):
    """Target logits after PROMPT + ANCHOR + every continuation of ``depth``
    tokens: [V**depth, V], continuations in lexicographic order."""
    conts = np.array(list(itertools.product(range(V), repeat=depth)), dtype=np.int32).reshape(V**depth, depth)
    seqs = np.concatenate([np.tile(PROMPT + [ANCHOR], (V**depth, 1)), conts], axis=1)
    return model(mx.array(seqs))[:, -1].astype(mx.float32)


def small_pair(root, base):
    """A tiny target with a 16-token vocabulary and a random DFlash drafter
    for it (block size 4). The byte tokenizer stays: ids 0..15 decode fine,
    and its eos (256) can never be sampled, so runs never stop early."""
    model, tokenizer = load(str(make_target(root / "target", base, seed=3, vocab_size=V)))
    cfg = draft_config(base, V, block_size=4)
    draft = dflash_mlx.load_draft(str(make_draft(root / "draft", cfg, seed=1)), model)
    return SimpleNamespace(model=model, tokenizer=tokenizer, draft=draft, base=base)


def generated_tokens(model, draft, tokenizer, seed, max_tokens, **kw):
    mx.random.seed(seed)
    return dflash_tokens(model, draft, tokenizer, PROMPT, max_tokens=max_tokens, **kw)


def pit_check(model, runs, setting, rng, allow=None, logits_processors=None):
    """Randomised PIT of every generated token under the target's exact
    processed p given its actual prefix (one plain mlx-lm forward per run;
    ``allow(tokens)``: the tokens allowed at each position ``[n, V]``, the
    others' logits -inf, as a grammar's mask leaves them;
    ``logits_processors()``: mlx-lm processors applied to each position with
    its own history first, as mlx-lm's decode applies them). A run is the
    tokens generated after PROMPT, or ``(prefix, history, tokens)``: those
    generated after ``prefix`` (a conversation's earlier turns), the
    processors' history starting at ``history`` (the turn's own prompt).

    Returns (KS distance of the PIT values from U(0, 1), its DKW bound,
    number of tokens committed outside the processed support).
    """
    us, outside = [], 0
    for run in runs:
        prefix, history, tokens = run if isinstance(run, tuple) else (PROMPT, PROMPT, run)
        logits = model(mx.array([prefix + tokens]))[0, len(prefix) - 1 : -1]
        if logits_processors is not None:
            rows = []
            for i in range(len(tokens)):
                row = logits[i : i + 1]
                for f in logits_processors():
                    row = f(mx.array(history + tokens[:i]), row)
                rows.append(row)
            logits = mx.concatenate(rows)
        if allow is not None:
            logits = mx.where(allow(tokens), logits, -mx.inf)
        p = np.array(processed_probs(logits, **setting), dtype=np.float64)
        x = np.array(tokens)
        p_x = p[np.arange(len(x)), x]
        outside += int((p_x == 0).sum())
        ids = np.arange(V)[None]
        above = (p > p_x[:, None]) | ((p == p_x[:, None]) & (ids < x[:, None]))
        us.append((p * above).sum(axis=1) + rng.uniform(size=len(x)) * p_x)
    u = np.sort(np.concatenate(us))
    n = u.size
    ks = max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max())
    return ks, np.sqrt(np.log(2 / DELTA) / (2 * n)), outside


def sampled_runs(small, draft, runs, setting, **kw):
    """``runs`` seeded sampled generations of REAL_TOKENS tokens after PROMPT
    (``small``: a target with a V-token vocabulary, and its tokenizer); the
    tokens of each, and the accepted count of every verify cycle."""
    out, responses = [], []
    for seed in range(runs):
        tokens, rs = generated_tokens(small.model, draft, small.tokenizer, seed, REAL_TOKENS, **setting, **kw)
        assert len(tokens) == REAL_TOKENS
        out.append(tokens)
        responses += rs[1:]
    return out, [r.accepted for r in responses]


# ---------------------------------------------------------------------------
# The DFlash drafter in plain numpy (float32), to check the real one against


def to_np(a):
    """An mlx array as a float32 numpy array."""
    return np.array(a.astype(mx.float32))


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """Non-traditional RoPE (rotate halves) on [..., S, D]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_logits(draft, target, blocks, contexts):
    """The DFlash drafter's logits, written out in numpy: a loop-level float32 forward over successive cycles.

    ``contexts[i]`` holds the tap states injected before block ``i``; the
    block's anchor sits right after all context injected so far.
    """
    cfg = draft.config
    W = {k: to_np(v) for k, v in tree_flatten(draft.parameters())}
    E = to_np(target.backbone.embed_tokens.weight)
    head = E if target.tied else to_np(target.text_model.lm_head.weight)
    eps, hd = cfg.rms_norm_eps, cfg.head_dim
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    ctx_feats = np.zeros((0, cfg.hidden_size), np.float32)
    outs = []
    for block, ctx in zip(blocks, contexts):
        fused = rms(to_np(ctx)[0] @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
        ctx_feats = np.concatenate([ctx_feats, fused])
        S, L = len(ctx_feats), len(block)
        pos_ctx, pos_blk = np.arange(S), S + np.arange(L)
        h = E[np.array(block)] * cfg.input_embedding_scale
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            x = rms(h, W[p + "input_layernorm.weight"], eps)
            q = (x @ W[p + "self_attn.q_proj.weight"].T).reshape(L, H, hd)
            q = rope(rms(q, W[p + "self_attn.q_norm.weight"], eps).transpose(1, 0, 2), pos_blk, cfg.rope_theta)
            kv_in = np.concatenate([ctx_feats, x])
            k = (kv_in @ W[p + "self_attn.k_proj.weight"].T).reshape(S + L, KV, hd)
            k = rope(rms(k, W[p + "self_attn.k_norm.weight"], eps).transpose(1, 0, 2),
                     np.concatenate([pos_ctx, pos_blk]), cfg.rope_theta)
            v = (kv_in @ W[p + "self_attn.v_proj.weight"].T).reshape(S + L, KV, hd).transpose(1, 0, 2)
            layer_type = cfg.layer_types[i]
            causal = (layer_type == "sliding_attention") if cfg.is_causal is None else cfg.is_causal
            window = cfg.sliding_window if layer_type == "sliding_attention" else None
            out = np.zeros((L, H, hd), np.float32)
            for head_i in range(H):
                kv_i = head_i // (H // KV)
                for qi in range(L):
                    qp = pos_blk[qi]
                    scores = []
                    for kj, kp in enumerate(np.concatenate([pos_ctx, pos_blk])):
                        ok = (not causal or kp <= qp) and (
                            window is None or (qp - kp < window and (causal or kp - qp < window))
                        )
                        scores.append(q[head_i, qi] @ k[kv_i, kj] / np.sqrt(hd) if ok else -np.inf)
                    scores = np.array(scores)
                    w = np.exp(scores - scores.max())
                    w /= w.sum()
                    out[qi, head_i] = w @ v[kv_i]
            h = h + out.reshape(L, -1) @ W[p + "self_attn.o_proj.weight"].T
            x = rms(h, W[p + "post_attention_layernorm.weight"], eps)
            g = x @ W[p + "mlp.gate_proj.weight"].T
            u = x @ W[p + "mlp.up_proj.weight"].T
            h = h + ((g / (1 + np.exp(-g))) * u) @ W[p + "mlp.down_proj.weight"].T
        h = rms(h, W["norm.weight"], eps)
        outs.append(h @ head.T)
    return outs


def drafter_and_reference_logits(draft, target, vocab, context_lengths, block_len, seed=3):
    """The drafter's logits over successive cycles of random tap contexts
    (one per length) and random blocks, and :func:`reference_logits`' for them."""
    rng = np.random.default_rng(seed)
    n_feat = draft.config.fc_input_size
    contexts = [mx.array(rng.standard_normal((1, s, n_feat)).astype(np.float32)) for s in context_lengths]
    blocks = [rng.integers(0, vocab, block_len).tolist() for _ in contexts]
    cache = draft.make_cache()
    got = [to_np(draft(mx.array([b]), c, cache)[0]) for b, c in zip(blocks, contexts)]
    return got, reference_logits(draft, target, blocks, contexts)


# ---------------------------------------------------------------------------
# Drafter test doubles


def committed_sequence(prompt, block, context, cache, reference=None) -> list:
    """The committed tokens up to and including the anchor, tracked from what
    the loop injects: ``context`` holds the taps of the positions committed
    since the last call (the whole prompt on the first call: any other
    length is a loop bug, reported here).

    With ``reference`` (the greedy continuation: every committed token is
    its) the positions of plain cycles between two drafts (the adaptive
    block size) are tracked too, and the anchor must be the reference's
    token right after them."""
    n = context.shape[1]
    anchor = int(block[0, 0].item())
    if cache["last"] is None and n == 1 < len(prompt):
        # dflash_mlx.calibration.calibrate's timing probe: a fresh scratch cache
        # fed one context position; nothing of the sequence to track (with a
        # one-token prompt it reads as a first call, which is as harmless)
        cache["probe"] = True
        return [anchor]
    if reference is not None and cache["last"] is not None:
        start = len(cache["tokens"]) - len(prompt)
        new = list(reference[start : start + n])
        assert new[:1] == cache["last"][:1] and reference[start + n : start + n + 1] == [anchor], (
            f"the drafter was fed {n} context positions, but the anchor is not the token after them"
        )
    elif reference is not None and cache["last"] is None and n > len(prompt):  # plain steps before the first draft
        new = list(prompt) + list(reference[: n - len(prompt)])
        assert reference[n - len(prompt) : n - len(prompt) + 1] == [anchor], (
            f"the drafter was first fed {n} context positions, but the anchor is not the token after them"
        )
    else:
        new = list(prompt) if cache["last"] is None else cache["last"][:n]
    assert n == len(new), f"the drafter was fed {n} context positions, {len(new)} were committed"
    cache["tokens"] += new
    return cache["tokens"] + [anchor]


class FakeDrafter:
    """Base of the test doubles behind the drafter interface: binds the
    target's adapter (one tap) and tracks the committed tokens (without a
    greedy ``reference``, from its own blocks: run it with
    ``copy_drafts=False``, since a cycle of copies commits tokens it did
    not propose)."""

    mask_token_id = 0
    vocab_ids = None  # head columns are target ids

    def __init__(self, prompt, block_size):
        self.prompt, self.block_size, self._target = list(prompt), block_size, None
        self.block_lengths = []  # of every block of masks it was asked to fill

    def bind(self, model):
        self._target = adapter_for(model)
        self._target.tap_ids = [0]
        return self

    @property
    def target(self):
        return self._target

    def check_block_size(self, block_size):
        pass

    def make_cache(self, window=None, sink=0):  # a test double keeps its whole context
        return {"tokens": [], "last": None}

    def propose(self, block, context, cache, slots=None):
        self.block_lengths.append(block.shape[1])
        seq = committed_sequence(self.prompt, block, context, cache, getattr(self, "reference", None))
        if cache.get("probe"):
            return mx.zeros((1, block.shape[1] - 1), dtype=mx.int32)[:, :slots]
        tokens = self.draft(seq, block.shape[1] - 1)
        cache["last"] = [seq[-1]] + tokens
        return mx.array([tokens])[:, :slots]

    def slot_logits(self, block, context, cache, slots=None):
        """Logits whose argmax is :meth:`propose`'s choice, by a wide margin
        (what a control drafting along the block itself reads)."""
        tokens = self.propose(block, context, cache, slots)
        return mx.where(mx.arange(self._target.vocab_size) == tokens[..., None], 100.0, 0.0)


class ScriptedDrafter(FakeDrafter):
    """Proposes the target's true greedy continuation with a mistake planted
    at a chosen slot each cycle, so every acceptance length 0..B-1 (and full
    blocks) occurs."""

    def __init__(self, reference, prompt, block_size, mistakes, vocab):
        super().__init__(prompt, block_size)
        self.reference, self.vocab = list(reference), vocab
        self.mistakes = itertools.cycle(mistakes)

    def draft(self, seq, n):
        at = len(seq) - 1 - len(self.prompt)  # index of the anchor in the reference
        proposal = (self.reference[at + 1 : at + 1 + n] + [0] * n)[:n]
        slot = next(self.mistakes)
        if slot < n:
            proposal[slot] = (proposal[slot] + 1) % self.vocab
        return proposal


class ScriptedSizer(BlockSizer):
    """Block sizer test double: chooses the lengths of a script (cycled),
    whatever the cycles show (``stream_generate(sizer=...)``)."""

    def __init__(self, script, max_block=16):
        super().__init__(max_block, None, fixed=True)
        self.script, self.asked = itertools.cycle(script), []

    def choose(self, remaining, rows=None):
        self.asked.append(min(next(self.script), remaining if rows is None else max(remaining)))
        return self.asked[-1]

    def observe(self, block, accepted, seconds, walk=None, context=None, **rows):
        pass


class DoubleDrafter(FakeDrafter):
    """q close to p: proposes autoregressively from the target itself
    (recomputed from the committed tokens) with fixed noise on its logits,
    so long prefixes get accepted."""

    def __init__(self, prompt, noise, block_size=4):
        super().__init__(prompt, block_size)
        self.noise = noise

    def draft(self, seq, n, pick=lambda logits: (mx.argmax(logits), None)):
        tokens, self.qs = [], []
        for _ in range(n):
            token, q = pick(self._target.model(mx.array([seq + tokens]))[0, -1] + self.noise)
            tokens.append(token.item())
            self.qs.append(q)
        return tokens

    def propose_with_probs(self, block, context, cache, temperature, top_p=0.0, top_k=0, min_p=0.0, slots=None, key=None):
        keys = [None] * block.shape[1] if key is None else list(mx.random.split(key, block.shape[1]))

        def pick(logits):
            q = processed_probs(logits, temperature, top_p, top_k, min_p)
            return sample(q, keys.pop()), q

        seq = committed_sequence(self.prompt, block, context, cache)
        tokens = self.draft(seq, block.shape[1] - 1, pick)
        cache["last"] = [seq[-1]] + tokens
        return mx.array([tokens])[:, :slots], mx.stack(self.qs)[None][:, :slots]


class TreeDoubleDrafter(DoubleDrafter):
    """:class:`DoubleDrafter`'s slot logits, for draft trees: the target's
    own logits (plus the noise) along its greedy continuation. A tree's
    walk commits the target's samples, which no proposal tells, so it reads
    the committed tokens from the prompt cache it follows (:meth:`follow`).
    ``scale`` sharpens its logits: a surer drafter, deeper trees."""

    def __init__(self, prompt, noise, block_size=4, scale=1.0):
        super().__init__(prompt, noise, block_size)
        self.scale = scale

    def follow(self, prompt_cache):
        self.followed = prompt_cache
        return prompt_cache

    def slot_head_logits(self, block, context, cache, slots=None):
        seq = list(self.followed.tokens)
        assert seq[-1] == int(block[0, 0].item()), "the anchor is the last committed token"
        rows, tokens = [], []
        for _ in range(block.shape[1] - 1):
            rows.append((self._target.model(mx.array([seq + tokens]))[0, -1] + self.noise) * self.scale)
            tokens.append(int(mx.argmax(rows[-1]).item()))
        return mx.stack(rows)[None][:, :slots]


class EchoDFlash2(DFlash2DraftModel):
    """A real DFlash2 drafter (its selector walk, its ``propose_with_probs``)
    whose slot states are the target's own final states along the target's
    greedy path, so its candidates are the tokens the target finds likely
    (a random drafter's rarely are, and gives a sampling check no power).
    The selector's pairwise term stays, from the seeded weights."""

    def __init__(self, config: DFlashConfig, prompt, seed=0):
        super().__init__(config)
        seeded_init(self, seed, scale=0.3)
        self.prompt = list(prompt)

    def make_cache(self, window=None, sink=0):  # a test double keeps its whole context
        return {"tokens": [], "last": None}

    def hidden_states(self, block_tokens, target_hidden, cache):
        seq = committed_sequence(self.prompt, block_tokens, target_hidden, cache)
        target, greedy = self.target, []
        for _ in range(block_tokens.shape[1] - 2):
            logits, _ = target.forward(mx.array([seq + greedy]), target.make_cache(), taps=[], record=False)
            greedy.append(int(mx.argmax(logits[0, -1]).item()))
        _, h = target.forward(mx.array([seq + greedy]), target.make_cache(), taps=[target.num_layers - 1], record=False)
        states = target.backbone.norm(h[:, -(block_tokens.shape[1] - 1) :])
        return mx.concatenate([states[:, :1], states], axis=1)  # slot 0's is never read

    def select(self, block_tokens, target_hidden, cache, *args, **kw):
        walk = super().select(block_tokens, target_hidden, cache, *args, **kw)
        cache["last"] = [int(block_tokens[0, 0].item())] + walk.tokens[0].tolist()
        return walk


# ---------------------------------------------------------------------------
# Gemma-4 checkpoints and drafters


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
    path = Path(path)
    vocab = vocab_size or write_tokenizer(path)
    if vocab_size:  # a smaller model vocabulary over the same tokenizer
        write_tokenizer(path)
    cfg = json.loads(json.dumps(base))
    text = cfg.get("text_config", cfg)
    text.update(vocab_size=vocab, vocab_size_per_layer_input=vocab)
    cfg["vocab_size"] = vocab
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    model, _ = load_model(path, strict=False)
    seeded_init(model, seed, scale=1.5)
    rng = np.random.default_rng(seed)
    weights = {
        # a positive per-layer output scale, as trained checkpoints have
        k: mx.array(rng.uniform(0.7, 1.2, v.shape), dtype=mx.float32) if k.endswith("layer_scalar") else v
        for k, v in tree_flatten(model.parameters())
    }
    weights = to_gemma4_hf_layout(weights, multimodal="text_config" in cfg)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
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


# ---------------------------------------------------------------------------
# z-lab's drafters for gpt-oss, Qwen3-Coder-Next and Kimi-K2.5, and targets of their shape

# Per drafter: its target's layer count and vocabulary, then its config.json's
# own fields as published (widths shrunk by :func:`zlab_draft_config`).
ZLAB_DRAFTERS = {
    # z-lab/gpt-oss-20b-DFlash's config.json.
    "gpt-oss-20b": (24, 201088, dict(
        architectures=["DFlashDraftModel"], attention_bias=True, attention_dropout=0.0, block_size=8,
        bos_token_id=199998, dflash_config={"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
        dtype="bfloat16", eos_token_id=200002, hidden_act="silu", initial_context_length=4096,
        initializer_range=0.02, max_position_embeddings=131072, model_type="gpt_oss", num_hidden_layers=8,
        rms_norm_eps=1e-5, rope_theta=150000,
    )),
    # z-lab/Kimi-K2.5-DFlash's config.json: a Qwen3-style drafter under YaRN.
    "Kimi-K2.5": (61, 163840, dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", num_target_layers=61, block_size=8,
        num_hidden_layers=6, dflash_config={"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]},
        attention_bias=False, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096},
        max_position_embeddings=262144,
    )),
    # z-lab/Qwen3-Coder-Next-DFlash: its config.json was not found; these
    # are the fields z-lab's Qwen drafters publish, its taps by z-lab's rule
    # for a 5-layer drafter over 48 target layers.
    "Qwen3-Coder-Next": (48, 151936, dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", num_target_layers=48, block_size=16,
        num_hidden_layers=5, dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 12, 23, 34, 45]},
        attention_bias=False, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=5000000.0,
        tie_word_embeddings=False, max_position_embeddings=262144,
    )),
}


def zlab_draft_config(name: str, hidden: int) -> dict:
    """A drafter of :data:`ZLAB_DRAFTERS` with every field as published but
    the widths: ``hidden`` (the shaped target's), two heads of 8."""
    _, vocab, fields = ZLAB_DRAFTERS[name]
    return dict(
        fields, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=vocab,
    )


SHAPE_HIDDEN = 16


def zlab_shaped_target(root: Path, name: str):
    """A target with the layer count, layer pattern and vocabulary of the
    drafter ``name``'s target (gpt-oss-20b, Qwen3-Coder-Next, Kimi-K2.5),
    its widths shrunk; loaded through mlx-lm."""
    n, vocab, _ = ZLAB_DRAFTERS[name]
    small = dict(hidden_size=SHAPE_HIDDEN, intermediate_size=16, num_hidden_layers=n, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=vocab)
    if name == "gpt-oss-20b":
        base = dict(GPT_OSS, **small, head_dim=8, layer_types=[SLIDING, FULL] * (n // 2))
    elif name == "Qwen3-Coder-Next":
        base = dict(QWEN3_NEXT, **small, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=1,
                    linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=8,
                    shared_expert_intermediate_size=8)
    else:
        mla = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        text = {**DEEPSEEK_V3, **small, **mla, "num_key_value_heads": 2, "moe_intermediate_size": 8}
        base = dict(KIMI_K25, text_config=dict(text, model_type="kimi_k2"))
    return load(str(make_hf_target(root / name, base)))


def interrupt_sampling_at(monkeypatch, n: int):
    """Ctrl-C while the trainer samples its ``n``-th batch (the checkpoints
    saved before survive); returns the real sampler, to put back."""
    from dflash_mlx import train

    real, calls = train.sample_batch, []

    def interrupted(*a):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(train, "sample_batch", interrupted)
    return real
