"""The BLAS behind MLX's CPU matmuls, and the CLIs' one-line warning about
the reference one. Each case runs in a fresh process: the preload decides
which library serves MLX, and the warning is given once per process."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx import blas

LINUX = sys.platform.startswith("linux")
WARNING = "warning: MLX's CPU matmuls run on the reference BLAS"
# MLX's Linux CPU wheel ships the Netlib BLAS beside itself (auditwheel's mlx_cpu.libs).
BUNDLED = sorted((Path(mx.__file__).parents[1] / "mlx_cpu.libs").glob("libblas*.so*"))
needs_bundled = pytest.mark.skipif(not (LINUX and BUNDLED), reason="MLX's Linux CPU wheel (reference BLAS) not installed")
needs_openblas = pytest.mark.skipif(
    not (LINUX and BUNDLED and Path(blas.openblas_path()).exists()), reason="no system OpenBLAS to preload"
)


def run(code_or_args, preload: bool):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = blas.openblas_path()
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


COMMANDS = ("generate", "chat", "bench", "server")


def probe(tmp_path, preload: bool):
    """One process: the BLAS found, then the four commands on a missing model
    (each warns, if at all, after parsing its flags and before loading)."""
    missing = str(tmp_path / "none")
    code = (
        "import json, sys; from dflash_mlx import blas, cli; print(json.dumps(blas.cpu_blas()))\n"
        f"for c in {COMMANDS!r}: print(c, cli.main([c, '--model', {missing!r}, '--draft-model', {missing!r}]), file=sys.stderr)"
    )
    done = run(code, preload)
    return done.stdout, done.stderr.splitlines()


@needs_bundled
def test_without_openblas_mlx_runs_the_bundled_reference_blas_and_the_commands_warn_once(tmp_path):
    found, lines = probe(tmp_path, preload=False)
    assert '"reference": true' in found and "mlx_cpu.libs/libblas" in found
    assert lines[0].startswith(WARNING) and sum(WARNING in line for line in lines) == 1
    assert "apt install libopenblas0-pthread" in lines[0] and f"LD_PRELOAD={blas.openblas_path()}" in lines[0]
    # after the warning, each command's own error and exit code 1
    assert [line for line in lines[1:] if not line.startswith("error:")] == [f"{c} 1" for c in COMMANDS]


@needs_openblas
def test_with_openblas_preloaded_it_serves_mlx_and_nothing_is_printed(tmp_path):
    found, lines = probe(tmp_path, preload=True)
    assert '"name": "OpenBLAS"' in found and '"reference": false' in found
    assert not any(WARNING in line for line in lines) and lines[0].startswith("error:")


class Warned(Exception):
    pass


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_warns_after_parsing_before_loading(command, monkeypatch, tmp_path):
    from dflash_mlx import cli

    def warn():
        raise Warned(command)

    monkeypatch.setattr(blas, "warn_if_reference", warn)
    with pytest.raises(Warned):  # raised before anything is loaded from the missing paths
        cli.main([command, "--model", str(tmp_path / "none"), "--draft-model", str(tmp_path / "none")])
    with pytest.raises(SystemExit):  # a bad flag ends the command before the warning
        cli.main([command, "--max-tokens", "0"])


def test_only_linux_warns(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert blas.cpu_blas() == {"name": "Accelerate", "library": None, "reference": False}
    assert blas.warn_if_reference.__wrapped__() is False and capsys.readouterr().err == ""


def test_the_matmul_probe_measures_a_rate():
    assert blas.matmul_gflops(n=64, repeats=3) > 0
