"""Gemma-4 targets: ``gemma4_text``, the ``gemma4`` multimodal wrapper and
the ``gemma4_unified`` exports (mlx-lm maps those onto ``gemma4``).

Runs the loop of mlx-lm's ``Gemma4TextModel`` with its own layers, taking
each layer's hidden output (element 0 of the tuple a Gemma-4 layer returns)
as a tap. What sets the family apart: embeddings scaled by sqrt(hidden);
per-layer inputs computed from the token ids (E2B/E4B); KV-shared layers
that reuse an earlier layer's keys/values, so ``make_cache()`` holds fewer
caches than there are layers; sliding-window layers on rotating caches; and
logits through the tied head, soft-capped. Rollback is the transformer one
(:mod:`.attention`).
"""

from mlx_lm.models.gemma4_text import logit_softcap

from .attention import layer_masks, sliding_window, tree_masks
from .transformer import TransformerTarget

SLIDING = "sliding_attention"


class Gemma4Target(TransformerTarget):
    def __init__(self, model):
        super().__init__(model)
        self.embed_scale = self.backbone.embed_scale
        self.soft_cap = self.text_model.final_logit_softcapping

    def embed(self, tokens):
        return self.backbone.embed_tokens(tokens) * self.embed_scale

    def per_layer_inputs(self, tokens, h):
        """mlx-lm's per-layer inputs from the token ids (E2B/E4B), one
        [B, S, width] array per layer; ``None`` per layer when the model has none.

        Written with the model's public modules and scales (mlx-lm's helpers
        are private); the adapter test compares the whole forward with mlx-lm's.
        """
        bb = self.backbone
        n = len(bb.layers)
        if not bb.hidden_size_per_layer_input:
            return [None] * n
        shape = (n, bb.hidden_size_per_layer_input)
        from_ids = bb.embed_tokens_per_layer(tokens) * bb.embed_tokens_per_layer_scale
        projected = bb.per_layer_model_projection(h) * bb.per_layer_projection_scale
        projected = bb.per_layer_projection_norm(projected.reshape(*h.shape[:2], *shape))
        inputs = (projected + from_ids.reshape(*h.shape[:2], *shape)) * bb.per_layer_input_scale
        return [inputs[:, :, i, :] for i in range(n)]

    def forward_block(self, tokens, cache, *, taps=None, last_logits_only=False, record=True, tree=None):
        taps = self.tap_ids if taps is None else taps
        bb = self.backbone
        h = self.embed(tokens)
        per_layer = self.per_layer_inputs(tokens, h)
        # KV-shared layers have no cache of their own.
        caches = list(cache) + [None] * (len(bb.layers) - len(cache))
        # A KV-shared layer is masked as the layer whose keys it reads; a
        # full-attention layer on a rotating cache (max_kv_size) by its size.
        owners = [caches[bb.previous_kvs[i]] for i in range(len(bb.layers))]
        windows = [
            bb.window_size if layer.layer_type == SLIDING else sliding_window(c) for layer, c in zip(bb.layers, owners)
        ]
        masks = layer_masks(h, owners, windows, decode=record) if tree is None else tree_masks(tree, owners, windows)
        shared = [(None, None)] * len(bb.layers)  # per layer: its keys/values and RoPE offset
        captured = {}
        with self.tree_scope(tree, cache):
            for i, layer in enumerate(bb.layers):
                kvs, offset = shared[bb.previous_kvs[i]]
                h, kvs, offset = layer(
                    h, masks[i], caches[i], per_layer_input=per_layer[i], shared_kv=kvs, offset=offset
                )
                shared[i] = (kvs, offset)
                captured[i] = h
        if record:
            cache.undo = tokens.shape[1]
        return self._finish(h, [captured[t] for t in taps], last_logits_only)

    def _finish(self, h, captured, last_logits_only):
        logits, tap_states = super()._finish(h, captured, last_logits_only)
        if self.soft_cap is not None:
            logits = logit_softcap(self.soft_cap, logits)
        return logits, tap_states
