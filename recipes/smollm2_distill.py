"""Self-distillation data for the SmolLM2 drafter: the target's own greedy chat answers.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 nohup nice -n 15 \\
        python recipes/smollm2_distill.py --requests ~/.cache/dflash_mlx/smollm2/requests.json \\
        --out ~/.cache/dflash_mlx/smollm2/distill --resume > /dev/null 2>&1 &

The training requests go through the target's chat template and mlx-lm's
``batch_generate`` answers them greedily, ``--batch-size`` at a time. Every
``--shard-size`` requests become one shard, written atomically
(``shard-00000.npz``: ``tokens`` prompt + answer back to back, ``offsets``,
``prompt_lens``, and the ``seconds`` it took), so ``--resume`` continues at
the first missing shard and the drafter's card can add up the time.
Progress goes to ``progress.log`` in ``--out``.
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def log(out: Path, line: str):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(out / "progress.log", "a") as f:
        f.write(f"{stamp} {line}\n")


def write_shard(path: Path, rows, prompt_lens, seconds: float):
    tmp = path.with_name(path.name + ".tmp.npz")
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    np.savez(
        tmp, tokens=np.concatenate(rows).astype(np.int32), offsets=offsets, prompt_lens=np.array(prompt_lens),
        seconds=np.float64(seconds),
    )
    os.replace(tmp, path)


def read_shard(path: Path):
    """(rows, prompt_lens) of a shard: each row is prompt + answer tokens."""
    with np.load(path) as z:
        tokens, offsets, prompt_lens = z["tokens"], z["offsets"], z["prompt_lens"]
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])], prompt_lens


def shard_seconds(path: Path) -> float:
    """Wall seconds the shard took to generate."""
    with np.load(path) as z:
        return float(z["seconds"])


def answer(model, tokenizer, requests, args):
    """Prompt + greedy answer token rows for ``requests`` (in order)."""
    from mlx_lm import batch_generate

    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": r["request"]}], add_generation_prompt=True)
        for r in requests
    ]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding
    res = batch_generate(
        model,
        tokenizer,
        [prompts[i] for i in order],
        max_tokens=args.max_tokens,
        return_token_ids=True,
        completion_batch_size=args.batch_size,
        prefill_batch_size=args.batch_size,
    )
    rows = [None] * len(prompts)
    for i, ids in zip(order, res.token_ids):
        rows[i] = np.asarray(list(prompts[i]) + list(ids), np.int32)
    return rows, [len(p) for p in prompts]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target directory (default: the smollm2 pair's, prepared on first use)")
    p.add_argument("--requests", required=True, help="requests.json from recipes/smollm2_requests.py")
    p.add_argument("--out", required=True, help="shard directory")
    p.add_argument("--max-tokens", type=int, default=896, help="answer length cap")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="answer only the first N training requests")
    p.add_argument("--resume", action="store_true", help="continue at the first missing shard")
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load

    out = Path(args.out).expanduser()
    if out.exists() and any(out.glob("shard-*.npz")) and not args.resume:
        raise SystemExit(f"error: {out} holds shards already: pass --resume to continue")
    out.mkdir(parents=True, exist_ok=True)
    requests = json.loads(Path(args.requests).expanduser().read_text())["train"][: args.limit]
    model_dir = args.model
    if model_dir is None:
        from dflash_mlx.pair import named_pair_paths

        model_dir = named_pair_paths("smollm2", need_draft=False)[0]
    model, tokenizer = load(str(model_dir))
    n_shards = (len(requests) + args.shard_size - 1) // args.shard_size
    log(out, f"start: {len(requests)} requests, {n_shards} shards, model {model_dir}")
    for i in range(n_shards):
        path = out / f"shard-{i:05d}.npz"
        chunk = requests[i * args.shard_size : (i + 1) * args.shard_size]
        if path.exists() and len(read_shard(path)[1]) == len(chunk):
            continue  # done (a shard cut short by an earlier --limit is redone)
        tic = time.perf_counter()
        rows, prompt_lens = answer(model, tokenizer, chunk, args)
        dt = time.perf_counter() - tic
        write_shard(path, rows, prompt_lens, dt)
        mx.clear_cache()
        answered = sum(len(r) - n for r, n in zip(rows, prompt_lens))
        long_rows = sum(len(r) >= 512 for r in rows)
        log(out, f"shard {i + 1}/{n_shards}: {len(rows)} rows, {answered} answer tokens "
                 f"({answered / dt:.1f} tok/s), {long_rows} rows >= 512 tokens, {dt:.0f} s")
    log(out, "done")


if __name__ == "__main__":
    main()
