"""One mixedad pass at a time per thread: a mixedad call made inside G is refused by name.

PyTorch keeps one forward-AD level, and a mixedad call inside G would need a derivative of third
order through the inner G to carry the outer tangent, so passes do not nest. The thread-local
record here names the outer call in the error.
"""
import contextlib
import threading

_passes = threading.local()


class NestedCallError(RuntimeError):
    """A mixedad call made inside G while mixedad pushes a tangent through G."""


def check_not_nested(call):
    """Raise :class:`NestedCallError` when this thread is inside a mixedad pass through G."""
    outer = getattr(_passes, "call", None)
    if outer is not None:
        raise NestedCallError(
            f"{call}: called inside G while {outer} pushes a tangent through G. mixedad's passes "
            f"cannot nest: the inner call's result would need a derivative of third order through "
            f"its own G. Compute the inner derivative outside G, or inside G with plain "
            f"torch.autograd (mixedad then differentiates G by its reverse pass)."
        )


@contextlib.contextmanager
def one_pass(call):
    """Mark this thread as inside ``call``'s pass through G for the block."""
    check_not_nested(call)
    _passes.call = call
    try:
        yield
    finally:
        _passes.call = None
