"""Quantize a drafter with the package's converter, then check it on its target.

    python convert/quantize_drafter.py                        # the bundled pair's drafter, 4-bit
    python convert/quantize_drafter.py --model Qwen/Qwen3.5-4B --bits 8 --mlx-path q8-draft

Converts the drafter with ``dflash_mlx.convert.convert`` (what
``mlx-dflash convert -q`` runs), loads the result beside its target and
decodes one prompt greedily at the drafter's trained block with the original
and the quantized drafter. The text is the target's either way (decoding is
lossless); what quantization can cost is tokens per cycle, printed for both.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.convert import convert
from dflash_mlx.defaults import DEFAULT_TARGET
from dflash_mlx.generate import build_prompt, cycle_lengths, mean_tokens_per_cycle
from dflash_mlx.loading import QUANTIZED_BITS, QUANTIZED_GROUP_SIZES
from dflash_mlx.pair import default_prompt, float_dtype, load_pair


def decode(model, draft, tokenizer, prompt, max_tokens):
    """(text, mean tokens per cycle) of one greedy generation at the trained block."""
    responses = list(stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens, block_size=draft.block_size))
    return "".join(r.text for r in responses), mean_tokens_per_cycle(cycle_lengths(responses))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_TARGET), help="target (default: the bundled pair's)")
    p.add_argument("--draft-model", default=None, help="drafter to quantize (default: the target's known or bundled one)")
    p.add_argument("--bits", type=int, default=4, choices=QUANTIZED_BITS)
    p.add_argument("--group-size", type=int, default=64, choices=QUANTIZED_GROUP_SIZES)
    p.add_argument("--mlx-path", default=None, help="keep the quantized drafter here (default: a temporary directory)")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)

    model, tokenizer, draft, draft_path = load_pair(args.model, args.draft_model)
    prompt = build_prompt(tokenizer, default_prompt(args.model))
    text, per_cycle = decode(model, draft, tokenizer, prompt, args.max_tokens)
    print(f"original drafter {draft_path}: {per_cycle:.2f} tokens per cycle")
    with tempfile.TemporaryDirectory() as tmp:
        dst = args.mlx_path or str(Path(tmp) / f"draft-{args.bits}bit")
        convert(draft_path, dst, kind="draft", quantize=True, q_bits=args.bits, q_group_size=args.group_size)
        quantized = load_draft(dst, model, dtype=float_dtype(model))
        q_text, q_per_cycle = decode(model, quantized, tokenizer, prompt, args.max_tokens)
    print(f"{args.bits}-bit drafter: {q_per_cycle:.2f} tokens per cycle")
    if q_text != text:
        print("error: the text changed with the quantized drafter; decoding should be lossless", file=sys.stderr)
        return 1
    print("same text with both drafters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
