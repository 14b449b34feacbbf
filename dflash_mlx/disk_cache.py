"""The prompt cache's disk tier: conversations that outlive the memory bound
and the server.

mlx-lm's ``LRUPromptCache`` keeps prompt caches in memory, bounded by
entries and bytes; a restart loses them, and a few agents' long
conversations evict each other. :class:`DiskPromptCache` keeps them in a
folder as well, one :func:`~dflash_mlx.cache.save_prompt_cache` file per
entry (the library's file layout: the target's caches, the drafter's
context, the pending token; a format version and a checksum), written by a
background thread, the least recently used going first past a byte bound.
:class:`TieredPromptCache` puts it under the memory tier behind the same two
calls the server makes (``fetch_nearest_cache``, ``insert_cache``): every
entry the memory tier takes is written through, so what it evicts is on disk
already, and a request whose longest cached prefix is on disk and not in
memory loads it instead of prefilling.

A file is found again by its tokens and its pair: the name hashes the
tokens and the pair's fingerprint (:func:`pair_identity`), and the file
records both. A file that is stale, cut short, damaged or another pair's is
skipped with a warning: it costs a prefill, never a crash or other text.
"""

import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .cache import PromptCache, cache_contents, load_prompt_cache, read_cache_metadata, write_cache_file
from .errors import ArgumentError

SUFFIX = ".prompt-cache.safetensors"
PENDING_WRITES = 8  # entries waiting for the writer; past them a write is dropped (the entry stays in memory)


def pair_identity(model, draft) -> str:
    """A fingerprint of a target and its drafter: every weight's name, shape
    and dtype and its first bytes, so a file written for other weights (a
    fine-tune at the same path, another quantization) is not read."""
    digest = hashlib.sha256()
    for part in (model, draft):
        leaves = [(k, a) for k, a in tree_flatten(part.parameters()) if isinstance(a, mx.array)]
        digest.update(json.dumps([(k, a.shape, str(a.dtype)) for k, a in leaves]).encode())
        if leaves:
            head = mx.concatenate([mx.view(a.reshape(-1)[:8], mx.uint8) for _, a in leaves])
            digest.update(np.array(head).tobytes())
    return digest.hexdigest()


@dataclass
class Entry:
    """A cache file the tier may load: its tokens, whether its caches can
    trim, its size and when it was last written or read."""

    path: str
    tokens: np.ndarray
    trimmable: bool
    size: int
    used: float


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def cache_layout(classes: List[str]) -> List[str]:
    """A target's cache class names, a quantized KV cache counted as the
    float one it was converted from (kv_bits converts caches mid-conversation)."""
    return ["KVCache" if name == "QuantizedKVCache" else name for name in classes]


class DiskPromptCache:
    """Prompt cache files in ``folder`` for one pair, at most ``max_bytes``
    of them; ``draft`` rebuilds the drafter's side of a file,
    ``target_classes`` are the class names of the target's caches and
    ``kv`` the KV cache settings they were made with (a file made with
    other settings is skipped)."""

    def __init__(self, folder: str, max_bytes: int, identity: str, draft, target_classes: List[str], kv=None):
        self.folder, self.max_bytes, self.identity = folder, max_bytes, identity
        self.draft, self.target_classes, self.kv = draft, cache_layout(target_classes), kv
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ArgumentError(f"cannot use {folder} for prompt cache files: {e.strerror or e}; choose another --prompt-cache-dir") from None
        self.lock = threading.Lock()  # the index, shared with the writer
        self.entries: Dict[str, Entry] = {}
        self.queued: set = set()
        for name in sorted(os.listdir(folder)):
            if name.endswith(SUFFIX) and not name.startswith("."):
                self.index(os.path.join(folder, name))
        self.writes: "queue.Queue" = queue.Queue(PENDING_WRITES)
        self.writer = threading.Thread(target=self.write_loop, name="dflash-cache-writer", daemon=True)
        self.writer.start()

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(e.size for e in self.entries.values())

    def path_for(self, tokens: List[int]) -> str:
        key = hashlib.sha256(self.identity.encode() + np.asarray(tokens, np.int64).tobytes()).hexdigest()[:40]
        return os.path.join(self.folder, key + SUFFIX)

    def index(self, path: str) -> None:
        """Add a file found in the folder to the index, or skip it with a warning."""
        try:
            metadata = read_cache_metadata(path)
            if metadata.get("dflash_mlx_pair") != self.identity:
                raise ArgumentError(f"{path} was written for another target or drafter")
            info = json.loads(metadata["dflash_mlx"])
            tokens = np.asarray(info["tokens"], np.int64)
            stat = os.stat(path)
        except (ArgumentError, OSError, ValueError, KeyError, TypeError) as e:
            logging.warning("prompt cache file skipped: %s", e)
            return
        self.entries[path] = Entry(path, tokens, bool(info.get("trimmable")), stat.st_size, stat.st_mtime)

    def nearest(self, tokens: List[int], held: int) -> Optional[Tuple[PromptCache, int]]:
        """The cache of the longest prefix of ``tokens`` on disk, if longer
        than ``held`` (what memory holds), and its length; trimmed where the
        file holds more, as mlx-lm's ``LRUPromptCache`` trims."""
        wanted = np.asarray(tokens, np.int64)
        with self.lock:
            entries = list(self.entries.values())
        found = []
        for e in entries:
            common = common_prefix(wanted, e.tokens)
            usable = common if common == len(e.tokens) else min(common, len(wanted) - 1) if e.trimmable else 0
            if usable > held:
                found.append((usable, e.used, e))
        for usable, _, e in sorted(found, key=lambda f: f[:2], reverse=True):
            cache = self.load(e)
            if cache is not None:
                cache.trim(len(cache.tokens) - usable)
                return cache, usable
        return None

    def load(self, entry: Entry) -> Optional[PromptCache]:
        """The cache in ``entry``'s file, checked; None (with a warning, and
        the file out of the index) if it cannot be used."""
        try:
            cache = load_prompt_cache(entry.path, self.draft)
            classes = cache_layout([type(c).__name__ for c in cache.target])
            if classes != self.target_classes or cache.tokens != entry.tokens.tolist():
                raise ArgumentError(f"{entry.path} does not hold caches of this target")
            if cache.target.kv != self.kv:
                raise ArgumentError(f"{entry.path} holds caches made with other KV cache settings ({cache.target.kv})")
            now = time.time()
            os.utime(entry.path, (now, now))
        except Exception as e:  # a file on disk is input: whatever is wrong with it, skip it
            logging.warning("prompt cache file skipped: %s", e)
            with self.lock:
                self.entries.pop(entry.path, None)
            return None
        entry.used = now
        return cache

    def put(self, cache: PromptCache) -> None:
        """Queue ``cache`` to be written (unless its file exists or is
        queued); its arrays are evaluated here, on the generating thread,
        and written on the writer's."""
        path = self.path_for(cache.tokens)
        with self.lock:
            if path in self.entries or path in self.queued:
                return
            self.queued.add(path)
        arrays, metadata = cache_contents(cache, {"dflash_mlx_pair": self.identity})
        size = sum(a.nbytes for a in arrays.values())
        try:
            if size > self.max_bytes:
                raise queue.Full
            self.writes.put_nowait((path, arrays, metadata, cache.tokens[:], cache.is_trimmable()))
        except queue.Full:
            logging.info("prompt cache of %d tokens not written to disk (the writer is behind, or it is over the bound)", len(cache.tokens))
            with self.lock:
                self.queued.discard(path)

    def write_loop(self):
        while True:
            path, arrays, metadata, tokens, trimmable = self.writes.get()
            try:
                write_cache_file(path, arrays, metadata)
                size = os.path.getsize(path)
            except Exception as e:  # a full disk, a folder taken away: the memory tier still serves
                logging.warning("could not write prompt cache file %s: %s", path, e)
                size = None
            with self.lock:
                self.queued.discard(path)
                if size is not None:
                    self.add(Entry(path, np.asarray(tokens, np.int64), trimmable, size, time.time()))
            self.writes.task_done()

    def add(self, entry: Entry) -> None:
        """Index a written file, drop the files it makes redundant (shorter
        prefixes of a cache that trims, as mlx-lm's ``LRUPromptCache`` does)
        and then the least recently used past the bound (lock held)."""
        self.entries[entry.path] = entry
        gone = []
        if entry.trimmable:
            gone = [e for e in self.entries.values() if e is not entry and len(e.tokens) < len(entry.tokens)
                    and common_prefix(e.tokens, entry.tokens) == len(e.tokens)]
        total = sum(e.size for e in self.entries.values()) - sum(e.size for e in gone)
        for e in sorted((e for e in self.entries.values() if e not in gone), key=lambda e: e.used):
            if total <= self.max_bytes:
                break
            gone.append(e)
            total -= e.size
        for e in gone:
            del self.entries[e.path]
            try:
                os.remove(e.path)
            except OSError as err:
                logging.warning("could not remove prompt cache file %s: %s", e.path, err)

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self.writes.join()


class TieredPromptCache:
    """mlx-lm's ``LRUPromptCache`` (``memory``) over a :class:`DiskPromptCache`,
    with the memory tier's two calls: every entry inserted is written through
    to disk; a lookup takes the longer of the two tiers' prefixes."""

    def __init__(self, memory, disk: DiskPromptCache):
        self.memory, self.disk = memory, disk

    def fetch_nearest_cache(self, key, tokens: List[int]):
        entry, rest = self.memory.fetch_nearest_cache(key, tokens)
        found = self.disk.nearest(tokens, len(tokens) - len(rest))
        if found is None:
            return entry, rest
        cache, n = found
        logging.info("prompt cache: %d of %d tokens read from disk", n, len(tokens))
        return [cache], tokens[n:]

    def insert_cache(self, key, tokens: List[int], prompt_cache: list, *, cache_type: str = "assistant"):
        self.memory.insert_cache(key, tokens, prompt_cache, cache_type=cache_type)
        self.disk.put(prompt_cache[0])
