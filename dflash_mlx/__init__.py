"""dflash_mlx: lossless DFlash / DFlash2 speculative decoding on MLX."""

from ._version import __version__
from .cache import PromptCache, load_prompt_cache, make_prompt_cache, save_prompt_cache
from .generate import GenerationResponse, generate, generate_step, stream_generate
from .loading import load, load_draft
from .models.dflash import DFlashConfig, DFlashDraftModel

__all__ = [
    "__version__",
    "DFlashConfig",
    "DFlashDraftModel",
    "GenerationResponse",
    "PromptCache",
    "generate",
    "generate_step",
    "load",
    "load_draft",
    "load_prompt_cache",
    "make_prompt_cache",
    "save_prompt_cache",
    "stream_generate",
]
