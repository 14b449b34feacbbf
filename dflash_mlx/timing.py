"""Timing helpers for ``mlx-dflash bench`` and the examples, and the timing
of drafter parts.

Kept out of the model files: a model module defines the model, the benchmark
decides what to time.
"""

import statistics
import time
from typing import Callable, Dict, Optional, Sequence

import mlx.core as mx

from .models.dflash import masked_block


def seconds_per_call(fn: Callable, iters: int, warmup: int) -> float:
    """Mean wall time of ``fn`` with its result evaluated, after ``warmup`` calls."""
    for _ in range(warmup):
        mx.eval(fn())
    tic = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - tic) / iters


def median_ms(fn: Callable, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` calls, after ``warmup``
    (``fn`` evaluates what it times)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(samples)


def conv_selector_share(
    draft,
    *,
    block_size: Optional[int] = None,
    context_len: int = 256,
    iters: int = 20,
    warmup: int = 3,
    implementations: Optional[Sequence[str]] = None,
    seed: int = 0,
) -> Dict[str, Dict[str, float]]:
    """Time a DFlash2 drafter's convs + selector against its whole greedy ``propose``.

    ``draft`` must be bound to its target. A context of ``context_len``
    random tap states is injected once, then each timed call drafts one block
    (``block_size``, default the trained one) with no new context, like a
    steady-state cycle. Per implementation (default "ops" and "compiled",
    plus "auto" when Metal is available; the drafter's own
    ``implementation`` is restored afterwards) returns seconds per call:
    ``draft_s`` (the whole propose), ``conv_s`` (every layer's two convs,
    prepare + finish incl. the coefficient projections, as one graph),
    ``selector_s`` (top-K + score tables + walk; the LM head, which DFlash1
    pays too, excluded) and ``share = (conv_s + selector_s) / draft_s``.
    """
    cfg = draft.config
    L = block_size or draft.block_size
    dtype = draft.norm.weight.dtype
    mx.random.seed(seed)
    cache = draft.make_cache()
    block = masked_block(draft, 0, L)
    context = mx.random.normal((1, context_len, cfg.fc_input_size)).astype(dtype)
    mx.eval(draft(block, context, cache))
    no_context = mx.zeros((1, 0, cfg.fc_input_size), dtype=dtype)
    x = mx.random.normal((1, L, cfg.hidden_size)).astype(dtype)
    hidden = draft.norm(mx.random.normal((1, L - 1, cfg.hidden_size)).astype(dtype))
    logits = draft.compute_logits(hidden)
    anchor = block[:, 0]
    mx.eval(x, hidden, logits)

    def convs():
        h = x
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                y, coef = conv.prepare(h)
                h = conv.finish(y, coef)
        return h

    def selector():
        w = draft.candidate_selector(anchor, hidden, logits)
        return w.tokens, w.rows

    if implementations is None:
        implementations = ("ops", "compiled") + (("auto",) if mx.metal.is_available() else ())
    result, saved = {}, draft.implementation
    try:
        for name in implementations:
            draft.implementation = name
            t = {
                "draft_s": seconds_per_call(lambda: draft.propose(block, no_context, cache), iters, warmup),
                "conv_s": seconds_per_call(convs, iters, warmup),
                "selector_s": seconds_per_call(selector, iters, warmup),
            }
            t["share"] = (t["conv_s"] + t["selector_s"]) / t["draft_s"]
            result[name] = t
    finally:
        draft.implementation = saved
    return result
