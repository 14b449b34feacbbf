"""Does quantizing the drafter cost acceptance? Mean tokens per cycle, float vs 8/4-bit.

    python examples/quantized_acceptance.py --model TARGET --draft-model DRAFTER \\
        --prompts dflash_mlx/default_pair/prompts.json --max-tokens 256

Converts the drafter to each bit width (into a temporary directory), runs
greedy DFlash on every prompt and prints mean tokens committed per verify
cycle. Greedy decoding is lossless, so every variant must produce the same
text; only the number of cycles it takes differs. The prompts file is a JSON
list of strings (or of {"prompt": ...} objects), or plain text with one prompt
per line.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx.benchmark import run_dflash
from dflash_mlx.convert import convert
from dflash_mlx.defaults import DEFAULT_MAX_TOKENS
from dflash_mlx.generate import build_prompt, mean_tokens_per_cycle


def read_prompts(path: Path):
    text = path.read_text()
    if path.suffix == ".json":
        items = json.loads(text)
        return [p["prompt"] if isinstance(p, dict) else p for p in items]
    return [line for line in text.splitlines() if line.strip()]


def run_variant(model, tokenizer, draft_dir, prompts, max_tokens):
    """Greedy DFlash over all prompts: (tokens per prompt, tokens committed by each verify cycle)."""
    draft = dflash_mlx.load_draft(draft_dir, model)
    outputs, lengths = [], []
    for prompt in prompts:
        run = run_dflash(model, draft, tokenizer, prompt, max_tokens, draft.block_size)
        outputs.append(run["tokens"])
        lengths += run["committed"]
    return outputs, lengths


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="target: local path or Hugging Face id")
    p.add_argument("--draft-model", required=True, help="float drafter: local path or Hugging Face id")
    p.add_argument("--prompts", required=True, type=Path, help="JSON list or one prompt per line")
    p.add_argument("--max-tokens", "-m", type=cli.positive_int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--limit", type=cli.positive_int, default=None, help="use the first N prompts")
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4], help="bit widths to compare (default 8 4)")
    p.add_argument("--q-group-size", type=cli.positive_int, default=64)
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompts as they are")
    args = p.parse_args(argv)

    model, tokenizer = dflash_mlx.load(args.model)
    prompts = read_prompts(args.prompts)[: args.limit]
    prompts = [build_prompt(tokenizer, q, use_chat_template=not args.ignore_chat_template) for q in prompts]
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for bits in [None, *args.bits]:
            label = "float" if bits is None else f"{bits}-bit g{args.q_group_size}"
            draft_dir = args.draft_model
            if bits is not None:
                draft_dir = str(Path(tmp) / f"q{bits}")
                convert(args.draft_model, draft_dir, kind="draft", quantize=True, q_bits=bits, q_group_size=args.q_group_size)
            tic = time.perf_counter()
            outputs, lengths = run_variant(model, tokenizer, draft_dir, prompts, args.max_tokens)
            seconds = time.perf_counter() - tic
            if reference is None:
                reference = outputs
            elif outputs != reference:
                sys.exit(f"{label}: greedy output differs from the float drafter's (lossless decoding is broken)")
            rows.append((label, mean_tokens_per_cycle(lengths), len(lengths), seconds))
    base = rows[0][1]
    print(f"\n{len(prompts)} prompts, {sum(map(len, reference))} generated tokens each run")
    print("| drafter | mean tokens/cycle | vs float | cycles | seconds |")
    print("|---|---|---|---|---|")
    for label, mean, cycles, seconds in rows:
        print(f"| {label} | {mean:.3f} | {100 * (mean / base - 1):+.1f}% | {cycles} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
