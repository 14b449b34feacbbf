"""Convert Hugging Face DFlash / DFlash2 drafters (and their targets) to MLX.

    mlx-dflash convert --hf-path z-lab/Qwen3.5-4B-DFlash --mlx-path dflash-4bit -q
    python -m dflash_mlx.convert --hf-path Qwen/Qwen3.5-4B --mlx-path target-4bit -q \\
        --draft-hf-path z-lab/Qwen3.5-4B-DFlash --draft-mlx-path dflash-4bit
    mlx-dflash convert --gguf model.Q4_1.gguf --mlx-path model-f32 --dtype float32

Drafters are converted here, one tensor at a time, so peak memory stays near
one output shard. Targets are handed to mlx-lm's own converter. Either way
the result appears at the destination only once it is complete.
"""

import argparse
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import cli
from .defaults import DTYPES
from .errors import DFlashError
from .loading import (
    DRAFT_ARCHITECTURES,
    QUANTIZED_BITS,
    QUANTIZED_GROUP_SIZES,
    build_draft,
    casts_to,
    check_draft_architecture,
    check_weights,
    draft_architecture,
    normalize_tensor_names,
    read_config,
    read_safetensors,
    resolve_path,
    stored_tensor_name,
)
from .models.dflash import DFlashConfig, DraftConfigError
from .shards import shard_units, write_shards

DEFAULT_SHARD_GB = 2.0
# Besides weights and config.json, files worth carrying over (model card,
# tokenizer, chat template, generation config, licence, remote code).
COPIED_SUFFIXES = {".json", ".md", ".txt", ".jinja", ".model", ".tiktoken", ".py"}
SOURCE_WEIGHT_FILES = {"config.json", "model.safetensors.index.json"}


class ConvertError(DFlashError, ValueError):
    """A conversion that cannot proceed; the message is shown as is."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step, where the system can: Linux's
    renameat2(RENAME_EXCHANGE), macOS's renamex_np(RENAME_SWAP). False where
    it cannot (another system, a file system without it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    a, b = os.fsencode(a), os.fsencode(b)
    if hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        return libc.renameat2(at_fdcwd, a, at_fdcwd, b, rename_exchange) == 0
    if hasattr(libc, "renamex_np"):
        rename_swap = 2
        return libc.renamex_np(a, b, rename_swap) == 0
    return False


def check_parents(dst) -> None:
    """Refuse a destination under a file up front: its directory could never
    be made, which the trainer found only at its first checkpoint."""
    dst = Path(dst).expanduser().absolute()
    blocked = next((p for p in dst.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ConvertError(f"cannot write {dst}: {blocked} is a file, not a directory; choose another destination")


class Staging:
    """A private directory beside DST that becomes DST only on commit().

    Same parent, so the final rename is atomic and never crosses file
    systems. An existing DST is refused up front unless ``force``; with
    ``force`` it is replaced only at commit, after the conversion succeeded.
    """

    def __init__(self, dst, force: bool):
        self.dst = Path(dst).expanduser().absolute()
        self.force = force
        check_parents(self.dst)
        if os.path.lexists(self.dst) and not force:
            raise ConvertError(f"{dst} already exists: pass --force to replace it")
        # Parents this run creates go again with a failed conversion.
        self.made = [p for p in (self.dst.parent, *self.dst.parent.parents) if not p.exists()]
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        self.remove_orphans()
        prefix = f".{self.dst.name}.{os.getpid()}."
        self.root = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=self.dst.parent))
        # Writers create this themselves (mlx-lm insists on a new path); being
        # made by mkdir, it gets ordinary permissions, unlike mkdtemp's 0700.
        self.path = self.root / "out"

    def remove_orphans(self):
        """Delete the staging directories beside DST that a killed process
        left (named after its pid, which is no longer running here)."""
        for stale in self.dst.parent.glob(f".{glob.escape(self.dst.name)}.*.tmp"):
            pid = stale.name[len(self.dst.name) + 2 :].split(".")[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)

    def commit(self):
        old = self.root / "old"
        if os.path.lexists(self.dst):
            if not self.force:
                raise ConvertError(f"{self.dst} appeared during the conversion; left it alone")
            if exchange(self.path, self.dst):  # one step: DST is never missing
                return self.discard()
            os.replace(self.dst, old)
        try:
            os.replace(self.path, self.dst)
        except OSError:
            if os.path.lexists(old):
                os.replace(old, self.dst)
            raise
        self.discard()

    def discard(self):
        shutil.rmtree(self.root, ignore_errors=True)
        if not os.path.lexists(self.dst):
            for parent in self.made:  # innermost first; a non-empty one stays
                try:
                    parent.rmdir()
                except OSError:
                    break


def quantizable(group_size: int):
    """nn.quantize predicate: Linear layers whose input width the group divides.

    Only matmul weights are quantized. Norms, DFlash2 conv base kernels and
    the selector codebooks stay float: they are tiny (no memory to win), and
    base kernels and codebooks are not matmul weights but terms of sums (conv
    taps over a block, pairwise selector scores) whose rounding errors
    compound along the block and the selector's walk.
    """
    return lambda path, module: isinstance(module, nn.Linear) and module.weight.shape[-1] % group_size == 0


def plan_draft_tensors(model: nn.Module, weights: Dict[str, mx.array], dtype, q) -> List[list]:
    """Lazy output tensors, grouped into units that are evaluated together.

    Consumes ``weights``: once a unit is evaluated and written nothing else
    holds its source, so memory is released tensor by tensor.
    """
    quantized = {p for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    units = []
    for name, _ in tree_flatten(model.parameters()):
        prefix, leaf = name.rsplit(".", 1)
        if prefix in quantized and leaf in ("scales", "biases"):
            continue  # emitted with the weight
        value = weights.pop(name)
        if dtype is not None and casts_to(name, value, dtype):
            value = value.astype(dtype)
        if prefix in quantized and leaf == "weight":
            w, scales, biases = mx.quantize(value, q["group_size"], q["bits"])
            units.append([(name, w), (f"{prefix}.scales", scales), (f"{prefix}.biases", biases)])
        else:
            units.append([(stored_tensor_name(name), value)])
    return units


def copy_side_files(src: Path, out: Path):
    """Model card, tokenizer and other small files, as they are."""
    for f in src.iterdir():
        if (
            f.is_file()
            and not f.name.startswith(".")
            and f.name not in SOURCE_WEIGHT_FILES
            and (f.suffix in COPIED_SUFFIXES or f.name.upper().startswith("LICENSE"))
        ):
            shutil.copy2(f, out / f.name)


def write_draft(
    hf_path: str,
    cfg: dict,
    out: Path,
    *,
    dtype: Optional[str],
    quantize: bool,
    q_bits: int,
    q_group_size: int,
    max_shard_bytes: int,
) -> dict:
    """Check the whole drafter, then write it to ``out`` shard by shard."""
    src = resolve_path(hf_path)
    if cfg.get("quantization"):
        raise ConvertError(f"{hf_path} is already quantized: convert from the float checkpoint")
    try:
        config = DFlashConfig.from_hf(cfg)
    except DraftConfigError as e:
        raise ConvertError(f"{src / 'config.json'}: {e}") from e
    weights = normalize_tensor_names(read_safetensors(src))
    model = build_draft(config)  # parameters stay lazy: nothing is allocated
    check_weights(model, weights, src)
    size_before = sum(v.nbytes for v in weights.values())
    n_before = len(weights)
    mx_dtype = DTYPES[dtype] if dtype else None
    q = {"group_size": q_group_size, "bits": q_bits, "mode": "affine"} if quantize else None
    kept_float = []
    if q:
        predicate = quantizable(q_group_size)
        kept_float = [
            p for p, m in model.named_modules() if isinstance(m, nn.Linear) and not predicate(p, m)
        ]
        nn.quantize(model, q_group_size, q_bits, class_predicate=predicate)
    shards = shard_units(plan_draft_tensors(model, weights, mx_dtype, q), max_shard_bytes)
    del model

    out.mkdir()
    n_out, size_after, n_shards = write_shards(out, shards)
    copy_side_files(src, out)
    out_cfg = dict(cfg)  # every original field survives
    if dtype:
        for key in ("torch_dtype", "dtype"):
            if key in out_cfg:
                out_cfg[key] = dtype
    if q:
        out_cfg["quantization"] = dict(q)
        out_cfg["quantization_config"] = dict(q)  # the HF-side name mlx-lm also writes
    (out / "config.json").write_text(json.dumps(out_cfg, indent=2))
    return {
        "tensors": (n_before, n_out),
        "bytes": (size_before, size_after),
        "shards": n_shards,
        "kept_float": kept_float,
    }


def write_target(hf_path: str, out: Path, *, dtype, quantize, q_bits, q_group_size) -> dict:
    """mlx-lm's converter, unchanged (its own shard size), writing to ``out``."""
    from mlx_lm.convert import convert as mlx_lm_convert

    src = Path(hf_path).expanduser()
    size_before = sum(f.stat().st_size for f in src.glob("*.safetensors")) if src.is_dir() else None
    mlx_lm_convert(
        hf_path=str(hf_path),
        mlx_path=str(out),
        quantize=quantize,
        q_bits=q_bits if quantize else None,
        q_group_size=q_group_size if quantize else None,
        dtype=dtype,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    return {
        "tensors": (None, len(index["weight_map"])),
        "bytes": (size_before, index["metadata"]["total_size"]),
        "shards": len(set(index["weight_map"].values())),
        "kept_float": [],
    }


def human(nbytes) -> str:
    if nbytes is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def summary_line(kind: str, dst: Path, stats: dict, seconds: float, q: Optional[dict]) -> str:
    n_in, n_out = stats["tensors"]
    b_in, b_out = stats["bytes"]
    tensors = f"{n_in} -> {n_out}" if n_in is not None else f"{n_out}"
    qtext = f", {q['bits']}-bit g{q['group_size']}" if q else ""
    line = (
        f"[convert] {kind} -> {dst}: {tensors} tensors in {stats['shards']} shard(s), "
        f"{human(b_in)} -> {human(b_out)}{qtext}, {seconds:.1f} s, "
        f"peak MLX memory {human(mx.get_peak_memory())}"
    )
    if stats["kept_float"]:
        line += (
            f"\n[convert] kept {len(stats['kept_float'])} linear layer(s) in float: input width "
            f"not divisible by the group size {q['group_size']} ({', '.join(stats['kept_float'][:4])}"
            f"{' ...' if len(stats['kept_float']) > 4 else ''})"
        )
    return line


def check_options(dtype: Optional[str], quantize: bool, q_bits: int, q_group_size: int):
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if quantize and (q_bits not in QUANTIZED_BITS or q_group_size not in QUANTIZED_GROUP_SIZES):
        raise ConvertError(f"quantization needs bits in {QUANTIZED_BITS} and group size in {QUANTIZED_GROUP_SIZES}")


def import_gguf(gguf_path: str, mlx_path: str, options: dict, force: bool, max_shard_gb: float) -> dict:
    """Import a llama.cpp GGUF model (see ``dflash_mlx.gguf``), all or nothing;
    ``options`` are :func:`convert`'s dtype / quantization options.

    By default the GGUF's quantized tensors stay quantized, bit for bit.
    ``dtype`` dequantizes everything to that type (in float32 arithmetic:
    the GGUF's float16 scales would otherwise give float16 weights). ``quantize``
    dequantizes to float32 and hands that to mlx-lm's quantizer.
    """
    from .gguf import read_gguf, write_gguf_model

    dtype, quantize = options["dtype"], options["quantize"]
    src = Path(gguf_path).expanduser()
    loaded = read_gguf(src)  # refuses a bad file before anything is created
    staging = Staging(mlx_path, force)
    try:
        tic = time.perf_counter()
        mx.reset_peak_memory()
        shard_bytes = int(max_shard_gb * (1 << 30))
        if quantize:
            floats = staging.root / "float32"
            write_gguf_model(src, loaded, floats, dtype="float32", max_shard_bytes=shard_bytes)
            stats = write_target(str(floats), staging.path, **options)
        else:
            stats = write_gguf_model(src, loaded, staging.path, dtype=dtype, max_shard_bytes=shard_bytes)
        q = {"group_size": options["q_group_size"], "bits": options["q_bits"]} if quantize else None
        line = summary_line("target", staging.dst, stats, time.perf_counter() - tic, q)
        staging.commit()
    finally:
        staging.discard()
    print(line)
    return stats


def check_not_holding(dsts: List[Path], sources: List[Path]) -> None:
    """No destination holds a source: ``--force`` replaces it whole, and
    the source went with it after the conversion."""
    for dst in dsts:
        if any(dst.resolve() in src.resolve().parents for src in sources):
            raise ConvertError(f"{dst} holds the source checkpoint: choose another destination")


def convert(
    hf_path: str,
    mlx_path: str,
    *,
    kind: str = "auto",
    dtype: Optional[str] = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    force: bool = False,
    max_shard_gb: float = DEFAULT_SHARD_GB,
    draft_hf_path: Optional[str] = None,
    draft_mlx_path: Optional[str] = None,
) -> List[dict]:
    """Convert one checkpoint, or a target + drafter pair, all or nothing.

    ``kind`` is "draft", "target", "auto" (from config.json's
    architectures) or "gguf" (``hf_path`` is a llama.cpp model file). Every destination is checked before any work starts and
    filled only after every conversion succeeded; on failure none is touched.
    Returns the per-checkpoint statistics.
    """
    check_options(dtype, quantize, q_bits, q_group_size)
    options = dict(dtype=dtype, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size)
    if kind == "gguf":
        if draft_hf_path is not None:
            raise ConvertError("a GGUF import converts a target model; it takes no drafter options")
        return [import_gguf(hf_path, mlx_path, options, force, max_shard_gb)]
    if (draft_hf_path is None) != (draft_mlx_path is None):
        raise ConvertError("--draft-hf-path and --draft-mlx-path go together")
    jobs = [(hf_path, mlx_path, kind)]
    if draft_hf_path is not None:
        jobs.append((draft_hf_path, draft_mlx_path, "draft"))
    dsts = [Path(d).expanduser().absolute() for _, d, _ in jobs]
    if len(set(dsts)) != len(dsts):
        raise ConvertError("the target and the drafter need different destinations")
    q = {"group_size": q_group_size, "bits": q_bits} if quantize else None

    resolved, sources = [], []
    for src, dst, job_kind in jobs:
        src_dir = resolve_path(src, allow_patterns=["config.json"])  # fetching nothing else yet
        cfg = read_config(src_dir)
        found = "draft" if draft_architecture(cfg) else "target"
        if job_kind == "auto":
            job_kind = found
        elif job_kind == "draft" and found != "draft":
            check_draft_architecture(cfg, src)  # raises, naming the architecture
        elif job_kind == "target" and found == "draft":
            raise ConvertError(f"{src} is a DFlash drafter ({draft_architecture(cfg)}), not a target: drop --kind target")
        if src_dir.resolve() == Path(dst).expanduser().resolve():
            raise ConvertError(f"{dst} is the source checkpoint: choose another --mlx-path")
        resolved.append((src, cfg, dst, job_kind))
        sources.append(src_dir)
    check_not_holding(dsts, sources)

    stagings = []
    try:
        for _, _, dst, _ in resolved:
            stagings.append(Staging(dst, force))
        lines = []
        stats = []
        for (src, cfg, dst, job_kind), staging in zip(resolved, stagings):
            tic = time.perf_counter()
            mx.reset_peak_memory()
            if job_kind == "draft":
                shard_bytes = int(max_shard_gb * (1 << 30))
                result = write_draft(src, cfg, staging.path, max_shard_bytes=shard_bytes, **options)
            else:
                result = write_target(src, staging.path, **options)
            result["kind"] = job_kind
            stats.append(result)
            lines.append(summary_line(job_kind, staging.dst, result, time.perf_counter() - tic, q))
        for staging in stagings:
            staging.commit()
    finally:
        for staging in stagings:
            staging.discard()
    for line in lines:
        print(line)
    return stats


def shard_gib(text: str) -> float:
    """argparse ``type`` for ``--max-shard-size``: a positive, finite number of GiB."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return value


def setup_arg_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="mlx-dflash convert",
        description="Convert a Hugging Face DFlash/DFlash2 drafter or its target model to MLX "
        "(drafters natively, targets through mlx-lm's converter).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-path", "--model", help="source: local directory or Hugging Face id")
    src.add_argument(
        "--gguf",
        metavar="FILE",
        help="source: a llama.cpp GGUF model file (llama, qwen2, qwen3); its quantized "
        "tensors stay quantized unless --dtype or -q is given",
    )
    p.add_argument("--mlx-path", required=True, help="destination directory (must not exist unless --force)")
    p.add_argument(
        "--kind",
        choices=("auto", "draft", "target"),
        default="auto",
        help="what --hf-path is (default: from config.json's architectures; "
        f"{' / '.join(DRAFT_ARCHITECTURES)} are drafters, anything else a target)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="type of the float tensors (default: as stored)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the linear layers")
    p.add_argument("--q-bits", type=int, choices=QUANTIZED_BITS, default=None, help="bits per weight (default 4)")
    p.add_argument("--q-group-size", type=int, choices=QUANTIZED_GROUP_SIZES, default=None, help="group size (default 64)")
    p.add_argument("--force", action="store_true", help="replace an existing destination (after success)")
    p.add_argument(
        "--max-shard-size",
        type=shard_gib,
        default=DEFAULT_SHARD_GB,
        metavar="GB",
        help=f"drafter output shard size in GiB; peak memory is about one shard (default {DEFAULT_SHARD_GB})",
    )
    p.add_argument("--draft-hf-path", default=None, help="also convert this drafter, with the same options")
    p.add_argument("--draft-mlx-path", default=None, help="destination of --draft-hf-path")
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if not args.quantize and (args.q_bits is not None or args.q_group_size is not None):
        raise ConvertError("--q-bits / --q-group-size need -q/--quantize")
    if args.gguf is not None and (args.kind == "draft" or args.draft_hf_path is not None):
        raise ConvertError("--gguf imports a target model; it takes no drafter options")
    options = dict(
        dtype=args.dtype,
        quantize=args.quantize,
        q_bits=args.q_bits or 4,
        q_group_size=args.q_group_size or 64,
        force=args.force,
        max_shard_gb=args.max_shard_size,
    )
    try:
        source, kind = (args.gguf, "gguf") if args.gguf is not None else (args.hf_path, args.kind)
        convert(source, args.mlx_path, kind=kind, draft_hf_path=args.draft_hf_path,
                draft_mlx_path=args.draft_mlx_path, **options)  # fmt: skip
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    except cli.USER_ERRORS:
        raise
    except (OSError, RuntimeError) as e:  # disk, permissions, mlx file errors: one line, not a traceback
        raise ConvertError(f"{type(e).__name__}: {e}") from e
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
