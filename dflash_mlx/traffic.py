"""Recorded traffic: the conversations a pair served, kept as drafter training data.

Opt-in (``--learn DIR``, ``record=``): every finished generation is stored
as its token ids and a mask of the answer positions (the tokens the target
itself chose, greedy or sampled: what self-distillation trains on, as in
online speculative decoding, Liu et al. 2024, arXiv 2310.07177). The
target's tap states are not stored: recomputing them is one prefill-speed
target pass over the record, while storing them costs taps x hidden x 2
bytes a token (SmolLM2-135M's five taps: 5,760 bytes against 4 for the id).

A traffic directory holds ``traffic.json`` (what it is) and ``records/``,
one ``.npz`` per conversation (``tokens`` int32, ``answer`` bool), named so
that their order is the order they were recorded in. Files are written to a
temporary name and renamed, readable by the owner only; the directory is
kept under a byte bound, oldest records out first. A later turn of a
conversation replaces the record of its earlier turns (its tokens begin
with them), keeping their answer marks.
"""

import errno
import json
import logging
import os
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from .errors import DFlashError

MARKER = "traffic.json"
FORMAT = "dflash-mlx-traffic"
VERSION = 1
RECORDS = "records"
DEFAULT_MAX_BYTES = 1 << 30
# Conversations whose later turns may still extend their record.
OPEN_CONVERSATIONS = 16
ADAPTING = ".adapting"  # `train --from-traffic` trains here, beside its --draft-model
ADAPT_RESULT = "adapt.json"  # an adapted drafter's held-out scores, beside its weights
# The share of its predecessor's tokens per cycle an adapted drafter must keep
# on held-out rows of the predecessor's own training data: what it may forget.
KEEP_SHARE = 0.97


class TrafficError(DFlashError, ValueError):
    """A traffic directory that cannot be recorded to or read."""


@dataclass(eq=False)
class Record:
    """One recorded conversation: its tokens and which of them the target wrote."""

    tokens: np.ndarray  # int32 [n]
    answer: np.ndarray  # bool [n]
    name: str = ""


def check_traffic_dir(path, create: bool = False) -> Path:
    """``path`` as a traffic directory; with ``create``, made (owner-only) when
    missing or empty. Any other directory is refused: recording never writes
    among someone else's files, and training never reads them."""
    root = Path(path).expanduser()
    marker = root / MARKER
    if marker.is_file():
        try:
            meta = json.loads(marker.read_text())
        except (OSError, ValueError):
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise TrafficError(f"{root} is not a traffic directory: its {MARKER} is not mlx-dflash's; choose another directory")
        if meta.get("version") != VERSION:
            raise TrafficError(f"{root} holds traffic of format version {meta.get('version')}, this mlx-dflash reads {VERSION}")
        return root
    if root.exists() and not root.is_dir():
        raise TrafficError(f"{root} is a file, not a traffic directory: choose a directory (--learn DIR)")
    if root.is_dir() and any(root.iterdir()):
        raise TrafficError(f"{root} is not a traffic directory (no {MARKER}) and not empty: choose a new or empty directory")
    if not create:
        raise TrafficError(f"{root} holds no recorded traffic: record some with --learn {root} first")
    try:
        (root / RECORDS).mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        write_atomically(marker, json.dumps({"format": FORMAT, "version": VERSION}).encode())
    except OSError as e:
        raise TrafficError(f"cannot create the traffic directory {root}: {e.strerror or e}") from None
    return root


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary owner-only file and a rename:
    a reader sees the old file or the new one, never part of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def encode_record(tokens: np.ndarray, answer: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, tokens=tokens.astype(np.int32), answer=answer.astype(bool))
    return buf.getvalue()


class Recorder:
    """Stores finished conversations in a traffic directory (see the module
    docstring) under ``max_bytes``. Thread-safe; :meth:`record` is the one
    call a generation loop makes when a generation finishes."""

    def __init__(self, path, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1:
            raise TrafficError("--learn-max-bytes must be at least 1")
        self.root = check_traffic_dir(path, create=True)
        self.dir = self.root / RECORDS
        try:
            self.dir.mkdir(mode=0o700, exist_ok=True)  # cleared by hand since it was made
        except OSError as e:
            raise TrafficError(f"cannot record to {self.root}: {e.strerror or e}") from None
        self.clear_killed_writers()
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.count = 0
        self.recorded = 0  # conversations recorded (turns of one counted once each)
        self.open: List[Record] = []  # the latest conversations, newest last
        self.sizes: Dict[str, int] = {}
        for f in sorted(self.dir.glob("*.npz")):
            self.sizes[f.name] = f.stat().st_size

    def clear_killed_writers(self) -> None:
        """Delete the temporary files (:func:`write_atomically`'s
        ``.NAME.PID.THREAD.tmp``) of writers killed before their rename:
        never read, they were never counted against the bound either."""
        from .convert import pid_alive

        for tmp in self.dir.glob(".*.tmp"):
            pid = tmp.name.rsplit(".", 3)[-3]
            if pid.isdigit() and not pid_alive(int(pid)):
                tmp.unlink(missing_ok=True)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def record(self, prompt_tokens: Sequence[int], answer_tokens: Sequence[int]) -> Optional[str]:
        """Store a finished generation: ``prompt_tokens`` (the whole context,
        earlier turns included) then ``answer_tokens`` (what the target wrote).
        Returns the record's file name (None if it exceeds the bound alone)."""
        prompt = np.asarray(prompt_tokens, np.int32).reshape(-1)
        answer = np.asarray(answer_tokens, np.int32).reshape(-1)
        tokens = np.concatenate([prompt, answer])
        marks = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(answer), bool)])
        with self.lock:
            earlier = self.earlier_turn(tokens)
            if earlier is not None:
                marks[: len(earlier.answer)] |= earlier.answer
                self.open.remove(earlier)
            name = earlier.name if earlier is not None else self.new_name()
            data = encode_record(tokens, marks)
            if len(data) > self.max_bytes:
                logging.warning("a %d-token conversation exceeds --learn-max-bytes alone: not recorded", len(tokens))
                return None
            self.make_room(len(data), keep=name)
            try:
                write_atomically(self.dir / name, data)
            except OSError as e:
                raise self.write_error(e) from None
            self.sizes[name] = len(data)
            self.recorded += 1
            self.open = self.open[-(OPEN_CONVERSATIONS - 1):] + [Record(tokens, marks, name)]
            return name

    def earlier_turn(self, tokens: np.ndarray) -> Optional[Record]:
        """The open conversation ``tokens`` continues, if any (newest first)."""
        for rec in reversed(self.open):
            n = len(rec.tokens)
            if n < len(tokens) and rec.name in self.sizes and np.array_equal(tokens[:n], rec.tokens):
                return rec
        return None

    def new_name(self) -> str:
        self.count += 1
        return f"{time.time_ns():020d}-{os.getpid()}-{self.count:06d}.npz"

    def make_room(self, nbytes: int, keep: str) -> None:
        """Delete the oldest records until ``nbytes`` more fit the bound
        (``keep``, the file being replaced, counts as freed)."""
        total = self.nbytes - self.sizes.get(keep, 0)
        for name in sorted(self.sizes):
            if total + nbytes <= self.max_bytes:
                break
            if name == keep:
                continue
            (self.dir / name).unlink(missing_ok=True)
            total -= self.sizes.pop(name)

    def write_error(self, e: OSError) -> TrafficError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return TrafficError(f"cannot record to {self.root}: the disk is full; free space or lower --learn-max-bytes")
        return TrafficError(f"cannot record to {self.root}: {e.strerror or e}")


def record_safely(recorder: Optional[Recorder], prompt_tokens, answer_tokens) -> None:
    """:meth:`Recorder.record` for a serving loop: a failure to record (a full
    disk) is logged, never raised into the request it followed."""
    if recorder is None:
        return
    try:
        recorder.record(prompt_tokens, answer_tokens)
    except TrafficError as e:
        logging.error("%s", e)


def read_record(path: Path) -> Record:
    with np.load(path, allow_pickle=False) as z:
        tokens, answer = z["tokens"], z["answer"]
    if tokens.ndim != 1 or answer.shape != tokens.shape or answer.dtype != np.bool_ or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError("tokens and answer arrays do not match")
    return Record(tokens.astype(np.int32), answer, path.name)


def read_traffic(path, vocab_size: Optional[int] = None) -> List[Record]:
    """Every readable record of a traffic directory, oldest first. A corrupt
    record (or one with ids outside ``vocab_size``: another target's) is
    skipped with a warning."""
    root = check_traffic_dir(path)
    records, foreign = [], 0
    for f in sorted((root / RECORDS).glob("*.npz")):
        try:
            rec = read_record(f)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            logging.warning("skipping the corrupt traffic record %s (%s)", f, e)
            continue
        if vocab_size is not None and len(rec.tokens) and (rec.tokens.min() < 0 or rec.tokens.max() >= vocab_size):
            foreign += 1
            continue
        records.append(rec)
    outside = f"{foreign} records of {root} hold ids outside the target's vocabulary (0..{vocab_size - 1})" if foreign else ""
    if not records and foreign:
        raise TrafficError(f"{outside}: they were recorded with another target; train with that target, or record with this one")
    if not records:
        raise TrafficError(f"{root} holds no readable recorded conversation: serve some requests with --learn {root} first")
    if foreign:
        logging.warning("skipping %s (another target's)", outside)
    return records


def refusal(result: dict) -> Optional[str]:
    """Why an adapted drafter's scores (``adapt.json``) do not earn it a
    place, or None: it must beat the drafter it started from on the held-out
    traffic and, where the replayed data was held out too (``replay``), keep
    :data:`KEEP_SHARE` of that drafter's tokens per cycle there."""
    if not result["after"] > result["before"]:
        return f"it does not beat the drafter it started from on the held-out traffic ({result['before']:.3f} -> {result['after']:.3f} tokens per cycle)"
    replay = result.get("replay")
    if replay and not replay["after"] >= KEEP_SHARE * replay["before"]:
        return (
            f"it forgets: {replay['before']:.3f} -> {replay['after']:.3f} tokens per cycle on the held-out replay rows, "
            f"below {KEEP_SHARE} of the drafter it started from"
        )
    return None


def split_held_out(records: List[Record], share: float = 0.1):
    """(training records, held-out records): the most recent ``share`` held
    out (at least one), as the traffic to come resembles the latest."""
    n = max(1, int(round(len(records) * share)))
    if len(records) < 2:
        raise TrafficError(f"{len(records)} recorded conversation: adapting needs at least 2 (one held out)")
    return records[:-n], records[-n:]


def pack(records: List[Record], seq_len: int):
    """Records one after another, cut into rows of exactly ``seq_len`` tokens
    (as language-model pre-training packs documents; the leftover shorter
    than a row is dropped): (rows [n, seq_len] int32, answer marks [n, seq_len])."""
    if not records:
        return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), bool)
    stream = np.concatenate([r.tokens for r in records])
    marks = np.concatenate([r.answer for r in records])
    n = len(stream) // seq_len
    return stream[: n * seq_len].reshape(n, seq_len), marks[: n * seq_len].reshape(n, seq_len)
