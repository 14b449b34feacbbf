"""z-lab's published drafters, found from the target's name.

    known_drafter("Qwen/Qwen3.5-4B")                     # 'z-lab/Qwen3.5-4B-DFlash'
    known_drafter("mlx-community/Qwen3.5-4B-4bit")       # the same: a quantized export
    known_drafter("my-model")                            # None

Only drafters for targets this runtime loads (Qwen3, Qwen3.5, Qwen3.6,
Qwen3.8, Qwen3-Coder-Next, Gemma-4, Llama-3.1, gpt-oss, Kimi-K2.5).
Sources: the "Supported Models" table of the z-lab/dflash README
(github.com/z-lab/dflash), z-lab's "DFlash" and "DFlash 2" collections on
Hugging Face (huggingface.co/collections/z-lab/dflash, /dflash-2) as the
dflash package's PyPI page lists them, and dflash-mlx's
target-to-drafter registry (github.com/bstnxbt/dflash-mlx,
dflash_mlx/runtime/registry.py). Note z-lab's 12B Gemma drafter is spelled
``gemma4-``, unlike the others.
"""

import re
from pathlib import PurePath
from typing import Optional

# target repository -> drafter repository
KNOWN_DRAFTERS = {
    # Qwen3 (non-thinking mode), DFlash
    "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    # Qwen3-Next (GatedDeltaNet hybrid), DFlash
    "Qwen/Qwen3-Coder-Next": "z-lab/Qwen3-Coder-Next-DFlash",
    # Qwen3.5, DFlash
    "Qwen/Qwen3.5-4B": "z-lab/Qwen3.5-4B-DFlash",
    "Qwen/Qwen3.5-9B": "z-lab/Qwen3.5-9B-DFlash",
    "Qwen/Qwen3.5-27B": "z-lab/Qwen3.5-27B-DFlash",
    "Qwen/Qwen3.5-35B-A3B": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "Qwen/Qwen3.5-122B-A10B": "z-lab/Qwen3.5-122B-A10B-DFlash",
    "Qwen/Qwen3.5-397B-A17B": "z-lab/Qwen3.5-397B-A17B-DFlash",
    # Qwen3.6, DFlash
    "Qwen/Qwen3.6-27B": "z-lab/Qwen3.6-27B-DFlash",
    "Qwen/Qwen3.6-35B-A3B": "z-lab/Qwen3.6-35B-A3B-DFlash",
    # Qwen3.8, DFlash2
    "Qwen/Qwen3.8-27B": "z-lab/Qwen3.8-27B-DFlash2",
    # Gemma-4, DFlash
    "google/gemma-4-12B-it": "z-lab/gemma4-12B-it-DFlash",
    "google/gemma-4-26B-A4B-it": "z-lab/gemma-4-26B-A4B-it-DFlash",
    "google/gemma-4-31B-it": "z-lab/gemma-4-31B-it-DFlash",
    # Llama-3.1, DFlash; Meta first published the target under the longer name
    "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    # gpt-oss, DFlash
    "openai/gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash",
    "openai/gpt-oss-120b": "z-lab/gpt-oss-120b-DFlash",
    # Kimi-K2.5 (DeepSeek-V3's multi-head latent attention), DFlash
    "moonshotai/Kimi-K2.5": "z-lab/Kimi-K2.5-DFlash",
}

# What community exports append to the base model's name: bit widths, float
# formats, quantization methods ("Qwen3.6-35B-A3B-4bit-DWQ", "Qwen3-8B-MLX-8bit",
# "gpt-oss-20b-MXFP4-Q8", "Kimi-K2.5-MLX-3.6bit").
EXPORT_TAG = re.compile(
    r"\d+(\.\d+)?bit|q\d+|bf16|fp16|f16|fp32|f32|b?float(16|32)|mxfp\d+|nvfp\d+|int\d+|w\d+a\d+|mlx|dwq|awq|gptq",
    re.IGNORECASE,
)
BY_NAME = {key.rsplit("/", 1)[-1].lower(): drafter for key, drafter in KNOWN_DRAFTERS.items()}


def base_name(target_id: str) -> str:
    """The model name under a repository id or local path, less export tags:
    ``mlx-community/Qwen3.5-4B-4bit`` -> ``qwen3.5-4b``."""
    words = re.split(r"([-_])", PurePath(str(target_id).rstrip("/")).name.lower())
    while len(words) >= 3 and EXPORT_TAG.fullmatch(words[-1]):
        words = words[:-2]
    return "".join(words)


def known_drafter(target_id) -> Optional[str]:
    """The z-lab drafter published for ``target_id`` (a Hugging Face id, a
    community export of the same model, or a local directory named after
    it), or None."""
    return KNOWN_DRAFTERS.get(str(target_id)) or BY_NAME.get(base_name(target_id))


def known_targets() -> str:
    """The targets :func:`known_drafter` resolves, for error messages."""
    return ", ".join(KNOWN_DRAFTERS)
