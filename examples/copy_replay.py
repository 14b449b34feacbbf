"""Replay prompt lookup alone (:class:`~dflash_mlx.copy_source.CopyIndex`)
over a target's greedy answers: how many tokens a cycle would commit if the
only draft were the copy, free of the machine's speed.

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
    python examples/copy_replay.py --model smollm2 --answers edit_answers.json          # generates, then replays
    python examples/copy_replay.py --model smollm2 --answers edit_answers.json --block-size 8 --max-ngram 8

The answers are mlx-lm's own greedy decode (``stream_generate``, its default
sampler) of the edit-shaped set (``dflash_mlx/prompt_sets/edit.json``, as
the bench's ``--prompt-set edit`` runs it; ``--prompts`` another JSON list
of requests), written
to ``--answers`` once and read from it after. Each answer is then replayed:
the index holds the prompt and the answer's first token (the prefill's);
every cycle proposes up to ``--block-size - 1`` tokens, commits those that
equal the answer and the target's own token after them (a cycle without a
proposal is a plain step: one token). Reported per request and pooled over
the set: tokens per cycle (over the cycles after the prefill), the cycles
that proposed and those of them that had nothing accepted (a verify the
loop would have paid for one token), and the share of answer tokens that
were copied.
"""

import argparse
import json
from pathlib import Path

from dflash_mlx.copy_source import DEFAULT_MAX_NGRAM, DEFAULT_MIN_MATCH, CopyIndex
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


def replay(prompt, answer, block_size: int, max_ngram: int, min_match: int) -> dict:
    """One answer decoded with copy drafts alone (see the module docstring)."""
    index = CopyIndex(prompt + answer[:1], max_ngram=max_ngram, min_match=min_match)
    at, cycles, proposing, missed, copied = 1, 0, 0, 0, 0
    while at < len(answer):
        proposal = index.propose(block_size - 1)
        accepted = 0
        while accepted < len(proposal) and at + accepted < len(answer) and proposal[accepted] == answer[at + accepted]:
            accepted += 1
        committed = answer[at : at + accepted + 1]
        index.extend(committed)
        at += len(committed)
        cycles, proposing, copied = cycles + 1, proposing + bool(proposal), copied + accepted
        missed += bool(proposal) and not accepted
    return {"tokens": len(answer) - 1, "cycles": cycles, "proposing": proposing, "missed": missed, "copied": copied,
            "tokens_per_cycle": round((len(answer) - 1) / max(cycles, 1), 2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="target (path or pair name) whose greedy answers are replayed")
    p.add_argument("--prompts", default=str(PROMPT_SETS["edit"]), help="JSON list of requests (default: the edit-shaped set)")
    p.add_argument("--answers", required=True, help="JSON file of the greedy answers: read if it exists, else written")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16, help="a cycle verifies at most this many tokens (block - 1 drafted)")
    p.add_argument("--max-ngram", type=int, default=DEFAULT_MAX_NGRAM)
    p.add_argument("--min-match", type=int, default=DEFAULT_MIN_MATCH)
    args = p.parse_args(argv)
    if args.block_size < 2:
        p.error("--block-size must be at least 2 (one drafted token)")
    answers_path = Path(args.answers)
    if not answers_path.exists():
        requests = json.loads(Path(args.prompts).read_text())
        answers_path.write_text(json.dumps(greedy_answers(args.model, requests, args.max_tokens), indent=1))
    runs = [replay(a["prompt"], a["answer"], args.block_size, args.max_ngram, args.min_match)
            for a in json.loads(answers_path.read_text())]
    for i, r in enumerate(runs):
        print(f"request {i:2d}: {r['tokens']:4d} tokens, {r['cycles']:4d} cycles ({r['proposing']:3d} proposing, {r['missed']:3d} of them none accepted), "
              f"{r['copied']:4d} copied, {r['tokens_per_cycle']:5.2f} tokens per cycle")
    tokens, cycles = sum(r["tokens"] for r in runs), sum(r["cycles"] for r in runs)
    proposing, missed = sum(r["proposing"] for r in runs), sum(r["missed"] for r in runs)
    print(f"set: {tokens} tokens in {cycles} cycles, {tokens / max(cycles, 1):.2f} tokens per cycle; "
          f"{proposing} cycles proposed, {missed} of them accepted nothing; "
          f"{sum(r['copied'] for r in runs) / max(tokens, 1):.0%} of the tokens copied "
          f"(block {args.block_size}, n-grams {args.min_match}..{args.max_ngram})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
