"""Self-distillation data for the SmolLM2 drafter: the target's own greedy chat answers.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 nohup nice -n 15 \\
        python recipes/smollm2_distill.py --requests ~/.cache/dflash_mlx/smollm2/requests.json \\
        --out ~/.cache/dflash_mlx/smollm2/distill --resume > /dev/null 2>&1 &

The training requests go through the target's chat template and mlx-lm's
``batch_generate`` answers them greedily, ``--batch-size`` at a time; a
request with ``followups`` is a multi-turn conversation, answered turn by
turn. Every ``--shard-size`` requests become one shard, written atomically
(``shard-00000.npz``: ``tokens`` the whole conversation back to back, as
uint16 where the vocabulary fits, ``offsets``, ``prompt_lens`` (up to the
last answer), ``answers`` (a packed bit per token: written by the target), and
the ``seconds`` it took), so ``--resume`` continues at the first missing
shard and the drafter's card can add up the time. Shards are made by index,
except that ``--defer A:B`` makes shards A..B-1 after all others: a build
that continues from a drafter gets the requests it has not seen first.
Progress goes to ``progress.log`` in ``--out``.

The target runs through :func:`dflash_mlx.targets.approximate.approximate`
unless ``--no-fast-target``: its answers are training data, needed to training
precision, and on an x86 CPU the exact softmax costs most of a decode step.
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def shard_index(path: Path) -> int:
    """``shard-00012.npz`` -> 12."""
    return int(path.stem.rsplit("-", 1)[1])


def shard_key(path: Path, defer=None):
    """Where a shard file comes in the distillation's order: by index,
    except that ``defer`` (a ``range`` of indices) comes after all others."""
    i = shard_index(path)
    return (defer is not None and i in defer, i)


def ordered_shards(directory: Path, defer=None, max_shards=None) -> list:
    """The shard files made in ``directory``, in the distillation's order,
    the first ``max_shards`` of them: a fixed data set while more are made."""
    return sorted(directory.glob("shard-*.npz"), key=lambda p: shard_key(p, defer))[:max_shards]


def parse_defer(text: str):
    """``A:B`` -> ``range(A, B)`` (``--defer``), or None for an empty text."""
    if not text:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--defer takes A:B (shard indices A..B-1), not {text!r}") from None
    return range(a, b)


def log(out: Path, line: str):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(out / "progress.log", "a") as f:
        f.write(f"{stamp} {line}\n")


def write_shard(path: Path, rows, prompt_lens, seconds: float, answers=None):
    """One shard, atomically; ``answers`` (bool per token, default: the
    tokens after each prompt) marks what the target wrote."""
    tmp = path.with_name(path.name + ".tmp.npz")
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    tokens = np.concatenate(rows)
    if answers is None:
        answers = [np.arange(len(r)) >= n for r, n in zip(rows, prompt_lens)]
    np.savez(
        tmp, tokens=tokens.astype(np.uint16 if tokens.max(initial=0) < 1 << 16 else np.int32), offsets=offsets,
        prompt_lens=np.array(prompt_lens), answers=np.packbits(np.concatenate(answers)), seconds=np.float64(seconds),
    )
    os.replace(tmp, path)


def read_shard(path: Path):
    """(rows, prompt_lens) of a shard: each row is a conversation's tokens
    (int32), its last answer after ``prompt_lens``."""
    with np.load(path) as z:
        tokens, offsets, prompt_lens = z["tokens"].astype(np.int32), z["offsets"], z["prompt_lens"]
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])], prompt_lens


def read_answers(path: Path):
    """Per row, a bool per token: written by the target (answers of every
    turn). Shards from before the field: the tokens after the prompt."""
    with np.load(path) as z:
        offsets, prompt_lens = z["offsets"], z["prompt_lens"]
        bits = np.unpackbits(z["answers"])[: offsets[-1]].astype(bool) if "answers" in z else None
    if bits is None:
        return [np.arange(b - a) >= n for a, b, n in zip(offsets[:-1], offsets[1:], prompt_lens)]
    return [bits[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def shard_seconds(path: Path) -> float:
    """Wall seconds the shard took to generate."""
    with np.load(path) as z:
        return float(z["seconds"])


def load_target(args):
    """(directory, model, tokenizer) of ``--model`` (default: the smollm2
    pair's target), through the approximate paths with ``--fast-target``."""
    from mlx_lm import load

    model_dir = args.model
    if model_dir is None:
        from dflash_mlx.pair import named_pair_paths

        model_dir = named_pair_paths("smollm2", need_draft=False)[0]
    model, tokenizer = load(str(model_dir))
    if args.fast_target:
        from dflash_mlx.targets.approximate import approximate

        approximate(model)
    return model_dir, model, tokenizer


def greedy_answers(model, tokenizer, prompts, args):
    """mlx-lm's batched greedy answers to token ``prompts`` (in order)."""
    from mlx_lm import batch_generate

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
    out = [None] * len(prompts)
    for i, ids in zip(order, res.token_ids):
        out[i] = list(ids)
    return out


def answer(model, tokenizer, requests, args):
    """(rows, prompt_lens, answers) for ``requests`` (in order): each row the
    chat-templated conversation with the target's greedy answers. Turn ``t``
    of every conversation that has one is answered in one batch; a follow-up
    sees the earlier answers as text (decoded, then templated again), and
    ``answers`` marks each answer's tokens inside the final row (the chat
    template extends a conversation's tokens, as ChatML does)."""
    turns = [[r["request"], *r.get("followups", [])] for r in requests]
    chats = [[] for _ in requests]
    last = [None] * len(requests)
    for t in range(max(map(len, turns))):
        live = [i for i in range(len(requests)) if t < len(turns[i])]
        for i in live:
            chats[i].append({"role": "user", "content": turns[i][t]})
        prompts = [tokenizer.apply_chat_template(chats[i], add_generation_prompt=True) for i in live]
        for i, prompt, ids in zip(live, prompts, greedy_answers(model, tokenizer, prompts, args)):
            chats[i].append({"role": "assistant", "content": tokenizer.decode(ids)})
            last[i] = (list(prompt), ids)
    rows, prompt_lens, answers = [], [], []
    for chat, (prompt, ids) in zip(chats, last):
        row = np.asarray(prompt + ids, np.int32)
        mask = np.arange(len(row)) >= len(prompt)
        for k in range(1, len(chat) - 1, 2):  # earlier assistant turns
            start = len(tokenizer.apply_chat_template(chat[:k], add_generation_prompt=True))
            end = len(tokenizer.apply_chat_template(chat[: k + 1]))
            mask[start:end] = True
        rows.append(row)
        prompt_lens.append(len(prompt))
        answers.append(mask)
    return rows, prompt_lens, answers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target directory (default: the smollm2 pair's, prepared on first use)")
    p.add_argument("--requests", required=True, help="requests.json from recipes/smollm2_requests.py")
    p.add_argument("--out", required=True, help="shard directory")
    p.add_argument("--max-tokens", type=int, default=896, help="answer length cap")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="answer only the first N requests")
    p.add_argument("--split", default="train", choices=("train", "heldout"), help="which requests of --requests")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N requests")
    p.add_argument("--resume", action="store_true", help="continue at the first missing shard")
    p.add_argument("--defer", type=parse_defer, default=None, metavar="A:B",
                   help="make shards A..B-1 after all others (requests a drafter the build continues from has seen)")
    p.add_argument("--max-shards", type=int, default=None, help="make only the first N shards in that order")
    p.add_argument(
        "--fast-target", action=argparse.BooleanOptionalAction, default=True,
        help="approximate softmax / SiLU in the target (CPU float32; answers to training precision)",
    )
    args = p.parse_args(argv)

    import mlx.core as mx

    out = Path(args.out).expanduser()
    if out.exists() and any(out.glob("shard-*.npz")) and not args.resume:
        raise SystemExit(f"error: {out} holds shards already: pass --resume to continue")
    out.mkdir(parents=True, exist_ok=True)
    requests = json.loads(Path(args.requests).expanduser().read_text())[args.split][args.skip :][: args.limit]
    model_dir, model, tokenizer = load_target(args)
    n_shards = (len(requests) + args.shard_size - 1) // args.shard_size
    log(out, f"start: {len(requests)} requests, {n_shards} shards, model {model_dir}")
    order = sorted((out / f"shard-{i:05d}.npz" for i in range(n_shards)), key=lambda p: shard_key(p, args.defer))
    for path in order[: args.max_shards]:
        i = shard_index(path)
        chunk = requests[i * args.shard_size : (i + 1) * args.shard_size]
        if path.exists() and len(read_shard(path)[1]) == len(chunk):
            continue  # done (a shard cut short by an earlier --limit is redone)
        tic = time.perf_counter()
        rows, prompt_lens, answers = answer(model, tokenizer, chunk, args)
        dt = time.perf_counter() - tic
        write_shard(path, rows, prompt_lens, dt, answers)
        mx.clear_cache()
        answered = int(sum(a.sum() for a in answers))
        long_rows = sum(len(r) >= 512 for r in rows)
        log(out, f"shard {i + 1}/{n_shards}: {len(rows)} rows, {answered} answer tokens "
                 f"({answered / dt:.1f} tok/s), {long_rows} rows >= 512 tokens, {dt:.0f} s")
    log(out, "done")


if __name__ == "__main__":
    main()
