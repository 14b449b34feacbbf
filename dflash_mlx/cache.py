"""The prompt cache: everything a conversation keeps between turns.

mlx-lm's prompt cache is the target's per-layer caches; after
``stream_generate`` it holds the prompt and every token it yielded, the last
one (and eos) included, so the next turn continues right after them. DFlash
keeps more, and :class:`PromptCache` holds all of it in one object:

- ``target``: the target's :class:`~dflash_mlx.targets.base.TargetCache`
  (the mlx-lm caches plus the rollback record, ``undo``);
- ``draft``: the drafter's context cache (K/V of the injected target
  states);
- ``pending``: tokens that belong to the sequence but that the target has
  not run yet (the loop feeds the last committed token only with the next
  verify);
- ``target_hidden``: the target's tap states for positions the drafter has
  not injected yet (the drafter's context lags the target);
- ``tokens``: the token ids the cache holds, pending ones included (the
  key a server stores it under).

It follows mlx-lm's cache protocol where it fits (``state``, ``nbytes``,
``is_trimmable``/``trim``), so mlx-lm's ``LRUPromptCache`` can hold it as a
one-element cache list, and :func:`save_prompt_cache` /
:func:`load_prompt_cache` mirror mlx-lm's functions of the same names.
"""

import json
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as lm_cache

from .errors import ArgumentError
from .targets.base import TargetCache


def bound_target(model, draft):
    """The drafter's target adapter for ``model`` (binding keeps an existing
    binding to the same model)."""
    return draft.bind(model).target


class PromptCache:
    """A DFlash conversation's state (see the module docstring)."""

    def __init__(self, target: TargetCache, draft: List[Any]):
        self.target = target
        self.draft = draft
        self.pending: List[int] = []
        self.hidden_chunks: List[mx.array] = []
        self.tokens: List[int] = []

    @property
    def offset(self) -> int:
        """Tokens in the sequence (mlx-lm's ``offset``): prompt and output so far."""
        return len(self.tokens)

    def add_hidden(self, target_hidden: mx.array) -> None:
        """Append tap states of positions the target just ran.

        Kept as chunks and joined once, when read: plain decoding adds one
        row per token for many tokens before the drafter takes them, and
        joining at every step would copy the whole backlog each time.
        """
        self.hidden_chunks.append(target_hidden)

    @property
    def target_hidden(self) -> Optional[mx.array]:
        """Tap states ``[1, n, taps * hidden]`` the drafter has not injected (None: none)."""
        if len(self.hidden_chunks) > 1:
            self.hidden_chunks = [mx.concatenate(self.hidden_chunks, axis=1)]
        return self.hidden_chunks[0] if self.hidden_chunks else None

    @target_hidden.setter
    def target_hidden(self, value: Optional[mx.array]) -> None:
        self.hidden_chunks = [] if value is None else [value]

    @property
    def state(self):
        return [
            [c.state for c in self.target],
            [c.state for c in self.draft],
            self.target_hidden,
        ]

    @property
    def nbytes(self) -> int:
        arrays = tree_flatten(self.state)
        return sum(a.nbytes for _, a in arrays if isinstance(a, mx.array))

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.target) and all(
            c.is_trimmable() for c in self.draft
        )

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens of the sequence; returns how many went.

        Pending tokens go first; then the target's caches and, where the
        drafter had injected the dropped positions, its context.
        """
        n = max(0, min(n, len(self.tokens)))
        keep = len(self.tokens) - n
        seen = len(self.tokens) - len(self.pending)  # positions the target ran
        if keep >= seen:
            self.pending = self.pending[: keep - seen]
        else:
            for c in self.target:
                c.trim(seen - keep)
            lag = 0 if self.target_hidden is None else self.target_hidden.shape[1]
            injected = seen - lag
            if keep >= injected:
                self.target_hidden = self.target_hidden[:, : keep - injected] if keep > injected else None
            else:
                for c in self.draft:
                    c.trim(injected - keep)
                self.target_hidden = None
            self.pending = []
        del self.tokens[keep:]
        return n


def make_prompt_cache(model, draft) -> PromptCache:
    """An empty prompt cache for ``model`` decoded with ``draft`` (mlx-lm's
    ``make_prompt_cache``, for a target and its drafter)."""
    return PromptCache(bound_target(model, draft).make_cache(), draft.make_cache())


def save_prompt_cache(file_name: str, cache: PromptCache, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``cache`` to a ``.safetensors`` file (mlx-lm's
    ``save_prompt_cache``, with the drafter's side and pending tokens too)."""
    leaves = tree_flatten(
        {"state": cache.state, "meta": [c.meta_state for c in cache.draft]}
    )
    arrays = {k: v for k, v in leaves if isinstance(v, mx.array)}
    info = {
        "target_classes": [type(c).__name__ for c in cache.target],
        "scalars": {k: v for k, v in leaves if not isinstance(v, mx.array)},
        "pending": cache.pending,
        "tokens": cache.tokens,
    }
    mx.save_safetensors(file_name, arrays, {**(metadata or {}), "dflash_mlx": json.dumps(info)})


def load_prompt_cache(file_name: str, draft, return_metadata: bool = False):
    """Read a cache written by :func:`save_prompt_cache`; ``draft`` (the
    drafter the cache was made with) builds the drafter's side."""
    arrays, metadata = mx.load(file_name, return_metadata=True)
    if "dflash_mlx" not in metadata:
        raise ArgumentError(f"{file_name} is not a dflash_mlx prompt cache (save it with save_prompt_cache)")
    info = json.loads(metadata.pop("dflash_mlx"))
    leaves = sorted({**arrays, **info["scalars"]}.items(), key=lambda kv: [int(p) if p.isdigit() else p for p in kv[0].split(".")])
    tree = tree_unflatten(leaves)
    target_states, draft_states, target_hidden = tree["state"]
    target = TargetCache(
        getattr(lm_cache, name).from_state(s) for name, s in zip(info["target_classes"], target_states)
    )
    draft_cache = draft.make_cache()
    if len(draft_cache) != len(draft_states):
        raise ArgumentError(
            f"{file_name} holds a drafter context of {len(draft_states)} layers, but this "
            f"drafter has {len(draft_cache)}: load it with the drafter it was made with"
        )
    for c, s, meta in zip(draft_cache, draft_states, tree["meta"]):
        c.state, c.meta_state = s, meta
    cache = PromptCache(target, draft_cache)
    cache.pending, cache.tokens, cache.target_hidden = info["pending"], info["tokens"], target_hidden
    return (cache, metadata) if return_metadata else cache
