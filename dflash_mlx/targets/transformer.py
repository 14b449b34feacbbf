"""Plain decoder-only transformers (llama, qwen2, qwen3, qwen3_moe).

Every layer is ``layer(h, mask, cache)`` over a trimmable KV cache, so
verification needs no record: rollback is a trim.
"""

from mlx_lm.models.base import create_attention_mask

from .base import TargetAdapter, TargetError


class TransformerTarget(TargetAdapter):
    def __init__(self, model):
        super().__init__(model, model, model.model)
        if getattr(self.args, "layer_types", None) and any(
            t != "full_attention" for t in self.args.layer_types
        ):
            raise TargetError(
                "targets with sliding-window layers keep rotating caches that cannot be "
                "rolled back; use a full-attention target"
            )

    def forward(self, tokens, cache, *, taps=None, last_logits_only=False, record=True):
        taps = self.tap_ids if taps is None else taps
        h = self.backbone.embed_tokens(tokens)
        mask = create_attention_mask(h, cache[0])
        captured = {}
        for i, (layer, c) in enumerate(zip(self.backbone.layers, cache)):
            h = layer(h, mask, c)
            captured[i] = h
        if record:
            cache.undo = tokens.shape[1]
        return self._finish(h, [captured[t] for t in taps], last_logits_only)

    def rollback(self, cache, keep):
        drop = cache.undo - keep
        if drop > 0:
            for c in cache:
                c.trim(drop)
        cache.undo = None
