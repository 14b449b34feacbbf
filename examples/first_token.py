"""Time to first token in a fresh process: DFlash against mlx-lm.

    python examples/first_token.py --model smollm2

Each measurement starts a new Python process, loads the pair and times one
short greedy chat request from the call to its first token:

- ``stream_generate``: mlx-lm's, then dflash_mlx's (what ``mlx-dflash
  generate`` runs), ``--repeats`` fresh processes each;
- the server's first request: ``mlx_lm server`` and ``mlx-dflash server``
  started afresh, one streamed chat request each, timed from sending it to
  the first content chunk.

The first generation of a pair in a process measures its cycles' costs;
its first token must not wait for that (issue 49's bar: at most 1.1x
mlx-lm's).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request

CHILD = r"""
import json, sys, time
which, model, draft, prompt = sys.argv[1:5]
from dflash_mlx.pair import load_pair
target, tokenizer, drafter, _ = load_pair(model, draft or None)
ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
tic = time.perf_counter()
if which == "mlx_lm":
    from mlx_lm import stream_generate
    stream = stream_generate(target, tokenizer, ids, max_tokens=32)
else:
    from dflash_mlx import stream_generate
    stream = stream_generate(target, drafter, tokenizer, ids, max_tokens=32)
first = None
for r in stream:
    first = first or time.perf_counter() - tic
print(json.dumps({"first": first, "total": time.perf_counter() - tic}))
"""

PROMPT = "Name three colours."


def library(args, which):
    out = subprocess.run([sys.executable, "-c", CHILD, which, args.model, args.draft_model or "", PROMPT],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def server_first(args, which, port):
    from dflash_mlx.pair import resolve_pair

    target, _ = resolve_pair(args.model, args.draft_model)
    cmd = ([sys.executable, "-m", "mlx_lm", "server", "--model", str(target)] if which == "mlx_lm"
           else [sys.executable, "-m", "dflash_mlx", "server", "--model", str(args.model)])
    proc = subprocess.Popen(cmd + ["--port", str(port)], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5).close()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"{which} server exited")
                time.sleep(0.5)
        body = json.dumps({"model": "default_model", "messages": [{"role": "user", "content": PROMPT}],
                           "max_tokens": 32, "temperature": 0.0, "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        tic = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as resp:
            for line in resp:
                if line.startswith(b"data: {") and b'"content"' in line:
                    return time.perf_counter() - tic
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=8491)
    args = p.parse_args(argv)
    seen = {"mlx_lm": [], "dflash": []}
    for _ in range(args.repeats):
        for which in seen:
            seen[which].append(library(args, which)["first"])
    row = {w: round(statistics.median(v), 3) for w, v in seen.items()}
    row["stream_generate_ratio"] = round(row["dflash"] / row["mlx_lm"], 2)
    first = {w: server_first(args, w, args.port + i) for i, w in enumerate(seen)}
    row.update(server_mlx_lm=round(first["mlx_lm"], 3), server_dflash=round(first["dflash"], 3),
               server_ratio=round(first["dflash"] / first["mlx_lm"], 2))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
