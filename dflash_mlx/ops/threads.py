"""MLX's per-thread state, released while the thread can still release it.

MLX (0.32) keeps each thread's compiled-function traces and its
``mx.random`` key in C++ thread-local storage that holds Python objects.
That storage is destroyed after Python has let go of the thread, so freeing
those objects takes the GIL again; when the interpreter is already exiting,
taking it ends the thread inside a destructor and the process aborts
("terminate called without an active exception", exit status -6). It
happens to any thread that ran a compiled function (ours or mlx-lm's) or
drew a random number, then ended, with the main thread exiting.

``mx.clear_streams()`` drops that state while the thread still holds the
GIL; MLX's own threaded tests call it as each thread ends
(ml-explore/mlx#3395, #4248). :func:`release_at_thread_exit` has it called
when the calling thread ends, from Python's own per-thread cleanup.
"""

import threading
from functools import partial, wraps

import mlx.core as mx

_local = threading.local()


class _ClearStreams:
    """Held in thread-local storage: freed as the thread ends, on that thread, GIL held."""

    def __del__(self):
        mx.clear_streams()


def release_at_thread_exit():
    """Clear this thread's MLX streams, compile traces and random key when
    it ends (the main thread's go with the process)."""
    if not hasattr(_local, "release"):
        _local.release = None if threading.current_thread() is threading.main_thread() else _ClearStreams()


def compiled(fn=None, **kwargs):
    """``mx.compile(fn, **kwargs)`` whose callers release their thread's
    MLX state as they end (usable as a decorator, with or without arguments)."""
    if fn is None:
        return partial(compiled, **kwargs)
    compiled_fn = mx.compile(fn, **kwargs)

    @wraps(fn)
    def call(*args, **kw):
        release_at_thread_exit()
        return compiled_fn(*args, **kw)

    return call
