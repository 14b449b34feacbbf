"""Target adapters: run an mlx-lm model's own layers while capturing taps.

DFlash needs three things from the target that its plain ``__call__`` does not
give: the hidden states of the tap layers (captured during the same forward,
never a second pass), logits for every verified slot, and a way to roll its
caches back to the accepted prefix. An adapter wraps one model instance; it
never patches mlx-lm classes. Each adapter is tested against the model's own
forward so upstream drift is caught.
"""

from typing import Dict, Type

from .base import TargetAdapter, TargetError
from .gemma4 import Gemma4Target
from .hybrid import HybridTarget
from .mla import MLATarget
from .transformer import TransformerTarget

ADAPTERS: Dict[str, Type[TargetAdapter]] = {
    "deepseek_v3": MLATarget,
    "gemma4": Gemma4Target,
    "gemma4_text": Gemma4Target,
    # Current MLX exports; mlx-lm loads them as gemma4 and keeps the name.
    "gemma4_unified": Gemma4Target,
    "gemma4_unified_text": Gemma4Target,
    "gpt_oss": TransformerTarget,
    # Kimi-K2.5's text model is DeepSeek-V3's, under a multimodal wrapper.
    "kimi_k25": MLATarget,
    "llama": TransformerTarget,
    "qwen2": TransformerTarget,
    "qwen3": TransformerTarget,
    "qwen3_moe": TransformerTarget,
    "qwen3_5": HybridTarget,
    "qwen3_5_moe": HybridTarget,
    "qwen3_next": HybridTarget,
}

SUPPORTED_MODEL_TYPES = tuple(sorted(ADAPTERS))


def model_type_of(model) -> str:
    return getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", "?")


def adapter_for(model, draft_config=None) -> TargetAdapter:
    """Wrap ``model`` for DFlash, checking it against ``draft_config``.

    Each call builds a new adapter around the model instance and stores
    nothing on the model. A drafter keeps the adapter it was bound with
    (``DFlashDraftModel.bind``), with whatever that adapter compiled;
    ``draft.target`` is the adapter to share.
    """
    if isinstance(model, TargetAdapter):
        adapter = model
    else:
        mtype = model_type_of(model)
        cls = ADAPTERS.get(mtype)
        if cls is None:
            raise TargetError(
                f"unsupported target model_type {mtype!r}; dflash_mlx supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        adapter = cls(model)
    if draft_config is not None:
        adapter.check_drafter(draft_config)
    return adapter


__all__ = [
    "ADAPTERS",
    "SUPPORTED_MODEL_TYPES",
    "TargetAdapter",
    "TargetError",
    "adapter_for",
    "model_type_of",
]
