"""The one-request path of this checkout against another commit's, in one
process: both checkouts' ``stream_generate`` take turns on the same prompts
(the default adaptive loop, then ``block_size=1``, the plain step), on the
bundled pair and SmolLM2. Every output must be identical.

    python examples/against_commit.py 22e958f
    python examples/against_commit.py 22e958f --pairs default --rounds 1   # a quick look

The other commit's package is copied out of git (``git archive``) under
another name, so both load side by side. The model loaded first decodes a
few percent slower on this CPU, so each pair runs twice, once with each
checkout's model loaded first; a ratio is the median of the per-generation
ratios (the other commit's seconds over this checkout's: above 1 is faster
here), reported for both orders and as their geometric mean.
"""

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, statistics
sys.path.insert(0, sys.argv[1])
import dflash_mlx as here
import dflash_mlx_other as other
pair, rounds, prompts, max_tokens, other_first = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"

def load(pkg):
    from importlib import import_module
    p = import_module(pkg.__name__ + ".pair")
    return p.load_pair(p.DEFAULT_TARGET if pair == "default" else pair, None), p

loaded = {}
for name, pkg in ([("other", other), ("here", here)] if other_first else [("here", here), ("other", other)]):
    loaded[name] = (pkg,) + load(pkg)
(_, (model, tokenizer, _, _), pairs) = loaded["here"]
found = pairs.default_prompts() if pair == "default" else pairs.named_prompts(pair)
ids = [tokenizer.encode(p) if pair == "default" else tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in found[:prompts]]

def run(name, prompt, block):
    pkg, (m, t, d, _), _ = loaded[name]
    tic, tokens = time.perf_counter(), []
    for r in pkg.stream_generate(m, d, t, prompt, max_tokens=max_tokens, block_size=block):
        tokens += r.tokens if hasattr(r, "tokens") else [r.token]
    return time.perf_counter() - tic, tokens

out = {}
for block in (None, 1):
    for name in loaded:
        run(name, ids[0], block)  # warm: calibration, compiled functions
    ratios, same = [], True
    for rnd in range(rounds):
        for i, p in enumerate(ids):
            order = ["here", "other"] if (rnd + i) % 2 == 0 else ["other", "here"]
            got = {name: run(name, p, block) for name in order}
            same = same and got["here"][1] == got["other"][1]
            ratios.append(got["other"][0] / got["here"][0])
    out["adaptive" if block is None else "plain step"] = dict(ratio=statistics.median(ratios), identical=same)
print(json.dumps(out))
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commit", help="the commit to compare against (anything git names)")
    p.add_argument("--pairs", nargs="+", default=["default", "smollm2"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(root), "archive", args.commit, "dflash_mlx"], capture_output=True)
        if archive.returncode:
            raise SystemExit(f"error: git cannot read {args.commit!r}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        Path(tmp, "dflash_mlx").rename(Path(tmp, "dflash_mlx_other"))
        for pair in args.pairs:
            orders = {}
            for other_first in ("0", "1"):
                child = [sys.executable, "-c", CHILD, tmp, pair, str(args.rounds), str(args.prompts), str(args.max_tokens), other_first]
                done = subprocess.run(child, capture_output=True, text=True, cwd=root)
                if done.returncode:
                    raise SystemExit(done.stderr[-2000:])
                orders[other_first] = json.loads(done.stdout.strip().splitlines()[-1])
            for loop in orders["0"]:
                a, b = orders["0"][loop]["ratio"], orders["1"][loop]["ratio"]
                rows.append(dict(pair=pair, loop=loop, this_first=round(a, 3), other_first=round(b, 3),
                                 mean=round(math.sqrt(a * b), 3),
                                 identical=orders["0"][loop]["identical"] and orders["1"][loop]["identical"]))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
