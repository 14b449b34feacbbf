"""DFlash vs autoregressive decoding of the same target, measured in one run.

    mlx-dflash bench                      # the bundled pair, its held-out prompts
    mlx-dflash bench --model smollm2      # a named pair: its held-out chat requests, at its lengths
    mlx-dflash bench --model smollm2 --prompt-set edit   # requests whose answers repeat their prompt
    mlx-dflash bench --model smollm2 --repetition-penalty 1.1   # also both sides penalised: both speedups, their ratio
    mlx-dflash bench --model T --draft-model D --prompts prompts.json --json out.json --plot out.png
    mlx-dflash bench --model smollm2 --prompt-lengths 512 2048 4096 7168 --draft-window 1024 --draft-sink 64

By default DFlash chooses its block size each cycle (adaptive, up to the
drafter's trained size); the fixed trained size runs in the same pass, so the
report compares both. ``--block-size N`` fixes it instead.

Several ``--max-tokens`` run the whole benchmark at each length (JSON: a list
of reports; the figure: a row each). Reports tok/s and speedup, mean tokens
per cycle (also by answer position: 0-256, 256-512, 512-1024, ...) and the
acceptance histogram, the chosen block sizes (histogram, and per cycle for
the figure), per-phase timings (draft / verify / rollback / host, on the first
prompt), the forward costs that
bound the speedup (T1: mlx-lm's target forward on 1 token, T16: the
verify forward on a block, Tdraft: the drafter as the loop runs it; each
timed right after a prompt's runs at its context, medians over prompts),
peak memory, and the share of generated tokens that repeat an earlier 4-gram
(repetitive output inflates acceptance). ``--prompt-lengths`` measures long
prompts instead (:func:`long_prompt_report`). Each prompt runs both decoders
``--repeats`` times, alternating. Every configuration gets a warm-up
run that is not counted, and the verify is compiled at every block length
before timing starts.
"""

import argparse
import copy
import functools
import importlib
import inspect
import itertools
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional

import mlx.core as mx

from . import cli
from .cache import make_prompt_cache
from .defaults import (
    DEFAULT_BENCH_MAX_TOKENS, DEFAULT_BENCH_REPEATS, DEFAULT_DRAFT_SINK, DEFAULT_DRAFT_WINDOW, DEFAULT_MAX_TOKENS,
)
from .controls import check_processor_settings, penalty_processors
from .errors import ArgumentError
from .generate import cycle_lengths, encode_prompt, mean_tokens_per_cycle, stream_generate
from .models.dflash import masked_block
from .pair import PROMPT_SETS
from .processors import PROCESSOR_DEFAULTS
from .sampling import ACCEPTANCE_RULES
from .timing import conv_selector_share, median_ms


@dataclass
class PhaseTimer:
    """Wall time per phase of the loop. Each timed call runs to completion
    (a sync per phase), so a timed run is slower than an untimed one."""

    seconds: Dict[str, float] = field(
        default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "rollback": 0.0, "host": 0.0}
    )
    cycles: int = 0
    started: tuple = (0.0, 0.0)

    def reset(self):
        self.seconds = {k: 0.0 for k in self.seconds}
        self.cycles = 0

    def start_cycles(self):
        self.started = (time.perf_counter(), sum(self.seconds.values()))

    def stop_cycles(self):
        """Whatever the cycles spent outside the timed phases is host time."""
        wall, timed = self.started
        self.seconds["host"] += (time.perf_counter() - wall) - (sum(self.seconds.values()) - timed)

    def run(self, phase: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, computed, its time added to ``phase``."""
        tic = time.perf_counter()
        out = fn(*args, **kwargs)
        mx.eval(out)
        self.seconds[phase] += time.perf_counter() - tic
        return out


class TimedTarget:
    """A target adapter whose forwards and rollbacks are timed (the loop
    itself has no timing code)."""

    def __init__(self, target, timer: PhaseTimer):
        self.target, self.timer = target, timer

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, tokens, cache, **kwargs):
        phase = "prefill" if kwargs.get("last_logits_only") else "verify"  # a plain cycle records nothing
        self.timer.cycles += phase == "verify"

        def step():
            return self.target.forward(tokens, cache, **kwargs), [c.state for c in cache]

        return self.timer.run(phase, step)[0]

    def rollback(self, cache, keep):
        def step():
            self.target.rollback(cache, keep)
            return [c.state for c in cache]

        self.timer.run("rollback", step)


class TimedDraft:
    """A drafter whose proposals are timed, bound to a :class:`TimedTarget`."""

    def __init__(self, draft, timer: PhaseTimer):
        self.draft, self.timer = draft, timer
        self.target = TimedTarget(draft.target, timer)

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def bind(self, model):
        """Bound, it stays the timed drafter (with its timed target)."""
        self.draft.bind(model)
        return self

    def propose(self, *args, **kwargs):
        return self.timer.run("draft", self.draft.propose, *args, **kwargs)

    def propose_with_probs(self, *args, **kwargs):
        return self.timer.run("draft", self.draft.propose_with_probs, *args, **kwargs)

    def slot_head_logits(self, *args, **kwargs):
        return self.timer.run("draft", self.draft.slot_head_logits, *args, **kwargs)


def repeated_4gram_share(tokens: List[int]) -> float:
    """Fraction of tokens that complete a 4-gram already seen in the output."""
    seen, repeats = set(), 0
    for i in range(3, len(tokens)):
        gram = tuple(tokens[i - 3 : i + 1])
        repeats += gram in seen
        seen.add(gram)
    return repeats / max(1, len(tokens))


def run_autoregressive(model, tokenizer, prompt, max_tokens, prompt_cache=None, logits_processors=None):
    """One generation of mlx-lm's greedy decode (:func:`mlx_lm_tokens`)."""
    responses = []
    tokens = list(mlx_lm_tokens(model, tokenizer, prompt, max_tokens, prompt_cache, responses, logits_processors))
    last = responses[-1]
    return {"tokens": tokens, "tps": last.generation_tps, "peak_memory": last.peak_memory,
            "ttft_s": time_to_first_token(last)}


def time_to_first_token(response) -> float:
    """Seconds of the prefill, from a response of mlx-lm's or DFlash's."""
    return response.prompt_tokens / response.prompt_tps


def run_dflash(model, draft, tokenizer, prompt, max_tokens, block_size, timer=None, tree_budget=None, **options):
    """One generation (``block_size=None``: adaptive; ``tree_budget`` as
    :func:`~dflash_mlx.generate.generate_step` takes it; ``options``:
    ``draft_window``, ``draft_sink``, ``prompt_cache``); tok/s counted from the first token,
    like mlx-lm. With a ``timer`` (``draft`` a :class:`TimedDraft` on it),
    the forwards and rollbacks are timed and the rest of each cycle counts
    as host time."""
    responses = []
    for r in stream_generate(
        model, draft, tokenizer, prompt, max_tokens=max_tokens, block_size=block_size, tree_budget=tree_budget, **options
    ):
        if not responses and timer is not None:  # the cycles start after the prefill's token
            timer.start_cycles()
        responses.append(r)
    if timer is not None:
        timer.stop_cycles()
    return {
        "tokens": [t for r in responses for t in r.tokens],
        "tps": responses[-1].generation_tps,
        **cycle_record(responses),
        "peak_memory": responses[-1].peak_memory,
        "ttft_s": time_to_first_token(responses[-1]),
    }


def cycle_record(responses) -> dict:
    """A DFlash generation's cycles, from its responses (the first is the
    prefill's token)."""
    return {
        "accepted": [r.accepted for r in responses[1:]],
        "copied": [r.copied for r in responses[1:]],
        "committed": cycle_lengths(responses),
        "block_sizes": [r.block_size for r in responses[1:]],
        "tree_sizes": [r.tree_size for r in responses[1:]],
    }


def mlx_lm_tokens(model, tokenizer, prompt, max_tokens, prompt_cache=None, responses=None,
                  logits_processors=None) -> Iterator[int]:
    """mlx-lm's greedy decode as a token stream (``logits_processors``:
    mlx-lm's), its eos left out as DFlash's responses leave it; each
    response is appended to ``responses`` where given."""
    from mlx_lm import stream_generate as mlx_lm_stream_generate

    for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=prompt_cache,
                                    logits_processors=logits_processors):
        if responses is not None:
            responses.append(r)
        if r.finish_reason != "stop":
            yield r.token


def dflash_tokens(
    model, draft, tokenizer, prompt, max_tokens, block_size=None, responses=None, **options
) -> Iterator[int]:
    """DFlash's decode as a token stream (``block_size`` None: adaptive;
    ``options`` as :func:`run_dflash` takes them); each response is
    appended to ``responses`` where given."""
    for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens, block_size=block_size, **options):
        if responses is not None:
            responses.append(r)
        yield from r.tokens


def lockstep(streams: Dict[str, Callable[[], Iterator[int]]], max_tokens: int, chunk: int, repeats: int,
             untimed: int = 1, held: Optional[Callable[[str], int]] = None,
             turn_s: Optional[float] = None) -> Dict[str, List[dict]]:
    """One generation of each decoder (``streams``: name -> a fresh token
    stream) at a time, advanced in turns, the order rotating by one each
    turn: the first turn is the prefill's token, untimed (tok/s counts from
    the first token, as mlx-lm's does); then turns of ``chunk`` tokens, or
    fewer where ``turn_s`` seconds have passed (slow steps then still make
    short turns). A turn ends once its tokens are out and the device is idle
    (``mx.synchronize``): a decoder queues its next step before it yields,
    and that step must not run in the next decoder's turn. A slow spell of
    the machine lasts many turns, so it falls on every decoder alike, where
    whole runs in turn can each meet a different one.

    ``untimed`` whole rounds warm up, then ``repeats`` are kept: per name a
    list of ``{"tps", "tokens"}``; with ``held(name)`` (the bytes other
    decoders hold while ``name`` runs) also ``peak_memory`` (GB), the
    round's peak as if ``name`` ran alone."""
    names = list(streams)
    runs = {name: [] for name in names}
    for r in range(untimed + repeats):
        live = {name: stream() for name, stream in streams.items()}
        tokens = {name: [] for name in names}
        seconds, timed, peak = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), dict.fromkeys(names, 0)
        for turn in itertools.count():
            k = turn % len(names)
            for name in [n for n in names[k:] + names[:k] if n in live]:
                want, got, ended = chunk if turn else 1, [], True
                if held is not None:
                    mx.reset_peak_memory()
                tic = time.perf_counter()
                for token in live[name]:
                    got.append(token)
                    if len(got) == want or (turn and turn_s and time.perf_counter() - tic >= turn_s):
                        ended = False
                        break
                mx.synchronize()
                if turn:
                    seconds[name] += time.perf_counter() - tic
                    timed[name] += len(got)
                if held is not None:
                    peak[name] = max(peak[name], mx.get_peak_memory() - held(name))
                tokens[name] += got
                if ended or len(tokens[name]) >= max_tokens:
                    del live[name]
            if not live:
                break
        if r >= untimed:
            for name in names:
                run = {"tps": timed[name] / seconds[name] if timed[name] else 0.0, "tokens": tokens[name]}
                runs[name].append(run if held is None else {**run, "peak_memory": peak[name] / 1e9})
    return runs


def tokens_per_cycle_by_rule(
    model,
    draft,
    tokenizer,
    prompts: Iterable,
    *,
    temperature: float = 0.7,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seed: int = 0,
    **kwargs,
) -> Dict[str, float]:
    """Mean tokens committed per verify cycle at ``temperature``, for each
    acceptance rule, on the same prompts and seeds (the benchmark's and the
    BENCHMARKS.md's speculative-vs-exact-match comparison).

    Returns ``{"speculative": ..., "exact-match": ...}``. ``kwargs`` go to
    ``stream_generate`` (``top_p``, ``top_k``, ``min_p``, ``block_size``...).
    """
    prompts = list(prompts)
    result = {}
    for rule in ACCEPTANCE_RULES:
        lengths = []
        for i, prompt in enumerate(prompts):
            mx.random.seed(seed + i)
            responses = stream_generate(
                model, draft, tokenizer, prompt, max_tokens=max_tokens, temperature=temperature, acceptance=rule, **kwargs
            )
            lengths += cycle_lengths(list(responses))
        result[rule] = mean_tokens_per_cycle(lengths)
    return result


def second_turn_ttft(model, draft, tokenizer, prompts, turn1_tokens: int = 1500) -> Dict[str, float]:
    """Time to the first token of a conversation's two turns on one prompt
    cache: turn 1 a ``turn1_tokens``-token prompt (the prompts joined and
    repeated), turn 2 one short line that only it prefills."""
    from contextlib import closing

    ids = tokenizer.encode("\n".join(prompts))
    ids = (ids * (turn1_tokens // max(1, len(ids)) + 1))[:turn1_tokens]
    list(stream_generate(model, draft, tokenizer, ids[:64], max_tokens=4))  # warm-up
    cache = make_prompt_cache(model, draft)
    seconds = []
    for prompt in (ids, tokenizer.encode("\ndef main():\n")):
        tic = time.perf_counter()
        with closing(stream_generate(model, draft, tokenizer, prompt, max_tokens=8, prompt_cache=cache)) as responses:
            next(responses)
            seconds.append(time.perf_counter() - tic)
    return {"turn1_tokens": turn1_tokens, "turn1_ttft_s": seconds[0], "turn2_ttft_s": seconds[1],
            "turn2_over_turn1": seconds[1] / seconds[0]}


def time_forwards(model, draft, prompt_ids, block_size, new_context=1, repeats=20) -> Dict[str, float]:
    """Median ms of the forwards that bound the speedup, warm, after the prompt.

    ``target_1`` is mlx-lm's own forward of one token on its own cache, the
    step the autoregressive baseline runs; ``target_{B}`` is the verify
    forward (target_hidden kept), the step DFlash runs; the drafter forward
    injects ``new_context`` positions per call over the prompt's context, as
    in the loop (:func:`time_drafter`).
    """
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_prompt_cache

    lm_cache = mlx_lm_prompt_cache(model)
    mx.eval(model(prompt_ids[None], cache=lm_cache))
    one = mx.array([[1]])

    def baseline_step():
        mx.eval(model(one, cache=lm_cache), [c.state for c in lm_cache])

    target = draft.target
    cache, target_hidden = prefilled_target(target, prompt_ids)
    return {
        "target_1": median_ms(baseline_step, repeats),
        f"target_{block_size}": time_verify(target, cache, block_size, repeats),
        # a block of 1 is a plain step: nothing to draft
        "drafter": time_drafter(model, draft, target_hidden, block_size, new_context, repeats) if block_size > 1 else 0.0,
    }


def prefilled_target(target, prompt_ids):
    """(a target cache holding the prompt, the prompt's target_hidden), evaluated."""
    cache = target.make_cache()
    _, target_hidden = target.forward(mx.array(prompt_ids).reshape(1, -1), cache, last_logits_only=True, record=False)
    mx.eval(target_hidden, [c.state for c in cache])
    return cache, target_hidden


def time_verify(target, cache, block_size, repeats=20) -> float:
    """Median ms of a verify of ``block_size`` tokens on ``cache`` (left as
    it was). A forward counts until its logits and the cache it leaves are
    computed: the chunked verify's recurrent state after the block is not
    on the way to its logits, and left lazy it would never be timed (the
    loop computes it, for the accepted prefix, when it rolls back)."""
    tokens = mx.array([[1] * block_size])

    def verify():
        out, hidden = target.forward(tokens, cache)
        mx.eval(out, hidden, [c.state for c in cache])
        target.rollback(cache, 0)

    return median_ms(verify, repeats)


def time_drafter(model, draft, target_hidden, block_size, new_context=1, repeats=20, draft_window=None,
                 draft_sink=None) -> float:
    """Median ms of a drafter forward that injects ``new_context`` positions
    over the context ``target_hidden`` holds, through a context cache with
    the draft window given."""
    block = masked_block(draft, 1, block_size)
    draft_cache = make_prompt_cache(model, draft, draft_window, draft_sink).draft
    mx.eval(draft.propose(block, target_hidden[:, :-new_context], draft_cache))
    fresh = target_hidden[:, -new_context:]
    return median_ms(lambda: mx.eval(draft.propose(block, fresh, draft_cache)), repeats)


def compile_block_lengths(draft, prompt_ids, block_size) -> None:
    """Run the verify once at every block length, and the drafter once.

    A generation's blocks change length (the adaptive loop's choices, the
    last block cut to the tokens left), and each new length traces and
    compiles the verify's fused layers once per process: a one-time cost,
    like the warm-up runs, not part of decoding speed. The drafter always
    fills its whole block, so it has one length.
    """
    target = draft.target
    cache = target.make_cache()
    _, target_hidden = target.forward(prompt_ids[None], cache, last_logits_only=True, record=False)
    mx.eval(target_hidden)  # first: a pipelined target's ranks must run their collectives in one order
    for n in range(1, block_size + 1):
        logits, _ = target.forward(mx.ones((1, n), mx.int32), cache)
        mx.eval(logits)
        target.rollback(cache, 1)
    if block_size > 1:
        block = masked_block(draft, 1, block_size)
        mx.eval(draft.propose(block, target_hidden[:, -1:], draft.make_cache()))


def run_speculative(model, ar_draft, tokenizer, prompt, max_tokens, num_draft_tokens):
    """mlx-lm's classic speculative decoding with an autoregressive drafter."""
    from mlx_lm import stream_generate as mlx_lm_stream_generate

    tokens, last = [], None
    for last in mlx_lm_stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, draft_model=ar_draft, num_draft_tokens=num_draft_tokens
    ):
        if last.finish_reason != "stop":
            tokens.append(last.token)
    return {"tokens": tokens, "tps": last.generation_tps}


def speculative_baseline(model, ar_draft, tokenizer, prompts, max_tokens, ar_reference, num_draft_tokens):
    """mlx-lm's draft-model mode, where mlx-lm supports it for this target."""
    try:
        run_speculative(model, ar_draft, tokenizer, prompts[0], 16, num_draft_tokens)  # warm-up
    except ValueError as e:  # e.g. hybrid targets: mlx-lm cannot trim recurrent caches
        return {"speculative_unavailable": str(e)}
    runs = [run_speculative(model, ar_draft, tokenizer, p, max_tokens, num_draft_tokens) for p in prompts]
    n = sum(len(r["tokens"]) for r in runs)
    return {
        "speculative_tps": n / sum(len(r["tokens"]) / r["tps"] for r in runs),
        "speculative_num_draft_tokens": num_draft_tokens,
        "speculative_outputs_identical": all(r["tokens"] == a["tokens"] for r, a in zip(runs, ar_reference)),
    }


def pooled_tps(runs: List[dict]) -> float:
    """Tokens over seconds, pooled over ``runs``."""
    return sum(len(r["tokens"]) for r in runs) / sum(len(r["tokens"]) / r["tps"] for r in runs)


def position_buckets(max_tokens: int) -> List[tuple]:
    """Answer-position ranges ``(0, 256), (256, 512), (512, 1024), ...``, the
    last cut at ``max_tokens``: where a drafter trained on short rows fades."""
    edges = [0]
    while edges[-1] < max_tokens:
        edges.append(min(max_tokens, max(256, 2 * edges[-1])))
    return list(zip(edges, edges[1:]))


def tokens_per_cycle_by_position(runs: List[dict], max_tokens: int) -> Dict[str, float]:
    """Mean tokens per cycle of ``runs`` by the answer position the cycle
    starts at (the prefill's token is position 0), per :func:`position_buckets`."""
    sums = {bucket: [0, 0] for bucket in position_buckets(max_tokens)}
    for r in runs:
        position = 1
        for committed in r["committed"]:
            for lo, hi in sums:
                if lo <= position < hi:
                    sums[(lo, hi)][0] += committed
                    sums[(lo, hi)][1] += 1
            position += committed
    return {f"{lo}-{hi}": round(c / n, 3) for (lo, hi), (c, n) in sums.items() if n}


def cycle_summary(runs: List[dict], max_block: int) -> dict:
    """Tokens per cycle, the chosen block sizes and draft-tree sizes of
    DFlash ``runs``, and the drafted tokens accepted from each source (a
    cycle of copies may verify more than ``max_block`` tokens)."""
    committed = [c for r in runs for c in r["committed"]]
    blocks = [b for r in runs for b, t in zip(r["block_sizes"], r["tree_sizes"]) if not t]
    trees = Counter(t for r in runs for t in r["tree_sizes"] if t)
    hist, chosen = Counter(committed), Counter(blocks)
    longest = max([max_block, *committed, *blocks])
    copied = sum(sum(r["copied"]) for r in runs)
    return {
        "mean_tokens_per_cycle": mean_tokens_per_cycle(committed),
        "accepted_from_drafter": sum(sum(r["accepted"]) for r in runs) - copied,
        "accepted_from_copies": copied,
        "acceptance_histogram": {str(k): hist.get(k, 0) for k in range(1, longest + 1) if k <= max_block or hist.get(k)},
        "block_size_histogram": {str(k): chosen.get(k, 0) for k in range(1, longest + 1) if k <= max_block or chosen.get(k)},
        "tree_size_histogram": {str(k): v for k, v in sorted(trees.items())},
        "mean_block_size": statistics.mean(blocks) if blocks else 1.0,
    }


def configuration_summary(runs: List[dict], ar_tps: float, max_block: int) -> dict:
    """One configuration side by side with the others: tok/s (pooled) and
    its speedup, tokens and seconds per cycle, the committed path lengths
    (a histogram) and the mean tree size verified."""
    cycles = [c for r in runs for c in r["committed"]]
    seconds = sum(len(r["tokens"]) / r["tps"] for r in runs)
    trees = [t for r in runs for t in r["tree_sizes"]]
    hist = Counter(cycles)
    tps = pooled_tps(runs)
    return {
        "tps": tps,
        "speedup": tps / ar_tps,
        "tokens_per_cycle": mean_tokens_per_cycle(cycles),
        "ms_per_cycle": 1e3 * seconds / max(1, len(cycles)),
        "path_length_histogram": {str(k): hist.get(k, 0) for k in range(1, max_block + 1)},
        "mean_tree_size": statistics.mean(trees) if trees else 0.0,
        "tree_cycle_share": sum(t > 0 for t in trees) / max(1, len(trees)),
    }


def timed_runs(model, draft, tokenizer, prompts, max_tokens, configs: Dict[str, tuple], repeats, penalty=None):
    """Per prompt: ``{"autoregressive": [...], name: [...]}`` over ``repeats``
    rounds in which every configuration (``(block_size, tree_budget,
    copy_drafts, logits_processors)``) runs once, alternating (mlx-lm first,
    then the others in turn); with a :class:`Penalty`, mlx-lm penalised too
    (``autoregressive_penalised``, right after mlx-lm); and the forward
    timings taken right after each prompt's runs."""
    per_prompt, timings = [], []
    max_block = max(c[0] or draft.block_size for c in configs.values())
    names = list(configs)
    for i, prompt in enumerate(prompts):
        runs = {"autoregressive": [], **({AR_PENALISED: []} if penalty else {}), **{name: [] for name in configs}}
        for r in range(repeats):
            runs["autoregressive"].append(run_autoregressive(model, tokenizer, prompt, max_tokens))
            if penalty:
                runs[AR_PENALISED].append(run_autoregressive(model, tokenizer, prompt, max_tokens, logits_processors=penalty.mlx_lm))
            # The run right after mlx-lm's is slowed on the CPU backend (measured
            # in BENCHMARKS.md), so the configurations take turns to be it.
            turn = (i * repeats + r) % len(names)
            for name in names[turn:] + names[:turn]:
                block_size, tree_budget, copies, processors = configs[name]
                runs[name].append(run_dflash(model, draft, tokenizer, prompt, max_tokens, block_size, tree_budget=tree_budget,
                                             copy_drafts=copies, logits_processors=processors))
        per_prompt.append(runs)
        # The forwards that bound the speedup, timed right after the runs they
        # bound and at this prompt's context, so that drift on a shared
        # machine moves both alike; the drafter injects what this run committed.
        committed = runs["dflash"][0]["committed"]
        new_context = round(mean_tokens_per_cycle(committed)) if committed else 1
        ids = encode_prompt(tokenizer, prompt)
        timings.append(time_forwards(model, draft, ids, max_block, new_context, repeats=10))
    return per_prompt, timings


def phase_timings(model, draft, tokenizer, prompts, max_tokens, block_size, tree_budget=None, copy_drafts=True) -> Dict[str, float]:
    """ms per cycle of each phase over ``prompts``, in runs of their own
    (every phase syncs). A warm-up run first, not counted: the timed drafter
    is calibrated anew."""
    timer = PhaseTimer()
    timed = TimedDraft(draft, timer)
    run_dflash(model, timed, tokenizer, prompts[0], 16, block_size, tree_budget=tree_budget, copy_drafts=copy_drafts)
    timer.reset()
    for prompt in prompts:
        run_dflash(model, timed, tokenizer, prompt, max_tokens, block_size, timer=timer, tree_budget=tree_budget, copy_drafts=copy_drafts)
    return {k: 1e3 * v / max(1, timer.cycles) for k, v in timer.seconds.items() if k != "prefill"}


@dataclass
class Penalty:
    """``--repetition-penalty``: mlx-lm's repetition penalty on both sides,
    as mlx-lm's ``make_logits_processors`` builds it for mlx-lm's decode
    (``mlx_lm``) and as DFlash's verify applies it (``dflash``: the same
    processors, every verified row with its own history)."""

    penalty: float
    context_size: int
    mlx_lm: list
    dflash: list

    @classmethod
    def of(cls, penalty: float, context_size: int, vocab_size: int) -> "Penalty":
        from mlx_lm.sample_utils import make_logits_processors

        dflash = penalty_processors(vocab_size, repetition_penalty=penalty, repetition_context_size=context_size)
        return cls(penalty, context_size, make_logits_processors(None, penalty, context_size), dflash)


AR_PENALISED = "autoregressive_penalised"  # mlx-lm's runs with the penalty's processors


def reference_run(name: str) -> str:
    """The mlx-lm runs a configuration's output must equal: the penalised ones' for ``penalised``."""
    return AR_PENALISED if name in (AR_PENALISED, "penalised") else "autoregressive"


def bench_configurations(block_size, max_block, tree_budget, tree_budgets, copy_drafts, penalty=None) -> Dict[str, tuple]:
    """:func:`benchmark`'s configurations, by name: ``(block_size, tree_budget,
    copy_drafts, logits_processors)``; with a :class:`Penalty`, the main one
    penalised too (``penalised``)."""
    configs = {"dflash": (block_size, tree_budget, copy_drafts, None)}
    if copy_drafts:
        configs["no_copy"] = (block_size, tree_budget, False, None)
    if penalty is not None:
        configs["penalised"] = (block_size, tree_budget, copy_drafts, penalty.dflash)
    if not block_size:
        configs["fixed"] = (max_block, 0, copy_drafts, None)
    if tree_budgets:
        configs["chain"] = (block_size, 0, copy_drafts, None)
        configs.update({f"tree_{n}": (max_block, n, copy_drafts, None) for n in tree_budgets})
    return configs


def penalty_report(penalty: Penalty, pooled: Dict[str, float]) -> dict:
    """DFlash's speedup over mlx-lm with the repetition penalty on both sides,
    and its ratio to the speedup without one (same prompts, same rounds)."""
    speedup = pooled["dflash"] / pooled["autoregressive"]
    penalised = pooled["penalised"] / pooled[AR_PENALISED]
    return {
        "repetition_penalty": penalty.penalty, "repetition_context_size": penalty.context_size,
        "penalised_autoregressive_tps": pooled[AR_PENALISED], "penalised_dflash_tps": pooled["penalised"],
        "penalised_speedup": penalised, "penalised_speedup_ratio": penalised / speedup,
    }


def benchmark(
    model, draft, tokenizer, prompts: List[str], max_tokens=DEFAULT_BENCH_MAX_TOKENS, block_size=None,
    repeats=DEFAULT_BENCH_REPEATS, tree_budget=None, tree_budgets=(), copy_drafts=True, penalty: Optional[Penalty] = None,
):
    """The report, and mlx-lm's run of each prompt (the reference outputs).

    ``block_size=None`` benchmarks the adaptive loop and, in the same pass,
    the fixed trained block size (a chain). ``tree_budgets`` adds, side by
    side, the chain-only adaptive loop and a draft tree of each budget every
    cycle (``report["configurations"]``); ``tree_budget`` is the main
    configuration's (None: the sizer chooses). With ``copy_drafts`` every
    configuration may verify spans copied from the context, and the main
    one also runs without them (``no_copy_tps``, ``copy_speedup``). A
    :class:`Penalty` runs mlx-lm and the main configuration with it too
    (:func:`penalty_report`). Each prompt's runs alternate
    ``repeats`` times; tok/s pools every timed run, which steadies the
    speedup on a shared machine. Outputs and acceptance come from the first
    run of each.
    """
    max_block = block_size or draft.block_size
    configs = bench_configurations(block_size, max_block, tree_budget, tree_budgets, copy_drafts, penalty)
    draft.bind(model)
    warm = prompts[0]
    run_autoregressive(model, tokenizer, warm, 16, logits_processors=penalty and penalty.mlx_lm)
    for b, t, c, p in configs.values():
        run_dflash(model, draft, tokenizer, warm, 16, b, tree_budget=t, copy_drafts=c, logits_processors=p)
    compile_block_lengths(draft, encode_prompt(tokenizer, warm), max_block)
    timed, timings = timed_runs(model, draft, tokenizer, prompts, max_tokens, configs, repeats, penalty)

    # Every run of a prompt, any decoder, must give mlx-lm's first output (with the same processors).
    mismatches = sum(
        any(r["tokens"] != runs[reference_run(name)][0]["tokens"] for name, rs in runs.items() for r in rs) for runs in timed
    )
    pooled = {name: pooled_tps([r for runs in timed for r in runs[name]]) for name in timed[0]}
    first = {name: [runs[name][0] for runs in timed] for name in timed[0]}
    summary = cycle_summary(first["dflash"], max_block)
    at_max = cycle_summary(first.get("fixed", first["dflash"]), max_block)["mean_tokens_per_cycle"]
    forwards = {k: statistics.median(t[k] for t in timings) for k in timings[0]}
    ideal = at_max * forwards["target_1"] / (forwards[f"target_{max_block}"] + forwards["drafter"])
    speedup = pooled["dflash"] / pooled["autoregressive"]
    trace = first["dflash"][0]
    report = {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "block_size": max_block,
        "adaptive": block_size is None,
        "repeats": repeats,
        "autoregressive_tps": pooled["autoregressive"],
        "dflash_tps": pooled["dflash"],
        "speedup": speedup,
        **summary,
        "tokens_per_cycle_by_position": tokens_per_cycle_by_position(first["dflash"], max_tokens),
        # On the first prompt: the split is the pair's and the length's, and
        # every prompt would cost the bench another whole decode.
        "phase_ms_per_cycle": phase_timings(model, draft, tokenizer, prompts[:1], max_tokens, block_size, tree_budget, copy_drafts),
        "forward_ms": forwards,
        "ideal_speedup": ideal,
        "fraction_of_ideal": speedup / ideal,
        "trace": {"committed": trace["committed"], "block_size": trace["block_sizes"]},
        "repeated_4gram_share": statistics.mean(repeated_4gram_share(r["tokens"]) for r in first["dflash"]),
        "outputs_identical": mismatches == 0,
        "mismatched_prompts": mismatches,
        "peak_memory_gb": max(r["peak_memory"] for runs in timed for rs in runs.values() for r in rs),
    }
    if "no_copy" in pooled:
        report["no_copy_tps"] = pooled["no_copy"]
        report["copy_speedup"] = pooled["dflash"] / pooled["no_copy"]
    if penalty is not None:
        report.update(penalty_report(penalty, pooled))
    if "fixed" in pooled:
        report["fixed_block_tps"] = pooled["fixed"]
        report["fixed_block_speedup"] = pooled["fixed"] / pooled["autoregressive"]
        report["fixed_block_tokens_per_cycle"] = at_max
        report["fixed_block_tokens_per_cycle_by_position"] = tokens_per_cycle_by_position(first["fixed"], max_tokens)
    if tree_budgets:
        report["configurations"] = {
            name: configuration_summary([r for runs in timed for r in runs[name]], pooled[reference_run(name)], max_block)
            for name in configs
        }
    return report, first["autoregressive"]


# Held-out prose for long prompts: Python's own documentation, the
# docstrings of these standard-library modules and their public members. It
# ships with every Python; the SmolLM2 pair's training requests leave these
# modules out (recipes/smollm2_requests.py).
DOCUMENT_MODULES = (
    "argparse", "json", "logging", "collections", "pathlib", "subprocess", "textwrap", "dataclasses",
    "unittest", "http.server", "email.message", "inspect", "functools",
)
# A turn when decoders are timed in :func:`lockstep`: at most this many
# tokens and, once one is out, about this many seconds. Many turns per
# generation, each long enough that its closing synchronisation is a small
# part of it, and short enough that a slow spell of the machine spans
# several decoders' turns.
LOCKSTEP_TOKENS = 32
LOCKSTEP_SECONDS = 0.25
DOCUMENT_QUESTION = "Which modules does the documentation above describe, and what is each one for? Answer briefly."


def documentation_text() -> str:
    """The docstrings of :data:`DOCUMENT_MODULES` and their public members, as one markdown text."""
    parts = []
    for name in DOCUMENT_MODULES:
        module = importlib.import_module(name)
        parts.append(f"# {name}\n\n{inspect.getdoc(module) or ''}")
        for attr, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if not attr.startswith("_") and getattr(obj, "__module__", None) == name else None
            if doc:
                parts.append(f"## {name}.{attr}\n\n{doc}")
    return "\n\n".join(parts)


def long_prompt(tokenizer, length: int) -> str:
    """A prompt of about ``length`` tokens: the start of
    :func:`documentation_text` and :data:`DOCUMENT_QUESTION`, in the chat
    template where the tokenizer has one."""

    def wrap(document):
        text = f"{document}\n\n{DOCUMENT_QUESTION}"
        if not getattr(tokenizer, "chat_template", None):
            return text
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)

    overhead = len(tokenizer.encode(wrap("")))
    ids = tokenizer.encode(documentation_text(), add_special_tokens=False)
    if length - overhead > len(ids):
        raise ArgumentError(f"--prompt-lengths {length}: the documentation text holds only {len(ids) + overhead} tokens")
    return wrap(tokenizer.decode(ids[: max(0, length - overhead)]))


def window_name(window, sink) -> str:
    return f"window {window} + sink {sink}" if window else "full context"


@dataclass
class LongPromptDecoder:
    """One decoder of :func:`long_prompt_report`: ``tokens(prompt,
    max_tokens, prompt_cache, responses)`` generates as a token stream
    (:func:`mlx_lm_tokens`, :func:`dflash_tokens`), ``make_cache()`` makes
    its empty prompt cache."""

    tokens: Callable
    make_cache: Callable
    state: Optional[object] = None  # its prompt cache after all of the prompt but its last token
    live: Optional[object] = None  # the prompt cache of the round under way
    ttft_s: float = 0.0
    peak_gb: float = 0.0
    responses: List[list] = field(default_factory=list)  # each round's

    def prefill(self, ids: List[int], others_bytes: int) -> None:
        """Generate one token after the whole prompt on a fresh cache (the
        time to first token and the prefill's peak memory), then trim it
        back to all but the prompt's last token: each round continues from
        a copy of that state, feeding the last token as mlx-lm's prefill
        runs it, alone. A cache that cannot trim keeps no state: each
        round prefills anew."""
        cache = self.make_cache()
        mx.reset_peak_memory()
        responses = []
        for _ in self.tokens(ids, 1, cache, responses):
            pass
        self.ttft_s = time_to_first_token(responses[-1])
        self.peak_gb = responses[-1].peak_memory - others_bytes / 1e9
        if cache.is_trimmable():
            cache.trim(cache.offset - (len(ids) - 1))
            self.state = cache

    def stream(self, ids: List[int], max_tokens: int) -> Iterator[int]:
        """One round's token stream, on a copy of the state (or, where none
        was kept, on a fresh cache from the whole prompt); its responses
        are kept in ``responses``."""
        self.live = self.make_cache() if self.state is None else copy.deepcopy(self.state)
        self.responses.append([])
        prompt = ids if self.state is None else ids[-1:]
        return self.tokens(prompt, max_tokens, self.live, self.responses[-1])

    def peak(self, runs: List[dict]) -> float:
        """Peak GB of the prefill and of the decoder's :func:`lockstep` rounds."""
        return max([self.peak_gb] + [run["peak_memory"] for run in runs])


class MlxLmCache(list):
    """mlx-lm's prompt cache (a list of layer caches) with the ``offset``,
    ``nbytes``, ``is_trimmable`` and ``trim`` of a DFlash
    :class:`~dflash_mlx.cache.PromptCache`, so that a decoder keeps either
    kind of state the same way."""

    @property
    def offset(self) -> int:
        return self[0].offset

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self)

    def is_trimmable(self) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache

        return can_trim_prompt_cache(self)

    def trim(self, n: int) -> int:
        from mlx_lm.models.cache import trim_prompt_cache

        return trim_prompt_cache(self, n)


def separate_drafter(draft):
    """A drafter object on ``draft``'s weights, target binding and draft
    head (shared, not copied) that learns on its own: what the loop learns
    (the calibration and the block sizer, :mod:`dflash_mlx.calibration`)
    is kept per drafter object. Decoders taking :func:`lockstep` turns
    each learn from their own cycles then, as one generating alone does,
    where sharing one drafter would mix their cycles into one sizer."""
    return copy.copy(draft)


def long_prompt_runs(d: LongPromptDecoder, runs: List[dict], ar_runs: List[dict]) -> dict:
    """A DFlash decoder's :func:`lockstep` rounds at one length against
    mlx-lm's (``ar_runs``)."""
    tps, ar_tps = [run["tps"] for run in runs], [run["tps"] for run in ar_runs]
    cycles = [cycle_record(responses) for responses in d.responses[-len(runs):]]
    return {
        "tps": statistics.median(tps),
        "speedup": statistics.median(tps) / statistics.median(ar_tps),
        "paired_speedup": statistics.median(x / y for x, y in zip(tps, ar_tps)),
        "ttft_s": d.ttft_s,
        "tokens_per_cycle": mean_tokens_per_cycle([c for record in cycles for c in record["committed"]]),
        "drafting_cycles": statistics.median(sum(b > 1 for b in record["block_sizes"]) for record in cycles),
        "peak_memory_gb": d.peak(runs),
        "outputs_identical": all(run["tokens"] == ar_runs[0]["tokens"] for run in [*ar_runs, *runs]),
    }


def context_forwards(draft, state, ids, block_size):
    """(verify ms, the context's target_hidden) at the prompt's context: on a
    copy of a full-context DFlash ``state`` (the prompt but its last token),
    or on a prefill of its own where no state was kept."""
    target = draft.target
    if state is None:
        cache, target_hidden = prefilled_target(target, ids)
    else:
        state = copy.deepcopy(state)
        cache, target_hidden = state.target, state.target_hidden
        mx.eval(target_hidden, [c.state for c in cache])
    return time_verify(target, cache, block_size, repeats=5), target_hidden


def warmed_drafters(model, draft, tokenizer, windows, sink, block_size) -> dict:
    """Compile and calibrate before anything is timed (mlx-lm and DFlash on
    a short prompt, every block length), and give each draft window its
    own :func:`separate_drafter`, warmed on that window: ``{window:
    drafter}``. ``draft`` runs once first, so that what the drafters share
    (the draft head) is built before they are separated."""
    draft.bind(model)
    warm = long_prompt(tokenizer, 64)
    run_autoregressive(model, tokenizer, warm, 8)
    run_dflash(model, draft, tokenizer, warm, 8, block_size)
    compile_block_lengths(draft, encode_prompt(tokenizer, warm), block_size or draft.block_size)
    drafts = {w: separate_drafter(draft) for w in windows}
    for w, d in drafts.items():
        run_dflash(model, d, tokenizer, warm, 8, block_size, draft_window=w, draft_sink=sink)
    return drafts


def long_prompt_report(model, draft, tokenizer, lengths, max_tokens, windows, sink, block_size=None,
                       repeats=DEFAULT_BENCH_REPEATS, copy_drafts: bool = True) -> dict:
    """Long prompts: at each length, mlx-lm and DFlash with the full context
    and with every draft window in ``windows`` (0 in it: the full context)
    and ``sink``.

    A long prompt's prefill takes minutes on a CPU, and one generation's
    tok/s moves from run to run by more than the bars, so each decoder
    prefills the prompt once (time to first token measured there,
    :meth:`LongPromptDecoder.prefill`) and decodes ``repeats`` rounds from
    that state, all decoders in :func:`lockstep` turns of up to
    :data:`LOCKSTEP_TOKENS` tokens or :data:`LOCKSTEP_SECONDS`, each DFlash
    decoder with a drafter of its own (:func:`warmed_drafters`). Reported
    per decoder: median tok/s, DFlash's speedup (of the medians, and the
    median of each round's own ratio), tokens per cycle, peak memory (of
    the prefill and of the rounds, as if the decoder ran alone: the other
    decoders' states are not counted) and the drafter's share of a cycle
    (its forward over its windowed cache against the verify, at that
    context). ``copy_drafts``: whether DFlash may verify spans copied from
    the context."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_prompt_cache

    configs = list(dict.fromkeys([0, *windows]))
    max_block = block_size or draft.block_size
    drafts = warmed_drafters(model, draft, tokenizer, configs, sink, block_size)

    def dflash(d, w):
        return LongPromptDecoder(
            lambda ids, n, cache, responses: dflash_tokens(model, d, tokenizer, ids, n, block_size, responses,
                                                           prompt_cache=cache, copy_drafts=copy_drafts),
            lambda: make_prompt_cache(model, d, w, sink),
        )

    rows = []
    for length in lengths:
        ids = encode_prompt(tokenizer, long_prompt(tokenizer, length)).tolist()
        decoders = {"mlx-lm": LongPromptDecoder(
            lambda ids, n, cache, responses: mlx_lm_tokens(model, tokenizer, ids, n, cache, responses),
            lambda: MlxLmCache(mlx_lm_prompt_cache(model)),
        )}
        decoders.update({w: dflash(d, w) for w, d in drafts.items()})

        def states():
            return sum(d.state.nbytes for d in decoders.values() if d.state is not None)

        def held(name):  # while ``name`` runs a round: every saved state and the others' rounds
            return states() + sum(d.live.nbytes for n, d in decoders.items() if n != name and d.live is not None)

        for d in decoders.values():
            d.prefill(ids, states())
        streams = {name: functools.partial(d.stream, ids, max_tokens) for name, d in decoders.items()}
        runs = lockstep(streams, max_tokens, LOCKSTEP_TOKENS, repeats, untimed=0, held=held, turn_s=LOCKSTEP_SECONDS)
        for d in decoders.values():
            d.live = None
        verify, target_hidden = context_forwards(drafts[0], decoders[0].state, ids, max_block)
        ar = decoders.pop("mlx-lm")
        row = {
            "prompt_length": length,
            "prompt_tokens": len(ids),
            "autoregressive": {"tps": statistics.median(run["tps"] for run in runs["mlx-lm"]), "ttft_s": ar.ttft_s,
                               "peak_memory_gb": ar.peak(runs["mlx-lm"])},
            "dflash": {},
        }
        for w, d in decoders.items():
            drafter = time_drafter(model, draft, target_hidden, max_block, repeats=5, draft_window=w, draft_sink=sink)
            row["dflash"][window_name(w, sink)] = {
                "draft_window": w, "draft_sink": sink if w else 0, **long_prompt_runs(d, runs[w], runs["mlx-lm"]),
                "drafter_ms": drafter, "verify_ms": verify, "drafter_share": drafter / (drafter + verify),
            }
        rows.append(row)
    return {"max_tokens": max_tokens, "block_size": max_block, "adaptive": block_size is None, "rounds": repeats,
            "turn_tokens": LOCKSTEP_TOKENS, "turn_seconds": LOCKSTEP_SECONDS,
            "document_source": f"docstrings of Python {sys.version.split()[0]}'s {', '.join(DOCUMENT_MODULES)}",
            "question": DOCUMENT_QUESTION, "lengths": rows}


def print_long_prompt_report(r: dict) -> None:
    mode = f"adaptive, up to {r['block_size']}" if r["adaptive"] else f"fixed {r['block_size']}"
    print(f"long prompts: {r['max_tokens']} new tokens, block size {mode}, medians of {r['rounds']} rounds after one "
          f"prefill each, the decoders in turns of up to {r['turn_tokens']} tokens "
          f"or {r['turn_seconds']} s; documents: {r['document_source']}")
    print(f"{'prompt':>7} {'decoder':<28} {'tok/s':>8} {'speedup':>8} {'paired':>7} {'TTFT s':>8} {'tok/cycle':>9} "
          f"{'drafted':>7} {'drafter':>8} {'peak GB':>8} identical")
    for row in r["lengths"]:
        ar = row["autoregressive"]
        print(f"{row['prompt_tokens']:>7} {'mlx-lm':<28} {ar['tps']:8.1f} {'':>8} {'':>7} {ar['ttft_s']:8.2f} {'':>9} "
              f"{'':>7} {'':>8} {ar['peak_memory_gb']:8.3f}")
        for name, d in row["dflash"].items():
            print(f"{'':>7} {'DFlash, ' + name:<28} {d['tps']:8.1f} {d['speedup']:7.2f}x {d['paired_speedup']:6.2f}x "
                  f"{d['ttft_s']:8.2f} "
                  f"{d['tokens_per_cycle']:9.2f} {d['drafting_cycles']:7g} {100 * d['drafter_share']:7.1f}% "
                  f"{d['peak_memory_gb']:8.3f} "
                  f"{d['outputs_identical']}")


def print_report(r: dict) -> None:
    B = r["block_size"]
    mode = f"adaptive, up to {B}" if r["adaptive"] else f"fixed {B}"
    print(f"prompts {r['prompts']}, max tokens {r['max_tokens']}, block size {mode}")
    print(f"autoregressive (mlx-lm)  {r['autoregressive_tps']:8.1f} tok/s")
    print(f"DFlash                   {r['dflash_tps']:8.1f} tok/s   speedup {r['speedup']:.2f}x")
    if "fixed_block_tps" in r:
        print(
            f"DFlash, fixed block {B:<4} {r['fixed_block_tps']:8.1f} tok/s   speedup {r['fixed_block_speedup']:.2f}x"
            f"   ({r['fixed_block_tokens_per_cycle']:.2f} tokens per cycle)"
        )
    if "no_copy_tps" in r:
        print(f"DFlash, no copy drafts   {r['no_copy_tps']:8.1f} tok/s   (copy drafts {r['copy_speedup']:.2f}x it)")
    if "penalised_speedup" in r:
        print(
            f"repetition penalty {r['repetition_penalty']:<5} mlx-lm {r['penalised_autoregressive_tps']:.1f} tok/s, "
            f"DFlash {r['penalised_dflash_tps']:.1f} tok/s   speedup {r['penalised_speedup']:.2f}x "
            f"({r['penalised_speedup_ratio']:.2f}x the speedup without it)"
        )
    print(f"mean tokens per cycle    {r['mean_tokens_per_cycle']:.2f}")
    print(f"accepted drafted tokens  {r['accepted_from_drafter']} from the drafter, {r['accepted_from_copies']} copied from the context")
    if len(r["tokens_per_cycle_by_position"]) > 1:
        fixed = r.get("fixed_block_tokens_per_cycle_by_position")
        by_pos = "  ".join(
            f"{k}: {v:.2f}" + (f" ({fixed[k]:.2f} fixed)" if fixed and k in fixed else "")
            for k, v in r["tokens_per_cycle_by_position"].items()
        )
        print(f"  by answer position     {by_pos}")
    chosen = " ".join(f"{k}:{v}" for k, v in r["block_size_histogram"].items() if v)
    print(f"chosen block sizes       {chosen}  (mean {r['mean_block_size']:.2f})")
    if r.get("tree_size_histogram"):
        trees = " ".join(f"{k}:{v}" for k, v in r["tree_size_histogram"].items())
        print(f"chosen draft trees       {trees}  (nodes:cycles)")
    print(
        f"forwards (ms)            target x1 {r['forward_ms']['target_1']:.2f}, "
        f"target x{B} {r['forward_ms'][f'target_{B}']:.2f}, drafter {r['forward_ms']['drafter']:.2f}"
    )
    print(f"ideal speedup            {r['ideal_speedup']:.2f}x  (achieved {100 * r['fraction_of_ideal']:.0f}% of it)")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phase_ms_per_cycle"].items())
    print(f"phases (ms per cycle)    {phases}  (first prompt, each phase synced)")
    hist = " ".join(f"{k}:{v}" for k, v in r["acceptance_histogram"].items())
    print(f"tokens per cycle hist    {hist}")
    print(f"repeated 4-gram share    {100 * r['repeated_4gram_share']:.1f}%")
    print(f"outputs identical to AR  {r['outputs_identical']}")
    print(f"peak memory              {r['peak_memory_gb']:.3f} GB")
    if "configurations" in r:
        print_configurations(r["configurations"])
    if "second_turn_ttft" in r:
        t = r["second_turn_ttft"]
        print(
            f"time to first token      turn 1 ({t['turn1_tokens']} tokens) {1e3 * t['turn1_ttft_s']:.1f} ms, "
            f"turn 2 on its cache {1e3 * t['turn2_ttft_s']:.1f} ms (ratio {t['turn2_over_turn1']:.3f})"
        )
    if "speculative_unavailable" in r:
        print(f"mlx-lm speculative       not available: {r['speculative_unavailable']}")
    if "speculative_tps" in r:
        print(
            f"mlx-lm speculative       {r['speculative_tps']:8.1f} tok/s   "
            f"({r['speculative_num_draft_tokens']} draft tokens, identical {r['speculative_outputs_identical']})"
        )
    if "sampled_tokens_per_cycle" in r:
        t = r["sampled_tokens_per_cycle"]
        print(
            f"tokens per cycle at T={r['sampling_temperature']}  rejection sampling {t['speculative']:.2f}, "
            f"exact match {t['exact-match']:.2f}"
        )
    for impl, share in r.get("conv_selector_share", {}).items():
        print(f"DFlash2 conv+selector    {impl}: {100 * share['share']:.1f}% of a draft forward ({1e3 * share['draft_s']:.2f} ms)")


CONFIGURATION_NAMES = {"dflash": "adaptive", "fixed": "chain, fixed block", "chain": "chain, adaptive"}


def print_configurations(configurations: Dict[str, dict]) -> None:
    """Chains, trees and the adaptive loop side by side (same prompts, same runs)."""
    print(f"{'configuration':<22} {'tok/s':>8} {'speedup':>8} {'tok/cycle':>10} {'ms/cycle':>9}  committed path lengths")
    for name, c in configurations.items():
        label = CONFIGURATION_NAMES.get(name, name.replace("_", " "))
        hist = " ".join(f"{k}:{v}" for k, v in c["path_length_histogram"].items() if v)
        print(
            f"{label:<22} {c['tps']:8.1f} {c['speedup']:7.2f}x {c['tokens_per_cycle']:10.2f} {c['ms_per_cycle']:9.2f}  {hist}"
        )


def plot(reports: List[dict], path: str) -> None:
    """One row of panels per report (per --max-tokens): acceptance, tok/s, and
    the first prompt's cycles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(reports), 3, figsize=(15, 4 * len(reports)), squeeze=False)
    for (ax1, ax2, ax3), r in zip(axes, reports):
        hist = r["acceptance_histogram"]
        ax1.bar([int(k) for k in hist], list(hist.values()), color="#4C72B0")
        ax1.set_xlabel("tokens committed per cycle")
        ax1.set_ylabel("cycles")
        ax1.set_title(f"{r['max_tokens']} tokens: acceptance (mean {r['mean_tokens_per_cycle']:.2f})")
        names = ["autoregressive", "DFlash"]
        values = [r["autoregressive_tps"], r["dflash_tps"]]
        if "fixed_block_tps" in r:
            names.append(f"fixed {r['block_size']}")
            values.append(r["fixed_block_tps"])
        if "speculative_tps" in r:
            names.insert(1, "spec. (mlx-lm)")
            values.insert(1, r["speculative_tps"])
        ax2.bar(names, values, color=["#999999", "#DD8452", "#55A868", "#C44E52"][: len(names)])
        ax2.set_ylabel("tokens / s")
        ax2.set_title(f"speedup {r['speedup']:.2f}x")
        plot_trace(ax3, r["trace"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_trace(ax, trace: dict) -> None:
    """Tokens committed and block size chosen per cycle, over the first prompt's generation."""
    position = list(itertools.accumulate([0] + trace["committed"][:-1]))
    ax.step(position, trace["block_size"], where="post", color="#C44E52", label="block size")
    ax.plot(position, trace["committed"], ".", color="#4C72B0", label="tokens committed")
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("per cycle")
    ax.set_title("first prompt, cycle by cycle")
    ax.legend()


def setup_arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description="Benchmark DFlash against autoregressive decoding of the same target.")
    cli.add_pair_arguments(p)
    p.add_argument("--prompts", default=None, help="JSON list of prompts (default: the bundled held-out prompts)")
    p.add_argument(
        "--prompt-set", choices=sorted(PROMPT_SETS), default=None,
        help="a prompt set of the package instead, as chat turns (edit: requests whose answer repeats the prompt; "
        "json_extract: JSON extraction requests, unconstrained here: examples/structured_bench.py holds them to their schemas)",
    )
    p.add_argument("--num-prompts", type=cli.positive_int, default=None)
    p.add_argument(
        "--max-tokens", "-m", type=cli.positive_int, nargs="+", default=None,
        help=f"new tokens per prompt; several values run the benchmark at each (default: the named pair's "
        f"lengths, else {DEFAULT_BENCH_MAX_TOKENS})",
    )
    cli.add_block_size_argument(p)
    cli.add_tree_budget_argument(p)
    cli.add_copy_drafts_argument(p)
    p.add_argument(
        "--tree-budgets", type=cli.positive_int, nargs="*", default=[8, 16, 32, 64],
        help="also run the chain-only adaptive loop and a draft tree of each of these node budgets every cycle, "
        "side by side (none: skip)",
    )
    p.add_argument("--repeats", type=cli.positive_int, default=DEFAULT_BENCH_REPEATS, help="timed runs per prompt of each configuration, alternating")
    p.add_argument("--ar-draft-model", default=None, help="also run mlx-lm's classic speculative decoding with this autoregressive drafter")
    p.add_argument("--num-draft-tokens", type=cli.positive_int, default=3, help="draft tokens per step for --ar-draft-model")
    p.add_argument("--temp", type=cli.temperature, default=None, help="also compare tokens per cycle of rejection sampling vs exact match at this temperature")
    p.add_argument("--sampling-temp", dest="temp", type=cli.temperature, help=argparse.SUPPRESS)  # the old spelling
    p.add_argument(
        "--prompt-lengths", type=cli.positive_int, nargs="+", default=None,
        help="measure long prompts instead: documentation text plus a question, about this many tokens each "
        "(mlx-lm, DFlash with the full context and with each --draft-window; default --max-tokens 256)",
    )
    cli.add_draft_window_arguments(p, several=True)
    p.add_argument(
        "--repetition-penalty", type=cli.checked(lambda v: check_processor_settings(repetition_penalty=v), float), default=None,
        help="also run mlx-lm and DFlash both with this repetition penalty (mlx-lm's processors), side by side: "
        "both speedups and their ratio",
    )
    p.add_argument(
        "--repetition-context-size", type=cli.checked(lambda v: check_processor_settings(repetition_context_size=v)),
        default=PROCESSOR_DEFAULTS["repetition_context_size"], help="with --repetition-penalty: the tokens it looks back over",
    )
    p.add_argument("--ttft-turn1", type=cli.positive_int, default=None, help="also time the first token of a second turn on the prompt cache after a turn 1 of this many tokens")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write a PNG figure here")
    return p


def read_prompts(path) -> List[str]:
    """The ``--prompts`` file: a JSON list of strings."""
    prompts = json.loads(open(path).read())
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ArgumentError(f"--prompts {path}: expected a non-empty JSON list of strings")
    return prompts


def main(argv=None):
    from .blas import warn_if_reference
    from .pair import benchmark_lengths, benchmark_prompts, load_pair

    args = setup_arg_parser().parse_args(argv)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ArgumentError(f"{flag} {path}: its directory does not exist")
    if args.prompt_lengths is None and (args.draft_window is not None or args.draft_sink is not None):
        raise ArgumentError("--draft-window is measured with --prompt-lengths (long prompts); add it")
    if args.prompts and args.prompt_set:
        raise ArgumentError("--prompts and --prompt-set both name the prompts: pass one")
    for flag, value in (("--prompts", args.prompts), ("--prompt-set", args.prompt_set), ("--plot", args.plot),
                        ("--repetition-penalty", args.repetition_penalty)):
        if args.prompt_lengths and value:
            raise ArgumentError(f"{flag} does not apply to --prompt-lengths (its prompts are documentation text)")
    prompts = read_prompts(args.prompts) if args.prompts else None
    model, tokenizer, draft, draft_path = load_pair(args.model, args.draft_model)
    warn_if_reference()  # loaded: about to measure
    if args.prompt_lengths:
        windows = args.draft_window or [DEFAULT_DRAFT_WINDOW]
        sink = DEFAULT_DRAFT_SINK if args.draft_sink is None else args.draft_sink
        max_tokens = args.max_tokens[0] if args.max_tokens else DEFAULT_MAX_TOKENS
        report = long_prompt_report(
            model, draft, tokenizer, args.prompt_lengths, max_tokens, windows, sink, args.block_size, args.repeats,
            args.copy_drafts,
        )
        report.update(model=str(args.model), draft_model=str(draft_path), mlx=mx.__version__, device=str(mx.default_device()))
        print_long_prompt_report(report)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return 0
    prompts = prompts or benchmark_prompts(args.model, tokenizer, args.prompt_set)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    ar_draft = None
    if args.ar_draft_model:  # loaded once for every length
        from mlx_lm import load as mlx_lm_load

        ar_draft = mlx_lm_load(args.ar_draft_model)[0]
    reports = []
    for max_tokens in args.max_tokens or benchmark_lengths(args.model):
        report = full_report(args, model, tokenizer, draft, ar_draft, prompts, max_tokens)
        report.update(model=str(args.model), draft_model=str(draft_path), mlx=mx.__version__, device=str(mx.default_device()))
        print_report(report)
        reports.append(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports[0] if len(reports) == 1 else reports, f, indent=2)
    if args.plot:
        plot(reports, args.plot)
    return 0


def full_report(args, model, tokenizer, draft, ar_draft, prompts, max_tokens) -> dict:
    """:func:`benchmark` at ``max_tokens`` and the comparisons the flags ask
    for (``ar_draft``: the ``--ar-draft-model``, or None)."""
    penalty = None
    if args.repetition_penalty is not None:
        penalty = Penalty.of(args.repetition_penalty, args.repetition_context_size, draft.target.vocab_size)
    report, ar_runs = benchmark(
        model, draft, tokenizer, prompts, max_tokens, args.block_size, args.repeats, args.tree_budget, args.tree_budgets,
        args.copy_drafts, penalty,
    )
    if ar_draft is not None:
        report.update(speculative_baseline(model, ar_draft, tokenizer, prompts, max_tokens, ar_runs, args.num_draft_tokens))
    if args.temp:
        report["sampling_temperature"] = args.temp
        report["sampled_tokens_per_cycle"] = tokens_per_cycle_by_rule(
            model, draft, tokenizer, prompts, temperature=args.temp, max_tokens=max_tokens, block_size=args.block_size,
        )
    if draft.config.architecture == "DFlash2DraftModel":
        report["conv_selector_share"] = conv_selector_share(draft, block_size=report["block_size"])
    if args.ttft_turn1:
        report["second_turn_ttft"] = second_turn_ttft(model, draft, tokenizer, prompts, args.ttft_turn1)
    return report


if __name__ == "__main__":
    sys.exit(cli.run(main))
