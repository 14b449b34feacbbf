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


def probe(preload: bool):
    """One process: the BLAS found, `generate` on the bundled pair, then the
    warning asked for again (given once per process)."""
    code = (
        "import json; from dflash_mlx import blas, cli; print(json.dumps(blas.cpu_blas()), flush=True)\n"
        "assert cli.main(['generate', '--max-tokens', '1']) == 0; blas.warn_if_reference()"
    )
    done = run(code, preload)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[0], done.stderr.splitlines()


@needs_bundled
def test_without_openblas_mlx_runs_the_bundled_reference_blas_and_generate_warns_once():
    found, lines = probe(preload=False)
    assert '"reference": true' in found and "mlx_cpu.libs/libblas" in found
    warnings = [line for line in lines if WARNING in line]
    assert len(warnings) == 1 and warnings[0].startswith(WARNING)  # on stderr, once per process
    assert "apt install libopenblas0-pthread" in warnings[0] and f"LD_PRELOAD={blas.openblas_path()}" in warnings[0]


@needs_openblas
def test_with_openblas_preloaded_it_serves_mlx_and_nothing_is_printed():
    found, lines = probe(preload=True)
    assert '"name": "OpenBLAS"' in found and '"reference": false' in found
    assert not any(WARNING in line for line in lines)


class Warned(Exception):
    pass


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_warns_once_its_pair_is_loaded(command, monkeypatch, tmp_path):
    from dflash_mlx import cli

    def warn():
        raise Warned(command)

    monkeypatch.setattr(blas, "warn_if_reference", warn)
    port = ["--port", "0"] if command == "server" else []
    with pytest.raises(Warned):  # the bundled pair loaded, before decoding
        cli.main([command, *port])
    missing = str(tmp_path / "none")  # a bad flag or model ends the command with its error alone
    assert cli.main([command, "--model", missing, "--draft-model", missing, *port]) == 1
    with pytest.raises(SystemExit):
        cli.main([command, "--max-tokens", "0"])


def test_only_linux_warns(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert blas.cpu_blas() == {"name": "Accelerate", "library": None, "reference": False}
    assert blas.warn_if_reference.__wrapped__() is False and capsys.readouterr().err == ""


def test_the_matmul_probe_measures_a_rate():
    assert blas.matmul_gflops(n=64, repeats=3) > 0
