"""Prefill: the target runs a prompt into a request's prompt cache, a
chunk at a time as mlx-lm's ``generate_step`` does, or several short
prompts together as one batched forward, as mlx-lm's batch generator does.
The tap states go to the cache for the drafter; the prompt's last token
runs alone and its logits give the first token (mlx-lm's order).
"""

from typing import List

import mlx.core as mx

from .cache import PromptCache
from .defaults import DEFAULT_PREFILL_STEP_SIZE
from .targets.rows import BatchCache


def feed(target, cache: PromptCache, tokens: List[int], step: int = DEFAULT_PREFILL_STEP_SIZE, progress=None) -> None:
    """Run the target over the cache's pending tokens and ``tokens``, all but
    the last, which stays pending (so the cache can stop at any boundary and
    still produce that position's logits later).

    Chunks of ``step`` tokens, as mlx-lm's ``generate_step`` prefills; the
    tap states go to ``cache.target_hidden`` for the drafter. The cache
    holds what the target ran after every chunk, so an interruption between
    chunks (``progress`` raising KeyboardInterrupt, say) leaves it usable.
    """
    tokens = list(tokens)
    if cache.pending and tokens and cache.target.kv is not None:
        # The last turn's last token runs on its own, as mlx-lm's decode ran it before the next turn's prompt:
        # with mlx-lm's bounded or quantized caches (``max_kv_size``, ``kv_bits``) what a forward computes
        # depends on where its chunk starts, so the new prompt's chunks must start where mlx-lm's do.
        _, taps = target.forward(mx.array([cache.pending]), cache.target, last_logits_only=True, record=False)
        mx.eval(taps, [c.state for c in cache.target])
        cache.commit([], taps, pending=())
    todo, held = cache.pending + tokens, len(cache.pending)
    body = todo[:-1]
    for start in range(0, len(body), step):
        chunk = body[start : start + step]
        _, taps = target.forward(mx.array([chunk]), cache.target, last_logits_only=True, record=False)
        mx.eval(taps, [c.state for c in cache.target])
        ran = start + len(chunk) - held  # of ``tokens``
        cache.commit(tokens[max(0, ran - len(chunk)) : max(0, ran)], taps, pending=())
        if progress is not None:
            progress(start + len(chunk), len(todo))
    cache.commit(tokens[max(0, len(body) - held) :], pending=todo[-1:])


def prefill(target, cache: PromptCache, tokens: List[int], step: int, progress=None) -> mx.array:
    """Feed ``tokens`` and every pending token to the target; the last one
    runs alone (mlx-lm's order). Returns its logits ``[1, V]``."""
    feed(target, cache, tokens, step, progress)
    logits, taps = target.forward(mx.array([cache.pending]), cache.target, last_logits_only=True, record=False)
    cache.commit([], taps, pending=())
    return logits[:, -1]


def prefill_together(target, caches: List[PromptCache], prompts: List[List[int]]) -> mx.array:
    """Prefill several whole prompts together: every row's tokens but its
    last (after its pending ones), right-padded to the longest (in pieces
    of the target's ``longest_ragged``), each row then keeping only its own
    (no real token sees the padding); then every row's last token, whose
    logits ``[B, V]`` are returned (mlx-lm's order). Each cache ends with its
    own target cache again."""
    runs = [c.pending + p for c, p in zip(caches, prompts)]
    batch = BatchCache.join([c.target for c in caches], [c.ran for c in caches])
    body = [run[:-1] for run in runs]
    longest = max(map(len, body))
    piece = target.longest_ragged or max(1, longest)
    for start in range(0, longest, piece):
        part = [b[start : start + piece] for b in body]
        width = max(map(len, part))
        _, taps = target.forward(mx.array([p + [0] * (width - len(p)) for p in part], dtype=mx.int32), batch, last_logits_only=True)
        target.keep(batch, [len(p) for p in part])
        for c, (b, p) in zip(caches, enumerate(part)):
            if p:
                c.commit([], taps[b : b + 1, : len(p)])
    logits, taps = target.forward(mx.array([run[-1:] for run in runs], dtype=mx.int32), batch, last_logits_only=True)
    target.keep(batch, [1] * len(caches))
    for b, (c, p) in enumerate(zip(caches, prompts)):
        c.commit(p, taps[b : b + 1], pending=())
        c.target = batch.row(b)
    return logits[:, -1]
