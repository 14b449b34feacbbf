"""Stage ``target``: train the tiny Qwen3.5 target from scratch on the train split.

The model is mlx-lm's own ``qwen3_5``; nothing in mlx-lm is patched. With
``--chunked-gdn`` (the default) the training forward goes through the
package's target adapter, whose GatedDeltaNet recurrence is the chunked WY
form of ``dflash_mlx.ops.gated_delta`` (a few matmuls per chunk instead of one
step per token); its gradients are mlx-lm's (tests/test_recipes.py). The
learning-rate schedule is the drafter trainer's, the output is written through
the converter's staging directory (it appears whole or not at all).
"""

import json
import math
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .cards import write_target_card
from .tokenizer import encode_split

# The target's shape: as small as still looks like Qwen3.5, because training
# must fit ~20 CPU minutes. GatedDeltaNet head dims are multiples of 32 so the
# Metal kernel is used on Apple GPUs (it needs Dk % 32 == 0), and value heads
# = 2 x key heads like real Qwen3.5 checkpoints (e.g. 32 value / 16 key).
TARGET_TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "full_attention_interval": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
}



def target_config(vocab_size: int, eos_id: int) -> dict:
    """Full config.json: the multimodal-wrapper layout real Qwen3.5 uses."""
    text = dict(TARGET_TEXT_CONFIG)
    text["vocab_size"] = vocab_size
    text["eos_token_id"] = eos_id
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": True,
        "eos_token_id": eos_id,
    }


def build_target(config: dict):
    from mlx_lm.models import qwen3_5

    return qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))



def training_forward(model, chunked: bool):
    """logits = forward(tokens): mlx-lm's model, or the same model through the
    hybrid target adapter with the chunked GatedDeltaNet recurrence."""
    if not chunked:
        return model
    from dflash_mlx.targets.hybrid import HybridTarget

    adapter = HybridTarget(model, recurrence="chunked", compile_layers=False)
    return lambda x: adapter.forward(x, adapter.make_cache(), taps=[], record=False)[0]


def make_step(model, forward, optimizer, compile_step: bool):
    """One AdamW update on a batch; compiled to fuse the GDN recurrence ops."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    def loss_fn(model, x, y):
        logits = forward(x)
        return nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, gnorm = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss, gnorm

    if compile_step:
        state = [model.state, optimizer.state, mx.random.state]
        step = mx.compile(step, inputs=state, outputs=state)
    return step


def evaluate(model, stream: np.ndarray, seq_len: int, batch: int, max_windows: int) -> float:
    """Mean next-token loss over fixed, non-overlapping held-out windows."""
    import mlx.core as mx
    import mlx.nn as nn

    n = min((len(stream) - 1) // seq_len, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        idx = np.arange(i, min(n, i + batch))
        win = np.stack([stream[j * seq_len : j * seq_len + seq_len + 1] for j in idx]).astype(np.int32)
        x, y = mx.array(win[:, :-1]), mx.array(win[:, 1:])
        loss = nn.losses.cross_entropy(model(x).astype(mx.float32), y, reduction="sum")
        total += loss.item()
        count += y.size
    return total / count


def count_params(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def stage_target(args) -> None:
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from dflash_mlx.convert import Staging
    from dflash_mlx.train import lr_at

    t_start = time.time()
    work = Path(args.work_dir)
    tok_dir = work / "tokenizer"
    tok_meta = json.loads((tok_dir / "tokenizer_meta.json").read_text())
    train = encode_split(work, "train")
    held = encode_split(work, "heldout")
    print(f"train tokens {len(train):,}  held-out tokens {len(held):,}")

    vocab = int(math.ceil(tok_meta["vocab_size"] / 64) * 64)
    config = target_config(vocab, tok_meta["eos_token_id"])
    mx.random.seed(args.seed)
    rng = np.random.RandomState(args.seed)
    model = build_target(config)
    model.train()
    n_params = count_params(model)
    print(f"target params {n_params:,}")

    steps = args.steps
    # The learning rate lives in optimizer.state as an array, so setting it
    # each step does not retrace the compiled step.
    optimizer = optim.AdamW(
        learning_rate=lr_at(0, steps, args.lr, args.warmup),
        betas=[0.9, args.adam_beta2],
        weight_decay=args.weight_decay,
    )
    step_fn = make_step(model, training_forward(model, args.chunked_gdn), optimizer, args.compile)

    L, B = args.seq_len, args.batch_size
    hi = len(train) - L - 1
    losses = []
    t_train = time.time()
    bar = tqdm(range(steps), desc="target")
    for s in bar:
        optimizer.learning_rate = lr_at(s, steps, args.lr, args.warmup)
        starts = rng.randint(0, hi, size=B)
        win = np.stack([train[o : o + L + 1] for o in starts]).astype(np.int32)
        loss, gnorm = step_fn(mx.array(win[:, :-1]), mx.array(win[:, 1:]))
        mx.eval(loss, gnorm, model.parameters(), optimizer.state)
        losses.append(loss.item())
        if s % 10 == 0 or s == steps - 1:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", gnorm=f"{gnorm.item():.2f}")
        if time.time() - t_train > 60 * args.max_train_minutes:
            print(f"time cap hit: stopping after {s + 1} of {steps} steps")
            break
    train_time = time.time() - t_train
    steps_done = len(losses)

    model.eval()
    heldout_loss = evaluate(model, held, L, 16, args.eval_windows)
    train_eval_loss = evaluate(model, train[: len(held)], L, 16, args.eval_windows)
    final_train_loss = float(np.mean(losses[-50:])) if losses else float("nan")
    print(f"train loss (last 50 steps) {final_train_loss:.4f}")
    print(f"train-split eval loss      {train_eval_loss:.4f}")
    print(f"held-out loss              {heldout_loss:.4f}")

    staging = Staging(args.out_dir, force=True)
    out = staging.path
    out.mkdir()
    # Round to bfloat16 (the precision real Qwen3.5 checkpoints ship in) except
    # what mlx_lm itself keeps in float32 (A_log, per the model's
    # cast_predicate), then store float32: MLX's CPU backend is fastest there.
    cast = model.cast_predicate
    weights = {
        k: (v.astype(mx.bfloat16).astype(mx.float32) if cast(k) else v)
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config["eos_token_id"], "do_sample": False}, indent=2) + "\n"
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tok_dir / name, out / name)

    stats = {
        "params": n_params,
        "vocab_size": vocab,
        "steps": steps,
        "steps_done": steps_done,
        "seq_len": L,
        "batch_size": B,
        "tokens_seen": steps_done * L * B,
        "train_tokens": int(len(train)),
        "heldout_tokens": int(len(held)),
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "adam_beta2": args.adam_beta2,
        "seed": args.seed,
        "command": args.command,
        "compile": bool(args.compile),
        "train_time_s": round(train_time, 1),
        "stage_time_s": round(time.time() - t_start, 1),
        "final_train_loss": round(final_train_loss, 4),
        "train_eval_loss": round(train_eval_loss, 4),
        "heldout_loss": round(heldout_loss, 4),
        "mask_token_id": tok_meta["mask_token_id"],
        "eos_token_id": tok_meta["eos_token_id"],
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "machine": f"{platform.machine()} CPU x{os.cpu_count()}",
    }
    (work / "target_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    sample = check_target(out, Path(args.pair_dir) / "prompts.json")
    stats["sample_prompt"], stats["sample_output"] = sample
    (work / "target_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    write_target_card(out, config, stats)
    try:
        staging.commit()
    finally:
        staging.discard()
    print(json.dumps({k: v for k, v in stats.items() if not k.startswith("sample")}, indent=2))


def check_target(path: Path, prompts_file: Path, max_tokens: int = 100) -> tuple[str, str]:
    """Reload through mlx_lm.load and decode greedily, as users will."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path))
    prompts = json.loads(prompts_file.read_text())
    prompt = prompts[0]
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)
    print("=" * 30 + " prompt\n" + prompt + "=" * 30 + " greedy continuation\n" + text)
    return prompt, text


