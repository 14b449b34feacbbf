"""A family adapter over one rank's slice of a pipelined target.

mlx-lm pipelines a model over ``mx.distributed``: rank ``r`` of ``n`` runs
one contiguous slice of the layers (rank ``n - 1`` the first ones, rank 0
the last), receives its input from rank ``r + 1``, sends its output to rank
``r - 1``, and an ``all_gather`` hands rank 0's final hidden state to every
rank (``mlx_lm/models/pipeline.py`` and the families' ``__call__``).

:class:`PipelineTarget` runs a family adapter the same way, and the same
``all_gather`` also carries the drafter's tap features: every rank puts its
own layers' taps in their slots (zeros in the others), so summing the
gathered slots gives every rank all the taps, bit for bit. Every rank then
holds the same logits and taps, so the same drafter and acceptance on every
rank roll every slice back alike. The gather also carries a fingerprint of
what each rank fed the forward (cache offset, tokens); a verify whose ranks
disagree is refused at its rollback, before its tokens are committed.
"""

import mlx.core as mx

from ..errors import ArgumentError
from . import adapter_for
from .base import TargetAdapter, TargetError

# Adapter families whose mlx-lm backbone has ``pipeline(group)`` (checked
# against mlx-lm by the tests).
PIPELINE_MODEL_TYPES = ("deepseek_v3", "kimi_k25", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next")


class _StageInput:
    """The embedding as the first layer of this rank's slice sees it: on every
    rank but the one holding the first layers, the previous rank's output
    (as in mlx-lm, the embedding then only gives ``recv_like`` its shape and
    is never computed). Anything else (the tied head's ``as_linear``) is the
    embedding's own."""

    def __init__(self, embedding, group):
        self.embedding = embedding
        self.group = group

    def __call__(self, tokens):
        h = self.embedding(tokens)
        rank, size = self.group.rank(), self.group.size()
        if rank < size - 1:
            h = mx.distributed.recv_like(h, rank + 1, group=self.group)
        return h

    def __getattr__(self, name):
        return getattr(self.embedding, name)


class _Stage:
    """This rank's slice of the backbone as the family adapter sees it: its
    own layers, so adapter, caches and rollback records all count them
    locally (mlx-lm's ``fa_idx`` / ``ssm_idx`` are local already)."""

    def __init__(self, backbone, group):
        self.backbone = backbone
        self.layers = backbone.pipeline_layers
        self.embed_tokens = _StageInput(backbone.embed_tokens, group)

    def __getattr__(self, name):
        return getattr(self.backbone, name)


class PipelineTarget(TargetAdapter):
    """A family adapter over this rank's layer slice (``model.model.pipeline``
    already applied, as mlx-lm's ``sharded_load`` leaves it).

    ``forward`` returns what the unsplit adapter returns, on every rank;
    caches, rollback records and ``rollback`` are this rank's slice only.
    """

    local_timings = False  # each rank times its own cycles: see ``agreed``
    no_trees = (
        "tree verification is not supported on pipelined targets (each rank would need the "
        "tree's mask and positions and a gathered rollback): use --tree-budget 0"
    )

    def __init__(self, model, group):
        stage = adapter_for(model)
        super().__init__(model, stage.text_model, stage.backbone)
        if getattr(self.backbone, "pipeline_size", 1) != group.size():
            raise TargetError(
                f"the target is not split over this group of {group.size()} ranks: load it "
                "with mlx_lm.utils.sharded_load(path, pipeline_group=group)"
            )
        self.group = group
        self.start, self.end = self.backbone.start_idx, self.backbone.end_idx
        if None in (getattr(self.backbone, "fa_idx", 0), getattr(self.backbone, "ssm_idx", 0)):
            # The hybrid adapter builds both masks from this rank's caches.
            raise TargetError(
                f"this rank's layers {self.start}..{self.end - 1} are all of one kind (attention "
                "or linear); the hybrid adapter needs both on every rank: use fewer ranks"
            )
        stage.backbone = _Stage(self.backbone, group)
        self.stage = stage

    @property
    def num_layers(self) -> int:
        return int(self.args.num_hidden_layers)

    def make_cache(self, kv=None):
        """This rank's caches; mlx-lm's plain ones only: ranks that hold
        other layers would see other offsets and split a block that crosses
        quantized_kv_start differently (and max_kv_size's rings are untested here)."""
        if kv is not None:
            raise ArgumentError(
                "kv_bits, kv_group_size, quantized_kv_start and max_kv_size are not supported on a pipelined "
                "target: leave them out, or run the target on one machine"
            )
        return super().make_cache()

    def agreed(self, values):
        """Rank 0's ``values`` on every rank: each rank times its own cycles,
        and ranks that chose blocks from their own timings would diverge."""
        mine = [float(v) if self.group.rank() == 0 else 0.0 for v in values]
        return mx.distributed.all_sum(mx.array(mine), group=self.group, stream=mx.cpu).tolist()

    def forward(self, tokens, cache, *, taps=None, last_logits_only=False, record=True):
        taps = self.tap_ids if taps is None else list(taps)
        local = [t for t in taps if self.start <= t < self.end]
        offset = next(c.offset for c in cache if hasattr(c, "offset"))  # before the stage runs
        # The stage's last layer comes back as one more tap: its output.
        _, states = self.stage.forward(
            tokens,
            cache,
            taps=[t - self.start for t in local] + [self.end - 1 - self.start],
            last_logits_only=True,
            record=record,
        )
        width = self.hidden_size
        h = states[..., -width:]
        rank, size = self.group.rank(), self.group.size()
        if rank > 0:
            h = mx.distributed.send(h, rank - 1, group=self.group)
        slots = mx.concatenate(
            [h]
            + [
                states[..., local.index(t) * width : (local.index(t) + 1) * width]
                if t in local
                else mx.zeros_like(h)
                for t in taps
            ],
            axis=-1,
        )
        # What each rank fed this forward rides along, to catch ranks that diverged.
        row = mx.concatenate([slots.reshape(-1), fingerprint(tokens, offset, slots.dtype)])
        gathered = mx.distributed.all_gather(row[None], group=self.group)
        prints = gathered[:, -FINGERPRINT:]
        agree = mx.all(prints == prints[0])
        gathered = gathered[:, :-FINGERPRINT].reshape(size, *slots.shape)
        # Rank 0 ran the last layers; each tap slot is non-zero on one rank only.
        tap_states = gathered[:, ..., width:].sum(axis=0) if taps else None
        logits, _ = self._finish(gathered[0, ..., :width], [], last_logits_only)
        if record:
            cache.undo = (cache.undo, agree)
        return mx.depends(logits, agree), tap_states

    def rollback(self, cache, keep):
        undo, agree = cache.undo
        cache.undo = undo
        self.stage.rollback(cache, keep)  # the cache stays consistent even when we raise
        if not agree.item():
            raise TargetError(
                "the ranks fed this verify different tokens or positions: their drafts or "
                "acceptances diverged. Every rank computes them itself, so every machine must "
                "run the same mlx, mlx-lm and mlx-dflash versions on the same kind of chip"
            )


def fingerprint(tokens, offset: int, dtype) -> mx.array:
    """The cache offset and a digest of ``tokens``, as bytes (exact in any
    float dtype)."""
    flat = tokens.astype(mx.uint32).reshape(-1)
    digest = (flat * (mx.arange(flat.size, dtype=mx.uint32) + 1)).sum()
    words = mx.stack([mx.array(offset, dtype=mx.uint32), digest])
    shifts = mx.array([0, 8, 16, 24], dtype=mx.uint32)
    return ((words[:, None] >> shifts) & 255).reshape(-1).astype(dtype)


FINGERPRINT = 8  # two words of four bytes
