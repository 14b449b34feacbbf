"""Replay copy drafts (:mod:`dflash_mlx.copy_source`) over a target's greedy
answers: how many tokens a cycle would commit, free of the machine's speed.
The copy source's constants are derived from these replays over the tuning
set (``--prompt-set edit_tuning``, the default); the bench's edit set
(``--prompt-set edit``) is held out: replayed and timed, never tuned on.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/copy_replay.py --block-size 33                  # the tuning set: generates its answers, then replays
    python examples/copy_replay.py --prompt-set edit --sized 0.054  # the held-out set, as the loop sizes copies

The answers are mlx-lm's own greedy decode (``stream_generate``, its default
sampler) of the set's requests as chat turns (as the bench's
``--prompt-set`` runs them; ``--prompts`` another JSON list of requests),
written to ``--answers`` once (default
``examples/results/<model>_<set>_answers.json``) and read from it after.
Each answer is then replayed: the index holds the prompt and the answer's
first token (the prefill's); a cycle commits the proposed tokens that
equal the answer and the target's own token after them (a cycle without a
proposal is a plain step: one token).

- Prompt lookup alone (the default): every cycle proposes up to
  ``--block-size - 1`` tokens. Reported per class of match
  (:data:`~dflash_mlx.copy_source.MATCH_CLASSES`): the proposals, the tokens
  accepted per proposal, and the share of copied slots accepted (accepted
  over accepted and proposals cut short), the pooled share that a class's
  prior (:data:`~dflash_mlx.copy_source.COPY_PRIORS`) stands for; and the
  priors those shares give (:func:`priors_of`). On the tuning set at
  ``--block-size 33`` (``MAX_COPY + 1``) they are ``COPY_PRIORS``.
- ``--sized SLOPE``: as the loop decides. Each cycle the row's
  :class:`~dflash_mlx.copy_source.CopyDrafts` proposes, the loop's own rule
  (:meth:`dflash_mlx.decode.Sizing.copies`) verifies a copy alone or takes
  a plain step, and the copy's class learns what was accepted. A verify of
  ``m`` tokens costs ``1 + SLOPE (m - 1)`` plain steps (a CPU's verify
  grows with its rows; 0: a device where rows are nearly free); the
  drafter is taken to accept nothing (on answers that copy their context
  it proposes next to nothing), so the other choice is a plain step.
  Reported besides: tokens per plain step's time, as that cost model has it.

Reported per request and pooled over the set: tokens per cycle (over the
cycles after the prefill), the cycles that proposed and those of them that
had nothing accepted (a verify the loop paid for one token), and the share
of answer tokens that were copied.
"""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from dflash_mlx.adaptive import BlockSizer, CycleCosts
from dflash_mlx.copy_source import DEFAULT_MAX_NGRAM, DEFAULT_MIN_MATCH, MATCH_CLASSES, CopyDrafts, CopyIndex, match_class
from dflash_mlx.decode import Request, Sizing
from dflash_mlx.pair import PROMPT_SETS


def greedy_answers(model_name: str, requests, max_tokens: int):
    """mlx-lm's greedy answer to each request: ``{"prompt": ids, "answer": ids}``."""
    from mlx_lm import load, stream_generate

    from dflash_mlx.generate import encode_prompt
    from dflash_mlx.pair import NAMED_PAIRS, as_chat, named_pair_paths

    path = named_pair_paths(model_name, need_draft=False)[0] if model_name in NAMED_PAIRS else model_name
    model, tokenizer = load(str(path))
    out = []
    for text in as_chat(tokenizer, requests):
        prompt = encode_prompt(tokenizer, text).tolist()
        answer = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
        out.append({"prompt": list(prompt), "answer": answer, "text": tokenizer.decode(answer)})
        print(f"[copy_replay] answer {len(out)}/{len(requests)}: {len(answer)} tokens", flush=True)
    return out


def accepted_of(span, answer, at: int) -> int:
    """How many of ``span``'s tokens equal the answer's from ``at`` on (greedy acceptance)."""
    n = 0
    while n < len(span) and at + n < len(answer) and span[n] == answer[at + n]:
        n += 1
    return n


def replay(prompt, answer, block_size: int, max_ngram: int, min_match: int) -> dict:
    """One answer decoded with prompt lookup alone (see the module docstring)."""
    index = CopyIndex(prompt + answer[:1], max_ngram=max_ngram, min_match=min_match)
    at, cycles, proposing, missed, copied = 1, 0, 0, 0, 0
    classes = [[0, 0, 0] for _ in MATCH_CLASSES]  # per class: proposals, tokens accepted, proposals cut short
    while at < len(answer):
        proposal = index.propose(block_size - 1)
        accepted = accepted_of(proposal, answer, at)
        if proposal:
            tally = classes[match_class(index.match_length)]
            tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + accepted, tally[2] + (accepted < len(proposal))
        committed = answer[at : at + accepted + 1]
        index.extend(committed)
        at += len(committed)
        cycles, proposing, copied = cycles + 1, proposing + bool(proposal), copied + accepted
        missed += bool(proposal) and not accepted
    return {"tokens": len(answer) - 1, "cycles": cycles, "proposing": proposing, "missed": missed, "copied": copied,
            "classes": classes}


def sized_replay(prompt, answer, slope: float, max_block: int, max_ngram: int, min_match: int) -> dict:
    """One answer decoded as the loop sizes copies (see the module docstring)."""
    tokens = list(prompt) + answer[:1]
    cache = SimpleNamespace(copy_index=CopyIndex(tokens, max_ngram=max_ngram, min_match=min_match), tokens=tokens)
    costs = CycleCosts({1: 1.0, 2: 1.0 + slope, max_block: 1.0 + slope * (max_block - 1)}, follow=False)
    sizing = Sizing(BlockSizer(max_block, costs))
    row = Request(0, cache, None, len(answer), frozenset(), n=1, copies=CopyDrafts(cache))
    at, cycles, proposing, missed, copied, seconds = 1, 0, 0, 0, 0, 0.0
    while at < len(answer):
        plan = sizing.copies([row], 1)[1][0]
        span, klass = plan if plan is not None else ([], 0)
        accepted = accepted_of(span, answer, at)
        if span:
            row.copies.observe(klass, len(span), accepted)
        committed = answer[at : at + accepted + 1]
        cache.tokens.extend(committed)
        at, row.n = at + len(committed), row.n + len(committed)
        cycles, proposing, copied = cycles + 1, proposing + bool(span), copied + accepted
        missed += bool(span) and not accepted
        seconds += costs.verify(len(span) + 1) if span else 1.0
    return {"tokens": len(answer) - 1, "cycles": cycles, "proposing": proposing, "missed": missed, "copied": copied,
            "plain_steps": seconds}


def report(runs, args) -> None:
    """Per request and over the set (see the module docstring)."""
    for i, r in enumerate(runs):
        print(f"request {i:2d}: {r['tokens']:4d} tokens, {r['cycles']:4d} cycles ({r['proposing']:3d} proposing, {r['missed']:3d} of them none accepted), "
              f"{r['copied']:4d} copied, {r['tokens'] / max(r['cycles'], 1):5.2f} tokens per cycle")
    tokens, cycles = sum(r["tokens"] for r in runs), sum(r["cycles"] for r in runs)
    proposing, missed = sum(r["proposing"] for r in runs), sum(r["missed"] for r in runs)
    print(f"set: {tokens} tokens in {cycles} cycles, {tokens / max(cycles, 1):.2f} tokens per cycle; "
          f"{proposing} cycles proposed, {missed} of them accepted nothing; "
          f"{sum(r['copied'] for r in runs) / max(tokens, 1):.0%} of the tokens copied")
    if args.sized is not None:
        print(f"sized as the loop (verify slope {args.sized}, drafter's block {args.block_size}): "
              f"{tokens / sum(r['plain_steps'] for r in runs):.2f}x a plain step's tokens per second")
        return
    print(f"prompt lookup alone (block {args.block_size}, n-grams {args.min_match}..{args.max_ngram}); per class of match:")
    pooled = [[sum(r["classes"][k][i] for r in runs) for i in range(3)] for k in range(len(MATCH_CLASSES))]
    for k, (start, (n, accepted, short)) in enumerate(zip(MATCH_CLASSES, pooled)):
        print(f"  class {k} (match {start}+): {n:4d} proposals, {accepted / max(n, 1):5.2f} accepted per proposal, "
              f"{accepted / max(accepted + short, 1):.3f} of copied slots accepted")
    print("priors (these shares, non-decreasing in match length):", ", ".join(f"{p:.2f}" for p in priors_of(pooled)))


def priors_of(pooled) -> list:
    """Per class, the share of copied slots accepted (``pooled``: per class
    proposals, tokens accepted, proposals cut short), made non-decreasing in
    match length by pooling adjacent classes that break the order (pool
    adjacent violators: isotonic regression weighted by the slots reached):
    a longer match is less often a chance recurrence, and a class seen a
    few times borrows its neighbour's evidence."""
    blocks = []  # [accepted, reached, classes]
    for _, accepted, short in pooled:
        blocks.append([accepted, accepted + short, 1])
        while len(blocks) > 1 and blocks[-2][0] * max(blocks[-1][1], 1) > blocks[-1][0] * max(blocks[-2][1], 1):
            last = blocks.pop()
            blocks[-1] = [blocks[-1][0] + last[0], blocks[-1][1] + last[1], blocks[-1][2] + last[2]]
    return [a / max(n, 1) for a, n, count in blocks for _ in range(count)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="target (path or pair name) whose greedy answers are replayed")
    p.add_argument("--prompt-set", choices=sorted(n for n in PROMPT_SETS if n.startswith("edit")), default="edit_tuning",
                   help="the requests: the tuning set (what the copy constants come from) or the held-out edit set")
    p.add_argument("--prompts", default=None, help="JSON list of requests, in place of --prompt-set")
    p.add_argument("--answers", default=None,
                   help="JSON file of the greedy answers: read if it exists, else written (default: examples/results/<model>_<set>_answers.json)")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16, help="a cycle verifies at most this many tokens (block - 1 drafted)")
    p.add_argument("--max-ngram", type=int, default=DEFAULT_MAX_NGRAM)
    p.add_argument("--min-match", type=int, default=DEFAULT_MIN_MATCH)
    p.add_argument("--sized", type=float, default=None, metavar="SLOPE",
                   help="replay as the loop sizes copies, a verify of m tokens costing 1 + SLOPE (m - 1) plain steps "
                        "(--block-size is then the drafter's block)")
    args = p.parse_args(argv)
    if args.block_size < 2:
        p.error("--block-size must be at least 2 (one drafted token)")
    if args.sized is not None and args.sized < 0:
        p.error("--sized must be at least 0 (a verify's cost per row, in plain steps)")
    prompts = Path(args.prompts) if args.prompts else PROMPT_SETS[args.prompt_set]
    answers_path = Path(args.answers or Path(__file__).parent / "results" / f"{Path(args.model).name}_{prompts.stem}_answers.json")
    if not answers_path.exists():
        requests = json.loads(prompts.read_text())
        answers_path.write_text(json.dumps(greedy_answers(args.model, requests, args.max_tokens), indent=1))
    answers = json.loads(answers_path.read_text())
    if args.sized is not None:
        runs = [sized_replay(a["prompt"], a["answer"], args.sized, args.block_size, args.max_ngram, args.min_match) for a in answers]
    else:
        runs = [replay(a["prompt"], a["answer"], args.block_size, args.max_ngram, args.min_match) for a in answers]
    report(runs, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
