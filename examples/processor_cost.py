"""What mlx-lm's logits processors cost a cycle of the loop (issue 59): a
verify's rows processed each with its own history, all at once
(``penalty_processors``) and one call per row (mlx-lm's own callables, which
any custom processor takes), and the drafter's block processed slot by slot
along its own proposal; against the seconds of a drafting cycle.

    python examples/processor_cost.py --model smollm2
    python examples/processor_cost.py --model smollm2 --block-size 16 --repetition-penalty 1.1 --json cost.json

The cycle: the pair's own greedy generation (a held-out request, ``--block-size``
fixed, no processors), its decode seconds over its cycles. The processors
run on real logits of that block's shape (the target's vocabulary) with a
history as long as the request's, each timed alone with its result
evaluated (median of ``--repeats``).
"""

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx import stream_generate
from dflash_mlx.controls import penalty_processors
from dflash_mlx.generate import encode_prompt
from dflash_mlx.pair import benchmark_prompts, load_pair, resolve_pair
from dflash_mlx.processors import Processors
from dflash_mlx.timing import median_ms


def evaluated_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` with its result evaluated."""
    return median_ms(lambda: mx.eval(fn()), repeats, warmup=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repetition-penalty", type=float, default=1.1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, tokenizer, draft, _ = load_pair(args.model, args.draft_model)
    prompt = benchmark_prompts(resolve_pair(args.model, args.draft_model)[0], tokenizer)[0]
    list(stream_generate(model, draft, tokenizer, prompt, max_tokens=8, block_size=args.block_size))  # warm
    tic, responses = time.perf_counter(), []
    for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens, block_size=args.block_size):
        if not responses:
            tic = time.perf_counter()  # decode only: from the prefill's token
        responses.append(r)
    cycle_ms = 1e3 * (time.perf_counter() - tic) / max(1, len(responses) - 1)
    history = encode_prompt(tokenizer, prompt).tolist() + [t for r in responses for t in r.tokens]
    vocab, rows = model.args.vocab_size, args.block_size
    logits = mx.random.normal((rows, vocab), key=mx.random.key(0))
    proposal = history[-(rows - 1):]
    settings = dict(repetition_penalty=args.repetition_penalty)
    vectorised = Processors(penalty_processors(vocab, **settings), history)
    per_row = Processors(make_logits_processors(**settings), history)
    drafter = logits[1:]
    row = dict(
        cycle_ms=round(cycle_ms, 2),
        verify_all_rows_ms=round(evaluated_ms(lambda: vectorised.block(logits, proposal), args.repeats), 3),
        verify_per_row_ms=round(evaluated_ms(lambda: per_row.block(logits, proposal, vectorised=False), args.repeats), 3),
        draft_block_ms=round(evaluated_ms(lambda: vectorised.draft_block(rows - 1, lambda: drafter, vocab)[0], args.repeats), 3),
        block=rows, history=len(history), device=str(mx.default_device()),
    )
    row["share_of_cycle"] = round((row["verify_all_rows_ms"] + row["draft_block_ms"]) / cycle_ms, 4)
    row["share_per_row_processors"] = round((row["verify_per_row_ms"] + row["draft_block_ms"]) / cycle_ms, 4)
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
