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
  not injected yet (the drafter's context lags the target), less those no
  drafter layer would read (``hole``, see :meth:`PromptCache.add_hidden`);
- ``tokens``: the token ids the cache holds, pending ones included (the
  key a server stores it under);
- ``copy_index``: the :class:`~dflash_mlx.copy_source.CopyIndex` of those
  tokens, kept up to them by :func:`~dflash_mlx.copy_source.index_for`
  (None until first used; not saved, rebuilt from the tokens);
- ``draft_window``/``draft_sink``: the draft window the drafter's context
  was made with (``draft_window`` None: the whole context).

It follows mlx-lm's cache protocol where it fits (``state``, ``nbytes``,
``is_trimmable``/``trim``), so mlx-lm's ``LRUPromptCache`` can hold it as a
one-element cache list, and :func:`save_prompt_cache` /
:func:`load_prompt_cache` mirror mlx-lm's functions of the same names.
"""

import hashlib
import json
import os
import shutil
import struct
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as lm_cache

from .defaults import DEFAULT_DRAFT_SINK, DEFAULT_DRAFT_WINDOW
from .errors import ArgumentError
from .models.dflash import ContextCache
from .targets.base import TargetCache
from .targets.kv import KVSettings


def bound_target(model, draft):
    """The drafter's target adapter for ``model`` (binding keeps an existing
    binding to the same model)."""
    return draft.bind(model).target


# Pending tap-state chunks of one size class kept apart before they are joined (see PromptCache.add_hidden).
JOIN_CHUNKS = 32


def rows_of(chunks: List[mx.array], start: int, stop: int) -> List[mx.array]:
    """Rows ``start..stop-1`` (axis 1) of the chunks taken as one array, as
    chunks. A slice shares its chunk's memory, so a part of half a chunk or
    less is copied: the sink's rows of a prompt's first prefill chunk would
    otherwise keep the whole chunk's tap states (thousands of rows) alive for
    the conversation. The oldest chunk of a sliding window, cut a few rows
    at a time, stays a slice until its last row goes."""
    out, at = [], 0
    for c in chunks:
        n = c.shape[1]
        a, b = max(start - at, 0), min(stop - at, n)
        if a < b:
            out.append(c if (a, b) == (0, n) else c[:, a:b] if 2 * (b - a) > n else mx.contiguous(c[:, a:b]))
        at += n
    return out


class PromptCache:
    """A DFlash conversation's state (see the module docstring)."""

    def __init__(self, target: TargetCache, draft: List[Any], draft_window: Optional[int] = None, draft_sink: int = 0):
        self.target = target
        self.draft = draft
        self.draft_window, self.draft_sink = draft_window, draft_sink
        self.pending: List[int] = []
        self.hidden_chunks: List[mx.array] = []
        self.added = 0  # tap chunks added (see add_hidden)
        self.hole: Optional[Tuple[int, int]] = None
        self.tokens: List[int] = []
        self.copy_index = None

    def commit(self, tokens: Sequence[int], taps: Optional[mx.array] = None, pending: Optional[Sequence[int]] = None) -> None:
        """``tokens`` join the sequence; ``taps``: the tap states of the
        positions the target just ran (for the drafter); ``pending``: the
        sequence's tokens the target has not run yet (None: as they were).
        The one place a prompt cache's sequence moves on."""
        self.tokens.extend(tokens)
        if taps is not None:
            self.add_hidden(taps)
        if pending is not None:
            self.pending = list(pending)

    @property
    def offset(self) -> int:
        """Tokens in the sequence (mlx-lm's ``offset``): prompt and output so far."""
        return len(self.tokens)

    @property
    def ran(self) -> int:
        """Positions the target has run: the sequence less its pending tokens."""
        return len(self.tokens) - len(self.pending)

    def context_bound(self) -> Tuple[int, Optional[int]]:
        """(first, last): a drafter layer may still read the first ``first``
        context positions and the last ``last``; ``last`` None: any."""
        if not self.draft or not all(isinstance(c, ContextCache) for c in self.draft):
            return 0, None
        if any(c.window is None for c in self.draft):
            return 0, None
        # at least one row: the drafter's forward takes the newest context
        return max(c.sink for c in self.draft), max(1, max(c.window for c in self.draft))

    def lag_rows(self) -> int:
        return sum(c.shape[1] for c in self.hidden_chunks)

    def add_hidden(self, target_hidden: mx.array) -> None:
        """Append tap states of positions the target just ran, and drop those
        no drafter layer can read any more (outside every layer's sink and
        window: new positions only push them further out); the dropped
        positions are the ``hole``, which the drafter's context caches skip.

        Kept as chunks and joined when read: plain decoding adds one row
        per token for many tokens before the drafter takes them, and joining
        at every step would copy the whole backlog each time. A plain step
        should cost the target's forward and little more, so one-row chunks
        are handled ``JOIN_CHUNKS`` at a time: only then are the unreadable
        rows cut (fewer than ``JOIN_CHUNKS`` of them wait in between; the
        drafter never reads them, and a read, a saved state or the end of a
        generation cuts them first) and the newest chunks joined by size
        class, as a logarithmic merge does: a run of ``JOIN_CHUNKS`` or more
        chunks of one class (rows below ``JOIN_CHUNKS``, below its square,
        ...) becomes one chunk of the next. A row is then copied once per
        class it climbs, not at every join (joining the whole backlog each
        time made a plain step slower the longer the generation), and the
        chunks are evaluated, so that no lazy graph grows with them.
        """
        self.hidden_chunks.append(target_hidden)
        self.added += 1
        if target_hidden.shape[1] > 1 or self.added % JOIN_CHUNKS == 0:
            self.drop_unreadable()
            self.join_newest()
            mx.async_eval(self.hidden_chunks)

    def join_newest(self) -> None:
        """Join the newest run of chunks of one size class while it is
        ``JOIN_CHUNKS`` long or more (see :meth:`add_hidden`)."""

        def size_class(chunk) -> int:
            rows, k = chunk.shape[1], 0
            while rows >= JOIN_CHUNKS:
                rows, k = rows // JOIN_CHUNKS, k + 1
            return k

        chunks = self.hidden_chunks
        while chunks:
            last = size_class(chunks[-1])
            run = next((i for i, c in enumerate(reversed(chunks)) if size_class(c) != last), len(chunks))
            if run < JOIN_CHUNKS:
                break
            chunks[-run:] = [mx.concatenate(chunks[-run:], axis=1)]

    def unlink_draft(self) -> None:
        """Its drafter context back from the buffers a batch drafted it in
        (:class:`~dflash_mlx.models.dflash.ContextRows`)."""
        for c in self.draft:
            if isinstance(c, ContextCache):
                c.unlink()

    def drop_unreadable(self) -> None:
        """Drop the pending tap states outside every drafter layer's sink and window (see :meth:`add_hidden`)."""
        sink, window = self.context_bound()
        if window is None:
            return
        injected = self.draft[0].offset
        h0, h1 = self.hole or (injected, injected)
        head = h0 - injected  # rows before the hole
        last = h1 + self.lag_rows() - head  # one past the newest position
        first = max(h1, sink)  # the oldest position that may go
        cut = last - window
        if cut <= first:
            return
        rows = self.lag_rows()
        self.hidden_chunks = rows_of(self.hidden_chunks, 0, head + first - h1) + rows_of(
            self.hidden_chunks, head + cut - h1, rows
        )
        self.set_hole((h0 if self.hole else first, cut))

    def set_hole(self, hole: Optional[Tuple[int, int]]) -> None:
        """Record the hole here and in the drafter's context caches, which skip it."""
        self.hole = hole
        for c in self.draft:
            if isinstance(c, ContextCache):
                c.skipped = hole

    @property
    def target_hidden(self) -> Optional[mx.array]:
        """Tap states ``[1, n, taps * hidden]`` the drafter has not injected (None: none)."""
        self.drop_unreadable()
        if len(self.hidden_chunks) > 1:
            self.hidden_chunks = [mx.concatenate(self.hidden_chunks, axis=1)]
        return self.hidden_chunks[0] if self.hidden_chunks else None

    @target_hidden.setter
    def target_hidden(self, value: Optional[mx.array]) -> None:
        """Replace the pending tap states (None: the drafter took them all)."""
        self.hidden_chunks = [] if value is None else [value]
        self.set_hole(None)

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
        drafter had injected the dropped positions, its context. Tap states
        dropped before (the hole) or rows a windowed drafter evicted are not
        recovered: its context then lacks them until newer positions replace
        them (a weaker draft, the same output).
        """
        n = max(0, min(n, len(self.tokens)))
        keep = len(self.tokens) - n
        seen = self.ran
        if keep >= seen:
            self.pending = self.pending[: keep - seen]
        else:
            for c in self.target:
                c.trim(seen - keep)
            h0, h1 = self.hole or (seen, seen)
            injected = seen - self.lag_rows() - (h1 - h0)
            if keep >= injected:
                rows = min(keep, h0) - injected + max(0, keep - h1)  # lag rows before keep
                self.hidden_chunks = rows_of(self.hidden_chunks, 0, rows)
                self.set_hole((h0, min(h1, keep)) if self.hole and keep > h0 else None)
            else:
                for c in self.draft:
                    c.trim(injected - keep)
                self.hidden_chunks = []
                self.set_hole(None)
            self.pending = []
        del self.tokens[keep:]
        if self.copy_index is not None:
            self.copy_index.truncate(keep)
        return n


def check_draft_window(draft_window: Optional[int], draft_sink: Optional[int]) -> Tuple[Optional[int], int]:
    """``(window, sink)`` checked and normalised, as a :class:`PromptCache`
    holds them: None takes the default (``DEFAULT_DRAFT_WINDOW``,
    ``DEFAULT_DRAFT_SINK``); a window of 0 is the whole context, ``(None,
    0)``: the drafter reads every context position, a sink included."""
    draft_window = DEFAULT_DRAFT_WINDOW if draft_window is None else draft_window
    draft_sink = DEFAULT_DRAFT_SINK if draft_sink is None else draft_sink
    if isinstance(draft_window, bool) or not isinstance(draft_window, int) or draft_window < 0:
        raise ArgumentError(
            f"draft_window must be a whole number of at least 0 (0: the whole context), not {draft_window!r}"
        )
    if isinstance(draft_sink, bool) or not isinstance(draft_sink, int) or draft_sink < 0:
        raise ArgumentError(f"draft_sink must be a whole number of at least 0, not {draft_sink!r}")
    return (None, 0) if draft_window == 0 else (draft_window, draft_sink)


def make_prompt_cache(
    model, draft, draft_window: Optional[int] = None, draft_sink: Optional[int] = None, *,
    kv_bits: Optional[int] = None, kv_group_size: Optional[int] = None,
    quantized_kv_start: Optional[int] = None, max_kv_size: Optional[int] = None,
) -> PromptCache:
    """An empty prompt cache for ``model`` decoded with ``draft`` (mlx-lm's
    ``make_prompt_cache``, for a target and its drafter).

    ``draft_window`` W and ``draft_sink`` S set the draft window: the
    drafter's full-attention layers read only the first S and the last W
    context positions, and nothing else of the context is projected or kept
    (None: ``DEFAULT_DRAFT_WINDOW`` and ``DEFAULT_DRAFT_SINK``; a window of
    0: the whole context). Output is the same whatever the window: the
    target verifies every token.

    ``kv_bits``, ``kv_group_size``, ``quantized_kv_start`` and
    ``max_kv_size`` are mlx-lm's ``generate_step`` cache settings (None
    each: mlx-lm's default); the target's caches follow them as mlx-lm's
    decode does (see :mod:`dflash_mlx.targets.kv`).
    """
    draft_window, draft_sink = check_draft_window(draft_window, draft_sink)
    kv = KVSettings.of(kv_bits, kv_group_size, quantized_kv_start, max_kv_size)
    draft_cache = draft.make_cache() if draft_window is None else draft.make_cache(draft_window, draft_sink)
    return PromptCache(bound_target(model, draft).make_cache(kv), draft_cache, draft_window, draft_sink)


def prompt_cache_for(
    model, draft, prompt_cache: Optional[PromptCache], draft_window=None, draft_sink=None, **kv_settings
) -> PromptCache:
    """A generation's prompt cache: ``prompt_cache``, whose draft window and
    KV cache settings (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``,
    ``max_kv_size``) must be the ones asked for (None: not asked), or a new
    one with them (None: the defaults)."""
    if prompt_cache is None:
        return make_prompt_cache(model, draft, draft_window, draft_sink, **kv_settings)
    check_kv_settings(prompt_cache, kv_settings)
    have = (prompt_cache.draft_window, prompt_cache.draft_sink)
    if draft_window is None and draft_sink is None:
        return prompt_cache
    asked = check_draft_window(
        (have[0] or 0) if draft_window is None else draft_window, have[1] if draft_sink is None else draft_sink
    )
    if asked != have:
        raise ArgumentError(
            f"the prompt cache was made with draft_window={have[0] or 0}, draft_sink={have[1]}, but this call asks "
            f"for draft_window={asked[0] or 0}, draft_sink={asked[1]}: make the cache with make_prompt_cache(model, draft, "
            "draft_window=..., draft_sink=...) and leave them out here, or pass the cache's"
        )
    return prompt_cache


def check_kv_settings(prompt_cache: PromptCache, asked: Dict[str, Optional[int]]) -> None:
    """Refuse KV cache settings (mlx-lm's keywords, None: not asked) other
    than those ``prompt_cache`` was made with: its caches are already made."""
    asked = {k: v for k, v in asked.items() if v is not None}
    if not asked:
        return
    have = prompt_cache.target.kv or KVSettings()
    names = dict(kv_bits="bits", kv_group_size="group_size", quantized_kv_start="quantized_start", max_kv_size="max_size")
    unknown = set(asked) - set(names)
    if unknown:
        raise ArgumentError(f"unknown KV cache setting {sorted(unknown)[0]!r}: the settings are {', '.join(names)}")
    differ = {k: v for k, v in asked.items() if getattr(have, names[k]) != v}
    if differ:
        k, v = next(iter(differ.items()))
        raise ArgumentError(
            f"the prompt cache was made with {k}={getattr(have, names[k])}, but this call asks for {k}={v}: pass the "
            f"setting to make_prompt_cache(model, draft, {k}=...) and leave it out here, or pass the cache's"
        )


# The version of the prompt cache file layout (save_prompt_cache): a file of
# another version is refused, not misread.
CACHE_FORMAT = "1"
CHUNK = 1 << 22  # bytes hashed or copied at a time


def cache_contents(cache: PromptCache, metadata: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, mx.array], Dict[str, str]]:
    """The arrays and metadata :func:`save_prompt_cache` writes for ``cache``,
    evaluated and contiguous: another thread can write them to disk while
    this one goes on generating (they are never changed in place)."""
    leaves = tree_flatten({"state": cache.state, "meta": [c.meta_state for c in cache.draft]})
    arrays = {k: mx.contiguous(v) for k, v in leaves if isinstance(v, mx.array)}
    mx.eval(arrays)
    info = {
        "target_classes": [type(c).__name__ for c in cache.target],
        "scalars": {k: v for k, v in leaves if not isinstance(v, mx.array)},
        "pending": cache.pending,
        "tokens": cache.tokens,
        "draft_window": [cache.draft_window, cache.draft_sink],
        "hole": cache.hole,
        "trimmable": cache.is_trimmable(),
        "kv": None if cache.target.kv is None else cache.target.kv.as_json(),
    }
    return arrays, {**(metadata or {}), "dflash_mlx": json.dumps(info), "dflash_mlx_format": CACHE_FORMAT}


def safetensors_header(f) -> Tuple[dict, int]:
    """The JSON header of an open safetensors file and where its data starts
    (https://huggingface.co/docs/safetensors: a little-endian u64 length, then the JSON)."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > 1 << 30:
        raise ValueError(f"a header of {n} bytes")
    raw = f.read(n)
    if len(raw) < n:
        raise ValueError("the header is cut short")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + n


def file_digest(header: dict, f, length: int) -> str:
    """SHA-256 of a cache file: its header but the checksum (as canonical
    JSON) and the next ``length`` bytes of ``f``, its tensor data (fewer:
    the file is cut short)."""
    head = {k: v for k, v in header.items() if k != "__metadata__"}
    head["__metadata__"] = {k: v for k, v in (header.get("__metadata__") or {}).items() if k != "dflash_mlx_sha256"}
    digest, left = hashlib.sha256(json.dumps(head, sort_keys=True).encode()), length
    while left > 0:
        chunk = f.read(min(CHUNK, left))
        if not chunk:
            raise ValueError("the data is cut short")
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def data_length(header: dict) -> int:
    """Bytes of tensor data the header describes."""
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    return max(ends, default=0)


def write_cache_file(file_name: str, arrays: Dict[str, mx.array], metadata: Dict[str, str]) -> None:
    """Write :func:`cache_contents` to ``file_name`` atomically (a temporary
    file beside it, renamed over it once whole), with the SHA-256 of its
    header and tensor data in the metadata: a reader never sees half a
    file, and a file damaged later is found out."""
    folder, name = os.path.split(os.path.abspath(file_name))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        mx.save_safetensors(tmp + ".safetensors", arrays, metadata)
        with open(tmp + ".safetensors", "rb") as src:
            header, start = safetensors_header(src)
            header.setdefault("__metadata__", {})["dflash_mlx_sha256"] = file_digest(header, src, data_length(header))
            text = json.dumps(header).encode()
            text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned
            src.seek(start)
            with open(tmp, "wb") as out:
                out.write(struct.pack("<Q", len(text)) + text)
                shutil.copyfileobj(src, out, CHUNK)
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, file_name)
    finally:
        for leftover in (tmp, tmp + ".safetensors"):
            if os.path.exists(leftover):
                os.remove(leftover)


def save_prompt_cache(file_name: str, cache: PromptCache, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``cache`` to a ``.safetensors`` file (mlx-lm's
    ``save_prompt_cache``, with the drafter's side and pending tokens too),
    atomically, with a format version and a checksum that
    :func:`load_prompt_cache` checks."""
    write_cache_file(file_name, *cache_contents(cache, metadata))


def read_cache_metadata(file_name: str, verify: bool = False) -> Dict[str, str]:
    """The metadata of a prompt cache file, its version and length checked
    (and with ``verify`` its checksum, which reads the whole file); an
    :class:`ArgumentError` names what is wrong."""

    def damaged(e):
        return ArgumentError(f"{file_name} is not a whole prompt cache file ({e}): save it again with save_prompt_cache")

    try:
        with open(file_name, "rb") as f:
            header, start = safetensors_header(f)
            metadata = header.get("__metadata__") or {}
            size = os.fstat(f.fileno()).st_size
            if size != start + data_length(header):
                raise ValueError(f"{size} bytes where the header describes {start + data_length(header)}")
            if isinstance(metadata, dict) and "dflash_mlx" not in metadata and "1.0" in metadata:  # its cache classes
                raise ArgumentError(
                    f"{file_name} is mlx-lm's prompt cache (mlx_lm.cache_prompt): it holds the target's cache "
                    "without the drafter's context, which DFlash decodes from; save one with "
                    "dflash_mlx.save_prompt_cache after a generation with make_prompt_cache(model, draft)"
                )
            if not isinstance(metadata, dict) or "dflash_mlx" not in metadata:
                raise ArgumentError(f"{file_name} is not a dflash_mlx prompt cache (save it with save_prompt_cache)")
            if metadata.get("dflash_mlx_format") != CACHE_FORMAT:
                raise ArgumentError(
                    f"{file_name} is a prompt cache of format {metadata.get('dflash_mlx_format', '0')}, this "
                    f"dflash_mlx reads format {CACHE_FORMAT}: save it again with this version"
                )
            if verify and file_digest(header, f, size - start) != metadata.get("dflash_mlx_sha256"):
                raise ValueError("its checksum does not match its contents")
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        if isinstance(e, ArgumentError):
            raise
        raise damaged(e) from None
    return metadata


def load_prompt_cache(file_name: str, draft, return_metadata: bool = False):
    """Read a cache written by :func:`save_prompt_cache`; ``draft`` (the
    drafter the cache was made with) builds the drafter's side. A file that
    is cut short, damaged or of another format version is refused."""
    read_cache_metadata(file_name, verify=True)
    arrays, metadata = mx.load(file_name, return_metadata=True)
    mx.eval(arrays)  # read now, the file just checked, not when first used
    metadata.pop("dflash_mlx_format")
    metadata.pop("dflash_mlx_sha256")
    info = json.loads(metadata.pop("dflash_mlx"))
    leaves = sorted({**arrays, **info["scalars"]}.items(), key=lambda kv: [int(p) if p.isdigit() else p for p in kv[0].split(".")])
    tree = tree_unflatten(leaves)
    target_states, draft_states, target_hidden = tree["state"]
    target = TargetCache(
        getattr(lm_cache, name).from_state(s) for name, s in zip(info["target_classes"], target_states)
    )
    target.kv = KVSettings(*info["kv"]) if info.get("kv") else None
    draft_cache = draft.make_cache()
    if len(draft_cache) != len(draft_states):
        raise ArgumentError(
            f"{file_name} holds a drafter context of {len(draft_states)} layers, but this "
            f"drafter has {len(draft_cache)}: load it with the drafter it was made with"
        )
    for c, s, meta in zip(draft_cache, draft_states, tree["meta"]):
        c.state, c.meta_state = s, meta
    cache = PromptCache(target, draft_cache, *info.get("draft_window", (None, 0)))
    cache.pending, cache.tokens, cache.target_hidden = info["pending"], info["tokens"], target_hidden
    cache.set_hole(tuple(info["hole"]) if info.get("hole") else None)
    return (cache, metadata) if return_metadata else cache
