"""dflash_mlx: lossless DFlash / DFlash2 speculative decoding on MLX."""

from ._version import __version__
from .generate import GenerationResponse, generate, stream_generate
from .loading import load, load_draft
from .models.dflash import DFlashConfig, DFlashDraftModel

__all__ = [
    "__version__",
    "DFlashConfig",
    "DFlashDraftModel",
    "GenerationResponse",
    "generate",
    "load",
    "load_draft",
    "stream_generate",
]
