"""Train a DFlash drafter for a frozen target, mlx-lm style.

    mlx-dflash train --model PATH --data corpus.txt --draft-model my-draft
    python -m dflash_mlx.train --model PATH --data tokens.npy --draft-model my-draft --resume

From Python, ``train(TrainConfig(model=..., data=[...], draft_model=...))``.

The recipe follows the DFlash paper (arXiv 2602.06036): the target is
frozen and run once per training sequence, giving the tap hidden states of every position and, for
self-distillation, its own greedy prediction at every position. Random anchor
positions ``a`` are drawn per sequence; each anchor becomes a block
``[token at a, MASK x (B-1)]`` at positions ``a..a+B-1``. All blocks of a
sequence go through the drafter in one pass under a block-sparse mask: a
block sees the fused taps of positions ``< a`` (what the inference loop has
injected when it drafts from anchor ``a``) and its own slots, never another
block. Slot ``j`` is trained with cross-entropy against the token at
``a + j`` (the target's greedy choice there, or the data token), weighted
``exp(-(j-1)/gamma)`` because a later slot only counts if every earlier one
was accepted.

Checkpoints are z-lab Hugging Face directories (``config.json`` +
``model.safetensors``), loadable with ``dflash_mlx.load_draft`` and the
converter as they are; ``training_state/`` beside them makes ``--resume``
continue bit-identically.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import re
import shutil
import sys
import time
import typing
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import cli
from .defaults import DEFAULT_BLOCK_SIZE, DTYPES
from .errors import DFlashError
from .ops import fast_math
from .traffic import ADAPT_RESULT, ADAPTING, KEEP_SHARE, check_traffic_dir, pack, read_traffic, refusal, split_held_out
from .models.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    default_target_layer_ids,
    draft_config_for_target,
    visible_positions,
)

STATE_DIR = "training_state"
# Settings that change the trained weights: --resume must repeat them.
RUN_KEYS = (
    "model", "data", "num_layers", "block_size", "taps", "steps", "learning_rate",
    "batch_size", "seq_len", "gamma", "anchors_per_seq", "seed", "targets", "warmup",
    "mask_token_id", "intermediate_size", "weight_decay", "grad_clip", "target_dtype",
    "init_from", "cache_dir", "approximate_target", "approximate_softmax", "draft_vocab", "loss_slots", "answer_mask", "init_from_target",
    "from_traffic", "replay_share",
)
# The schedule's peak: a drafter's training from scratch or on its own data.
PEAK_LR = 6e-4
# --from-traffic fine-tunes a trained drafter on data of another kind with a
# fresh AdamW, whose steps move every weight by about the learning rate
# whatever its gradient's size (Kingma & Ba 2015, arXiv 1412.6980, section
# 2.1). MLX's AdamW leaves out the bias correction by default, and its first
# few hundred steps are then up to 6.5x the rate (at step 10; 3.2x at 100):
# with the peak rate besides, the fine-tune wrecks the drafter before it
# learns the new kind, and what it relearns is mostly the new kind
# (forgetting). So a fine-tune corrects the bias and re-warms to a lower peak,
# as continual pre-training does against forgetting (Gupta et al. 2023,
# arXiv 2308.04014; Ibrahim et al. 2024, arXiv 2403.08763).
FINE_TUNE_LR = 1e-4
FINE_TUNE_WARMUP = 0.1  # of the steps: a gentle start
# Rows of --data held out by --from-traffic: the forgetting check's rows.
REPLAY_HELD_OUT = 8
# Blocks per window: a run from scratch, and a fine-tune (what the shipped
# drafters' recipes train with, so a fine-tune's step costs what theirs did).
ANCHORS, FINE_TUNE_ANCHORS = 32, 16
# --cache-target's bound in memory (a fine-tune runs beside a server).
DEFAULT_CACHE_BYTES = 2 << 30
# The largest relative difference of the approximate softmax's loss from the
# exact one's, on a fine-tune's first batch, at which it is taken by default.
SOFTMAX_TOLERANCE = 1e-3
MASK_NAME = re.compile(r"^<\|?\s*mask\s*\|?>$", re.IGNORECASE)


class TrainError(DFlashError, ValueError):
    """Bad input to the trainer: reported as one line, no traceback."""


def option(default=dataclasses.MISSING, help=None, **flag):
    """A :class:`TrainConfig` field with its ``train`` flag's help (as argparse
    prints it: ``%%`` for a percent sign) and argparse keywords (``type``
    where the annotation's scalar will not do, ``choices``, ``nargs``, hidden
    ``aliases``), so a setting's default and help live in one place. A
    callable ``default`` (``list``) is the field's factory."""
    kind = {"default_factory": default} if callable(default) else {"default": default}
    return dataclasses.field(**kind, metadata={"help": help, **flag})


@dataclasses.dataclass
class TrainConfig:
    """One training run's settings; the ``train`` CLI has a flag per field
    (same name, default and help), and ``--resume`` compares the saved run's
    with it. ``None`` means a default that depends on the target or on other
    settings."""

    model: str = option(help="target model: local path or Hugging Face id", aliases=("--target",))
    draft_model: str = option(help="output drafter checkpoint directory", aliases=("--out",))
    data: List[str] = option(
        list, "text files (tokenised with the target's tokenizer) or .npy token arrays", nargs="+"
    )
    # The drafter: its shape, the target layers it reads, its mask token.
    num_layers: int = option(2, "drafter layers", type=cli.positive_int)
    block_size: int = option(DEFAULT_BLOCK_SIZE, "tokens per drafted block: the anchor and the slots after it")
    taps: Optional[List[int]] = option(
        None, "comma list of target layers to tap (default: the reference rule, one per drafter layer)", type=str
    )
    intermediate_size: Optional[int] = option(None, "drafter MLP width (default: the target's)")
    mask_token_id: Optional[int] = option(None, "default: the tokenizer's <|mask|>-like token")
    draft_vocab: Optional[int] = option(
        None,
        "score only the K target tokens most frequent in the data (FR-Spec's draft vocabulary), in training "
        "and drafting; the target still verifies every token (default: the whole vocabulary)",
    )
    init_from_target: bool = option(
        False,
        "start drafter layer j from the target's layer n - L + j (the last L layers; same width and heads "
        "needed) instead of a random initialisation",
    )
    # What each slot learns, and how much a later slot counts.
    targets: str = option(
        "self-distill",
        "labels: the target's own greedy predictions, or the data tokens",
        choices=("self-distill", "data"),
    )
    gamma: Optional[float] = option(
        None, "slot loss decay exp(-(j-1)/gamma) (default: block-size / 2, i.e. the public 4 for block 8)"
    )
    loss_slots: Optional[int] = option(
        None, "train slots 1..N only, those whose decayed weight matters (default: all block-size - 1)"
    )
    # The optimisation.
    steps: int = option(1000, "optimizer steps", type=cli.positive_int)
    learning_rate: Optional[float] = option(
        None, f"peak learning rate (default: {PEAK_LR}; with --from-traffic, a fine-tune: {FINE_TUNE_LR}, AdamW bias-corrected)"
    )
    warmup: Optional[int] = option(
        None,
        f"linear warmup steps (default: 5%% of --steps; with --from-traffic {FINE_TUNE_WARMUP * 100:.0f}%%), then cosine to 10%%",
    )
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "global gradient-norm clip")
    seed: int = option(0, "seed of the drafter's initialisation and of the batches")
    approximate_softmax: Optional[bool] = option(
        None,
        "the drafter's attention softmax and the loss's logsumexp through the approximate fused exp while "
        "training on the CPU (float32; gradients by the exact functions' formulas); default: with --from-traffic on "
        f"the CPU, on when its loss on a first batch is within {SOFTMAX_TOLERANCE:g} of the exact one's, else off",
    )
    # The batches: windows of seq_len tokens, anchors_per_seq blocks each.
    batch_size: int = option(4, "windows per step", type=cli.positive_int)
    seq_len: int = option(512, "tokens per window", type=cli.positive_int)
    anchors_per_seq: Optional[int] = option(
        None, f"blocks drawn per window (default: {ANCHORS}; with --from-traffic {FINE_TUNE_ANCHORS})", type=cli.positive_int
    )
    answer_mask: Optional[str] = option(
        None,
        ".npy of booleans shaped like the one --data .npy, true on answer tokens: anchors are drawn where the "
        "next token is an answer token (not in prompts or the chat template), others only to fill up",
    )
    # The frozen target's outputs: its dtype, and whether they are kept.
    target_dtype: Optional[str] = option(
        None,
        "run the frozen target in this dtype (default: as stored; with --from-traffic on the CPU float32, which is "
        "faster there for a bf16 checkpoint, its taps differing from bf16 inference by rounding only)",
        choices=tuple(DTYPES),
    )
    approximate_target: Optional[bool] = option(
        None,
        "run the frozen target's attention softmax and SiLU through the approximate fused exp on the CPU "
        "(float32; llama/qwen targets): taps and labels to training precision, much cheaper on x86 "
        "(default: with --from-traffic on the CPU, on where the target's layers allow it, else off)",
    )
    cache_target: Optional[bool] = option(
        None,
        "keep each row's target taps and predictions in memory after its first pass, so later draws skip "
        "the target (data: 2-D .npy rows of exactly --seq-len tokens; memory: rows x seq-len x taps x hidden floats, "
        "for the rows the run is expected to draw more than once, within --cache-max-bytes; default: on with "
        "--from-traffic, else off)",
    )
    cache_max_bytes: int = option(
        DEFAULT_CACHE_BYTES,
        "with --cache-target in memory: the most bytes of target outputs kept (the rows drawn most often first); "
        f"the rows beyond it run the target whenever drawn (default: {DEFAULT_CACHE_BYTES >> 30} GiB)",
        type=cli.positive_int,
    )
    cache_dir: Optional[str] = option(
        None,
        "with --cache-target: keep the target outputs in memory-mapped files here (taps as float16) instead "
        "of memory, for data larger than memory; reused by --resume and later runs on the same rows",
    )
    # The checkpoints.
    save_every: int = option(200, "checkpoint every N steps (and at the end)", type=cli.positive_int)
    resume: bool = option(False, "continue the run saved in --draft-model")
    init_from: Optional[str] = option(
        None,
        "start from this drafter's weights (a checkpoint of the same shape, e.g. an earlier run's "
        "--draft-model, or with fewer layers: the added ones start adding nothing) instead of a random "
        "initialisation; a fresh schedule and optimizer",
    )
    dtype: str = option("float32", "dtype of the saved model.safetensors (training is float32)", choices=tuple(DTYPES))
    # Adapting to recorded traffic (docs/adapting.md).
    from_traffic: Optional[str] = option(
        None,
        "fine-tune the --init-from drafter on the conversations recorded in this traffic directory (--learn DIR): "
        "the most recent tenth held out; --data (with --answer-mask), if given, is the drafter's original data, "
        f"replayed, {REPLAY_HELD_OUT} of its rows held out; --draft-model is written only if its held-out tokens per "
        f"cycle beat --init-from's on the traffic and keep {KEEP_SHARE * 100:.0f}%% of them on those rows",
    )
    replay_share: float = option(
        0.5,
        "with --from-traffic and --data: the share of training windows drawn from --data (half: as much of the old "
        "kind as of the new), from as many of its rows as the run draws",
    )
    max_minutes: Optional[float] = option(None, "end the run after this many minutes of training (a checkpoint then)")
    # The learning curve.
    eval_data: Optional[str] = option(
        None,
        "2-D .npy of held-out rows (the target's greedy answers, never trained on): at the start, every "
        "--eval-every steps and at the end, the tokens a greedy verify cycle at the whole block would commit on them",
    )
    eval_every: int = option(500, "with --eval-data: the learning curve's step between two points", type=cli.positive_int)
    eval_answer_mask: Optional[str] = option(
        None, "booleans shaped like --eval-data, true on the tokens the target wrote (default: every token after the first)"
    )
    eval_train_rows: int = option(
        0,
        "with --eval-data: also score this many training rows (seeded) at each point; far above the held-out "
        "rows, the drafter needs more varied data sooner than more steps",
        type=cli.non_negative_int,
    )


# ------------------------------------------------------------------ the math


def context_mask(anchors: mx.array, seq_len: int) -> mx.array:
    """Boolean [b, n, seq_len]: block ``i`` (anchor ``a_i``) sees the context
    positions ``< a_i``, those the inference loop has injected when it drafts
    from that anchor. Blocks never see each other (see ``train_forward``)."""
    return mx.arange(seq_len) < anchors[..., None]


def layer_visibility(attn, q_pos: mx.array, k_pos: mx.array) -> Optional[mx.array]:
    """The layer's causal / sliding-window rule on broadcastable positions."""
    return visible_positions(q_pos, k_pos, is_causal=attn.is_causal, sliding_window=attn.sliding_window)


def _rope_at(rope, x: mx.array, positions: mx.array) -> mx.array:
    """RoPE of ``x`` [b, L, H, D] with each slot at its own absolute position.

    Each slot becomes a length-1 sequence whose offset is its position, so
    blocks at scattered anchors rotate exactly as in a contiguous decode.
    Returns [b, H, L, D].
    """
    b, L, H, D = x.shape
    y = rope(x.reshape(b * L, 1, H, D).transpose(0, 2, 1, 3), offset=positions.reshape(-1))
    return y.reshape(b, L, H, D).transpose(0, 2, 1, 3)


def _block_attention(attn, x, ctx_k, ctx_v, rope, positions, mask, fast=False, spans=None):
    """``DraftAttention.__call__`` for ``n`` blocks per sequence at once.

    Each block attends to ``[context ; its own slots]`` under one softmax,
    as at inference. Scores are computed only against the context and the
    block itself (not the other blocks, which are hidden anyway): three
    times less work than a dense masked attention over all blocks.
    """
    b, n, B, _ = x.shape
    L, H, Hk, S = n * B, attn.n_heads, attn.n_kv_heads, ctx_k.shape[2]
    x = x.reshape(b, L, -1)
    q = attn.q_norm(attn.q_proj(x).reshape(b, L, H, -1))
    q = _rope_at(rope, q, positions) * attn.scale
    D = q.shape[-1]
    # project_kv with one-token sequences at per-slot offsets.
    k, v = attn.project_kv(x.reshape(b * L, 1, -1), rope, positions.reshape(-1))
    k, v = (t.reshape(b, 1, n, B, Hk, D).transpose(0, 4, 1, 2, 3, 5) for t in (k, v))
    q = q.reshape(b, Hk, H // Hk, n, B, D)  # query head h reads KV head h // (H / Hk)
    s_blk = q @ k.swapaxes(-1, -2)  # [b, Hk, H/Hk, n, B, B]
    q_pos = positions[:, None, None, :, :, None]
    visible = mask[:, None, None, :, None, :]
    rule = layer_visibility(attn, q_pos, mx.arange(S))
    if rule is not None:
        visible = visible & rule
    own = layer_visibility(attn, q_pos, positions[:, None, None, :, None, :])
    if fast and fast_math.approx_for(s_blk):
        # Each block scores only the context it sees in some row.
        parts = []
        for i, seen in enumerate(context_spans(mask) if spans is None else spans):
            pick = (slice(None),) * 3 + (slice(i, i + 1),)
            q_g = q[pick]
            s_ctx = (q_g.reshape(b, Hk, -1, D) @ ctx_k[:, :, :seen].swapaxes(-1, -2)).reshape(*q_g.shape[:-1], seen)
            own_g = None if own is None else own[pick]
            parts.append(_split_softmax(s_ctx, s_blk[pick], visible[pick][..., :seen], own_g, ctx_v[:, :, :seen], v[pick]))
        out = mx.concatenate(parts, axis=3) if len(parts) > 1 else parts[0]
    else:
        s_ctx = (q.reshape(b, Hk, -1, D) @ ctx_k.swapaxes(-1, -2)).reshape(*q.shape[:-1], S)
        s_ctx = mx.where(visible, s_ctx, -mx.inf)
        if own is not None:
            s_blk = mx.where(own, s_blk, -mx.inf)
        p = mx.softmax(mx.concatenate([s_ctx, s_blk], axis=-1), axis=-1, precise=True)
        out = (p[..., :S].reshape(b, Hk, -1, S) @ ctx_v).reshape(q.shape) + p[..., S:] @ v
    out = out.reshape(b, H, L, D).transpose(0, 2, 1, 3).reshape(b, n, B, -1)
    return attn.o_proj(out)


def context_spans(mask: mx.array) -> List[int]:
    """The context positions each block of a batch's context ``mask``
    [b, n, S] scores: only the first ones,
    up to the last it sees in any row, so most hidden scores (and their
    exponentials) are never computed. One host read of the mask."""
    seen = np.array(mx.any(mask, axis=0))  # [n, S]: seen in some row
    return [int(np.flatnonzero(row)[-1]) + 1 if row.any() else 1 for row in seen]


def _split_softmax(s_ctx, s_blk, visible, own, ctx_v, v):
    """The attention output of one softmax over the context scores ``s_ctx``
    [b, Hk, G, n, B, S] (where ``visible``) and the block's ``s_blk`` [..., B]
    (where ``own``; None: all), without joining them: each part's
    approximate numerators are multiplied into its values, and the sum is
    divided by their common denominator once (as FlashAttention combines key
    blocks, Dao et al. 2022, arXiv 2205.14135). A joined score array, its
    probabilities and their slices back would each be another pass over the
    largest arrays of the step. The row maximum only keeps the exponentials
    in range: the softmax does not depend on it, so it carries no gradient."""
    b, Hk, G, n, B, S = s_ctx.shape
    own = mx.array(True) if own is None else own
    hidden = mx.array(-mx.inf, s_ctx.dtype)
    top = mx.stop_gradient(
        mx.maximum(
            mx.max(mx.where(visible, s_ctx, hidden), axis=-1, keepdims=True),
            mx.max(mx.where(own, s_blk, hidden), axis=-1, keepdims=True),
        )
    )
    e_ctx = fast_math.exp_below_where_trainable(s_ctx, top, visible)
    e_blk = fast_math.exp_below_where_trainable(s_blk, top, own)
    total = e_ctx.sum(axis=-1, keepdims=True) + e_blk.sum(axis=-1, keepdims=True)
    return ((e_ctx.reshape(b, Hk, -1, S) @ ctx_v).reshape(*s_ctx.shape[:-1], -1) + e_blk @ v) / total


def train_forward(draft: DFlashDraftModel, target_embed, tap_states, blocks, positions, mask, fast=False):
    """Final drafter states [b, n, B, hidden] of ``n`` blocks per sequence.

    ``DFlashDraftModel.hidden_states`` with the drafter's own modules, so
    training and inference compute the same function; only the attention
    differs, since inference runs one block against a context cache and
    training runs all blocks of a sequence at once, each against the context
    before its anchor (:func:`_block_attention`). The fused taps of
    all ``S`` positions [b, S, taps*hidden] are projected to K/V once per
    layer (absolute positions ``0..S-1``); block slots ``blocks`` at
    ``positions`` (both [b, n, B]) attend to the context positions ``mask``
    [b, n, S] allows (see :func:`context_mask`) and to their own block, as
    the layer's causal / sliding-window rule allows. ``fast``: the
    approximate softmax on the CPU (``--approximate-softmax``).
    """
    h, context = draft.layer_inputs(blocks, tap_states, target_embed)
    spans = context_spans(mask) if fast else None
    for layer in draft.layers:
        attn = layer.self_attn
        ctx_k, ctx_v = attn.project_kv(context, draft.rope, 0)
        h = h + _block_attention(attn, layer.input_layernorm(h), ctx_k, ctx_v, draft.rope, positions, mask, fast, spans)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h)


def slot_weights(block_size: int, gamma: float) -> mx.array:
    """Loss weight of slots 1..B-1: exp(-(j-1)/gamma)."""
    return mx.exp(-mx.arange(block_size - 1, dtype=mx.float32) / gamma)


def make_blocks(tokens: mx.array, anchors: mx.array, block_size: int, mask_id: int):
    """Block tokens [b, n, B] (anchor token + masks) and their positions."""
    b, n = anchors.shape
    first = mx.take_along_axis(tokens, anchors, axis=1)[..., None]
    masks = mx.full((b, n, block_size - 1), mask_id, dtype=tokens.dtype)
    blocks = mx.concatenate([first, masks], axis=-1)
    return blocks, anchors[..., None] + mx.arange(block_size)


def slot_labels(tokens, greedy, anchors, block_size: int) -> mx.array:
    """Labels [b, n, B-1] of slots 1..B-1: the data token at ``a+j``, or
    with ``greedy`` the target's prediction at ``a+j-1`` (what it would emit
    at ``a+j``)."""
    b, n = anchors.shape
    idx = anchors[..., None] + mx.arange(1, block_size)
    if greedy is not None:
        tokens, idx = greedy, idx - 1
    return mx.take_along_axis(tokens, idx.reshape(b, -1), axis=1).reshape(b, n, block_size - 1)


# Logits the head computes at once in training (rows x draft ids): a slice
# small enough to stay in the CPU's cache through the cross-entropy's passes.
HEAD_CHUNK = 1 << 21


def head_loss(draft, hidden: mx.array, labels: mx.array, fast: bool = False):
    """Cross-entropy against ``labels`` (-1 counts as id 0; the caller masks
    it) and the head's best id, per position of ``hidden`` [..., hidden].
    Computed a slice of rows at a time: the logits of a whole batch are the
    largest arrays of a training step, and each pass over them (softmax,
    its gradient) would go to memory and back."""
    lead, width = hidden.shape[:-1], hidden.shape[-1]
    hidden, labels = hidden.reshape(-1, width), mx.maximum(labels, 0).reshape(-1)
    ids = draft.config.draft_vocab
    rows = max(1, HEAD_CHUNK // (draft.config.vocab_size if ids is None else len(ids)))
    ce, best = [], []
    for i in range(0, hidden.shape[0], rows):
        logits = draft.head_logits(hidden[i : i + rows]).astype(mx.float32)
        loss_fn = fast_math.cross_entropy_approx if fast and fast_math.approx_for(logits) else nn.losses.cross_entropy
        ce.append(loss_fn(logits, labels[i : i + rows]))
        best.append(mx.stop_gradient(mx.argmax(logits, axis=-1)))
    return mx.concatenate(ce).reshape(lead), mx.concatenate(best).reshape(lead)


def drafter_loss(draft, target_embed, tap_states, blocks, positions, mask, labels, weights, fast=False):
    """Decayed cross-entropy and accuracy proxies of one batch, over the
    slots ``labels`` covers (``len(weights)`` of them, from slot 1) and, with
    a draft vocabulary, over its ids: ``labels`` are then draft ids, -1 for a
    token outside it (no loss; never proposed, so never correct). ``fast``:
    the approximate softmax and logsumexp on the CPU."""
    hidden = train_forward(draft, target_embed, tap_states, blocks, positions, mask, fast)
    hidden = hidden[:, :, 1 : 1 + weights.shape[0]]  # slot 0 is the known anchor
    ce, best = head_loss(draft, hidden, labels, fast)
    inside = labels >= 0
    loss = (ce * inside * weights).sum(-1).mean() / weights.sum()
    correct = mx.stop_gradient((best == labels) & inside)
    # 1 + accepted prefix: the tokens a verify cycle would commit.
    accept_len = 1 + mx.cumprod(correct.astype(mx.float32), axis=-1).sum(-1).mean()
    return loss, (correct[..., 0].mean(), correct.mean(), accept_len)


def cycles_along(accepted: np.ndarray, written: np.ndarray) -> List[int]:
    """Tokens each cycle commits when greedy decoding at a fixed block writes
    the runs of ``written`` (booleans per position: the target's tokens)
    of one row, where a block drafted after anchor ``a`` has ``accepted[a]``
    tokens accepted (-1: none drafted there, the row ends). The text is the
    target's whatever the drafter proposes, so a cycle from anchor ``a``
    commits ``accepted[a] + 1`` tokens (the last the target's own) and the
    next cycle's anchor is the last of them. A run's first token comes from
    the prompt's forward, as a generation's first token does."""
    out = []
    edges = np.flatnonzero(np.diff(np.concatenate([[0], written.astype(np.int8), [0]])))
    for start, end in zip(edges[::2], edges[1::2]):
        a = max(int(start), 1)  # an anchor has context before it
        while a < end - 1 and accepted[a] >= 0:
            n = min(int(accepted[a]) + 1, end - 1 - a)
            out.append(n)
            a += n
    return out


def held_out_cycles(draft, adapter, rows, written, taps, fast=False, chunk=128) -> List[int]:
    """:func:`cycles_along` over held-out ``rows`` (token arrays) and their
    ``written`` masks: the drafter's block from every anchor whose next
    token the target wrote, ``chunk`` blocks per pass, scored as training
    scores them, against the row's own next tokens. ``taps``: per row, the
    target's tap states [1, S, taps * hidden] (see :func:`target_pass`)."""
    cfg = draft.config
    out = []
    for row, marks, tap_states in zip(rows, written, taps):
        tokens, n_anchors = mx.array(row[None].astype(np.int32)), len(row) - cfg.block_size
        anchors = np.flatnonzero(marks[2 : n_anchors + 2]) + 1  # a in 1..n_anchors, token a + 1 written
        accepted = np.full(len(row), -1)
        for i in range(0, len(anchors), chunk):
            a = mx.array(anchors[None, i : i + chunk].astype(np.int32))
            blocks, positions = make_blocks(tokens, a, cfg.block_size, cfg.mask_token_id)
            mask = context_mask(a, len(row))
            hidden = train_forward(draft, adapter.embed, tap_states, blocks, positions, mask, fast)[:, :, 1:]
            labels = draft_labels(slot_labels(tokens, None, a, cfg.block_size), cfg.draft_vocab, adapter.vocab_size)
            correct = mx.argmax(draft.head_logits(hidden), axis=-1) == labels
            accepted[anchors[i : i + chunk]] = np.array(mx.cumprod(correct.astype(mx.int32), axis=-1).sum(-1))[0]
        out += cycles_along(accepted, marks)
    return out


def frequent_tokens(docs: List[np.ndarray], k: int, vocab_size: int, answers: Optional[List[np.ndarray]] = None):
    """The ``k`` ids most frequent in ``docs`` (only on ``answers`` where
    given), ascending: a draft vocabulary (FR-Spec). Ties go to the lower id."""
    flat = np.concatenate(docs)
    if answers is not None:
        flat = flat[np.concatenate(answers)]
    counts = np.bincount(flat, minlength=vocab_size)
    top = np.argsort(-counts, kind="stable")[:k]
    return sorted(int(i) for i in top)


def draft_labels(labels: mx.array, draft_vocab: Optional[List[int]], vocab_size: int) -> mx.array:
    """Target ids -> draft ids (-1 outside the draft vocabulary); unchanged without one."""
    if draft_vocab is None:
        return labels
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[draft_vocab] = np.arange(len(draft_vocab))
    return mx.array(t2d)[labels]


def init_from_target_layers(draft: DFlashDraftModel, adapter) -> None:
    """Drafter layer ``j`` starts as the target's layer ``n - L + j``: every
    tensor of the drafter layer the target layer holds with the same name and
    shape (attention projections, MLP, norms); the drafter's own q/k norms,
    which a llama target lacks, stay at one."""
    n, L = adapter.num_layers, len(draft.layers)
    if L > n:
        raise TrainError(f"--init-from-target: the drafter's {L} layers exceed the target's {n}")
    for j, layer in enumerate(draft.layers):
        source = dict(tree_flatten(adapter.backbone.layers[n - L + j].parameters()))
        own = dict(tree_flatten(layer.parameters()))
        copied = {k: v.astype(own[k].dtype) for k, v in source.items() if k in own and v.shape == own[k].shape}
        missing = sorted(k for k in own if k not in copied and not k.endswith(("q_norm.weight", "k_norm.weight")))
        if missing:
            raise TrainError(
                f"--init-from-target: target layer {n - L + j} lacks drafter tensors of the same shape "
                f"({', '.join(missing[:4])}): a quantized target, or another width or head count"
            )
        layer.load_weights(list(copied.items()), strict=False)


def target_pass(adapter, tokens: mx.array, taps: Sequence[int]):
    """Frozen target: tap states of every position and its greedy predictions
    (lazy: a caller that evaluates only the taps never runs the layers past
    the last tap nor the LM head)."""
    logits, tap_states = adapter.forward(
        tokens, adapter.make_cache(), taps=list(taps), last_logits_only=False, record=False
    )
    return mx.stop_gradient(tap_states), mx.stop_gradient(mx.argmax(logits, axis=-1))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak``, then cosine down to 10% of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------------- data


@contextlib.contextmanager
def quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def read_data(paths: List[str], tokenizer, vocab_size: int) -> List[np.ndarray]:
    """Token documents. Text files (tokenised, EOS after each) and 1-D
    ``.npy`` arrays join one running stream, so windows may cross file ends
    as in LM pre-training; each row of a 2-D ``.npy`` is a document of its
    own (e.g. one prompt + target continuation), never crossed."""
    eos = tokenizer.eos_token_id
    stream, docs = [], []
    for p in map(Path, paths):
        if p.suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
            if not np.issubdtype(arr.dtype, np.integer) or arr.ndim > 2:
                raise TrainError(f"{p}: token arrays must be 1-D or 2-D integers, not {arr.ndim}-D {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                raise TrainError(
                    f"{p}: token ids span {arr.min()}..{arr.max()}, outside the target "
                    f"vocabulary (0..{vocab_size - 1}): tokenised for another model?"
                )
            if arr.ndim == 2:
                docs.extend(arr)
            else:
                stream.append(arr)
        else:
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise TrainError(f"{p}: not UTF-8 text (pass token arrays as .npy)") from None
            with quiet_transformers():  # whole files exceed model_max_length: harmless here
                ids = tokenizer.encode(text, add_special_tokens=False)
            stream.append(np.asarray(ids + ([eos] if eos is not None else [])))
    if stream:
        docs.insert(0, np.concatenate(stream))
    return [d.astype(np.int32) for d in docs]


def window_starts(docs: List[np.ndarray], seq_len: int):
    """The documents as one array and every start of a window inside one."""
    flat = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    offsets = np.cumsum([0] + [len(d) for d in docs[:-1]])
    starts = [o + np.arange(len(d) - seq_len + 1) for o, d in zip(offsets, docs) if len(d) >= seq_len]
    return flat, (np.concatenate(starts) if starts else np.zeros(0, np.int64))


def sample_batch(rng: np.random.Generator, data, args, answers: Optional[np.ndarray] = None):
    """Window starts, random windows [batch, seq_len] and sorted anchors
    [batch, n] with ``1 <= a`` and ``a + B - 1 < seq_len`` (no two alike).
    With ``answers`` (booleans over the flat data), anchors whose next token
    is an answer token come first; others only fill up a short answer.
    ``data``: the flat data, the window starts and their chances of being
    drawn (None: alike)."""
    flat, valid, weights = data
    starts = valid[rng.integers(0, len(valid), size=args.batch_size) if weights is None else rng.choice(len(valid), args.batch_size, p=weights)]
    windows = np.stack([flat[s : s + args.seq_len] for s in starts])
    n_valid, n = args.seq_len - args.block_size, args.anchors_per_seq
    picked = []
    for s in starts:
        if answers is None:
            picked.append(rng.choice(n_valid, size=n, replace=False) + 1)
            continue
        inside = answers[s + 2 : s + 2 + n_valid]  # anchor a = 1 + i: its next token is s + a + 1
        good, rest = np.flatnonzero(inside), np.flatnonzero(~inside)
        take = rng.choice(good, size=min(n, len(good)), replace=False)
        fill = rng.choice(rest, size=n - len(take), replace=False)
        picked.append(np.concatenate([take, fill]) + 1)
    return starts, windows, np.sort(np.stack(picked), axis=-1).astype(np.int32)


def read_eval(args: "TrainConfig"):
    """``--eval-data`` rows and their ``--eval-answer-mask`` (default: every
    token after a row's first), checked."""
    rows = np.load(args.eval_data, allow_pickle=False)
    if rows.ndim != 2 or not np.issubdtype(rows.dtype, np.integer) or rows.shape[1] < args.block_size + 2:
        raise TrainError(
            f"--eval-data must be a 2-D .npy of token rows of at least block-size + 2 = {args.block_size + 2} "
            f"tokens, not {rows.dtype} {rows.shape}"
        )
    if args.eval_answer_mask is None:
        return rows, np.arange(rows.shape[1]) >= np.ones((len(rows), 1))
    written = np.load(args.eval_answer_mask, allow_pickle=False)
    if written.dtype != np.bool_ or written.shape != rows.shape:
        raise TrainError(f"--eval-answer-mask must be booleans shaped like --eval-data {rows.shape}, not {written.dtype} {written.shape}")
    return rows, written


def answers_by_doc(docs: List[np.ndarray], answers: Optional[np.ndarray]) -> Optional[List[np.ndarray]]:
    """The flat ``--answer-mask`` split into one mask per document (None without one)."""
    return None if answers is None else np.split(answers, np.cumsum([len(d) for d in docs[:-1]]))


def training_sample(args: "TrainConfig", docs: List[np.ndarray], answers: Optional[np.ndarray]):
    """``--eval-train-rows`` of the training documents (seeded apart from
    the batches), each cut to ``--seq-len``, and their answer masks (default:
    every token after the first), for the learning curve's training-row points."""
    marks = answers_by_doc(docs, answers)
    fits = [i for i, d in enumerate(docs) if len(d) >= args.block_size + 2]
    pick = np.random.default_rng([args.seed, 1]).choice(fits, min(args.eval_train_rows, len(fits)), replace=False)
    rows, written = [], []
    for i in sorted(pick):
        n = min(len(docs[i]), args.seq_len)
        rows.append(np.asarray(docs[i][:n]))
        written.append(np.arange(n) >= 1 if marks is None else marks[i][:n])
    return rows, written


# The learning curves besides the held-out rows' (``eval``): the state's key
# and what its rows are.
CURVES = {"eval_replay": "held-out replay rows", "eval_train": "training rows"}


class HeldOut:
    """The learning curve (``--eval-data``): tokens per greedy cycle at the
    whole block on ``rows`` (held-out ones, or a sample of the training
    rows), at a step (:func:`held_out_cycles`). The target's taps of the
    rows are computed once."""

    def __init__(self, rows, written, adapter, args: "TrainConfig"):
        self.rows, self.written = rows, written
        self.adapter, self.tap_ids, self.fast = adapter, list(args.taps), args.approximate_softmax
        self.taps = None

    def __call__(self, draft, step: int) -> list:
        """``[step, tokens per cycle, cycles]``."""
        if self.taps is None:
            self.taps = [target_pass(self.adapter, mx.array(r[None].astype(np.int32)), self.tap_ids)[0] for r in self.rows]
            mx.eval(self.taps)
        committed = held_out_cycles(draft, self.adapter, self.rows, self.written, self.taps, self.fast)
        return [step, round(float(np.mean(committed)), 4) if committed else 0.0, len(committed)]


# Rows a cache fill passes through the target at once: a pass over many rows
# at once runs slower a row on a CPU, its activations outgrowing the caches.
CACHE_PASS_ROWS = 4


class TargetOutputs:
    """The frozen target's taps for a batch of windows, and its greedy
    predictions where they are the labels (``--targets self-distill``; with
    ``data`` they are None, and the target runs only up to its last tap).

    Without ``--cache-target`` the target runs on every batch. With it each
    row (a whole window) runs once: kept in memory, or with ``--cache-dir`` in
    memory-mapped files there (taps as float16), which outlive the run, so a
    resumed or repeated run over the same rows, target and taps reuses them.
    A row is marked done only after its data is flushed. In memory, only the
    rows the run is expected to draw more than once are kept (``chance``:
    each row's chance of a draw, None: alike; a fine-tune's replayed rows
    are drawn about once each, by design, and keeping them would grow the
    run's memory by a row's taps at almost every step for nothing); the
    others run the target every time they are drawn.
    """

    def __init__(self, adapter, args, n_rows: int, width: int, chance: Optional[np.ndarray] = None):
        self.adapter, self.taps_ids, self.seq_len = adapter, list(args.taps), args.seq_len
        self.enabled, self.greedy = args.cache_target, args.targets == "self-distill"
        if not self.enabled:
            return
        draws = args.steps * args.batch_size * (np.full(n_rows, 1 / n_rows) if chance is None else np.asarray(chance))
        kept = np.arange(n_rows) if args.cache_dir is not None else self.kept_in_memory(args, draws, width)
        self.slot = np.full(n_rows, -1)  # where each row is kept; -1: not kept
        self.slot[kept] = np.arange(len(kept))
        shapes = {"taps": (len(kept), args.seq_len, width), "done": (len(kept),)}
        if self.greedy:
            shapes["greedy"] = (len(kept), args.seq_len)
        if args.cache_dir is None:
            dtypes = {"taps": np.float32, "greedy": np.int32, "done": np.bool_}
            self.arrays = {k: np.zeros(shape, dtypes[k]) for k, shape in shapes.items()}
            return
        dtypes = {"taps": np.float16, "greedy": np.int32, "done": np.bool_}
        root = Path(args.cache_dir)
        key = {
            "target": str(Path(args.model).resolve()), "data": [str(Path(d).resolve()) for d in args.data],
            "taps": self.taps_ids, "seq_len": args.seq_len, "rows": n_rows, "target_dtype": args.target_dtype,
        }  # fmt: skip
        if args.approximate_target:
            key["approximate_target"] = True
        if not self.greedy:
            key["greedy"] = False  # such a cache cannot serve self-distillation's labels
        meta = root / "cache.json"
        fresh = not meta.is_file()
        if not fresh and json.loads(meta.read_text()) != key:
            saved = json.loads(meta.read_text())
            diff = ", ".join(k for k in key if saved.get(k) != key[k])
            raise TrainError(f"--cache-dir {root} holds the target outputs of another run ({diff} differ): choose another directory")
        root.mkdir(parents=True, exist_ok=True)
        self.arrays = {
            k: np.lib.format.open_memmap(root / f"{k}.npy", "w+" if fresh else "r+", dtypes[k], shape)
            for k, shape in shapes.items()
        }
        if fresh:
            meta.write_text(json.dumps(key, indent=1))

    def kept_in_memory(self, args, draws: np.ndarray, width: int) -> np.ndarray:
        """The rows kept in memory: those expected to be drawn more than
        once, the most drawn first, as many as ``--cache-max-bytes`` holds."""
        row_bytes = args.seq_len * (4 * width + (4 if self.greedy else 0)) + 1  # taps, labels, done
        again = np.flatnonzero(draws > 1)
        kept = np.sort(again[np.argsort(-draws[again], kind="stable")][: args.cache_max_bytes // row_bytes])
        if len(kept) < len(again):
            print(
                f"--cache-target keeps {len(kept)} of the {len(again)} rows drawn more than once "
                f"(--cache-max-bytes {args.cache_max_bytes}); the others run the target when drawn",
                file=sys.stderr,
            )
        return kept

    def __call__(self, starts: np.ndarray, windows: np.ndarray):
        if not self.enabled:
            taps, greedy = target_pass(self.adapter, mx.array(windows), self.taps_ids)
            return taps, greedy if self.greedy else None
        slots = self.slot[starts // self.seq_len]  # each row is one window (checked in train)
        a = self.arrays
        kept = slots[slots >= 0]
        new = sorted(set(kept[~a["done"][kept]].tolist()))
        for i in range(0, len(new), CACHE_PASS_ROWS):
            part = new[i : i + CACHE_PASS_ROWS]
            pick = [int(np.flatnonzero(slots == r)[0]) for r in part]
            taps, greedy = target_pass(self.adapter, mx.array(windows[pick]), self.taps_ids)
            a["taps"][part] = np.array(taps.astype(mx.float32))
            if self.greedy:
                a["greedy"][part] = np.array(greedy)
        if new:
            for name in ("taps", "greedy"):
                if isinstance(a.get(name), np.memmap):
                    a[name].flush()
            a["done"][new] = True
            if isinstance(a["done"], np.memmap):
                a["done"].flush()
        taps = np.empty((len(slots), *a["taps"].shape[1:]), np.float32)
        taps[slots >= 0] = a["taps"][kept]
        greedy = np.empty((len(slots), self.seq_len), np.int32) if self.greedy else None
        if self.greedy:
            greedy[slots >= 0] = a["greedy"][kept]
        passing = np.flatnonzero(slots < 0)  # rows not kept: the target runs for them now
        if len(passing):
            passed, labels = target_pass(self.adapter, mx.array(windows[passing]), self.taps_ids)
            taps[passing] = np.array(passed.astype(mx.float32))
            if self.greedy:
                greedy[passing] = np.array(labels)
        return mx.array(taps), None if greedy is None else mx.array(greedy)


# ----------------------------------------------------------------- checkpoint


def find_mask_token(tokenizer) -> int:
    """The tokenizer's mask token, if it declares one or has one named like ``<|mask|>``."""
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None:
        return int(mask_id)
    vocab = tokenizer.get_vocab()
    hits = sorted(i for t, i in vocab.items() if MASK_NAME.match(t))
    if not hits:
        raise TrainError(
            "the target tokenizer has no mask token (like <|mask|>); pass --mask-token-id "
            "with an id the target never needs to produce (a reserved special token)"
        )
    return hits[0]


def write_checkpoint(out: Path, config: dict, draft, optimizer, state: dict, dtype) -> None:
    """Write the z-lab layout + training state beside ``out``, then swap it
    in (``convert.Staging``), so a crash never leaves a half-written checkpoint."""
    from .convert import Staging

    staging = Staging(out, force=True)
    try:
        tmp = staging.path
        (tmp / STATE_DIR).mkdir(parents=True)
        params = dict(tree_flatten(draft.parameters()))
        mx.save_safetensors(
            str(tmp / "model.safetensors"),
            {k: v.astype(dtype) for k, v in params.items()},
            metadata={"format": "pt"},
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        arrays = {f"model.{k}": v for k, v in params.items()}
        arrays.update({f"optimizer.{k}": v for k, v in tree_flatten(optimizer.state)})
        mx.save_safetensors(str(tmp / STATE_DIR / "training_state.safetensors"), arrays)
        (tmp / STATE_DIR / "training_state.json").write_text(json.dumps(state, indent=1) + "\n")
        staging.commit()
    finally:
        staging.discard()


def read_state(out: Path):
    state_dir = out / STATE_DIR
    if not (state_dir / "training_state.json").exists():
        raise TrainError(f"--resume: {out} holds no training state ({STATE_DIR}/) to continue")
    try:
        state = json.loads((state_dir / "training_state.json").read_text())
        arrays = mx.load(str(state_dir / "training_state.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:  # mx.load: RuntimeError
        raise TrainError(
            f"--resume: the training state in {out} is damaged ({e}); start again into a new --draft-model (--init-from {out} starts from its weights)"
        ) from None
    return state, arrays


# A drafter layer's outputs into the residual stream: zero, the layer adds nothing.
RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
RESIDUAL_BIASES = ("self_attn.o_proj.bias",)  # with attention_bias
ZEROED_IN_ADDED_LAYERS = RESIDUAL_OUTPUTS + RESIDUAL_BIASES


def init_weights(draft: DFlashDraftModel, path: Path) -> None:
    """Copy the weights of the drafter at ``path``, which must have
    ``draft``'s configuration (loaded, and its files checked, by
    ``load_draft``), its draft vocabulary aside: the head is the target's,
    so no weight depends on which ids it scores, and a drafter trained over
    the whole vocabulary can continue over the most frequent ids.

    A run with more layers than that drafter grows it: its layers are the
    first ones, and each added layer keeps its fresh initialisation but for
    its outputs into the residual stream, set to zero, so the grown drafter
    drafts exactly what the saved one does and training starts where that
    one stopped, with the depth to use (zero-initialised residual branches,
    as in Goyal et al. 2017, arXiv 1706.02677, and Net2Net's
    function-preserving growth, arXiv 1511.05641)."""
    from .loading import check_weights, load_draft

    saved = load_draft(path, dtype=mx.float32)
    kept, layers = saved.config.num_hidden_layers, draft.config.num_hidden_layers
    diff = [
        f"{k} {getattr(saved.config, k)!r} (run: {getattr(draft.config, k)!r})"
        for k in draft.config.__dataclass_fields__
        if k not in ("draft_vocab", "num_hidden_layers", "layer_types") and getattr(saved.config, k) != getattr(draft.config, k)
    ]
    if kept > layers:
        diff.append(f"num_hidden_layers {kept} (run: {layers}; a run may add layers, not drop them)")
    if saved.config.layer_types and list(saved.config.layer_types) != list(draft.config.layer_types or [])[:kept]:
        diff.append(f"layer_types {saved.config.layer_types!r} (run: {draft.config.layer_types!r})")
    if diff:
        raise TrainError(f"--init-from {path} is a different drafter: {', '.join(diff)}")
    weights = dict(tree_flatten(saved.parameters()))
    for j in range(kept, layers):
        added = dict(tree_flatten(draft.layers[j].parameters()))
        if not all(name in added for name in RESIDUAL_OUTPUTS):
            raise TrainError(f"--init-from: layers of this drafter cannot be added ({', '.join(RESIDUAL_OUTPUTS)} needed)")
        weights.update({f"layers.{j}.{k}": mx.zeros_like(v) if k in ZEROED_IN_ADDED_LAYERS else v for k, v in added.items()})
    check_weights(draft, weights, path)  # e.g. a quantized checkpoint
    draft.load_weights(list(weights.items()), strict=True)


def run_config(args: TrainConfig) -> dict:
    """The settings ``--resume`` compares; the target is saved as ``target``,
    the name runs were saved under before the flag became ``--model``."""
    cfg = {k: getattr(args, k) for k in RUN_KEYS if k != "model"}
    cfg["target"] = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    cfg["data"] = [str(Path(p).resolve()) for p in args.data]
    if args.init_from is not None:
        cfg["init_from"] = str(Path(args.init_from).resolve())
    return cfg


def check_resume(saved: dict, current: dict) -> None:
    diff = [k for k in current if saved.get(k) != current.get(k)]
    if diff:
        detail = ", ".join(f"--{k.replace('_', '-')} {current[k]!r} (saved {saved.get(k)!r})" for k in diff)
        raise TrainError(f"--resume must repeat the original run's arguments; differs: {detail}")


# ---------------------------------------------------------------------- main


def setup_arg_parser() -> argparse.ArgumentParser:
    """A flag per :class:`TrainConfig` field: ``--model`` / ``--draft-model``
    are mlx-lm's names for the target and the output (``--target`` / ``--out``
    still work, unlisted)."""
    p = cli.ArgumentParser(
        prog="mlx-dflash train",
        description="Train a DFlash drafter for a frozen target (z-lab checkpoint layout).",
    )
    for f in dataclasses.fields(TrainConfig):
        options = dict(f.metadata)
        aliases = options.pop("aliases", ())
        p.add_argument("--" + f.name.replace("_", "-"), **flag_options(f, options))
        for alias in aliases:
            p.add_argument(alias, dest=f.name, help=argparse.SUPPRESS)
    return p


def flag_options(f: dataclasses.Field, options: dict) -> dict:
    """argparse keywords of a field's flag: a switch for a bool, else a value
    of the annotation's scalar (``int`` for ``Optional[int]``), the field's
    default (``None`` for a required field: ``check_args`` names it)."""
    if f.type is bool:
        return dict(options, action="store_true")
    if f.type == Optional[bool]:  # on, off (--no-...), or left to the run (None)
        return dict(options, action=argparse.BooleanOptionalAction, default=f.default)
    if f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = None if f.default is dataclasses.MISSING else f.default
    scalar = [t for t in typing.get_args(f.type) if t is not type(None)]
    options.setdefault("type", scalar[0] if scalar else f.type)
    return dict(options, default=default)


def fill_defaults(args: TrainConfig) -> None:
    """The settings left to the run (``None``) that neither the target nor
    the drafter decide. A fine-tune (``--from-traffic``, and so each round of
    ``server --adapt``) takes what the traffic bench
    (examples/traffic_adaptation.py) trains with: a lower, re-warmed rate,
    the recipes' anchors per window, the traffic's target outputs kept
    (:class:`TargetOutputs`, within ``--cache-max-bytes``) and, on the CPU,
    the target in float32; the approximate target and softmax stay ``None``
    there, for :func:`prepare` and :func:`train` to check. Anything else
    gets the plain defaults, every lever off."""
    fine_tune = args.from_traffic is not None
    if args.anchors_per_seq is None:
        args.anchors_per_seq = FINE_TUNE_ANCHORS if fine_tune else ANCHORS
    if args.cache_target is None:
        args.cache_target = fine_tune
    if args.learning_rate is None:
        args.learning_rate = FINE_TUNE_LR if fine_tune else PEAK_LR
    if args.warmup is None:
        args.warmup = max(1, int(args.steps * FINE_TUNE_WARMUP) if fine_tune else args.steps // 20)
    if fine_tune and mx.default_device() == mx.cpu:
        args.target_dtype = args.target_dtype or "float32"
        return
    args.approximate_target, args.approximate_softmax = bool(args.approximate_target), bool(args.approximate_softmax)


def check_args(args: TrainConfig) -> None:
    """Everything that can be checked before loading the target (the
    defaults filled in first: :func:`fill_defaults`)."""
    fill_defaults(args)
    check_numbers(args)
    if not args.model or not args.draft_model:
        raise TrainError("training needs a target (--model) and an output directory (--draft-model)")
    if args.from_traffic is not None:
        check_traffic_args(args)
    elif not args.data:
        raise TrainError("no --data files given")
    missing = [p for p in args.data if not Path(p).is_file()]
    if missing:
        raise TrainError(f"--data file(s) not found: {', '.join(missing)}")
    for name in ("num_layers", "steps", "batch_size", "anchors_per_seq"):
        if getattr(args, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be at least 1")
    if args.block_size < 2:
        raise TrainError("--block-size must be at least 2 (the anchor plus one drafted slot)")
    if args.seq_len < args.block_size + 1:
        raise TrainError(
            f"--seq-len {args.seq_len} is shorter than a block: it needs at least "
            f"block-size + 1 = {args.block_size + 1} tokens (one context token before the anchor)"
        )
    n_valid = args.seq_len - args.block_size
    if args.anchors_per_seq > n_valid:
        raise TrainError(
            f"--anchors-per-seq {args.anchors_per_seq} exceeds the {n_valid} anchor positions "
            f"a --seq-len {args.seq_len} window has for block size {args.block_size}"
        )
    if args.cache_dir is not None and not args.cache_target:
        raise TrainError("--cache-dir keeps --cache-target's outputs: pass --cache-target too")
    if args.loss_slots is not None and not 1 <= args.loss_slots < args.block_size:
        raise TrainError(f"--loss-slots must be 1..{args.block_size - 1} (the drafted slots of a block)")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise TrainError("--draft-vocab must be at least 1")
    if args.answer_mask is not None:
        if len(args.data) != 1 or Path(args.data[0]).suffix != ".npy":
            raise TrainError("--answer-mask marks the tokens of one --data .npy file: pass exactly one")
        if not Path(args.answer_mask).is_file():
            raise TrainError(f"--answer-mask file not found: {args.answer_mask}")
    if args.eval_answer_mask is not None and args.eval_data is None:
        raise TrainError("--eval-answer-mask marks the tokens of --eval-data: pass --eval-data too")
    if args.eval_train_rows and args.eval_data is None:
        raise TrainError("--eval-train-rows adds training rows to the learning curve of --eval-data: pass --eval-data too")
    for flag, path in (("--eval-data", args.eval_data), ("--eval-answer-mask", args.eval_answer_mask)):
        if path is not None and not Path(path).is_file():
            raise TrainError(f"{flag} file not found: {path}")
    if args.eval_data is not None:
        read_eval(args)
    if args.taps is not None and not args.taps:
        raise TrainError("--taps is empty")
    if args.init_from is not None and args.init_from_target:
        raise TrainError("--init-from and --init-from-target both set the starting weights: pass one")
    if args.init_from is not None and not (Path(args.init_from) / "config.json").is_file():
        raise TrainError(f"--init-from {args.init_from} holds no drafter checkpoint (config.json)")
    if args.init_from is not None and inherited_config(args).get("quantization"):
        raise TrainError(
            f"--init-from {args.init_from} is quantized, and training needs float weights: start from the "
            "checkpoint it was converted from (and convert -q the result)"
        )
    out = Path(args.draft_model)
    check_out(out)
    if not args.resume and out.exists() and any(out.iterdir()):
        raise TrainError(f"{out} exists and is not empty: pass --resume to continue it, or choose a new --draft-model")


def check_out(out: Path) -> None:
    """--draft-model must be a directory to be: a file there was a
    traceback, a file above it failed the run at its first checkpoint."""
    from .convert import check_parents

    if out.exists() and not out.is_dir():
        raise TrainError(f"--draft-model {out} is a file: choose a directory")
    check_parents(out)


def check_numbers(args: TrainConfig) -> None:
    """The optimiser's numbers and the seed: finite and in range (a NaN
    learning rate or gamma trained, and saved, a NaN drafter (a zero rate
    keeps the starting weights, as --init-from runs may ask); a negative
    seed reached mx.random.seed as a traceback)."""
    for name, low, positive in (("learning_rate", 0.0, False), ("gamma", 0.0, True), ("weight_decay", 0.0, False),
                                ("grad_clip", 0.0, False), ("max_minutes", 0.0, True)):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > low if positive else value >= low)):
            raise TrainError(f"--{name.replace('_', '-')} must be a finite number {'above' if positive else 'of at least'} {low}, not {value}")
    if args.warmup is not None and args.warmup < 0:
        raise TrainError(f"--warmup must be at least 0, not {args.warmup}")
    if not 0 <= args.seed <= cli.MAX_SEED:
        raise TrainError(f"--seed must be 0 to {cli.MAX_SEED}, not {args.seed}")


def check_traffic_args(args: TrainConfig) -> None:
    """--from-traffic's own rules; the drafter's shape is --init-from's."""
    check_traffic_dir(args.from_traffic)
    if args.init_from is None or not (Path(args.init_from) / "config.json").is_file():
        raise TrainError("--from-traffic fine-tunes a drafter: pass its checkpoint directory as --init-from")
    if args.eval_data is not None:
        raise TrainError("--from-traffic holds out the most recent tenth of the traffic: drop --eval-data")
    if args.cache_dir is not None:
        raise TrainError("--cache-dir keeps the target outputs of fixed data, and recorded traffic grows: use --cache-target alone")
    if not 0 <= args.replay_share < 1:
        raise TrainError("--replay-share must be at least 0 and below 1")
    cfg = inherited_config(args)
    dcfg = cfg["dflash_config"]
    args.num_layers, args.block_size = cfg["num_hidden_layers"], cfg["block_size"]
    args.taps, args.mask_token_id = list(dcfg["target_layer_ids"]), dcfg["mask_token_id"]
    args.intermediate_size = cfg.get("intermediate_size")
    args.draft_vocab = len(dcfg["draft_vocab"]) if dcfg.get("draft_vocab") else None


def inherited_config(args: TrainConfig) -> dict:
    """The --init-from drafter's config: with --from-traffic, its shape,
    taps, mask token, block size and draft vocabulary are the run's."""
    try:
        cfg = json.loads((Path(args.init_from) / "config.json").read_text())
        cfg["dflash_config"]["target_layer_ids"]
    except (OSError, ValueError, KeyError, TypeError):
        raise TrainError(f"--init-from {args.init_from} holds no readable DFlash drafter config") from None
    return cfg


def traffic_data(args: TrainConfig, tokenizer, vocab: int):
    """--from-traffic: (training rows, their answer marks, held-out rows by
    learning curve: ``eval`` the traffic's, ``eval_replay`` --data's, the
    ids the target wrote in the training traffic, each row's chance of
    being drawn or None). Rows of exactly --seq-len: the traffic but its
    most recent tenth, packed, and --data's rows (repacked to --seq-len;
    :data:`REPLAY_HELD_OUT` of them held out), drawn --replay-share of the time."""
    train_records, held = split_held_out(read_traffic(args.from_traffic, vocab))
    rows, marks = pack(train_records, args.seq_len)
    n_new, weights = len(rows), None
    if not len(rows):
        n = sum(len(r.tokens) for r in train_records)
        raise TrainError(f"the recorded traffic holds {n} tokens to train on, less than one --seq-len {args.seq_len} row: record more or lower --seq-len")
    if args.data:
        old = read_data(args.data, tokenizer, vocab)
        old_marks = read_answer_mask(args, old)
        stream, flags = np.concatenate(old), np.ones(sum(len(d) for d in old), bool) if old_marks is None else old_marks
        n = len(stream) // args.seq_len
        if n < 2:
            raise TrainError(f"--data holds {n} --seq-len {args.seq_len} row: replay needs at least 2 (one held out)")
        old_rows, old_marks = stream[: n * args.seq_len].reshape(n, -1), flags[: n * args.seq_len].reshape(n, -1)
        order = np.random.default_rng([args.seed, 2]).permutation(n)
        held_old, pool = np.sort(order[: min(REPLAY_HELD_OUT, n // 2)]), order[min(REPLAY_HELD_OUT, n // 2) :]
        # As many rows as the run draws windows of them: a few rows replayed
        # over and over are memorised, not the drafter's skill kept.
        pick = np.sort(pool[: math.ceil(args.steps * args.batch_size * args.replay_share)])
        if len(pick):
            share = [(1 - args.replay_share) / len(rows)] * len(rows) + [args.replay_share / len(pick)] * len(pick)
            weights = np.array(share) / np.sum(share)
        rows, marks = np.concatenate([rows, old_rows[pick]]), np.concatenate([marks, old_marks[pick]])
    fit = [r for r in held if len(r.tokens) >= args.block_size + 2]
    if not fit:
        raise TrainError(f"no held-out conversation is longer than a block ({args.block_size + 2} tokens): record more")
    held_out = {"eval": ([r.tokens for r in fit], [r.answer for r in fit])}
    if args.data:
        held_out["eval_replay"] = (list(old_rows[held_old].astype(np.int32)), list(old_marks[held_old]))
    replay = f"; {len(rows) - n_new} rows of --data replayed at {args.replay_share}, {len(held_old)} held out" if args.data else ""
    print(f"traffic: {len(train_records)} conversations in {n_new} rows of {args.seq_len}, {len(fit)} most recent held out{replay}", file=sys.stderr)
    written = np.unique(np.concatenate([r.tokens[r.answer] for r in train_records]))
    return list(rows.astype(np.int32)), marks.reshape(-1), held_out, written, weights


def prepare(args: TrainConfig):
    """The target (with its adapter), the training windows and the held-out
    rows of each learning curve (see :data:`CURVES`); fills in the defaults
    that depend on them (taps, mask token, gamma, learning rate, warmup)."""
    from .loading import load
    from .targets import adapter_for
    from .targets.approximate import approximate
    from .targets.base import TargetError

    try:
        model, tokenizer = load(args.model)
    except ValueError as e:  # mlx-lm: unknown model type, bad config
        raise TrainError(f"cannot load target {args.model}: {e}") from None
    if args.target_dtype is not None:
        model.set_dtype(DTYPES[args.target_dtype])
    if args.approximate_target is None:  # a fine-tune's default on the CPU, where the target's layers allow it
        try:
            approximate(model)
            args.approximate_target = True
        except TargetError as e:
            print(f"the exact target: {e}", file=sys.stderr)
            args.approximate_target = False
    elif args.approximate_target:
        approximate(model)
    adapter = adapter_for(model)
    vocab = adapter.vocab_size
    n_target = adapter.num_layers
    if args.taps is None:
        args.taps = default_target_layer_ids(n_target, args.num_layers)
    bad = [t for t in args.taps if not 0 <= t < n_target]
    if bad:
        raise TrainError(f"--taps {bad} out of range: the target has layers 0..{n_target - 1}")
    if args.mask_token_id is None:
        args.mask_token_id = find_mask_token(tokenizer)
    if not 0 <= args.mask_token_id < vocab:
        raise TrainError(f"--mask-token-id {args.mask_token_id} is outside the target vocabulary (0..{vocab - 1})")
    args.gamma = args.gamma if args.gamma is not None else args.block_size / 2

    if args.draft_vocab is not None and args.draft_vocab > vocab:
        raise TrainError(f"--draft-vocab {args.draft_vocab} exceeds the target vocabulary ({vocab})")
    draft_ids, weights = None, None
    if args.from_traffic is not None:
        docs, answers, held_out, written, weights = traffic_data(args, tokenizer, vocab)
        if args.draft_vocab is not None:  # FR-Spec's vocabulary follows the data: the traffic's ids join it
            draft_ids = sorted(set(inherited_config(args)["dflash_config"]["draft_vocab"]) | set(written.tolist()))
            args.draft_vocab = len(draft_ids)
    else:
        docs = read_data(args.data, tokenizer, vocab)
        answers = read_answer_mask(args, docs)
        held_out = {"eval": read_eval(args)} if args.eval_data else {}
        if args.draft_vocab is not None:
            draft_ids = frequent_tokens(docs, args.draft_vocab, vocab, answers_by_doc(docs, answers))
    data = (*window_starts(docs, args.seq_len), weights)  # --from-traffic's rows are its windows, one each
    if not len(data[1]):
        longest = max((len(d) for d in docs), default=0)
        raise TrainError(
            f"the data holds no --seq-len {args.seq_len} window (longest document {longest} "
            f"tokens): add data or lower --seq-len (a block needs {args.block_size + 1})"
        )

    if args.cache_target and any(len(d) != args.seq_len for d in docs):
        raise TrainError(
            f"--cache-target needs data that is only 2-D .npy rows of exactly --seq-len "
            f"{args.seq_len} tokens (each window a whole row)"
        )
    return model, adapter, docs, data, answers, held_out, draft_ids


def read_answer_mask(args: TrainConfig, docs: List[np.ndarray]) -> Optional[np.ndarray]:
    """``--answer-mask`` as booleans over the flat data (None without one)."""
    if args.answer_mask is None:
        return None
    mask = np.load(args.answer_mask, allow_pickle=False)
    shape = np.load(args.data[0], mmap_mode="r").shape
    if mask.dtype != np.bool_ or mask.shape != shape:
        raise TrainError(
            f"--answer-mask must be booleans shaped like --data {tuple(shape)}, not {mask.dtype} {mask.shape}"
        )
    return mask.reshape(-1)


def restore(out: Path, run: dict, draft, optimizer, rng) -> dict:
    """Weights, optimizer and sampler state of the run saved in ``out``."""
    saved, arrays = read_state(out)
    check_resume(saved["run"], run)
    draft.load_weights([(k[6:], v) for k, v in arrays.items() if k.startswith("model.")], strict=True)
    optimizer.state = tree_unflatten([(k[10:], v) for k, v in arrays.items() if k.startswith("optimizer.")])
    rng.bit_generator.state = saved["rng"]
    print(f"resuming {out} at step {saved['step']}", file=sys.stderr)
    return saved


def new_drafter(args: TrainConfig, model, adapter, draft_ids: Optional[List[int]]):
    """``(config, drafter)`` the run starts from: the config for the target
    (with its draft vocabulary ``draft_ids``, see :func:`prepare`), the
    weights seeded, the target's last layers, or a checkpoint's."""
    config = draft_config_for_target(
        adapter.args,
        num_layers=args.num_layers,
        block_size=args.block_size,
        target_layer_ids=args.taps,
        mask_token_id=args.mask_token_id,
        intermediate_size=args.intermediate_size,
    )
    if draft_ids is not None:
        config["dflash_config"]["draft_vocab"] = draft_ids
    mx.random.seed(args.seed)  # drafter initialisation
    draft = DFlashDraftModel(DFlashConfig.from_hf(config))
    draft.bind(model)
    if args.init_from_target:
        init_from_target_layers(draft, adapter)
    if args.init_from is not None:
        init_weights(draft, Path(args.init_from))
    return config, draft


def new_optimizer(args: TrainConfig) -> optim.AdamW:
    """AdamW at the schedule's first rate; for a fine-tune (--from-traffic)
    with the bias correction MLX leaves out by default (see :data:`FINE_TUNE_LR`)."""
    return optim.AdamW(
        learning_rate=lr_at(0, args.steps, args.learning_rate, args.warmup), weight_decay=args.weight_decay,
        bias_correction=args.from_traffic is not None,
    )


class Batches:
    """A step's inputs to :func:`drafter_loss` (after the drafter) from
    sampled windows and anchors: the target's outputs, blocks, labels, mask."""

    def __init__(self, args: TrainConfig, adapter, target_outputs: TargetOutputs, vocab_ids: Optional[List[int]]):
        self.args, self.adapter, self.target_outputs, self.vocab_ids = args, adapter, target_outputs, vocab_ids
        self.n_slots = args.loss_slots or args.block_size - 1
        self.weights = slot_weights(args.block_size, args.gamma)[: self.n_slots]

    def __call__(self, starts: np.ndarray, windows: np.ndarray, anchors: mx.array) -> tuple:
        args, tokens = self.args, mx.array(windows)
        tap_states, greedy = self.target_outputs(starts, windows)
        blocks, positions = make_blocks(tokens, anchors, args.block_size, args.mask_token_id)
        labels = slot_labels(tokens, greedy, anchors, args.block_size)
        labels = draft_labels(labels[..., : self.n_slots], self.vocab_ids, self.adapter.vocab_size)
        return self.adapter.embed, tap_states, blocks, positions, context_mask(anchors, args.seq_len), labels, self.weights


def softmax_close_enough(args: TrainConfig, draft, batches: Batches, data, answers) -> bool:
    """``--approximate-softmax``'s default where it is left to the run:
    whether the approximate softmax's loss on a first batch (drawn apart
    from the run's batches) is within :data:`SOFTMAX_TOLERANCE` of the exact one's."""
    starts, windows, anchors = sample_batch(np.random.default_rng([args.seed, 3]), data, args, answers)
    inputs = batches(starts, windows, mx.array(anchors))
    exact, fast = (drafter_loss(draft, *inputs, fast=f)[0].item() for f in (False, True))
    close = abs(fast - exact) <= SOFTMAX_TOLERANCE * abs(exact)
    verdict = "on" if close else "off (--approximate-softmax takes it anyway)"
    print(f"approximate softmax {verdict}: a first batch's loss {fast:.6f}, exact {exact:.6f}", file=sys.stderr)
    return close


def expected_end(args: TrainConfig, steps_left: int, per_step: float, trained: float) -> str:
    """The clock time the run should end at (``HH:MM``): its steps left at
    ``per_step`` seconds, or ``--max-minutes`` after ``trained`` seconds if sooner."""
    left = steps_left * per_step
    if args.max_minutes is not None:
        left = max(0.0, min(left, 60 * args.max_minutes - trained))
    return time.strftime("%H:%M", time.localtime(time.time() + left))


def train(args: TrainConfig) -> dict:
    """Run (or, with ``resume``, continue) the training run ``args`` describes;
    returns its state (step, loss history, training seconds)."""
    check_args(args)
    model, adapter, docs, data, answers, held_out, draft_ids = prepare(args)
    config, draft = new_drafter(args, model, adapter, draft_ids)
    target_outputs = TargetOutputs(adapter, args, n_rows=len(docs), width=len(args.taps) * adapter.hidden_size, chance=data[2])
    batches = Batches(args, adapter, target_outputs, config["dflash_config"].get("draft_vocab"))
    if args.approximate_softmax is None:
        args.approximate_softmax = softmax_close_enough(args, draft, batches, data, answers)
    optimizer = new_optimizer(args)
    optimizer.init(draft.trainable_parameters())
    rng = np.random.default_rng(args.seed)
    out = Path(args.draft_model)
    run = run_config(args)
    state = {"step": 0, "history": [], "train_seconds": 0.0, "run": run}
    if args.resume:
        state = restore(out, run, draft, optimizer, rng)
    mx.eval(draft.parameters(), optimizer.state)
    value_and_grad = nn.value_and_grad(draft, drafter_loss)

    def step_fn(starts, windows, anchors):
        (loss, metrics), grads = value_and_grad(draft, *batches(starts, windows, anchors), args.approximate_softmax)
        grads, _ = optim.clip_grad_norm(grads, args.grad_clip)
        optimizer.update(draft, grads)
        return loss, metrics

    from tqdm import tqdm

    from .loading import load_draft

    bar = tqdm(initial=state["step"], total=args.steps, desc="drafter", unit="step")
    curves = learning_curves(args, held_out, docs, answers, adapter)

    def evaluate(drafter=draft):
        if not curves:
            return
        began = time.perf_counter()
        for key, curve in curves.items():
            state.setdefault(key, []).append(curve(drafter, state["step"]))
        state["eval_spent"] = state.get("eval_spent", 0.0) + time.perf_counter() - began
        state.setdefault("eval_seconds", []).append(round(state["train_seconds"] + time.perf_counter() - tic, 1))
        bar.write(curve_line(state, curves))

    def save():
        state["rng"] = rng.bit_generator.state
        write_checkpoint(out, config, draft, optimizer, state, DTYPES[args.dtype])

    tic = start = time.perf_counter()
    begun = state["step"]
    initial = draft if args.from_traffic is None else load_draft(args.init_from, model, dtype=mx.float32)
    if not state.get("eval"):  # where the curve starts: with --from-traffic, --init-from as it is (its vocabulary)
        evaluate(initial)
    elif args.from_traffic is not None:  # resumed: the traffic, so its held-out rows, may have grown since
        state["eval"][0] = curves["eval"](initial, 0)
    for step in range(state["step"], args.steps):
        optimizer.learning_rate = lr_at(step, args.steps, args.learning_rate, args.warmup)
        starts, windows, anchors = sample_batch(rng, data, args, answers)
        loss, (acc1, acc, tau) = step_fn(starts, windows, mx.array(anchors))
        mx.eval(loss, acc1, acc, tau, draft.parameters(), optimizer.state)
        record = [round(x.item(), 6) for x in (loss, acc1, acc, tau)]
        state["history"].append(record)
        state["step"] = step + 1
        trained = state["train_seconds"] + time.perf_counter() - tic
        end = expected_end(args, args.steps - state["step"], (time.perf_counter() - start) / (state["step"] - begun), trained)
        bar.set_postfix(loss=f"{record[0]:.3f}", acc1=f"{record[1]:.3f}", acc=f"{record[2]:.3f}", tau=f"{record[3]:.2f}", ends=end, refresh=False)
        bar.update()
        timed_out = out_of_time(args, trained)
        last = state["step"] == args.steps or timed_out
        if state["step"] % args.eval_every == 0 or last:
            evaluate()
        if state["step"] % args.save_every == 0 or last:
            state["train_seconds"] += time.perf_counter() - tic
            tic = time.perf_counter()
            save()
        if timed_out:
            break
    bar.close()
    return state


def learning_curves(args: TrainConfig, held_out: dict, docs, answers, adapter) -> dict:
    """The run's learning curves by state key: each of ``held_out``'s
    (:func:`prepare`) and, with --eval-train-rows, a sample of the training
    rows', where the gap to the held-out rows says whether data or steps are short."""
    curves = {key: HeldOut(*rows, adapter, args) for key, rows in held_out.items()}
    if curves and args.eval_train_rows:
        curves["eval_train"] = HeldOut(*training_sample(args, docs, answers), adapter, args)
    return curves


def curve_line(state: dict, curves: dict) -> str:
    """The learning curves' latest point, as the progress bar prints it."""
    step, per_cycle, cycles = state["eval"][-1]
    line = f"step {step}: {per_cycle:.3f} tokens per cycle on the held-out rows ({cycles} cycles)"
    for key in [k for k in curves if k != "eval"]:
        line += f", {state[key][-1][1]:.3f} on {len(curves[key].rows)} {CURVES[key]}"
    return line


def out_of_time(args: TrainConfig, seconds: float) -> bool:
    """Whether ``--max-minutes`` of training are spent."""
    return args.max_minutes is not None and seconds >= 60 * args.max_minutes


def adapt(args: TrainConfig) -> dict:
    """``--from-traffic``: train beside ``--draft-model``, then write it only
    if its held-out tokens per cycle beat ``--init-from``'s (a drafter
    changes the speed, never the text, so only a better one is worth a swap)
    and, with replay, it keeps their share on the held-out replay rows
    (:func:`~dflash_mlx.traffic.refusal`). Returns the scores before and
    after and whether it was written."""
    out = Path(args.draft_model)
    check_out(out)
    if out.exists() and any(out.iterdir()):
        raise TrainError(f"{out} exists and is not empty: choose a new --draft-model")
    run = dataclasses.replace(args, draft_model=str(out.with_name(out.name + ADAPTING)))
    state = train(run)
    (_, before, cycles), (step, after, _) = state["eval"][0], state["eval"][-1]
    per_step = (state["train_seconds"] - state.get("eval_spent", 0.0)) / max(1, step)
    result = {
        "init_from": str(Path(args.init_from).resolve()), "before": before, "after": after, "steps": step,
        "held_out_cycles": cycles, "train_seconds": round(state["train_seconds"], 1), "seconds_per_step": round(per_step, 3),
        "curve": [[s, tpc, sec] for (s, tpc, _), sec in zip(state["eval"], state["eval_seconds"])],
        "learning_rate": run.learning_rate, "warmup": run.warmup,
    }
    print(f"held-out tokens per cycle: {before:.3f} with {args.init_from}, {after:.3f} adapted ({step} steps, {per_step:.2f} s a step)")
    if state.get("eval_replay"):
        (_, old, old_cycles), (_, kept, _) = state["eval_replay"][0], state["eval_replay"][-1]
        result["replay"] = {"before": old, "after": kept, "cycles": old_cycles, "curve": [r[:2] for r in state["eval_replay"]]}
        print(f"held-out replay rows (what it may forget): {old:.3f} with {args.init_from}, {kept:.3f} adapted ({kept / old:.3f}x)")
    why = refusal(result)
    result["written"] = why is None
    if why is None:
        publish(Path(run.draft_model), out, result)
        print(f"adapted drafter: {out}")
    else:
        print(f"the adapted drafter is refused: {why}; {out} not written, keep using {args.init_from}")
    shutil.rmtree(run.draft_model, ignore_errors=True)
    return result


def publish(run_dir: Path, out: Path, result: dict) -> None:
    """The run's drafter (weights and config, no training state) and its
    scores into ``out``, all at once."""
    from .convert import Staging

    staging = Staging(out, force=True)
    try:
        staging.path.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(run_dir / name, staging.path / name)
        (staging.path / ADAPT_RESULT).write_text(json.dumps(result, indent=1) + "\n")
        staging.commit()
    finally:
        staging.discard()


def parse_taps(text: Optional[str]) -> Optional[List[int]]:
    """``--taps 1,2,4`` -> ``[1, 2, 4]``."""
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise TrainError(f"--taps must be a comma list of layer indices, not {text!r}") from None


def config_of(argv) -> TrainConfig:
    """``mlx-dflash train``'s command line as the run's config (what a
    server's adaptation rounds are also checked with)."""
    args = vars(setup_arg_parser().parse_args(argv))
    args["taps"] = parse_taps(args["taps"])
    return TrainConfig(**args)


def main(argv=None) -> int:
    config = config_of(argv)
    try:
        if config.from_traffic is not None:
            adapt(config)
            return 0
        state = train(config)
    except KeyboardInterrupt:
        where = str(Path(config.draft_model)) + (ADAPTING if config.from_traffic is not None else "")  # see adapt()
        print(f"\ninterrupted; the last checkpoint in {where} resumes with --resume", file=sys.stderr)
        return 130
    hist = state["history"]
    tail = np.mean([h[0] for h in hist[-20:]]) if hist else float("nan")
    summary = f"trained {state['step']} steps in {state['train_seconds']:.0f}s; loss (last 20) {tail:.4f}"
    print(f"{summary}; checkpoint {config.draft_model}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
