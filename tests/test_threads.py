"""Threads and interruptions: one pair, two threads, generations cut off
mid-cycle, and a process whose generating threads ended before it exits.

Most tests here use long-lived workers, as the server's generation thread;
``test_threads_that_ended_let_the_process_exit`` uses threads that end (see
dflash_mlx/ops/threads.py and docs/robustness.md).
"""

import json
import queue
import subprocess
import sys
import threading

import mlx.core as mx
import pytest
from test_state import assert_like_fresh_prefill

import dflash_mlx
from dflash_mlx.errors import ArgumentError


class Worker:
    """A daemon thread that runs what it is given and never ends."""

    def __init__(self):
        self.jobs = queue.Queue()
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self):
        while True:
            fn, done = self.jobs.get()
            try:
                done.put((True, fn()))
            except BaseException as e:  # handed back to the caller
                done.put((False, e))

    def submit(self, fn) -> "queue.Queue":
        done = queue.Queue()
        self.jobs.put((fn, done))
        return done


@pytest.fixture(scope="module")
def workers():
    return Worker(), Worker()


@pytest.fixture(scope="module")
def draft_path(qwen3_pair, tmp_path_factory):
    return qwen3_pair.make_draft(tmp_path_factory.mktemp("d") / "d", block_size=4)


@pytest.fixture(scope="module")
def pair_and_draft(qwen3_pair, draft_path):
    return qwen3_pair, dflash_mlx.load_draft(draft_path, qwen3_pair.model)


PROMPTS = [[5, 9, 13, 40, 41, 42, 7] * 3, [100, 3, 3, 60, 61, 8] * 3]


def test_two_threads_on_one_pair_are_exact_or_told_what_to_do(pair_and_draft, workers):
    """Both start together; each either matches mlx-lm or is refused with an
    error that says what to do, and the pair works afterwards."""
    pair, draft = pair_and_draft
    start = threading.Barrier(2)

    def job(prompt):
        def run():
            start.wait()
            return [t for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, prompt, max_tokens=24) for t in r.tokens]

        return run

    pending = [w.submit(job(p)) for w, p in zip(workers, PROMPTS)]
    outcomes = [done.get(timeout=300) for done in pending]
    want = [pair.reference(p, 24, eos_ids=None) for p in PROMPTS]
    exact = [ok and got == w for (ok, got), w in zip(outcomes, want)]
    refused = [not ok and isinstance(got, ArgumentError) and "one generation per pair" in str(got) for ok, got in outcomes]
    assert all(e or r for e, r in zip(exact, refused)), outcomes
    assert any(exact)
    ok, got = workers[1].submit(lambda: dflash_mlx.generate(pair.model, draft, pair.tokenizer, PROMPTS[1], max_tokens=24)).get(timeout=300)
    assert ok and got == pair.tokenizer.decode(want[1])


def test_a_refused_thread_leaves_the_running_one_exact(pair_and_draft, workers):
    """The second thread asks while the first is between tokens."""
    pair, draft = pair_and_draft
    first_token, resume = threading.Event(), threading.Event()

    def first():
        out = []
        for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, PROMPTS[0], max_tokens=24):
            out += r.tokens
            first_token.set()
            resume.wait()
        return out

    done = workers[0].submit(first)
    first_token.wait(timeout=300)
    ok, err = workers[1].submit(lambda: dflash_mlx.generate(pair.model, draft, pair.tokenizer, PROMPTS[1], max_tokens=4)).get(timeout=300)
    resume.set()
    assert not ok and isinstance(err, ArgumentError) and "another thread" in str(err)
    ok, got = done.get(timeout=300)
    assert ok and got == pair.reference(PROMPTS[0], 24, eos_ids=None)


class Interrupt(KeyboardInterrupt):
    pass


class InterruptingDrafter:
    """The drafter, raising KeyboardInterrupt at its ``n``-th proposal (mid
    cycle: after the last cycle's commit, before this one's verify)."""

    def __init__(self, draft, n):
        self.draft, self.n = draft, n

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def propose(self, *args, **kw):
        self.n -= 1
        if self.n == 0:
            raise Interrupt
        return self.draft.propose(*args, **kw)


def next_turn_is_exact(pair, draft, cache):
    """After an interruption the cache is a fresh prefill's, and the next
    turn equals mlx-lm's continuation of everything the cache holds."""
    assert_like_fresh_prefill(cache, pair.model, draft)
    turn = [77, 78, 79, 80]
    want = pair.reference(cache.tokens + turn, 12, eos_ids=None)
    got = [t for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, turn, max_tokens=12, prompt_cache=cache) for t in r.tokens]
    assert got == want


@pytest.mark.parametrize("stop_after, block_size", [(1, 4), (2, 4), (5, 4), (9, 4), (2, 1), (9, 1)])
def test_closing_the_generator_mid_cycle_leaves_the_cache_usable(pair_and_draft, stop_after, block_size):
    """At every yield the next cycle is already queued (verified, not read;
    a plain step's on the previous one's token, before the host read it):
    closing the generator there rolls it back."""
    pair, draft = pair_and_draft
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    steps = dflash_mlx.stream_generate(
        pair.model, draft, pair.tokenizer, PROMPTS[0], max_tokens=40, prompt_cache=cache, block_size=block_size
    )
    for _ in range(stop_after):
        next(steps)
    assert cache.target.undo is not None  # a cycle is in flight
    steps.close()
    assert cache.target.undo is None
    next_turn_is_exact(pair, draft, cache)


@pytest.mark.parametrize("at", [1, 3])
def test_keyboard_interrupt_mid_cycle_leaves_the_cache_usable(pair_and_draft, at):
    pair, draft = pair_and_draft
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)
    with pytest.raises(KeyboardInterrupt):
        for _ in dflash_mlx.stream_generate(
            pair.model, InterruptingDrafter(draft, at), pair.tokenizer, PROMPTS[1], max_tokens=40, prompt_cache=cache, block_size=4
        ):
            pass
    next_turn_is_exact(pair, draft, cache)


def test_keyboard_interrupt_in_the_prefill_leaves_the_cache_usable(pair_and_draft):
    pair, draft = pair_and_draft
    cache = dflash_mlx.make_prompt_cache(pair.model, draft)

    def progress(done, total):
        if done >= 8:
            raise Interrupt

    with pytest.raises(KeyboardInterrupt):
        list(dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, PROMPTS[0] * 2, max_tokens=8,
                                        prompt_cache=cache, prefill_step_size=4, prompt_progress_callback=progress))
    assert cache.tokens == (PROMPTS[0] * 2)[:8] and cache.pending == []  # the chunks that ran
    next_turn_is_exact(pair, draft, cache)
    mx.clear_cache()


# Two threads, one after the other, each generate on one pair and end; the
# second samples, seeded (mx.random's key is per thread). Then the process
# exits: MLX frees an ended thread's compile traces and random key as the
# interpreter exits, and aborted it (-6) in most runs before ops.threads.
ENDED_THREADS = """
import json, sys, threading
import mlx.core as mx
mx.set_default_device(mx.cpu)
from mlx_lm import load
import dflash_mlx
target, draft_path, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model, tokenizer = load(target)
draft = dflash_mlx.load_draft(draft_path, model)
out = []
def run(prompt, **kw):
    if kw:
        mx.random.seed(7)
    out.append([t for r in dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=16, **kw) for t in r.tokens])
for prompt, kw in zip(prompts, [{}, dict(temperature=0.8, block_size=4)]):
    thread = threading.Thread(target=run, args=(prompt,), kwargs=kw)
    thread.start()
    thread.join()
print(json.dumps(out))
"""


def test_threads_that_ended_let_the_process_exit(pair_and_draft, draft_path):
    """Exit status 0 in each of two processes (most aborted before), with
    the greedy thread's output exact and the sampled one's equal to the same
    seeded run on the main thread."""
    pair, draft = pair_and_draft
    mx.random.seed(7)
    sampled = [t for r in dflash_mlx.stream_generate(pair.model, draft, pair.tokenizer, PROMPTS[1], max_tokens=16,
                                                      temperature=0.8, block_size=4) for t in r.tokens]
    want = [pair.reference(PROMPTS[0], 16, eos_ids=None), sampled]
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", ENDED_THREADS, str(pair.path), str(draft_path), json.dumps(PROMPTS)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout) == want
