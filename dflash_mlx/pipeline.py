"""DFlash on a target split across processes (machines) by layers.

mlx-lm pipelines a model over ``mx.distributed``: rank ``r`` of ``n`` runs
one contiguous slice of the layers (rank ``n - 1`` the first ones, rank 0
the last), receives its input from rank ``r + 1``, sends its output to rank
``r - 1``, and an ``all_gather`` hands rank 0's final hidden state to every
rank (``mlx_lm/models/pipeline.py`` and the families' ``__call__``).

:class:`PipelineTarget` runs a family adapter the same way, and the same
``all_gather`` also carries the drafter's tap features: every rank puts its
own layers' taps in their slots (zeros in the others), so summing the
gathered slots gives every rank all the taps, bit for bit. Every rank then
holds the same logits and the same taps, runs the same drafter on them and
the same acceptance, and so rolls its own slice back identically; sampled
runs draw the same numbers because every rank seeds ``mx.random`` alike
(:func:`agree_seed`), as ``mlx_lm.chat`` does for its pipelined ranks.

Every rank runs the drafter rather than rank 0 alone: during the draft the
other ranks would otherwise wait, so on separate machines it adds no time,
while drafting on one rank would add a message per cycle (the block to the
rank holding the first layers) to the critical path. The drafter is small,
so its memory on every rank is too.
"""

import json
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

import mlx.core as mx

from .loading import load_draft, resolve_path
from .targets import ADAPTERS, SUPPORTED_MODEL_TYPES, TargetAdapter, TargetError, adapter_for

# Adapter families whose mlx-lm backbone has ``pipeline(group)`` (checked
# against mlx-lm by the tests).
PIPELINE_MODEL_TYPES = ("qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_moe")

INDEX = "model.safetensors.index.json"
# Everything of a hub checkpoint but its weights (mlx-lm's sharded_load
# fetches the weight files of the local slice only).
NON_WEIGHT_PATTERNS = ["*.json", "*.py", "*.txt", "*.jinja", "*.jsonl", "tokenizer*", "*.tiktoken"]
MAX_ERROR_BYTES = 2048


class PipelineError(ValueError):
    """A pipelined run that cannot start (on any of its ranks)."""


def pipeline_group() -> mx.distributed.Group:
    """The group ``mlx.launch`` started; an error when this process is alone."""
    group = mx.distributed.init()
    if group.size() < 2:
        raise PipelineError(
            "--pipeline needs at least 2 processes; start them with mlx.launch, e.g. "
            "`mlx.launch --backend ring -n 2 -m dflash_mlx.generate --pipeline ...` "
            "(see the README's multi-Mac recipe)"
        )
    return group


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

    def __init__(self, model, group):
        stage = adapter_for(model)
        super().__init__(model, stage.text_model, stage.backbone)
        self.group = group
        self.start, self.end = self.backbone.start_idx, self.backbone.end_idx
        stage.backbone = _Stage(self.backbone, group)
        self.stage = stage

    @property
    def num_layers(self) -> int:
        return int(self.args.num_hidden_layers)

    def forward(self, tokens, cache, *, taps=None, last_logits_only=False, record=True):
        taps = self.tap_ids if taps is None else list(taps)
        local = [t for t in taps if self.start <= t < self.end]
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
        slots = [h] + [
            states[..., local.index(t) * width : (local.index(t) + 1) * width]
            if t in local
            else mx.zeros_like(h)
            for t in taps
        ]
        B = tokens.shape[0]
        gathered = mx.distributed.all_gather(mx.concatenate(slots, axis=-1), group=self.group)
        gathered = gathered.reshape(size, B, *gathered.shape[1:])
        # Rank 0 ran the last layers; each tap slot is non-zero on one rank only.
        tap_states = gathered[:, ..., width:].sum(axis=0) if taps else None
        logits, _ = self._finish(gathered[0, ..., :width], [], last_logits_only)
        return logits, tap_states

    def rollback(self, cache, keep):
        self.stage.rollback(cache, keep)


def check_pipeline_family(model_path: Path) -> None:
    """Fail on every rank alike, before any weights are read."""
    config = json.loads((model_path / "config.json").read_text())
    mtype = config.get("model_type", "?")
    if mtype not in ADAPTERS:
        raise TargetError(
            f"unsupported target model_type {mtype!r}; dflash_mlx supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if mtype not in PIPELINE_MODEL_TYPES:
        raise PipelineError(
            f"target model_type {mtype!r} cannot be pipelined: mlx-lm splits only "
            f"{', '.join(PIPELINE_MODEL_TYPES)} across ranks; run it without --pipeline"
        )


def indexed_view(path: Path, into: Path) -> Path:
    """``path`` as seen through links in ``into``, plus the weight index that
    mlx-lm's ``sharded_load`` reads (a single-file checkpoint has none)."""
    from safetensors import safe_open

    weight_map = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            weight_map.update({k: f.name for k in st.keys()})
    if not weight_map:
        raise FileNotFoundError(f"{path} has no .safetensors weights")
    for f in path.iterdir():
        (into / f.name).symlink_to(f.resolve())
    (into / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return into


def load_slice(model: str, group) -> Tuple[object, object]:
    """This rank's slice of the target through mlx-lm's ``sharded_load``."""
    from mlx_lm.utils import sharded_load

    local = Path(model).expanduser()
    path = local if local.exists() else resolve_path(model, NON_WEIGHT_PATTERNS + [INDEX])
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: is this a model directory?")
    check_pipeline_family(path)
    if (path / INDEX).exists():
        return sharded_load(str(path) if local.exists() else model, pipeline_group=group)
    path = path if local.exists() else resolve_path(model)
    with tempfile.TemporaryDirectory(prefix="dflash-pipeline-") as tmp:
        return sharded_load(str(indexed_view(path, Path(tmp))), pipeline_group=group)


def raise_if_any_failed(error: Optional[BaseException], group) -> None:
    """One collective tells every rank whether any rank failed; all raise the
    first failing rank's message, so none is left waiting in a later one."""
    msg = str(error).encode()[:MAX_ERROR_BYTES] if error else b""
    row = mx.array([len(msg)] + list(msg) + [0] * (MAX_ERROR_BYTES - len(msg)), dtype=mx.int32)
    rows = mx.distributed.all_gather(row[None], group=group, stream=mx.cpu).tolist()
    texts = [bytes(r[1 : 1 + r[0]]).decode(errors="replace") if r[0] else None for r in rows]
    failed = [(rank, text) for rank, text in enumerate(texts) if text is not None]
    if len(failed) == len(texts) and len(set(texts)) == 1:
        raise PipelineError(texts[0])  # the same on every rank: no rank to name
    if failed:
        rank, text = failed[0]
        raise PipelineError(f"rank {rank}: {text}")


def load_pipelined_pair(model: str, draft_model: Optional[str], group, seed: Optional[int] = None):
    """Target slice, tokenizer and bound drafter on every rank of ``group``.

    Whatever fails on any rank (a family mlx-lm cannot pipeline, a missing
    or corrupt file on one machine) makes every rank raise one message, the
    failing rank's, instead of leaving the others waiting for it. Then
    ``mx.random`` is seeded alike on every rank (:func:`agree_seed`).
    """
    from .pair import default_draft_for

    error = target = tokenizer = draft = None
    try:
        target, tokenizer = load_slice(model, group)
    except Exception as e:  # a bad weight file surfaces as mlx's RuntimeError
        error = e
        # sharded_load ends in a barrier, where the ranks that loaded now wait.
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    if error is None:
        try:
            draft = load_draft(draft_model or default_draft_for(model), PipelineTarget(target, group))
        except Exception as e:
            error = e
    raise_if_any_failed(error, group)
    mx.random.seed(agree_seed(seed, group))
    return target, tokenizer, draft


def agree_seed(seed: Optional[int], group) -> int:
    """``seed``, or one drawn on rank 0, the same on every rank."""
    if seed is not None:
        return int(seed)
    mine = int(mx.random.randint(0, 2**31 - 1, ()).item()) if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine), group=group, stream=mx.cpu).item())


__all__ = [
    "PIPELINE_MODEL_TYPES",
    "PipelineError",
    "PipelineTarget",
    "agree_seed",
    "load_pipelined_pair",
    "load_slice",
    "pipeline_group",
]
