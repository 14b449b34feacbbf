"""dflash_mlx: lossless DFlash / DFlash2 speculative decoding on MLX."""

import warnings

# `python -m dflash_mlx.generate` runs a module this package has imported
# already (for its API, as mlx_lm's __init__ imports mlx_lm.generate); the
# module defines and runs nothing at import, so runpy's warning about it is
# noise on a command's stderr.
warnings.filterwarnings("ignore", message=r"'dflash_mlx\.generate' found in sys\.modules", category=RuntimeWarning)

from ._version import __version__
from .batch import BatchGenerator, BatchResponse, BatchResult, batch_generate
from .cache import PromptCache, load_prompt_cache, make_prompt_cache, save_prompt_cache
from .drafters import known_drafter
from .generate import GenerationResponse, generate, generate_step, stream_generate
from .loading import load, load_draft
from .models.dflash import DFlashConfig, DFlashDraftModel

__all__ = [
    "__version__",
    "BatchGenerator",
    "BatchResponse",
    "BatchResult",
    "DFlashConfig",
    "DFlashDraftModel",
    "GenerationResponse",
    "PromptCache",
    "batch_generate",
    "generate",
    "generate_step",
    "known_drafter",
    "load",
    "load_draft",
    "load_prompt_cache",
    "make_prompt_cache",
    "save_prompt_cache",
    "stream_generate",
]
