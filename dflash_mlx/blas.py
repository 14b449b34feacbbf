"""Which BLAS MLX's CPU matmuls run on, and the warning when it is the slow one.

MLX's Linux CPU wheel links the reference (Netlib) BLAS, whose ``sgemm`` is a
plain triple loop. OpenBLAS, preloaded, takes over the same symbols: the
dynamic linker looks a symbol up in the preloaded libraries before a
library's own dependencies. So the library that serves ``cblas_sgemm`` to
MLX is the one the global scope exports, if any, else the BLAS that MLX
itself loaded; it is named from the mapped file and told apart by the
symbols each implementation exports. (NumPy's bundled OpenBLAS renames its
symbols, so it never takes MLX's calls.)
"""

import ctypes
import os
import platform
import sys
import time
from functools import lru_cache
from typing import Optional

# Symbols that only the optimised implementations export.
SIGNATURES = (
    ("openblas_get_config", "OpenBLAS"),
    ("mkl_get_version", "MKL"),
    ("bli_info_get_version_str", "BLIS"),
    ("ATL_buildinfo", "ATLAS"),
)


def openblas_path() -> str:
    """Where Debian and Ubuntu's ``libopenblas0-pthread`` puts the library."""
    return f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libopenblas.so.0"


def fix() -> str:
    return f"apt install libopenblas0-pthread, then export LD_PRELOAD={openblas_path()}"


def mapped_libraries() -> list:
    """Shared objects mapped into this process, in load order."""
    seen = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and ".so" in fields[5]:
                seen.setdefault(fields[5], None)
    return list(seen)


def library_at(address: int) -> Optional[str]:
    """The mapped file holding ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end and len(fields) >= 6:
                return fields[5]
    return None


def exports(path: Optional[str], symbol: str) -> bool:
    """Whether the already loaded library ``path`` (None: the global scope) defines ``symbol``."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY) if path else ctypes.CDLL(None)
    except OSError:
        return False
    return hasattr(lib, symbol)


def sgemm_library() -> Optional[str]:
    """The file whose ``cblas_sgemm`` MLX calls (Linux, MLX imported)."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
        return library_at(address)
    except AttributeError:  # nothing global: MLX binds its own dependency
        pass
    for path in mapped_libraries():
        name = os.path.basename(path)
        if "blas" in name.lower() or "mkl" in name.lower() or "blis" in name.lower():
            if exports(path, "cblas_sgemm"):
                return path
    return None


def cpu_blas() -> dict:
    """``{"name", "library", "reference"}`` for MLX's CPU matmuls.

    ``reference`` is True only for a library named ``libblas`` that exports
    none of the optimised implementations' symbols: the Netlib build MLX's
    Linux wheel ships. macOS runs Accelerate.
    """
    import mlx.core  # noqa: F401  (loads MLX and its BLAS)

    if sys.platform == "darwin":
        return {"name": "Accelerate", "library": None, "reference": False}
    if not sys.platform.startswith("linux"):
        return {"name": "unknown", "library": None, "reference": False}
    path = sgemm_library()
    if path is None:
        return {"name": "unknown", "library": None, "reference": False}
    for symbol, name in SIGNATURES:
        if exports(path, symbol):
            return {"name": name, "library": path, "reference": False}
    reference = os.path.basename(path).startswith("libblas")
    return {"name": "reference BLAS (Netlib)" if reference else "unknown", "library": path, "reference": reference}


def matmul_gflops(n: int = 384, repeats: int = 5) -> float:
    """Measured float32 matmul rate on MLX's CPU stream (median of ``repeats``)."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.random.normal((n, n), key=mx.random.key(0))
        b = mx.random.normal((n, n), key=mx.random.key(1))
        mx.eval(a @ b)  # warm-up
        times = []
        for _ in range(repeats):
            tic = time.perf_counter()
            mx.eval(a @ b)
            times.append(time.perf_counter() - tic)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


@lru_cache(maxsize=None)
def warn_if_reference() -> bool:
    """One stderr line, once per process, when the model runs on the CPU and
    MLX's CPU matmuls run on the reference BLAS; returns whether it printed."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu or not cpu_blas()["reference"]:
        return False
    print(
        "warning: MLX's CPU matmuls run on the reference BLAS, many times slower than OpenBLAS; "
        f"fix: {fix()}",
        file=sys.stderr,
    )
    return True
