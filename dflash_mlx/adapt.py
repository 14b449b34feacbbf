"""Adapting while serving (``mlx-dflash server --learn DIR --adapt``).

Online speculative decoding (Liu et al. 2024, arXiv 2310.07177) distils the
drafter on the queries a server actually gets. Here each round is an
``mlx-dflash train --from-traffic`` run in a child process at the lowest
priority, with that command's defaults (:func:`dflash_mlx.train.fill_defaults`,
the one home of both; ``--adapt-args`` overrides them), started once
``--adapt-every`` new conversations are recorded and no request is running, stopped (SIGSTOP) while any request runs and
continued when none does. The child writes its candidate only when it beats
the current drafter on the most recent traffic it held out; the generation
thread swaps it in between requests (:meth:`Adaptation.swap`), after loading
it. A candidate that fails to load, or whose scores do not show it beating
the drafter in use (and, where the round replays the drafter's original data,
keeping what it knew there: :func:`~dflash_mlx.traffic.refusal`), is
refused. The loop's output is the target's whatever
the drafter, so a swap changes the speed, never the text.

State, beside the traffic: ``DIR/drafters/v<N>/`` (each accepted drafter,
with its ``adapt.json`` scores), ``DIR/drafters/current.json`` (the last
accepted one: a restart continues from it) and ``v<N>.log`` per round.
"""

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from .errors import ArgumentError, DFlashError
from .traffic import ADAPT_RESULT, ADAPTING, DEFAULT_MAX_BYTES, Recorder, refusal, write_atomically

DRAFTERS = "drafters"
CURRENT = "current.json"
DEFAULT_EVERY = 64


class Adaptation:
    """Rounds of background fine-tuning on a :class:`Recorder`'s traffic and
    the swap of their drafters; ``target`` and ``drafter`` are the paths of
    the served pair (the drafter: the one the server started with)."""

    def __init__(self, recorder: Recorder, target, drafter, every: int = DEFAULT_EVERY, train_args: str = "", poll: float = 1.0):
        self.recorder, self.target, self.every, self.poll = recorder, str(target), every, poll
        self.train_args = check_train_args(train_args)
        self.root = recorder.root / DRAFTERS
        self.root.mkdir(mode=0o700, exist_ok=True)
        self.lock = threading.Lock()
        self.running = 0  # requests being served
        self.child: Optional[subprocess.Popen] = None
        self.candidate: Optional[Path] = None  # a round's output, not yet swapped in
        self.last_round = 0  # recorder.recorded when the last round started
        self.stopping = False
        self.version, self.path, self.scores = 0, Path(drafter), {}
        self.origin = str(Path(drafter).resolve())  # the drafter the server was started with
        self.resume(drafter)
        self.check_round(train_args)
        self.thread = threading.Thread(target=self.loop, name="dflash-adaptation", daemon=True)

    def resume(self, drafter) -> None:
        """Continue from the last accepted drafter (``current.json``), if it is there."""
        saved = self.root / CURRENT
        if not saved.is_file():
            return
        try:
            state = json.loads(saved.read_text())
            if state.get("origin", self.origin) != self.origin:  # another --draft-model: it is what serves
                logging.warning(
                    "adaptation: %s continues %s, not %s; starting from %s", saved, state["origin"], drafter, drafter
                )
                self.version = int(state["version"])  # later rounds keep the other line's drafters
                return
            path = Path(state["path"])
            if not (path / "model.safetensors").is_file():
                raise ValueError(f"{path} is gone")
            self.version, self.path, self.scores = int(state["version"]), path, dict(state["scores"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            logging.warning("adaptation: cannot continue from %s (%s); starting from %s", saved, e, drafter)

    def check_round(self, train_args: str) -> None:
        """What a round's trainer checks before its work, checked when the
        server starts: a flag it refuses would fail every round into its log."""
        from .train import check_args, config_of

        try:
            check_args(config_of(self.round_argv(self.root / ".check")))
        except DFlashError as e:
            raise ArgumentError(f"{f'--adapt-args {train_args!r}' if train_args else '--adapt'}: {e}") from None

    def start(self) -> "Adaptation":
        self.thread.start()
        return self

    # ------------------------------------------------ the generation thread's calls

    def request_started(self) -> None:
        """A request is being served: the round in progress waits."""
        with self.lock:
            self.running += 1
            self.signal(signal.SIGSTOP)

    def request_finished(self) -> None:
        with self.lock:
            self.running -= 1
            if not self.running:
                self.signal(signal.SIGCONT)

    def swap(self, model, draft):
        """The drafter to serve the next request with: a new round's, once
        loaded and checked, else ``draft``. Called between requests."""
        from .loading import load_draft
        from .pair import float_dtype

        with self.lock:
            path, self.candidate = self.candidate, None
        if path is None:
            return draft
        try:
            scores = json.loads((path / ADAPT_RESULT).read_text())
            if Path(scores["init_from"]) != self.path.resolve():
                raise ValueError(f"it was adapted from {scores['init_from']}, not from the drafter in use")
            why = refusal(scores)
            if why is not None:
                raise ValueError(why)
            new = load_draft(path, model, dtype=float_dtype(model))
        except Exception as e:  # a broken or worse candidate never replaces the drafter in use
            logging.warning("adaptation: refused the candidate drafter %s: %s", path, e)
            shutil.rmtree(path, ignore_errors=True)
            return draft
        self.version += 1
        self.scores = {"before": scores["before"], "after": scores["after"]}
        self.path = path
        state = {"version": self.version, "path": str(path.resolve()), "scores": self.scores, "origin": self.origin}
        try:
            write_atomically(self.root / CURRENT, json.dumps(state).encode())
        except OSError as e:  # serving goes on; a restart would start from the first drafter
            logging.error("adaptation: cannot save %s (%s)", self.root / CURRENT, e.strerror or e)
        logging.info(
            "adaptation: drafter v%d in use (%s): held-out tokens per cycle %.3f -> %.3f",
            self.version, path, scores["before"], scores["after"],
        )
        return new

    def offer(self, path) -> None:
        """A round's candidate, for the next :meth:`swap`."""
        with self.lock:
            self.candidate = Path(path)

    def stop(self) -> None:
        self.stopping = True
        with self.lock:
            if self.child is not None and self.child.poll() is None:
                self.signal(signal.SIGCONT)
                self.child.terminate()

    # ------------------------------------------------------------ the rounds

    def signal(self, sig) -> None:
        """Send ``sig`` to the round in progress, if any (under ``lock``)."""
        if self.child is not None and self.child.poll() is None:
            try:
                os.kill(self.child.pid, sig)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def loop(self) -> None:
        while not self.stopping:
            time.sleep(self.poll)
            try:
                self.step()
            except Exception:
                logging.exception("adaptation: a round failed; serving goes on with the drafter in use")
                with self.lock:
                    self.child = None

    def step(self) -> None:
        """Start a round when due and idle; collect one that ended."""
        with self.lock:
            child, idle = self.child, not self.running
        if child is None:
            due = self.recorder.recorded - self.last_round >= self.every and self.candidate is None
            if due and idle:
                self.start_round()
            return
        if child.poll() is None:
            return
        out = self.round_dir(self.version + 1)
        with self.lock:
            self.child = None
        if child.returncode == 0 and (out / ADAPT_RESULT).is_file():
            self.offer(out)
        elif child.returncode != 0:
            logging.warning("adaptation: the round ended with code %d (see %s); the drafter in use stays", child.returncode, out.with_suffix(".log"))
        else:
            logging.info("adaptation: the round's drafter did not beat the one in use; it stays")

    def round_dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    def round_argv(self, out: Path) -> list:
        """A round's ``mlx-dflash train`` flags: the traffic, the drafter in
        use, the target, ``out``, then ``--adapt-args``."""
        return [
            "--from-traffic", str(self.recorder.root), "--init-from", str(self.path), "--model", self.target,
            "--draft-model", str(out), *self.train_args,
        ]  # fmt: skip

    def start_round(self) -> subprocess.Popen:
        out = self.round_dir(self.version + 1)
        shutil.rmtree(out, ignore_errors=True)  # a killed round's leftovers
        shutil.rmtree(out.with_name(out.name + ADAPTING), ignore_errors=True)
        cmd = ["nice", "-n", "19", sys.executable, "-m", "dflash_mlx.train", *self.round_argv(out)]
        self.last_round = self.recorder.recorded
        with open(out.with_suffix(".log"), "w") as log, self.lock:
            self.child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if self.running:
                self.signal(signal.SIGSTOP)
        logging.info("adaptation: round for v%d started (pid %d)", self.version + 1, self.child.pid)
        return self.child


def check_train_args(train_args: str) -> list:
    """``--adapt-args`` split and parsed as a round will parse them, so a bad
    one is refused when the server starts, not in every round's log."""
    from .train import setup_arg_parser

    def refuse(message):
        raise ArgumentError(f"--adapt-args {train_args!r}: {message}; fix or drop it")

    try:
        argv = shlex.split(train_args)
    except ValueError as e:
        refuse(e)
    parser = setup_arg_parser()
    parser.error = refuse  # this instance's, not argparse's exit
    own = {"from_traffic": "TRAFFIC", "init_from": "INIT", "model": "T", "draft_model": "OUT", "resume": False}
    parsed = vars(parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in own.items() if v] + argv))
    taken = [k for k, v in own.items() if parsed[k] != v]  # a round's flags come first: these would replace them
    if taken:
        refuse(f"--{taken[0].replace('_', '-')} is the server's to set (each round's traffic, drafter, target, output)")
    return argv


def add_learn_arguments(parser, adapt: bool = False) -> None:
    """``--learn DIR`` and ``--learn-max-bytes`` (chat, server); with
    ``adapt``, the server's ``--adapt`` flags."""
    from . import cli

    parser.add_argument(
        "--learn", default=None, metavar="DIR",
        help="record every finished conversation (its tokens: prompts and answers) in this traffic directory, "
        "as training data for the drafter (docs/adapting.md); off by default",
    )
    parser.add_argument("--learn-max-bytes", type=cli.positive_int, default=DEFAULT_MAX_BYTES, help="most bytes of recorded traffic kept; the oldest go first")
    if not adapt:
        return
    parser.add_argument("--adapt", action="store_true", help="with --learn: fine-tune the drafter on the traffic in the background, swapping in one only when it beats the one in use")
    parser.add_argument("--adapt-every", type=cli.positive_int, default=DEFAULT_EVERY, help="new conversations recorded between two adaptation rounds")
    parser.add_argument("--adapt-args", default="", help="more `mlx-dflash train` flags for each round, e.g. \"--steps 200 --seq-len 256\"")


def learning(args):
    """``(Recorder or None, Adaptation or None)`` as the ``--learn`` flags ask
    (the adaptation not started yet), for the pair ``--model`` and
    ``--draft-model`` name."""
    if getattr(args, "adapt", False) and args.learn is None:
        raise ArgumentError("--adapt trains on the traffic --learn DIR records: pass --learn too")
    if args.learn is None:
        return None, None
    if getattr(args, "pipeline", False):
        raise ArgumentError("--learn records in one process: drop --pipeline")
    recorder = Recorder(args.learn, args.learn_max_bytes)
    if not getattr(args, "adapt", False):
        return recorder, None
    from .loading import resolve_path
    from .pair import resolve_pair

    target, drafter = resolve_pair(args.model, args.draft_model)
    return recorder, Adaptation(recorder, target, resolve_path(drafter), args.adapt_every, args.adapt_args)
