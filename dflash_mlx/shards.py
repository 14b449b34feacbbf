"""Safetensors shards written a unit at a time, shared by the drafter converter
and the GGUF importer (which import this module, never each other)."""

import json
from pathlib import Path
from typing import List, Tuple

import mlx.core as mx


def shard_units(units: List[list], max_bytes: int) -> List[List[list]]:
    """Consecutive units per shard; a unit larger than the limit gets its own."""
    shards, size = [], 0
    for unit in units:
        nbytes = sum(v.nbytes for _, v in unit)
        if not shards or size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += nbytes
    return shards


def write_shards(out: Path, shards: List[List[list]]) -> Tuple[int, int, int]:
    """Evaluate and write the shards (consumed) plus the index, with a progress
    bar; returns (tensors, bytes, shards) written."""
    from tqdm import tqdm

    n_shards = len(shards)
    weight_map, size_after = {}, 0
    total = sum(len(u) for s in shards for u in s)
    with tqdm(total=total, unit="tensor", desc="converting", disable=None) as bar:
        for i in range(n_shards):
            shard, shards[i] = shards[i], None
            fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
            tensors = {}
            for unit in shard:
                mx.eval(*(v for _, v in unit))
                tensors.update(unit)
                bar.update(len(unit))
            del shard
            mx.save_safetensors(str(out / fname), tensors, metadata={"format": "mlx"})
            size_after += sum(v.nbytes for v in tensors.values())
            weight_map.update(dict.fromkeys(tensors, fname))
            del tensors
            mx.clear_cache()
    (out / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": size_after}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2,
        )
    )
    return len(weight_map), size_after, n_shards
