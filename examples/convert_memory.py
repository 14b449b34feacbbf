"""Peak memory of converting a drafter of real width, against its size.

Writes a random bf16 drafter shaped like z-lab/Qwen3.5-4B-DFlash (hidden
2560, 6 layers, 8 taps -> fc input 20480, intermediate 9216, 32/8 heads,
head_dim 128; vocab 1024 since a drafter has no embedding) as three shards,
then converts it in fresh processes and prints each one's peak RSS and MLX
peak memory. Needs about 3 GB of free disk space in --workdir.

    python examples/convert_memory.py
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx.loading import build_draft
from dflash_mlx.models.dflash import DFlashConfig

CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 6,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9216,
    "vocab_size": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000.0,
    "max_position_embeddings": 32768,
    "num_target_layers": 32,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "block_size": 16,
    "dflash_config": {"target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29], "mask_token_id": 1023},
}

# Runs in a fresh process so its peak RSS is the conversion's own. On Linux
# ru_maxrss survives exec (it would report this parent's peak), so read the
# per-process high-water mark VmHWM there; macOS's ru_maxrss is in bytes.
CHILD = """
import json, resource, sys
import mlx.core as mx
from dflash_mlx.convert import main

def peak_rss():
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

base = peak_rss()
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "base": base, "peak": peak_rss(), "mlx_peak": mx.get_peak_memory()}))
"""


def write_drafter(path: Path, shards: int = 3) -> int:
    """Random bf16 weights, one tensor in memory at a time; returns bytes."""
    path.mkdir(parents=True)
    params = tree_flatten(build_draft(DFlashConfig.from_hf(CONFIG)).parameters())
    total = sum(p.size for _, p in params) * 2
    per_shard, shard, size, weight_map = total / shards, {}, 0, {}
    count = 0

    def flush():
        nonlocal shard, size, count
        count += 1
        name = f"model-{count:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / name), shard)
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for i, (name, p) in enumerate(params):
        if name.endswith("norm.weight"):
            value = mx.ones(p.shape, dtype=mx.bfloat16)
        else:
            value = (mx.random.normal(p.shape, key=mx.random.key(i)) * 0.02).astype(mx.bfloat16)
        mx.eval(value)
        shard[name] = value
        size += value.nbytes
        if size >= per_shard and count < shards - 1:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None, help="scratch directory (default: a new temp dir)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src = Path(tmp) / "drafter-bf16"
        tic = time.perf_counter()
        total = write_drafter(src)
        print(f"drafter: {total / 1e9:.3f} GB bf16 in 3 shards ({time.perf_counter() - tic:.0f} s to write)")
        runs = [
            ("4-bit g64, default 2 GiB shards", ["-q"]),
            ("4-bit g64, 0.1 GiB shards", ["-q", "--max-shard-size", "0.1"]),
            ("8-bit g64, 0.1 GiB shards", ["-q", "--q-bits", "8", "--max-shard-size", "0.1"]),
            ("bf16 copy, default 2 GiB shards", []),
            ("bf16 copy, 0.25 GiB shards", ["--max-shard-size", "0.25"]),
        ]
        print("| conversion | output | largest shard | peak RSS - baseline | MLX peak | seconds |")
        print("|---|---|---|---|---|---|")
        for i, (label, flags) in enumerate(runs):
            dst = Path(tmp) / f"out{i}"
            tic = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, "--hf-path", str(src), "--mlx-path", str(dst), *flags],
                capture_output=True,
                text=True,
            )
            seconds = time.perf_counter() - tic
            if proc.returncode != 0:
                sys.exit(f"{label}: failed\n{proc.stderr}")
            stats = json.loads(proc.stdout.strip().splitlines()[-1])
            files = list(dst.glob("*.safetensors"))
            out_size = sum(f.stat().st_size for f in files)
            largest = max(f.stat().st_size for f in files)
            rss = stats["peak"] - stats["base"]
            print(
                f"| {label} | {out_size / 1e9:.3f} GB ({len(files)} files) | {largest / 1e9:.3f} GB "
                f"| {rss / 1e9:.3f} GB | {stats['mlx_peak'] / 1e9:.3f} GB | {seconds:.1f} |"
            )
            for f in files:
                f.unlink()
        print(f"baseline RSS (python + mlx + converter imported): {stats['base'] / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
