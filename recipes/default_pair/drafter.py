"""Stage ``drafter``: the DFlash drafter for the bundled target, trained with
``mlx-dflash train`` on the target's own continuations of train-split prompts
(from scratch on a first set, then ``--init-from`` on those plus fresh ones),
its acceptance measured on the held-out prompts, written with a model card
through the converter's staging directory."""

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .cards import write_drafter_card
from .common import (
    DRAFTER_ANCHORS, DRAFTER_BATCH, DRAFTER_BLOCK, DRAFTER_LAYERS, DRAFTER_MAX_PROMPT, DRAFTER_ROW, DRAFTER_TAPS,
    REPO, read_split, stdlib_root,
)  # fmt: skip
from .data import make_prompts


def target_continuations(target_dir: Path, prompts: list[list[int]], row_len: int, max_prompt: int,
                         batch: int) -> np.ndarray:
    """Rows [n, row_len]: each prompt followed by the target's greedy continuation.

    At inference the drafter reads (and must predict) the target's own output,
    which for this tiny target is far more repetitive than the stdlib; the
    drafter trained on these rows accepts more tokens per cycle on held-out
    prompts than one trained as long on raw stdlib windows (BENCHMARKS.md).
    Prompts are sorted by length and cut to the shortest of their batch, so a
    batch decodes in lockstep without padding; the target runs in float32
    (faster than bf16 on the CPU, BENCHMARKS.md).
    """
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(target_dir))
    model.set_dtype(mx.float32)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    rows = []
    for start in tqdm(range(0, len(order), batch), desc="target continuations"):
        group = [prompts[i] for i in order[start : start + batch]]
        p = min(max_prompt, min(len(g) for g in group))
        x = mx.array([g[:p] for g in group])
        cache = make_prompt_cache(model)
        y = mx.argmax(model(x, cache=cache)[:, -1], axis=-1)
        out = [y]
        for i in range(row_len - p - 1):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            out.append(y)
            if i % 32 == 0:
                mx.eval(y)
        rows.append(np.concatenate([np.array(x), np.array(mx.stack(out, axis=1))], axis=1))
    return np.concatenate(rows)


def measure_acceptance(target_dir: Path, draft_dir: Path, prompts: list[str], max_tokens: int = 128) -> dict:
    """Greedy tokens committed per verify cycle on held-out prompts, counted by
    the benchmark's own run (the prefill's token is not a cycle)."""
    from dflash_mlx import load, load_draft
    from dflash_mlx.benchmark import run_dflash

    model, tokenizer = load(str(target_dir))
    draft = load_draft(draft_dir, model)
    committed = cycles = 0
    per_prompt = []
    for prompt in tqdm(prompts, desc="acceptance"):
        accepted = run_dflash(model, draft, tokenizer, prompt, max_tokens, draft.block_size)["accepted"]
        c = len(accepted) + sum(accepted)  # each cycle commits its accepted tokens + one
        committed, cycles = committed + c, cycles + len(accepted)
        per_prompt.append(round(c / max(1, len(accepted)), 3))
    return {
        "mean_tokens_per_cycle": round(committed / max(1, cycles), 3),
        "per_prompt": per_prompt,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
    }


def stage_drafter(args) -> None:
    """Train the DFlash drafter for the bundled target with ``mlx-dflash train``
    (self-distillation on the target's own continuations of train-split
    prompts), check its acceptance on the held-out prompts and write it,
    with a model card, to ``dflash_mlx/default_pair/draft``."""
    from tokenizers import Tokenizer

    from dflash_mlx import cli
    from dflash_mlx import train as dflash_train

    work = Path(args.work_dir)
    target = Path(args.out_dir)
    if not (target / "config.json").exists():
        sys.exit(f"{target} holds no target: run --stage target first")
    tok_meta = json.loads((work / "tokenizer" / "tokenizer_meta.json").read_text())
    prompt_order = []  # train-split prompts in the seeded order both phases draw from

    def continuation_rows(path: Path, first: int, count: int) -> float:
        """Target continuations of prompts ``first..first+count`` of the seeded
        order; returns the seconds they took (kept beside the rows, so a
        resumed build still reports the whole build's time)."""
        timing = path.with_suffix(".json")
        if args.drafter_resume and path.exists() and timing.exists():
            return json.loads(timing.read_text())["seconds"]
        t0 = time.time()
        if not prompt_order:
            prompts = make_prompts(stdlib_root(), read_split(work, "train"), 10**6)
            perm = np.random.default_rng(args.seed).permutation(len(prompts))
            prompt_order.extend(prompts[i] for i in perm)
        tok = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
        chosen = prompt_order[first : first + count]
        ids = [e.ids for e in tok.encode_batch(chosen, add_special_tokens=False)]
        rows = target_continuations(target, ids, DRAFTER_ROW, DRAFTER_MAX_PROMPT, batch=128)
        np.save(path, rows.astype(np.uint16))
        seconds = time.time() - t0
        timing.write_text(json.dumps({"seconds": round(seconds, 1)}) + "\n")
        print(f"{len(rows)} rows of {DRAFTER_ROW} tokens from train-split prompts {first}..{first + count - 1}")
        return seconds

    def train_run(data_files, run_dir: Path, steps: int, lr: float, init_from=None) -> list:
        if not args.drafter_resume:
            shutil.rmtree(run_dir, ignore_errors=True)
        argv = [
            "--model", str(target), "--data", *map(str, data_files), "--draft-model", str(run_dir),
            "--num-layers", str(DRAFTER_LAYERS), "--block-size", str(DRAFTER_BLOCK), "--taps", DRAFTER_TAPS,
            "--mask-token-id", str(tok_meta["mask_token_id"]), "--targets", "self-distill",
            "--steps", str(steps), "--learning-rate", str(lr),
            "--warmup", str(max(1, steps // 20)), "--batch-size", str(DRAFTER_BATCH),
            "--seq-len", str(DRAFTER_ROW), "--anchors-per-seq", str(DRAFTER_ANCHORS), "--seed", str(args.seed),
            "--save-every", "100", "--target-dtype", "float32", "--cache-target", "--dtype", "float32",
        ]  # fmt: skip
        if init_from is not None:
            argv += ["--init-from", str(init_from)]
        resume = ["--resume"] if args.drafter_resume and (run_dir / "training_state").exists() else []
        if cli.run(dflash_train.main, argv + resume) != 0:
            raise SystemExit("drafter training failed")
        return argv  # the command a fresh build runs

    # Phase 1: from scratch on the continuations of the first prompts.
    data_files = [work / "drafter_data.npy"]
    t_data = continuation_rows(data_files[0], 0, args.drafter_prompts)
    run_dirs = [work / "drafter_run"]
    commands = [train_run(data_files, run_dirs[0], args.drafter_steps, args.drafter_lr)]
    # Phase 2: continue from phase 1 on those rows plus fresh ones (a new
    # warmup and cosine), which lifts acceptance further than more epochs
    # over the same rows.
    if args.drafter_extra_steps:
        data_files.append(work / "drafter_data_extra.npy")
        t_data += continuation_rows(data_files[-1], args.drafter_prompts, args.drafter_extra_prompts)
        run_dirs.append(work / "drafter_run_extra")
        commands.append(
            train_run(data_files, run_dirs[-1], args.drafter_extra_steps, args.drafter_extra_lr, init_from=run_dirs[0])
        )
    run_dir = run_dirs[-1]
    states = [json.loads((d / "training_state" / "training_state.json").read_text()) for d in run_dirs]
    train_seconds = sum(s["train_seconds"] for s in states)

    from dflash_mlx.convert import Staging

    pair_dir = Path(args.pair_dir)
    staging = Staging(pair_dir / "draft", force=True)
    tmp = staging.path
    tmp.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(run_dir / name, tmp / name)
    held = json.loads((pair_dir / "prompts.json").read_text())
    t_measure = time.time()
    accept = measure_acceptance(target, tmp, held)
    t_measure = time.time() - t_measure
    print(f"held-out mean tokens per cycle: {accept['mean_tokens_per_cycle']:.3f}")

    tail = np.array(states[-1]["history"][-20:])
    stats = {
        "steps": sum(s["step"] for s in states),
        "phase_steps": [s["step"] for s in states],
        "train_rows": sum(int(np.load(f, mmap_mode="r").shape[0]) for f in data_files),
        "final_loss": round(float(tail[:, 0].mean()), 4),
        "final_slot1_acc": round(float(tail[:, 1].mean()), 4),
        "final_mean_slot_acc": round(float(tail[:, 2].mean()), 4),
        "final_accept_len_proxy": round(float(tail[:, 3].mean()), 3),
        "acceptance": accept,
        "data_time_s": round(t_data, 1),
        "train_time_s": round(train_seconds, 1),
        # data + training + acceptance: the stage's time from scratch, even
        # when this invocation resumed an interrupted run.
        "stage_time_s": round(t_data + train_seconds + t_measure, 1),
        "seed": args.seed,
        "command": args.command,
        "train_commands": [
            "mlx-dflash train " + " ".join(argv).replace(str(REPO) + "/", "") for argv in commands
        ],
        "machine": f"{platform.machine()} CPU x{os.cpu_count()}",
    }
    (work / "drafter_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    write_drafter_card(tmp, json.loads((tmp / "config.json").read_text()), stats)
    try:
        staging.commit()
    finally:
        staging.discard()
    out = staging.dst
    size = sum(f.stat().st_size for d in (out, target) for f in d.iterdir())
    print(json.dumps({k: v for k, v in stats.items() if k != "acceptance"}, indent=2))
    print(f"pair size {size / 1e6:.1f} MB")


