"""Multi-head latent attention targets: DeepSeek-V3 (``deepseek_v3``) and
Kimi-K2.5 (``kimi_k25``, mlx-lm's wrapper around the same text model).

MLA caches one compressed latent per token (``kv_lora_rank`` wide) and its
rope part (``qk_rope_head_dim`` wide) in an ordinary ``KVCache``, as keys
and values; the heads' keys and values are expanded from the latent inside
the attention. Rollback is the transformer one, trimming those two arrays
(:mod:`.attention`). mlx-lm's MLA adds the rope scores to the mask with
``mx.where``, so it takes masks as arrays only, a draft tree's included.
"""

from .transformer import TransformerTarget


class MLATarget(TransformerTarget):
    array_masks = True
