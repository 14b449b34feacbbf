"""Model cards of the bundled pair, filled from each stage's statistics."""

from pathlib import Path

from .common import DRAFTER_ANCHORS, DRAFTER_BATCH, DRAFTER_MAX_PROMPT, DRAFTER_ROW
from .data import MAX_FILE_BYTES


def write_target_card(out: Path, config: dict, stats: dict) -> None:
    t = config["text_config"]
    kinds = ["attention" if (i + 1) % t["full_attention_interval"] == 0 else "gated_deltanet" for i in range(t["num_hidden_layers"])]
    size = (out / "model.safetensors").stat().st_size
    steps_note = f"{stats['steps_done']} steps"
    if stats["steps_done"] < stats["steps"]:
        steps_note += f" (of {stats['steps']} planned: stopped by --max-train-minutes)"
    card = f"""# dflash_mlx default target (tiny Qwen3.5, Python stdlib)

A tiny language model with the Qwen3.5 text architecture (mlx-lm `model_type`
`qwen3_5`: hybrid Gated DeltaNet + gated full attention), trained from scratch on
the Python {stats['python']} standard library. It exists so dflash_mlx can test and
demonstrate DFlash speculative decoding offline; it is not a useful code model.

Built by `recipes/build_default_pair.py` (seeded; rerun to rebuild):

```
{stats['command']}
```

## Architecture

| field | value |
| --- | --- |
| parameters | {stats['params']:,} (tied embeddings) |
| layers | {t['num_hidden_layers']}: {', '.join(kinds)} |
| hidden / MLP | {t['hidden_size']} / {t['intermediate_size']} (SwiGLU) |
| attention | {t['num_attention_heads']} query heads, {t['num_key_value_heads']} KV heads, head_dim {t['head_dim']}, output gate, partial RoPE {t['rope_parameters']['partial_rotary_factor']} |
| Gated DeltaNet | {t['linear_num_key_heads']} key heads x {t['linear_key_head_dim']}, {t['linear_num_value_heads']} value heads x {t['linear_value_head_dim']}, conv kernel {t['linear_conv_kernel_dim']} |
| vocab | {stats['vocab_size']} (byte-level BPE; `<|endoftext|>` = {stats['eos_token_id']} is EOS/pad, `<|mask|>` = {stats['mask_token_id']} is the DFlash mask token) |
| weights | `model.safetensors`, float32 holding bfloat16-rounded values (A_log kept float32, as mlx-lm does; float32 because MLX computes fastest in it on the CPU), {size / 1e6:.2f} MB, MLX layout (`language_model.model.*` keys, conv1d as `[C, K, 1]`) |

`config.json` uses the Qwen3.5 wrapper layout (`text_config`), and loads with
`mlx_lm.load(path)`. There is no chat template: prompts are raw code.

## Data

`.py` files of the CPython {stats['python']} stdlib, excluding tests, idlelib,
site-packages, lib2to3 tests, pydoc topics, sysconfig data, generated codec
tables and files over {MAX_FILE_BYTES // 1000} kB. Split by file with a SHA-256
bucket of the relative path: {stats['train_tokens']:,} train tokens,
{stats['heldout_tokens']:,} held-out tokens. The held-out prompts shipped in
`../prompts.json` come only from held-out files.

## Training

AdamW (lr {stats['lr']}, {stats['warmup']} warmup steps then cosine to 10%,
weight decay {stats['weight_decay']}, grad-norm clip 1.0), float32, next-token
cross-entropy on random windows of {stats['seq_len']} tokens, batch
{stats['batch_size']}, {steps_note} ({stats['tokens_seen']:,} tokens seen), seed
{stats['seed']} (`mx.random.seed` and `numpy.random.RandomState`).
Trained in {stats['train_time_s'] / 60:.1f} min ({stats['stage_time_s'] / 60:.1f} min for the
whole stage) on {stats['machine']} with mlx {stats['mlx']} (CPU backend, OpenBLAS).

| loss (nats/token) | value |
| --- | --- |
| train, mean of last 50 steps | {stats['final_train_loss']:.3f} |
| train split, fixed windows | {stats['train_eval_loss']:.3f} |
| held-out files | {stats['heldout_loss']:.3f} |

## Sample (greedy, 100 tokens, first held-out prompt)

```python
{stats['sample_prompt']}{stats['sample_output']}
```
"""
    (out / "README.md").write_text(card)



def write_drafter_card(out: Path, config: dict, stats: dict) -> None:
    acc = stats["acceptance"]
    size = (out / "model.safetensors").stat().st_size
    card = f"""# dflash_mlx default drafter (DFlash, for the bundled tiny Qwen3.5 target)

A DFlash block-diffusion drafter for `../target`: it drafts {config['block_size']}-token
blocks in one forward pass from the target's hidden states, and the target
verifies them (lossless: greedy output is the target's own). Built by
`recipes/build_default_pair.py --stage drafter` (seeded; rerun to rebuild):

```
{stats['command']}
```

which trains with dflash_mlx's own trainer, in {len(stats['train_commands'])} phase(s):

```
{chr(10).join(stats['train_commands'])}
```

## Architecture

| field | value |
| --- | --- |
| layers | {config['num_hidden_layers']} (Qwen3-style, non-causal within the block) |
| hidden / MLP | {config['hidden_size']} / {config['intermediate_size']} (as the target) |
| attention | {config['num_attention_heads']} query heads, {config['num_key_value_heads']} KV heads, head_dim {config['head_dim']} |
| target taps | layers {config['dflash_config']['target_layer_ids']} of {config['num_target_layers']} (fused by `fc` + `hidden_norm`) |
| block size | {config['block_size']}, mask token `<|mask|>` = {config['dflash_config']['mask_token_id']} |
| embedding / LM head | borrowed from the target (tied) |
| weights | `model.safetensors`, float32 (MLX computes fastest in it on the CPU), {size / 1e6:.2f} MB, z-lab layout (loads with `dflash_mlx.load_draft`) |

## Data

{stats['train_rows']} rows of {DRAFTER_ROW} tokens (phase 1 trains on the first
file, phase 2 on both): a def/class prompt from the
*train* split of the stdlib (header + docstring, cut to at most
{DRAFTER_MAX_PROMPT} tokens) followed by the target's own greedy continuation
(float32 target). No held-out file is used. Self-distillation: every slot's
label is the target's greedy prediction at that position (on the continuation
that is the next token itself).

## Training

{stats['steps']} steps ({' + '.join(map(str, stats['phase_steps']))} by phase; phase 2 starts from
phase 1's weights with a fresh optimizer) of AdamW (peak lr from each command,
5% warmup then cosine to 10%, grad-norm clip 1.0), batch {DRAFTER_BATCH} rows, {DRAFTER_ANCHORS} random anchors per row, loss
cross-entropy of slot j weighted exp(-(j-1)/gamma) with gamma = block/2 = 8;
drafter float32, target frozen and run in float32, once per row
(`--cache-target`). Seed
{stats['seed']} (drafter init, prompt choice, windows and anchors).
Continuations took {stats['data_time_s'] / 60:.1f} min, training
{stats['train_time_s'] / 60:.1f} min, the whole stage {stats['stage_time_s'] / 60:.1f} min on
{stats['machine']} (mlx CPU backend, OpenBLAS).

| last 20 steps | value |
| --- | --- |
| loss (weighted CE, nats; last phase) | {stats['final_loss']:.3f} |
| slot-1 accuracy | {stats['final_slot1_acc']:.3f} |
| mean slot accuracy | {stats['final_mean_slot_acc']:.3f} |
| accepted-length proxy (1 + correct prefix) | {stats['final_accept_len_proxy']:.2f} |

The proxy averages over random anchors; decoding starts each block right after
a rejection, where the target is least predictable, so the measured acceptance
below is lower.

## Acceptance

Greedy `dflash_mlx.stream_generate` on the {acc['prompts']} held-out prompts
(`../prompts.json`), {acc['max_tokens']} new tokens each, block {config['block_size']}:
**{acc['mean_tokens_per_cycle']:.2f} tokens committed per verify cycle** (mean over all
cycles; the prefill token is not counted). Per prompt:
{', '.join(f'{x:.2f}' for x in acc['per_prompt'])}.
"""
    (out / "README.md").write_text(card)

