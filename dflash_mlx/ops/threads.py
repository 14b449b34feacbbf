"""``mx.compile``, one compiled function per thread.

MLX (0.32) aborts the process at exit ("terminate called without an active
exception") after a function compiled on one thread ran on another thread
that has since ended; compiled and run on the same thread, it does not. So a
module-level compiled function is compiled anew on each thread that calls it.
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
