"""What every target adapter provides to the DFlash loop."""

from contextlib import nullcontext
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from ..errors import ArgumentError, DFlashError
from .attention import tree_positions
from .kv import KVSettings, forward_kv, make_kv_caches, rollback_kv, rows_before_quantizing


class TargetError(DFlashError, ValueError):
    """A target that cannot serve a drafter (wrong family, vocab, taps...)."""


class TargetCache(list):
    """A target's per-layer mlx-lm caches (a plain list to mlx-lm), plus
    ``undo``: what the last recorded forward needs to be rolled back.

    The record lives on the cache, not on the adapter, so two caches over one
    model (two conversations, two requests) never share it. ``kv``: the
    :class:`~.kv.KVSettings` it was made with (None: mlx-lm's plain caches).
    """

    undo = None
    batched = False  # a batch's rows (:class:`~.rows.BatchCache`), not one request's
    kv: Optional[KVSettings] = None

    def rows_before_quantizing(self) -> Optional[int]:
        """Positions that still run on float KV caches before mlx-lm's decode
        would quantize them (None: no conversion ahead). A chain may cross
        that point (the forward splits there); a draft tree may not: its
        rows must lie within this many positions (a tree at most this many
        rows deep, the anchor's row included)."""
        return rows_before_quantizing(self)


class TargetAdapter:
    """Per-instance view of an mlx-lm model as a DFlash target.

    ``forward(tokens, cache)`` returns ``(logits, taps)`` and stores in
    ``cache.undo`` what it needs to undo; ``rollback(cache, keep)`` then keeps
    only the first ``keep`` tokens of that forward in every cache. With
    ``tree`` (a :class:`~dflash_mlx.tree.DraftTree` whose tokens are
    ``tokens``) each row sees only the context and its ancestors, at
    position context + depth, and ``keep`` may be the walked path's rows.
    """

    # Whether this process's timings are the generation's, free to follow
    # cycle by cycle; pipelined ranks must first agree on them (``agreed``).
    local_timings = True
    # Why this adapter verifies chains only (None: it verifies trees too).
    no_trees: Optional[str] = None
    # The longest forward of a batch whose rows then keep prefixes of their
    # own (``rollback_rows``) that it runs well (None: any).
    longest_ragged: Optional[int] = None

    def __init__(self, model: nn.Module, text_model: nn.Module, backbone: nn.Module):
        self.model = model
        self.text_model = text_model  # owns lm_head / args
        self.backbone = backbone  # owns embed_tokens, layers, norm
        self.args = text_model.args
        self.tap_ids: List[int] = []
        self.tied = bool(getattr(self.args, "tie_word_embeddings", False)) or not hasattr(
            text_model, "lm_head"
        )

    def agreed(self, values: Sequence[float]) -> List[float]:
        """``values`` (timings) as every process running this generation uses
        them: here this process's own. Choices made from timings (block
        lengths, the evaluation strategy) then agree wherever the target runs."""
        return [float(v) for v in values]

    # Shapes the drafter is checked against.
    @property
    def num_layers(self) -> int:
        return len(self.backbone.layers)

    @property
    def family(self) -> str:
        """The model type the user loaded (a multimodal wrapper's, not its text model's)."""
        return getattr(self.model, "model_type", None) or self.args.model_type

    @property
    def hidden_size(self) -> int:
        return int(self.args.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.backbone.embed_tokens.weight.shape[0])

    def check_tokens(self, tokens: Sequence[int]) -> None:
        """Refuse token ids outside the vocabulary before any forward: MLX's
        embedding gather does not check its indices, and one past the table
        reads memory that is not the model's (a crash, or text from garbage)."""
        vocab = self.vocab_size
        bad = next(((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ArgumentError(
                f"token id {bad[1]} at position {bad[0]} is outside the target's vocabulary (0..{vocab - 1}): "
                "send ids the target's tokenizer made"
            )

    def check_drafter(self, config) -> None:
        """Raise one clear error if this target cannot feed ``config``'s drafter."""
        if config.vocab_size != self.vocab_size:
            raise TargetError(
                f"drafter vocab_size {config.vocab_size} != target vocabulary "
                f"{self.vocab_size} ({self.family} target): this drafter was "
                f"trained for another target"
            )
        bad = [i for i in config.target_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(
                f"drafter taps target layers {bad}, but the target has only "
                f"{self.num_layers} layers (0..{self.num_layers - 1}; a {self.family} "
                f"target): drafter and target do not match"
            )
        if config.num_target_layers is not None and int(config.num_target_layers) != self.num_layers:
            raise TargetError(
                f"drafter was trained on a target of {config.num_target_layers} layers, "
                f"this {self.family} target has {self.num_layers}: drafter and "
                f"target do not match"
            )
        want = len(config.target_layer_ids) * self.hidden_size
        if config.fc_input_size != want:
            raise TargetError(
                f"drafter fc expects {config.fc_input_size} input features (drafter hidden "
                f"{config.hidden_size}), but {len(config.target_layer_ids)} taps x target hidden "
                f"{self.hidden_size} = {want} ({self.family} target): drafter and target do not match"
            )
        if config.hidden_size != self.hidden_size:  # it embeds with the target's table and scores with its head
            raise TargetError(
                f"drafter hidden_size {config.hidden_size} != target hidden size {self.hidden_size} "
                f"({self.family} target): the drafter shares the target's embedding and LM head, "
                f"so this drafter was trained for another target"
            )
        self.tap_ids = list(config.target_layer_ids)

    # Shared weights for the drafter.
    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings as the target's first layer sees them (Gemma
        scales them): the drafter embeds its block the same way."""
        return self.backbone.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return self.backbone.embed_tokens.as_linear(hidden)
        return self.text_model.lm_head(hidden)

    def lm_head_rows(self, ids: Sequence[int]):
        """The LM head over the rows ``ids`` only (a drafter's draft
        vocabulary): a function of the hidden states giving ``[..., len(ids)]``
        logits, equal to ``lm_head``'s columns ``ids``. The rows are gathered
        once, so scoring K ids costs K / vocab of the full head."""
        head = self.backbone.embed_tokens if self.tied else self.text_model.lm_head
        rows = mx.array(list(ids), mx.int32)
        weight = head.weight[rows]
        bias = head["bias"][rows] if "bias" in head else 0.0
        if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            scales = head.scales[rows]
            biases = head["biases"][rows] if "biases" in head else None
            kw = dict(transpose=True, group_size=head.group_size, bits=head.bits, mode=head.mode)
            return lambda h: mx.quantized_matmul(h, weight, scales, biases, **kw) + bias
        return lambda h: h @ weight.T + bias

    def kv_head_dims(self) -> List[int]:
        """The widths of the attention layers' keys and values (what a KV
        quantization group must divide)."""
        return [int(getattr(self.args, "head_dim", None) or self.hidden_size // self.args.num_attention_heads)]

    def make_cache(self, kv: Optional[KVSettings] = None) -> TargetCache:
        """Empty caches, as mlx-lm makes them for ``kv`` (see :mod:`.kv`)."""
        cache = TargetCache(make_kv_caches(self.model, kv, self.kv_head_dims() if kv else []))
        cache.kv = kv
        return cache

    def forward(
        self,
        tokens: mx.array,
        cache: Sequence,
        *,
        taps: Optional[Sequence[int]] = None,
        last_logits_only: bool = False,
        record: bool = True,
        tree=None,
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """The family's :meth:`forward_block` on caches quantized when mlx-lm's
        decode would have quantized them (:func:`~.kv.forward_kv`)."""
        return forward_kv(self, tokens, cache, taps=taps, last_logits_only=last_logits_only, record=record, tree=tree)

    def rollback(self, cache: Sequence, keep) -> None:
        """Keep ``keep`` of the last recorded forward (:func:`~.kv.rollback_kv`)."""
        rollback_kv(self, cache, keep)

    # Forward with taps and rollback of one forward: implemented per family.
    def forward_block(self, tokens, cache, *, taps=None, last_logits_only=False, record=True, tree=None):
        raise NotImplementedError

    def rewind(self, cache: Sequence, keep) -> None:
        raise NotImplementedError

    def keep(self, cache, kept: Sequence) -> None:
        """After a recorded forward, each row keeps what it accepted: row
        ``b`` of a batch its first ``kept[b]`` tokens; a request's own cache
        its first ``kept[0]`` tokens, or a draft tree's walked rows."""
        if cache.batched:
            self.rollback_rows(cache, kept)
        else:
            self.rollback(cache, kept[0])

    def rollback_rows(self, cache, kept: Sequence[int]) -> None:
        """A batch's rollback (``cache``: a :class:`~.rows.BatchCache`): row
        ``b`` keeps the first ``kept[b]`` tokens of the last forward."""
        cache.undo = None
        cache.advance(kept)

    def tree_scope(self, tree, cache):
        """While a tree's forward is built, every attention layer of this
        instance rotates its rows at the tree's positions (nothing without
        a tree)."""
        if tree is None:
            return nullcontext()
        offset = next(c.offset for c in cache if hasattr(c, "offset"))
        attentions = [layer.self_attn for layer in self.backbone.layers if hasattr(layer, "self_attn")]
        return tree_positions(attentions, tree.positions(offset))

    def _finish(self, h, captured, last_logits_only):
        if last_logits_only:
            h = h[:, -1:]
        logits = self.lm_head(self.backbone.norm(h))
        tap_states = mx.concatenate(captured, axis=-1) if captured else None
        return logits, tap_states
