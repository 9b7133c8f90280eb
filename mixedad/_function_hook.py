"""Reaching custom ``autograd.Function``\\ s, whose ``apply`` bypasses ``__torch_function__``.

While a mixedad pass runs in a thread, every ``Function.apply`` call in that thread is routed to
the thread's handler (:class:`mixedad.op_rules.OpRules` in the forward pass, a handler that runs
reentrant checkpoints directly in reverse passes). Other threads reach the original ``apply``
unchanged, and so do calls inside torch.func transforms unless the handler says
``under_transforms = True``.

Users often keep ``apply`` in a variable (``bias_act = BiasAct.apply``), so replacing the class
attribute would miss them. Instead the code object of ``Function.apply``'s function is swapped
for a small trampoline while at least one pass in the process needs it, and swapped back when the
last one ends; bound methods taken earlier share that function object, so they are reached too.
The original code runs from a copy of the function that keeps torch's globals and closure.
"""
import contextlib
import threading
import types

from torch.autograd.function import Function

from mixedad._transforms import in_functorch_transform

_FUNC = Function.__dict__["apply"].__func__
_ORIGINAL_CODE = _FUNC.__code__
_original = types.FunctionType(_ORIGINAL_CODE, _FUNC.__globals__, _FUNC.__name__, _FUNC.__defaults__,
                               _FUNC.__closure__)
_original.__kwdefaults__ = _FUNC.__kwdefaults__
_local = threading.local()
_lock = threading.Lock()
_users = 0


def original_apply(cls, *args, **kwargs):
    """``cls.apply(*args, **kwargs)`` as torch defines it."""
    return _original(cls, *args, **kwargs)


def route(cls, args, kwargs):
    """Where the trampoline sends ``cls.apply(*args, **kwargs)``."""
    handler = getattr(_local, "handler", None)
    if handler is None or (in_functorch_transform() and not getattr(handler, "under_transforms", False)):
        return _original(cls, *args, **kwargs)
    return handler.custom_function(cls, args, kwargs)


def _trampoline_code():
    cell = None  # torch's apply has one free variable (``__class__``, for super()); so must this

    def apply(cls, *args, **kwargs):
        cell  # noqa: B018
        from mixedad._function_hook import route

        return route(cls, args, kwargs)

    return apply.__code__


_TRAMPOLINE = _trampoline_code() if len(_ORIGINAL_CODE.co_freevars) == 1 else None


def _install():
    if _TRAMPOLINE is not None:
        _FUNC.__code__ = _TRAMPOLINE
    else:  # another torch layout: replace the class attribute (misses bound methods kept earlier)
        Function.apply = classmethod(lambda cls, *args, **kwargs: route(cls, args, kwargs))


def _uninstall():
    if _TRAMPOLINE is not None:
        _FUNC.__code__ = _ORIGINAL_CODE
    else:
        Function.apply = classmethod(_FUNC)


@contextlib.contextmanager
def direct():
    """``Function.apply`` as torch defines it in this thread for the block (the local rule's own
    reverse passes, the probes): no handler sees the Functions they run."""
    previous = getattr(_local, "handler", None)
    _local.handler = None
    try:
        yield
    finally:
        _local.handler = previous


@contextlib.contextmanager
def routing(handler):
    """Send this thread's ``Function.apply`` calls to ``handler.custom_function(cls, args, kwargs)``."""
    global _users
    with _lock:
        if _users == 0:
            _install()
        _users += 1
    previous = getattr(_local, "handler", None)
    _local.handler = handler
    try:
        yield
    finally:
        _local.handler = previous
        with _lock:
            _users -= 1
            if _users == 0:
                _uninstall()
