"""What the copy index costs the loop per cycle at long contexts: committing
tokens (``extend``) and finding and proposing a copy (``propose``), against
a plain step of the target (issue 61: at most 2% of SmolLM2's at 32K).

    python examples/copy_index_cost.py
    python examples/copy_index_cost.py --contexts 1024 8192 32768 --cycles 400 --step-ms 50

The stream is code, as agents copy it: this package's own source, tokenized
with the bundled target's tokenizer; its last ``--file-tokens`` before the
answer are a file the answer writes out again and again with a few tokens
changed each time (an edited file, read and written back). At each context
length the index holds that many tokens; then ``--cycles`` cycles
each propose up to ``--block-size - 1`` tokens and commit those that equal
the stream's next tokens and one more (as a verify would), timed apart.
The build of the whole context (a prompt, or a cache rebuilt after a trim)
and a copy of the index (a forked cache) are timed once. ``--step-ms``:
the plain step to compare with (SmolLM2's float32 target on this CPU: 50 ms,
BENCHMARKS.md; longer at long contexts, so the share printed is an upper
bound there).
"""

import argparse
import copy
import os
import random
import time
from pathlib import Path

from dflash_mlx.copy_source import CopyIndex
from dflash_mlx.defaults import DEFAULT_TARGET


def package_tokens():
    """This package's source, tokenized with the bundled target's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_TARGET))
    package = Path(__file__).resolve().parent.parent / "dflash_mlx"
    return tokenizer.encode("".join(p.read_text() for p in sorted(package.rglob("*.py"))))


def edited_copies(file, length: int, edits: int = 8, seed: int = 0):
    """``length`` tokens of ``file`` written out again and again, each time
    with ``edits`` tokens changed (an edited file, read and written back)."""
    rng, out = random.Random(seed), []
    while len(out) < length:
        edited = list(file)
        for _ in range(edits):
            edited[rng.randrange(len(edited))] = rng.choice(file)
        out += edited
    return out[:length]


def measure(source, context: int, cycles: int, block_size: int, file_tokens: int) -> dict:
    """Seconds per committed token (extend) and per cycle (propose) at
    ``context`` tokens of ``source``, the last ``file_tokens`` of them a file
    the answer writes out edited."""
    tokens = source[:context]
    tokens += edited_copies(tokens[-file_tokens:], cycles * block_size)
    start = time.perf_counter()
    index = CopyIndex(tokens[:context])
    build = time.perf_counter() - start
    start = time.perf_counter()
    copy.deepcopy(index)
    fork = time.perf_counter() - start
    at, extend_s, propose_s, committed, work = context, 0.0, 0.0, 0, index.work
    for _ in range(cycles):
        t0 = time.perf_counter()
        proposal = index.propose(block_size - 1)
        t1 = time.perf_counter()
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == tokens[at + accepted]:
            accepted += 1
        new = tokens[at : at + accepted + 1]
        t2 = time.perf_counter()
        index.extend(new)
        t3 = time.perf_counter()
        propose_s, extend_s, at, committed = propose_s + t1 - t0, extend_s + t3 - t2, at + len(new), committed + len(new)
    return {"context": context, "build_s": build, "fork_s": fork, "extend_us_per_token": 1e6 * extend_s / committed,
            "propose_us_per_cycle": 1e6 * propose_s / cycles, "tokens_per_cycle": committed / cycles,
            "cycle_us": 1e6 * (extend_s + propose_s) / cycles, "work_per_token": (index.work - work) / committed}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--cycles", type=int, default=400)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--file-tokens", type=int, default=2000, help="the file at the end of the context that the answer edits")
    p.add_argument("--step-ms", type=float, default=50.0, help="the plain step compared with, in ms")
    args = p.parse_args(argv)
    source = package_tokens()
    if len(source) < max(args.contexts):
        p.error(f"--contexts: the package's source is {len(source)} tokens, no more")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for context in args.contexts:
        r = measure(source, context, args.cycles, args.block_size, min(args.file_tokens, context))
        print(f"{context:6d} tokens: extend {r['extend_us_per_token']:5.1f} us/token, propose "
              f"{r['propose_us_per_cycle']:5.1f} us/cycle, {r['tokens_per_cycle']:.1f} tokens/cycle -> "
              f"{r['cycle_us']:6.1f} us/cycle = {r['cycle_us'] / (10 * args.step_ms):.2f}% of a {args.step_ms:g} ms step; "
              f"{r['work_per_token']:.0f} operations/token; build {1e3 * r['build_s']:.0f} ms, copy {1e3 * r['fork_s']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
