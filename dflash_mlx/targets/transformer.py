"""Plain decoder-only transformers (llama, qwen2, qwen3, qwen3_moe,
gpt_oss), with sliding-window layers where the model has them (llama's
``layer_types``; gpt-oss alternates a 128-token window with full attention).
gpt-oss's per-head attention sinks live inside its attention modules, so a
chain's or a tree's mask reaches them as any other family's does.

Every layer is ``layer(h, mask, cache)`` over an attention cache, so a
verify needs no record beyond its length: rollback cuts every cache back to
the kept prefix (:mod:`.attention`).
"""

from .attention import layer_masks, rewind_caches, sliding_window, tree_masks
from .base import TargetAdapter


class TransformerTarget(TargetAdapter):
    # Whether the layers take masks as arrays only (see :mod:`.mla`).
    array_masks = False

    def __init__(self, model):
        text = getattr(model, "language_model", model)
        super().__init__(model, text, text.model)

    def forward_block(self, tokens, cache, *, taps=None, last_logits_only=False, record=True, tree=None):
        taps = self.tap_ids if taps is None else taps
        h = self.backbone.embed_tokens(tokens)
        windows = [sliding_window(c) for c in cache]
        masks = layer_masks(h, cache, windows, self.array_masks, record) if tree is None else tree_masks(tree, cache, windows)
        captured = {}
        with self.tree_scope(tree, cache):
            for i, (layer, c, mask) in enumerate(zip(self.backbone.layers, cache, masks)):
                h = layer(h, mask, c)
                captured[i] = h
        if record:
            cache.undo = tokens.shape[1]
        return self._finish(h, [captured[t] for t in taps], last_logits_only)

    def rewind(self, cache, keep):
        rewind_caches(cache, cache.undo, keep)
        cache.undo = None
