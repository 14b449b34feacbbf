"""Fixtures: tiny targets of every supported family, the device a test runs
on, and a run summary saying which device paths ran."""

import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

# Tests that take no ``device`` run on the CPU: their lossless checks compare
# float32 arithmetic with mlx-lm's own decode, the same on every machine. Set
# before mlx-lm is imported: its decode runs on a stream of the device that
# is the default at import, so mlx-lm's reference is always the CPU's.
mx.set_default_device(mx.cpu)
sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402


def gpu_backend():
    """"metal", "cuda" or None: the GPU MLX has here."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


DEVICES = ["cpu"] + (["gpu"] if gpu_backend() else [])


@pytest.fixture(scope="session")
def make_pair(tmp_path_factory):
    """name -> tiny.Pair of that family, built once per session."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = tiny.Pair(tmp_path_factory.mktemp(name), tiny.FAMILIES[name])
        return built[name]

    return get


@pytest.fixture(scope="session", autouse=True)
def blas_warning_given():
    """The CLIs warn about a reference BLAS once per process: warn before
    any test, so no test's captured stderr depends on running first."""
    from dflash_mlx.blas import warn_if_reference

    warn_if_reference()


@pytest.fixture(scope="session")
def qwen3_pair(make_pair):
    return make_pair("qwen3")


@pytest.fixture(scope="session")
def qwen3_5_pair(make_pair):
    return make_pair("qwen3_5")


@pytest.fixture(scope="session")
def llama_pair(make_pair):
    return make_pair("llama")


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """The Qwen-style tiny chat tokenizer: <tool_call> a single (non-special) token, mlx-lm's json_tools parser."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tiny_chat import QWEN_CHAT, write_chat_tokenizer

    path = tmp_path_factory.mktemp("chat_tokenizer")
    write_chat_tokenizer(path, QWEN_CHAT)
    return load_tokenizer(path)


@pytest.fixture(params=["qwen3", "qwen3_5"])
def pair(request, make_pair):
    return make_pair(request.param)


@pytest.fixture(params=list(tiny.FAMILIES))
def family_pair(request, make_pair):
    return make_pair(request.param)


@pytest.fixture(params=tiny.LOOP_FAMILIES)
def loop_family_pair(request, make_pair):
    return make_pair(request.param)


# ---------------------------------------------------------------------------
# Devices and the paths that ran on them

RAN = Counter()


@pytest.fixture
def ran(request):
    """``ran(path)``: note that this test exercised ``path`` (counted in the
    run summary if the test passes). Noted in the test's report, so the
    count is the same when pytest-xdist runs the tests in worker processes."""

    def note(path):
        if ("ran", path) not in request.node.user_properties:
            request.node.user_properties.append(("ran", path))

    return note


@pytest.fixture(params=DEVICES)
def device(request, ran):
    """The default device for this test: the CPU, and the GPU where MLX has
    one (DFlash runs there; mlx-lm's reference decode stays on the CPU)."""
    saved = mx.default_device()
    mx.set_default_device(mx.cpu if request.param == "cpu" else mx.gpu)
    ran("CPU" if request.param == "cpu" else f"GPU ({gpu_backend()})")
    try:
        yield request.param
    finally:
        mx.set_default_device(saved)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        RAN.update(path for key, path in report.user_properties if key == "ran")


def pytest_terminal_summary(terminalreporter):
    gpu = gpu_backend()
    lines = [f"CPU: {RAN['CPU']} device-parametrised tests passed"]
    gpu_name = f"GPU ({gpu})"
    lines.append(f"{gpu_name}: {RAN[gpu_name]} passed" if gpu else "GPU: none here (MLX has no Metal or CUDA device)")
    for path, needs in (("Metal kernels", "Metal"), ("fused recurrence", "Metal (mlx-lm's GatedDeltaNet kernel)")):
        lines.append(f"{path}: {RAN[path]} passed" if RAN[path] else f"{path}: not run (needs {needs})")
    terminalreporter.write_sep("-", "dflash_mlx device paths")
    for line in lines:
        terminalreporter.write_line(line)
