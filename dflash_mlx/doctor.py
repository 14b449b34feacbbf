"""``mlx-dflash doctor``: is DFlash usable on this machine, and does it help?

    mlx-dflash doctor                          # the machine: MLX, BLAS, kernels, memory
    mlx-dflash doctor --model smollm2 --json   # and a pair: loads, speed against mlx-lm

Checks the platform and MLX's backend, the BLAS MLX's CPU matmuls run on
(a measured matmul with the library behind it), the Metal kernels and the
GatedDeltaNet recurrence against MLX's ops, the CPU fast-math probe and
memory. Given a pair it loads it and decodes one short prompt with mlx-lm
and with DFlash (greedy), and ends with one line saying whether DFlash
helps here. Exit code 0 when DFlash is usable, 1 with the reason otherwise.
"""

import contextlib
import json
import os
import platform
import sys
import time
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import mlx.core as mx

from . import cli
from ._version import __version__

OK, WARNING, UNAVAILABLE, FAILED = "ok", "warning", "unavailable", "failed"
# DFlash/AR ratios within this band of 1 are a tie on one short prompt.
TIE = 0.05


def check(status: str, summary: str, **details) -> dict:
    """One check's result: its status, the line it prints, and details for --json."""
    return {"status": status, "summary": summary, **details}


def backend() -> str:
    if mx.metal.is_available():
        return "Metal"
    if mx.cuda.is_available():
        return "CUDA"
    return "CPU"


def chip() -> str:
    name = mx.device_info().get("device_name", "")
    if sys.platform.startswith("linux") and not name:
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return name or platform.processor() or "unknown"


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def platform_check() -> dict:
    found = dict(system=platform.system(), machine=platform.machine(), chip=chip(), python=platform.python_version())
    return check(OK, "{system} {machine}, {chip}, Python {python}".format(**found), **found)


def versions_check() -> dict:
    found = {"mlx": mx.__version__, "mlx-lm": package_version("mlx-lm"), "mlx-dflash": __version__}
    return check(OK, ", ".join(f"{k} {v}" for k, v in found.items()), **found)


def backend_check() -> dict:
    name, device = backend(), str(mx.default_device())
    return check(OK, f"{name} (models run on {device})", backend=name, default_device=device)


def blas_check() -> dict:
    from .blas import cpu_blas, fix, matmul_gflops

    found = cpu_blas()
    rate = matmul_gflops()
    summary = f"{found['name']}, {rate:.1f} GFLOP/s on a float32 matmul"
    if found["reference"]:
        return check(WARNING, summary + f"; the CPU path is many times slower than it should be. Fix: {fix()}",
                     fix=fix(), gflops=rate, **found)
    return check(OK, summary, gflops=rate, **found)


def probe_inputs(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def metal_kernels_check() -> dict:
    """DFlash2's conv and selector-walk kernels against the ops they replace."""
    if not mx.metal.is_available():
        return check(UNAVAILABLE, "no Metal on this machine; the compiled MLX ops run instead")
    from .models import dflash2 as d2

    x, base, coef = probe_inputs((1, 16, 64), 0), probe_inputs((2, 64), 1), probe_inputs((1, 16, 2, 8), 2)
    unary, first, pair = probe_inputs((1, 15, 8), 3), probe_inputs((1, 8), 4), probe_inputs((1, 14, 8, 8), 5)
    noise = mx.zeros((1, 15, 8))
    results = {}
    for name, kernel, ops, same in (
        ("conv", lambda: d2.conv_mix_metal(x, base, coef), lambda: d2.conv_mix_ops(x, base, coef),
         lambda a, b: mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()),
        ("walk", lambda: d2.walk_metal(unary, first, pair, noise), lambda: d2.walk_ops(unary, first, pair, noise),
         lambda a, b: mx.array_equal(a[0], b[0]).item() and mx.allclose(a[1], b[1]).item()),
    ):
        try:
            got, want = kernel(), ops()
            mx.eval(got, want)
            results[name] = "matches the ops" if same(got, want) else "differs from the ops"
        except Exception as e:  # a kernel that does not build is what this probe is for
            results[name] = f"failed to run ({type(e).__name__}: {e})"
    bad = {k: v for k, v in results.items() if v != "matches the ops"}
    summary = "DFlash2 conv and walk kernels compile and match the ops" if not bad else (
        "; ".join(f"{k}: {v}" for k, v in bad.items()) + " (the runtime falls back to the ops)")
    return check(WARNING if bad else OK, summary, kernels=results)


def recurrence_check() -> dict:
    """The GatedDeltaNet recurrence a verify runs here (mlx-lm's fused Metal
    kernel, else this package's chunked WY form) against mlx-lm's ops."""
    from mlx_lm.models.gated_delta import gated_delta_kernel, gated_delta_ops

    from .ops.gated_delta import chunked_gated_delta
    from .targets.hybrid import has_fused_recurrence

    B, T, Hk, Hv, D = 1, 16, 2, 4, 32
    q, k = (x / mx.linalg.norm(x, axis=-1, keepdims=True) for x in (probe_inputs((B, T, Hk, D), s) for s in (6, 7)))
    v = probe_inputs((B, T, Hv, D), 8)
    log_g = -mx.abs(probe_inputs((B, T, Hv), 9)) * 0.1
    beta = mx.sigmoid(probe_inputs((B, T, Hv), 10))
    state = probe_inputs((B, Hv, D, D), 11) * 0.1
    want_y, want_state = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)
    fused = has_fused_recurrence()
    try:
        if fused:
            got_y, got_state = gated_delta_kernel(q, k, v, mx.exp(log_g), beta, state)
        else:
            got_y, got_state, _ = chunked_gated_delta(q, k, v, log_g, beta, state, chunk_size=T, compiled=True)
        error = max(mx.abs(got_y - want_y).max().item(), mx.abs(got_state - want_state).max().item())
    except Exception as e:  # a kernel that does not build is what this probe is for
        return check(FAILED, f"the recurrence does not run ({type(e).__name__}: {e})")
    path = "mlx-lm's fused Metal kernel" if fused else "chunked WY form, compiled (no fused kernel here)"
    if error > 1e-4:
        return check(FAILED, f"{path} differs from mlx-lm's ops by {error:.1e}", path=path, max_error=error)
    return check(OK, f"{path}, matches mlx-lm's ops (max error {error:.1e})", path=path, max_error=error)


def fast_math_check() -> dict:
    from .ops import fast_math

    if mx.default_device() != mx.cpu:
        return check(UNAVAILABLE, "not used off the CPU (MLX's own exp is fast there)")
    if fast_math.available(mx.cpu):
        return check(OK, "on: the verify's fused exp/sigmoid/silu equal MLX's ops bit for bit")
    return check(WARNING, "off: the fused functions differ from this MLX build's ops, so MLX's slower ops run")


def memory_check() -> dict:
    found = {}
    if sys.platform.startswith("linux"):
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
        found.update(total=info.get("MemTotal"), available=info.get("MemAvailable"))
    else:
        with contextlib.suppress(ValueError, OSError):
            found["total"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if mx.metal.is_available():
        found["recommended_working_set"] = mx.device_info().get("max_recommended_working_set_size")
        found["wired_limit"] = mx.set_wired_limit(0)
        mx.set_wired_limit(found["wired_limit"])  # read, then put back
    gb = {k: f"{v / 1e9:.1f} GB" for k, v in found.items() if v is not None}
    summary = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in gb.items()) or "unknown"
    return check(OK, summary, **found)


def pair_check(model_path, draft_path, prompt: Optional[str], max_tokens: int) -> dict:
    """Load the pair, then one short greedy prompt with mlx-lm and with
    DFlash (each warmed up first): speed, tokens per cycle, block sizes."""
    from .benchmark import compile_block_lengths, run_autoregressive, run_dflash
    from .generate import build_prompt, encode_prompt, mean_tokens_per_cycle
    from .pair import default_prompt, load_pair

    tic = time.perf_counter()
    try:
        model, tokenizer, draft, draft_path = load_pair(model_path, draft_path)
    except (*cli.USER_ERRORS, OSError) as e:
        return check(FAILED, f"cannot load the pair: {e}", model=str(model_path), draft_model=draft_path)
    loaded = time.perf_counter() - tic
    ids = encode_prompt(tokenizer, build_prompt(tokenizer, prompt if prompt is not None else default_prompt(model_path)))
    compile_block_lengths(draft, ids, draft.block_size)
    run_autoregressive(model, tokenizer, ids, 4)
    run_dflash(model, draft, tokenizer, ids, 8, None)  # also calibrates the adaptive block
    ar = run_autoregressive(model, tokenizer, ids, max_tokens)
    dflash = run_dflash(model, draft, tokenizer, ids, max_tokens, None)
    ratio = dflash["tps"] / ar["tps"]
    drafting = [c for c, b in zip(dflash["committed"], dflash["block_sizes"]) if b > 1]
    chains = [b for b, n in zip(dflash["block_sizes"], dflash["tree_sizes"]) if not n]
    blocks = dict(sorted(Counter(chains).items()))
    trees = dict(sorted(Counter(n for n in dflash["tree_sizes"] if n).items()))
    identical = dflash["tokens"] == ar["tokens"]
    details = dict(
        model=str(model_path), draft_model=str(draft_path), load_seconds=loaded, prompt_tokens=ids.size,
        new_tokens=len(dflash["tokens"]), trained_block_size=draft.block_size,
        autoregressive_tps=ar["tps"], dflash_tps=dflash["tps"], speedup=ratio,
        tokens_per_cycle=mean_tokens_per_cycle(dflash["committed"]),
        tokens_per_drafting_cycle=mean_tokens_per_cycle(drafting), block_sizes=blocks, tree_sizes=trees,
        identical_to_mlx_lm=identical, peak_memory=dflash["peak_memory"] * 1e9,
    )
    summary = (
        f"{model_path} + {draft_path}: loaded in {loaded:.1f} s; {len(dflash['tokens'])} tokens: DFlash "
        f"{dflash['tps']:.1f} tok/s, mlx-lm {ar['tps']:.1f} tok/s ({ratio:.2f}x); "
        f"{details['tokens_per_cycle']:.2f} tokens per cycle ({details['tokens_per_drafting_cycle']:.2f} when drafting); "
        "block sizes picked (size: cycles) " + " ".join(f"{b}: {n}" for b, n in blocks.items())
        + ("; draft trees picked (nodes: cycles) " + " ".join(f"{k}: {n}" for k, n in trees.items()) if trees else "")
        + ("; output identical to mlx-lm's" if identical else "; output differs from mlx-lm's")
    )
    # Off float32 a block verify may round differently from mlx-lm's one-token step (see docs).
    return check(OK if identical else WARNING, summary, **details)


def verdict(report: dict) -> str:
    failed = [f"{name}: {c['summary']}" for name, c in report["checks"].items() if c["status"] == FAILED]
    if failed:
        return "DFlash is not usable here: " + "; ".join(failed)
    pair = report["checks"].get("pair")
    slow_blas = report["checks"]["blas"]["status"] == WARNING
    note = " (MLX's CPU matmuls run on the reference BLAS: fix that first, see BLAS above)" if slow_blas else ""
    if pair is None:
        return "DFlash is usable here" + note + "; pass --model (and --draft-model) to see whether it helps"
    ratio = pair["speedup"]
    if ratio >= 1 + TIE:
        return f"DFlash helps here: {ratio:.2f}x plain decoding for {pair['model']} on one short prompt" + note
    if ratio > 1 - TIE:
        return f"DFlash breaks even here: {ratio:.2f}x plain decoding for {pair['model']} on one short prompt" + note
    return f"DFlash does not help here: {ratio:.2f}x plain decoding for {pair['model']} on one short prompt" + note


def diagnose(model=None, draft_model=None, prompt=None, max_tokens: int = 64) -> dict:
    """The whole report: every check, whether DFlash is usable, the verdict."""
    checks = {
        "platform": platform_check(),
        "versions": versions_check(),
        "backend": backend_check(),
        "blas": blas_check(),
        "metal_kernels": metal_kernels_check(),
        "recurrence": recurrence_check(),
        "fast_math": fast_math_check(),
        "memory": memory_check(),
    }
    if model is not None or draft_model is not None:
        from .defaults import DEFAULT_TARGET

        checks["pair"] = pair_check(model or str(DEFAULT_TARGET), draft_model, prompt, max_tokens)
    report = {"checks": checks, "usable": all(c["status"] != FAILED for c in checks.values())}
    report["verdict"] = verdict(report)
    return report


def print_report(report: dict) -> None:
    for name, c in report["checks"].items():
        mark = "" if c["status"] == OK else f"  [{c['status']}]"
        print(f"{name.replace('_', ' '):14s}{c['summary']}{mark}")
    print(report["verdict"])


def setup_arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="mlx-dflash doctor", description="Check that DFlash runs well on this machine, and on a pair.")
    p.add_argument("--model", default=None, help="target to check with its drafter: local path, Hugging Face id or a pair name (smollm2)")
    p.add_argument("--draft-model", default=None, help="its drafter (default: the pair's, or z-lab's published one for the target)")
    p.add_argument("--prompt", default=None, help="the prompt of the pair check (default: the pair's first held-out prompt)")
    p.add_argument("--max-tokens", "-m", type=cli.positive_int, default=64, help="new tokens per decoder in the pair check")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    # With --json, stdout carries the JSON alone; anything the checks print goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        report = diagnose(args.model, args.draft_model, args.prompt, args.max_tokens)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0 if report["usable"] else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
