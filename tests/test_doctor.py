"""``mlx-dflash doctor``: the machine's checks, a pair's, the verdict and the exit code."""

import json
import os
import subprocess
import sys

import pytest
from test_blas import BUNDLED, LINUX, needs_openblas

from dflash_mlx import blas, doctor
from dflash_mlx.adaptive import MAX_TREE_NODES
from dflash_mlx.defaults import DEFAULT_TARGET

CHECKS = ["platform", "versions", "backend", "blas", "metal_kernels", "recurrence", "fast_math", "memory"]


def doctor_json(preload: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = blas.openblas_path()
    done = subprocess.run([sys.executable, "-m", "dflash_mlx", "doctor", "--json"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("preload", [False, pytest.param(True, marks=needs_openblas)], ids=["own BLAS", "OpenBLAS"])
def test_json_report_names_the_blas_with_and_without_the_preload(preload):
    report = doctor_json(preload)
    assert list(report["checks"]) == CHECKS and report["usable"] is True
    found = report["checks"]["blas"]
    assert found["gflops"] > 0
    if preload:
        assert found["name"] == "OpenBLAS" and found["status"] == "ok" and "openblas" in found["library"]
    elif LINUX and BUNDLED:
        assert found["name"] == "reference BLAS (Netlib)" and found["status"] == "warning" and found["reference"]
        assert "LD_PRELOAD=" in found["fix"] and "reference BLAS" in report["verdict"]
    if not report["checks"]["backend"]["backend"] == "Metal":
        assert report["checks"]["metal_kernels"]["status"] == "unavailable"  # not a failure
    assert report["checks"]["recurrence"]["status"] == "ok" and report["checks"]["recurrence"]["max_error"] < 1e-4
    assert report["verdict"].startswith("DFlash is usable here")


def test_the_bundled_pair_check_reports_speed_cycles_block_sizes_and_the_verdict(capsys):
    report = json.loads(json.dumps(doctor.diagnose(str(DEFAULT_TARGET), max_tokens=24), default=str))
    pair = report["checks"]["pair"]
    assert report["usable"] and pair["status"] == "ok" and pair["identical_to_mlx_lm"] and pair["new_tokens"] == 24
    assert pair["speedup"] == pytest.approx(pair["dflash_tps"] / pair["autoregressive_tps"])
    sizes = {int(b): n for b, n in pair["block_sizes"].items()}
    trees = {int(k): n for k, n in pair["tree_sizes"].items()}
    assert set(trees) <= set(range(1, MAX_TREE_NODES + 1))
    assert set(sizes) <= set(range(1, pair["trained_block_size"] + 1))
    assert sum(sizes.values()) + sum(trees.values()) >= 1
    assert 1 <= pair["tokens_per_cycle"] <= pair["trained_block_size"]
    doctor.print_report(report)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == [c.split("_")[0] for c in CHECKS] + ["pair"]
    assert "output identical to mlx-lm's" in lines[-2] and "block sizes picked" in lines[-2]
    verdict = lines[-1]
    assert verdict == report["verdict"] and f"{pair['speedup']:.2f}x plain decoding for {DEFAULT_TARGET}" in verdict
    assert verdict.startswith(("DFlash helps here: ", "DFlash breaks even here: ", "DFlash does not help here: "))


def test_an_unusable_pair_exits_1_with_the_reason(tmp_path, capsys):
    assert doctor.main(["--json", "--model", str(tmp_path / "my-model")]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["usable"] is False and report["checks"]["pair"]["status"] == "failed"
    assert report["verdict"].startswith("DFlash is not usable here: pair: cannot load the pair: no known drafter")


@pytest.mark.parametrize(
    "speedup, blas_status, start",
    [
        (1.62, "ok", "DFlash helps here: 1.62x plain decoding for m on one short prompt"),
        (1.02, "ok", "DFlash breaks even here: 1.02x"),
        (0.97, "ok", "DFlash breaks even here: 0.97x"),
        (0.56, "warning", "DFlash does not help here: 0.56x"),
    ],
)
def test_the_verdict_reads_the_ratio_and_names_a_slow_blas(speedup, blas_status, start):
    checks = {"blas": {"status": blas_status}, "pair": {"status": "ok", "speedup": speedup, "model": "m"}}
    verdict = doctor.verdict({"checks": checks})
    assert verdict.startswith(start)
    assert ("reference BLAS" in verdict) == (blas_status == "warning")


def test_a_failed_check_makes_the_verdict_its_reason():
    checks = {"blas": {"status": "ok"}, "recurrence": {"status": "failed", "summary": "differs from mlx-lm's ops"}}
    assert doctor.verdict({"checks": checks}) == "DFlash is not usable here: recurrence: differs from mlx-lm's ops"
