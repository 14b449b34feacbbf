"""``mx.compile``, one compiled function per thread.

MLX (0.32) can abort the process at exit ("terminate called without an
active exception") when a compiled function that ran on a thread that has
since ended is destroyed with the interpreter. A module-level compiled
function lives that long; compiled anew for each calling thread and held in
thread-local storage, it goes with its thread instead.
"""

import threading
from functools import partial, wraps

import mlx.core as mx


def compile_per_thread(fn=None, **kwargs):
    """``mx.compile(fn, **kwargs)``, compiled once in each calling thread
    (usable as a decorator, with or without arguments)."""
    if fn is None:
        return partial(compile_per_thread, **kwargs)
    local = threading.local()

    @wraps(fn)
    def call(*args, **kw):
        compiled = getattr(local, "fn", None)
        if compiled is None:
            compiled = local.fn = mx.compile(fn, **kwargs)
        return compiled(*args, **kw)

    return call
