"""Many requests at once: DFlash's batched cycles against mlx-lm's batching.

    python examples/concurrency.py                       # library: batch_generate, bundled pair
    python examples/concurrency.py --plain               # ... and plain batched steps in the same rounds
    python examples/concurrency.py --plain --fixed 4 8 16     # ... and fixed blocks: the best fixed choice in hindsight
    python examples/concurrency.py --server --model smollm2   # both servers on loopback
    python examples/concurrency.py --shapes                   # a batched cycle's cost by its shape, here

Library mode runs mlx-lm's ``batch_generate`` and dflash_mlx's on the same
held-out prompts at each concurrency, taking turns (``--repeats`` rounds
of each, the order rotating), and reports aggregate tokens per second,
their ratio, tokens per cycle per request, and whether every text matched
mlx-lm's; ``--plain`` and ``--fixed`` add fixed blocks of the same loop in
the same rounds (what the sizer's choices are up against: the best fixed
block for these prompts, known only in hindsight).

Server mode starts ``mlx_lm server`` (its default continuous batching) and
``mlx-dflash server`` on loopback ports with the same target, sends the
pair's held-out prompts as greedy chat requests, ``c`` at a time, each
server in turn, and reports aggregate tokens per second (all completion
tokens over the round's wall time), mean request latency and their ratios.
Every answer is compared with mlx-lm's. Run with nothing else on the
machine and OpenBLAS preloaded (see BENCHMARKS.md).
"""

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import mlx.core as mx


def prompts_for(model, count, tokenizer=None):
    """``count`` of the pair's held-out prompts, cycled: with ``tokenizer``
    as the benchmark hands them to a generator (a chat pair's as chat turns:
    a bare request makes SmolLM2 end at once), else the bare requests a
    client sends to a server."""
    from dflash_mlx.pair import DEFAULT_TARGET, benchmark_prompts, default_prompts, named_prompts

    if tokenizer is not None:
        found = benchmark_prompts(model, tokenizer)
    elif str(model) == str(DEFAULT_TARGET):
        found = default_prompts()
    else:
        found = named_prompts(model)
    return [found[i % len(found)] for i in range(count)]


def library(args):
    """mlx-lm's ``batch_generate`` and DFlash's (adaptive, or ``--block-size``)
    at each concurrency, with ``--plain`` (block 1) and each ``--fixed``
    block in the same rounds, the order rotating by one each round."""
    from mlx_lm import batch_generate as mlx_lm_batch_generate

    from dflash_mlx.batch import batch_generate
    from dflash_mlx.blas import warn_if_reference
    from dflash_mlx.pair import load_pair

    model, tokenizer, draft, _ = load_pair(args.model, args.draft_model)
    warn_if_reference()
    blocks = {"dflash": args.block_size, **({"plain": 1} if args.plain else {}), **{f"block_{b}": b for b in args.fixed}}
    names = ["mlx_lm", *blocks]
    rows = []
    for c in args.concurrency:
        prompts = prompts_for(args.model, c, tokenizer)
        encoded = [tokenizer.encode(p) for p in prompts]

        def run(name, max_tokens):
            if name == "mlx_lm":
                return mlx_lm_batch_generate(model, tokenizer, encoded, max_tokens=max_tokens)
            return batch_generate(model, draft, tokenizer, prompts, max_tokens=max_tokens, block_size=blocks[name])

        for name in names:  # warm every variant
            run(name, 4)
        times, texts, per_cycle = {n: [] for n in names}, [], []
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                tic = time.perf_counter()
                out = run(name, args.max_tokens)
                times[name].append(time.perf_counter() - tic)
                texts.append((name, out.texts))
                if name == "dflash":
                    per_cycle += [s["tokens_per_cycle"] for s in out.stats]
        reference = next(t for n, t in texts if n == "mlx_lm")
        tokens = sum(len(tokenizer.encode(t)) for t in reference)
        tps = {n: tokens / statistics.median(v) for n, v in times.items()}
        row = dict(concurrency=c, mlx_lm_tps=round(tps["mlx_lm"], 1), dflash_tps=round(tps["dflash"], 1),
                   ratio=round(tps["dflash"] / tps["mlx_lm"], 3), tokens_per_cycle=round(statistics.mean(per_cycle), 2),
                   identical=all(t == reference for _, t in texts))
        if args.plain:
            row.update(plain_tps=round(tps["plain"], 1), ratio_to_best=round(tps["dflash"] / max(tps["mlx_lm"], tps["plain"]), 3))
        if args.fixed:
            fixed = {n: v for n, v in tps.items() if n not in ("mlx_lm", "dflash")}
            best = max(fixed, key=fixed.get)
            row.update({f"{n}_tps": round(v, 1) for n, v in fixed.items() if n != "plain"})
            row.update(best_fixed=blocks[best], best_fixed_over_mlx_lm=round(fixed[best] / tps["mlx_lm"], 3),
                       ratio_to_best_fixed=round(tps["dflash"] / fixed[best], 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def shapes(args):
    """What a batched cycle costs by its shape on this machine: for each
    concurrency and fixed block, a cycle's milliseconds once every request
    decodes (median of ``--cycles``), the tokens each request commits per
    cycle, and the batch's milliseconds per committed token (block 1: plain
    batched steps). Speculation pays at a shape whose last figure is below
    block 1's."""
    from dflash_mlx.batch import BatchGenerator
    from dflash_mlx.pair import load_pair

    model, tokenizer, draft, _ = load_pair(args.model, args.draft_model)
    rows = []
    for c in args.concurrency:
        encoded = [tokenizer.encode(p) for p in prompts_for(args.model, c, tokenizer)]
        for block in (1, 2, 4, 8, 16):
            gen = BatchGenerator(model, draft, block_size=block)
            uids = gen.insert(encoded, 8 + args.cycles * block)  # no eos: every request decodes every timed cycle
            for _ in range(3):  # warm: a cycle of every request at this shape
                while not (len(out := gen.next()) == c and all(r.block == block for r in out)):
                    pass
            seconds, tokens = [], 0
            for _ in range(args.cycles):
                tic = time.perf_counter()
                out = gen.next()
                seconds.append(time.perf_counter() - tic)
                tokens += sum(len(r.tokens) for r in out)
            gen.remove(uids)
            per_cycle = statistics.median(seconds)
            rows.append(dict(concurrency=c, block=block, ms_per_cycle=round(1e3 * per_cycle, 2),
                             tokens_per_cycle=round(tokens / args.cycles / c, 2),
                             ms_per_token=round(1e3 * per_cycle * args.cycles / max(tokens, 1), 3)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def wait_ready(url, proc, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server at {url} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the server at {url} did not come up")


def chat(url, prompt, max_tokens):
    body = json.dumps({"model": "default_model", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    tic = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as resp:
        answer = json.loads(resp.read())
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"], time.perf_counter() - tic


def round_of(url, prompts, max_tokens):
    """All ``prompts`` at once; (texts, completion tokens, wall seconds, latencies)."""
    out = [None] * len(prompts)

    def one(i):
        try:
            out[i] = chat(url, prompts[i], max_tokens)
        except Exception as e:  # raised below, on the caller's thread
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    failed = next((o for o in out if isinstance(o, Exception)), None)
    if failed is not None:
        detail = failed.read().decode() if hasattr(failed, "read") else ""
        raise SystemExit(f"a request to {url} failed: {failed!r} {detail}")
    return [o[0] for o in out], sum(o[1] for o in out), wall, [o[2] for o in out]


def servers(args):
    from dflash_mlx.pair import resolve_pair

    target, _ = resolve_pair(args.model, args.draft_model)
    lm_port, df_port = args.port, args.port + 1
    procs = [
        subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(target), "--port", str(lm_port)],
                         stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL),
        subprocess.Popen([sys.executable, "-m", "dflash_mlx", "server", "--model", str(args.model), "--port", str(df_port)]
                         + (["--draft-model", str(args.draft_model)] if args.draft_model else []),
                         stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL),
    ]
    urls = {"mlx_lm": f"http://127.0.0.1:{lm_port}", "dflash": f"http://127.0.0.1:{df_port}"}
    rows = []
    try:
        for url, proc in zip(urls.values(), procs):
            wait_ready(url, proc)
        for name, url in urls.items():  # warm both
            round_of(url, prompts_for(args.model, 2), 8)
        for c in args.concurrency:
            prompts = prompts_for(args.model, c)
            seen = {name: dict(tps=[], latency=[], texts=None) for name in urls}
            for _ in range(args.repeats):
                for name, url in urls.items():
                    texts, tokens, wall, latencies = round_of(url, prompts, args.max_tokens)
                    seen[name]["tps"].append(tokens / wall)
                    seen[name]["latency"].append(statistics.mean(latencies))
                    seen[name]["texts"] = texts
            lm, df = seen["mlx_lm"], seen["dflash"]
            row = dict(
                concurrency=c, mlx_lm_tps=round(statistics.median(lm["tps"]), 1),
                dflash_tps=round(statistics.median(df["tps"]), 1),
                ratio=round(statistics.median(df["tps"]) / statistics.median(lm["tps"]), 2),
                latency_ratio=round(statistics.median(df["latency"]) / statistics.median(lm["latency"]), 2),
                identical=lm["texts"] == df["texts"],
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)
    return rows


def main(argv=None):
    from dflash_mlx.pair import DEFAULT_TARGET

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_TARGET), help="target (a path or a pair name such as smollm2)")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=None, help="library mode: fix DFlash's block (default adaptive)")
    p.add_argument("--plain", action="store_true", help="library mode: also time plain batched steps (block 1) in each round")
    p.add_argument("--fixed", type=int, nargs="+", default=[], metavar="B",
                   help="library mode: also time these fixed blocks in each round (the best fixed choice, found in hindsight)")
    p.add_argument("--server", action="store_true", help="compare the two servers over HTTP")
    p.add_argument("--shapes", action="store_true", help="what a batched cycle costs by its rows and block, here")
    p.add_argument("--cycles", type=int, default=24, help="--shapes: cycles timed per shape")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = servers(args) if args.server else shapes(args) if args.shapes else library(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, device=str(mx.default_device())), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
