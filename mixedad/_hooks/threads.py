"""Threads that G starts while mixedad's pass runs, which its dispatch cannot follow.

mixedad's dispatch (grad mode read at each op, the per-op rules, the custom-Function hook) is a
per-thread torch-function mode. Ops that G runs in a thread it starts itself would carry
tangents on PyTorch's formulas alone, ignoring ``no_grad`` there. So the pass watches for the
threads that *its own thread* starts while G runs, and a pass that saw one takes the whole-G
fallback.

The watch sits where every ``threading.Thread.start`` ends (``threading._start_new_thread``,
``_start_joinable_thread`` on newer Pythons; ``ThreadPoolExecutor`` and ``multiprocessing``'s
thread pools start their threads there too). It is in place only while some pass runs, and it
counts a start only in a thread that is running a pass: threads that other threads start
meanwhile (a second caller of mixedad, a data loader, a logger) are not G's. Two passes in two
threads share one watch (:class:`mixedad._hooks.refcount.SharedPatch`); the last one out puts
``threading`` back as it was. A profile function was tried instead: it is exact too, but slows a small G's pass
(docs/performance.md, "Measurements behind the design").

What this relies on (pinned by ``tests/_hooks/test_threads.py``): Python's ``Thread.start`` calls
the module global ``threading._start_new_thread`` (Python 3.9 to 3.12) or
``threading._start_joinable_thread`` (3.13 on) at call time, so replacing the global reaches it.

Threads started inside a custom Function's forward are not counted (:func:`unwatched`): what a
Function computes inside its forward is not differentiated through; its ``jvp`` or
``backward`` is. Not seen: threads of a pool made before the call, and threads started with
``_thread.start_new_thread`` directly; the docs say so.
"""
import contextlib
import threading

from mixedad._hooks.refcount import SharedPatch

_STARTERS = tuple(name for name in ("_start_new_thread", "_start_joinable_thread") if hasattr(threading, name))
_state = threading.local()
_originals = {}


def _watched(original):
    def start_thread(*args, **kwargs):
        started = getattr(_state, "started", None)
        if started is not None and not getattr(_state, "paused", 0):
            started.append(args[0] if args else kwargs.get("function"))
        return original(*args, **kwargs)

    start_thread.__wrapped__ = original
    start_thread._mixedad_watch = True
    return start_thread


def _install():
    for name in _STARTERS:
        _originals[name] = getattr(threading, name)
        setattr(threading, name, _watched(_originals[name]))


def _uninstall():
    for name, original in _originals.items():
        if getattr(getattr(threading, name), "_mixedad_watch", False):
            setattr(threading, name, original)
    _originals.clear()


_PATCH = SharedPatch(_install, _uninstall)


@contextlib.contextmanager
def watching_threads():
    """Record the Python threads this thread starts while the block runs: yields a list, one entry each."""
    started = []
    outer = getattr(_state, "started", None)
    with _PATCH.use():
        _state.started = started
        try:
            yield started
        finally:
            _state.started = outer
            if outer is not None:
                outer.extend(started)


@contextlib.contextmanager
def unwatched():
    """Threads started in the block (inside a custom Function's forward) are not recorded."""
    _state.paused = getattr(_state, "paused", 0) + 1
    try:
        yield
    finally:
        _state.paused -= 1
