"""Threads that G starts while mixedad's pass runs, which its dispatch cannot follow.

mixedad's dispatch (grad mode read at each op, the per-op rules, the custom-Function hook) is a
per-thread torch-function mode. Ops that G runs in a thread it starts itself would carry
tangents on PyTorch's formulas alone, ignoring ``no_grad`` there. So the pass watches for
threads started while G runs: ``threading.setprofile`` reaches every thread started in the
window, and the hook records the thread at its first event and hands it the profile function
that was set before (usually none). A pass that saw one takes the whole-G fallback.

Threads started inside a custom Function's forward are not counted (:func:`unwatched`): what a
Function computes inside its forward is not differentiated through; its ``jvp`` or
``backward`` is. Threads of a pool made before the call are not seen; the docs say so.
"""
import contextlib
import sys
import threading

_state = threading.local()


@contextlib.contextmanager
def watching_threads():
    """Record the Python threads started while the block runs: yields the list of their ids."""
    started = []
    previous = threading.getprofile()

    def first_event(frame, event, arg):
        started.append(threading.get_ident())
        sys.setprofile(previous)

    threading.setprofile(first_event)
    outer = getattr(_state, "watch", None)
    _state.watch = (first_event, previous)
    try:
        yield started
    finally:
        _state.watch = outer
        threading.setprofile(previous)


@contextlib.contextmanager
def unwatched():
    """Threads started in the block (inside a custom Function's forward) are not recorded."""
    watch = getattr(_state, "watch", None)
    if watch is None:
        yield
        return
    first_event, previous = watch
    threading.setprofile(previous)
    try:
        yield
    finally:
        threading.setprofile(first_event)
