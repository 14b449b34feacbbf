"""``--pipeline``: DFlash with the target split by layers across processes
(machines) started by ``mlx.launch``.

Every rank loads its slice of the target through mlx-lm's ``sharded_load``
and wraps it in :class:`~.targets.pipeline.PipelineTarget`, which hands every
rank the whole verify's logits and taps. Every rank also loads and runs the
drafter rather than rank 0 alone: during the draft the other ranks would
otherwise wait, so on separate machines it adds no time, while drafting on
one rank would put a message per cycle (the block, to the rank holding the
first layers) on the critical path; the drafter is small, so its memory on
every rank is too. Sampled runs draw the same numbers on every rank because
every rank seeds ``mx.random`` alike (:func:`agree_seed`), as ``mlx_lm.chat``
does for its pipelined ranks.

``chat`` and ``server`` run the same turns on every rank: rank 0 reads each
line or receives each request and shares it (:func:`share`) before any rank
acts on it; only rank 0 prints or answers.
"""

import json
import os
import pickle
import queue
import re
import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx

from .errors import DFlashError
from .loading import load_draft, resolve_path
from .targets.pipeline import PIPELINE_MODEL_TYPES, PipelineTarget

INDEX = "model.safetensors.index.json"
# Everything of a hub checkpoint but its weights (mlx-lm's sharded_load
# fetches the weight files of the local slice only).
NON_WEIGHT_PATTERNS = ["*.json", "*.py", "*.txt", "*.jinja", "*.jsonl", "tokenizer*", "*.tiktoken"]
MAX_ERROR_BYTES = 2048


class PipelineError(DFlashError, ValueError):
    """A pipelined run that cannot start (on any of its ranks)."""


def pipeline_group() -> mx.distributed.Group:
    """The group ``mlx.launch`` started; an error when this process is alone."""
    group = mx.distributed.init()
    if group.size() < 2:
        raise PipelineError(
            "--pipeline needs at least 2 processes; start them with mlx.launch, e.g. "
            "`mlx.launch --backend ring -n 2 -- -m dflash_mlx.generate --pipeline ...` "
            "(see docs/pipeline.md for several Macs)"
        )
    return group


def check_pipeline_family(model_path: Path) -> None:
    """Fail on every rank alike, before any weights are read."""
    config = json.loads((model_path / "config.json").read_text())
    mtype = config.get("model_type", "?")
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


def check_local_shards(model: str, target) -> None:
    """mlx-lm loads a slice without insisting on every tensor, so a shard
    missing on this machine would leave its layers random: name it instead
    (each machine needs only the shards of its own layers)."""
    path = Path(model).expanduser()
    if not (path / INDEX).exists():
        return  # a hub snapshot (mlx-lm fetched the slice's shards) or one file
    start, end = target.model.start_idx, target.model.end_idx
    for key, name in json.loads((path / INDEX).read_text())["weight_map"].items():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", key)  # sharded_load's rule
        if (m is None or start <= int(m.group(1)) < end) and not (path / name).exists():
            raise FileNotFoundError(
                f"{path / name} is missing; this rank's layers {start}..{end - 1} need it"
            )


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


def load_for_command(model: str, draft_model: Optional[str], seed: Optional[int] = None):
    """:func:`load_pipelined_pair` for a command run by ``mlx.launch``.

    Every rank gets the same message for a failure, so rank 0 raises it (one
    ``error:`` line) and the other ranks exit with status 1 quietly.
    """
    from .cli import USER_ERRORS

    rank = mx.distributed.init().rank()
    try:
        return load_pipelined_pair(model, draft_model, seed=seed)
    except USER_ERRORS:
        if rank == 0:
            raise
        raise SystemExit(1)


def load_pipelined_pair(model: str, draft_model: Optional[str], group=None, seed: Optional[int] = None):
    """Target slice, tokenizer and bound drafter on every rank of ``group``
    (default: the processes ``mlx.launch`` started, :func:`pipeline_group`).

    Whatever fails on any rank (a family mlx-lm cannot pipeline, a missing
    or corrupt file on one machine) makes every rank raise one message, the
    failing rank's, instead of leaving the others waiting for it. Then
    ``mx.random`` is seeded alike on every rank (:func:`agree_seed`).
    """
    from .pair import default_draft_for

    group = group or pipeline_group()
    error = target = tokenizer = draft = None
    try:
        target, tokenizer = load_slice(model, group)
    except Exception as e:  # a bad weight file surfaces as mlx's RuntimeError
        error = e
        # sharded_load ends in a barrier, where the ranks that loaded now wait.
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    if error is None:  # past the barrier: no more collectives until the agreement
        try:
            check_local_shards(model, target)
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


STOP = "stop"  # what rank 0's server shares when it shuts down


def share(obj, group):
    """``obj`` (any picklable value, ``None`` too) from rank 0 on every rank:
    pickled and summed across the ranks, as mlx-lm's server shares its
    requests with its other ranks."""
    if group.rank() == 0:
        data = mx.array(pickle.dumps(obj))
        mx.eval(mx.distributed.all_sum(data.size, group=group, stream=mx.cpu))
        mx.eval(mx.distributed.all_sum(data, group=group, stream=mx.cpu))
        return obj
    size = mx.distributed.all_sum(0, group=group, stream=mx.cpu).item()
    data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=group, stream=mx.cpu)
    return pickle.loads(data)


def share_request(item, group):
    """A server's next work item on every rank: ``None`` (idle), ``STOP``, or
    rank 0's ``(responses, request...)`` with the request shared; the other
    ranks answer nobody, so their responses go to a queue of their own."""
    shared = share(item[1:] if isinstance(item, tuple) else item, group)
    if not isinstance(shared, tuple):
        return shared
    return (item[0] if group.rank() == 0 else queue.Queue(), *shared)


def agree_flag(flag: bool, group, stream) -> bool:
    """Whether any rank's ``flag`` is set, on every rank alike (a stop that
    rank 0 alone sees, such as a client that went away), agreed on the
    ``stream`` the generation's forwards run on. The ranks' collectives
    share one connection, so they must run in one order on every rank:
    ops on one stream run in the order they were queued, where a forward
    still queued on another stream could run before the flag's sum on one
    rank and after it on the other, each then reading the other's data."""
    return mx.distributed.all_sum(mx.array(int(flag)), group=group, stream=stream).item() > 0


def rank0_repl(input_fn, group):
    """A REPL's input as rank 0 reads it, on every rank, and output on rank 0
    alone: mlx.launch copies stdin to every rank but MPI does not, and every
    rank must run the same turns (each line is shared before it is acted on,
    'q' and 'r' too). End of input on rank 0 ends every rank's input."""
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")

    def read(prompt):
        line = None
        if group.rank() == 0:
            try:
                line = input_fn(prompt)
            except EOFError:
                pass
        line = share(line, group)
        if line is None:
            raise EOFError
        return line

    return read


def follow_rank0(generator) -> int:
    """A pipelined server's rank other than 0: it answers nobody, generates
    every request rank 0 shares and ends when rank 0 shuts down. Ctrl-C
    reaches every local rank; rank 0's decides, so the ranks end together."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    generator.done.wait()
    return 1 if generator.failed else 0


__all__ = [
    "PipelineError",
    "STOP",
    "agree_flag",
    "agree_seed",
    "follow_rank0",
    "load_pipelined_pair",
    "load_slice",
    "pipeline_group",
    "rank0_repl",
    "share",
    "share_request",
]
