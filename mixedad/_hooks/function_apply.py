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

What this relies on in torch (pinned by ``tests/_hooks/test_function_apply.py``):

- ``Function.__dict__["apply"]`` is a ``classmethod`` over a plain Python function;
- that function has exactly one free variable (``__class__``, for ``super()``), so a trampoline
  with one free variable can take its code object. On another layout the class attribute is
  replaced instead (bound methods taken earlier are then missed);
- ``Function.jvp``, ``Function.vmap`` and ``_SingleLevelFunction.setup_context`` are the
  defaults a Function that defines none of them inherits.

Nothing is resolved at import: the function and its code are looked up when a pass first needs
the trampoline.
"""
import contextlib
import functools
import threading
import types

from torch.autograd.function import Function, _SingleLevelFunction

from mixedad._hooks.functorch import in_functorch_transform
from mixedad._hooks.refcount import SharedPatch
from mixedad._hooks.thread_local import setting

_local = threading.local()


class _Apply:
    """``Function.apply``'s function, its code, a callable copy of it, and the trampoline's code."""

    def __init__(self):
        self.func = Function.__dict__["apply"].__func__
        self.code = self.func.__code__
        self.original = types.FunctionType(self.code, self.func.__globals__, self.func.__name__,
                                           self.func.__defaults__, self.func.__closure__)
        self.original.__kwdefaults__ = self.func.__kwdefaults__
        self.trampoline = _trampoline_code() if len(self.code.co_freevars) == 1 else None


@functools.lru_cache(maxsize=None)
def _apply():
    return _Apply()


def original_apply(cls, *args, **kwargs):
    """``cls.apply(*args, **kwargs)`` as torch defines it."""
    return _apply().original(cls, *args, **kwargs)


def route(cls, args, kwargs):
    """Where the trampoline sends ``cls.apply(*args, **kwargs)``."""
    handler = getattr(_local, "handler", None)
    if handler is None or (in_functorch_transform() and not getattr(handler, "under_transforms", False)):
        return original_apply(cls, *args, **kwargs)
    return handler.custom_function(cls, args, kwargs)


def _trampoline_code():
    cell = None  # torch's apply has one free variable (``__class__``, for super()); so must this

    def apply(cls, *args, **kwargs):
        cell  # noqa: B018
        from mixedad._hooks.function_apply import route

        return route(cls, args, kwargs)

    return apply.__code__


def _install():
    a = _apply()
    if a.trampoline is not None:
        a.func.__code__ = a.trampoline
    else:  # another torch layout: replace the class attribute (misses bound methods kept earlier)
        Function.apply = classmethod(lambda cls, *args, **kwargs: route(cls, args, kwargs))


def _uninstall():
    a = _apply()
    if a.trampoline is not None:
        a.func.__code__ = a.code
    else:
        Function.apply = classmethod(a.func)


_PATCH = SharedPatch(_install, _uninstall)


@contextlib.contextmanager
def direct():
    """``Function.apply`` as torch defines it in this thread for the block (the local rule's own
    reverse passes, the probes): no handler sees the Functions they run."""
    with setting(_local, "handler", None):
        yield


@contextlib.contextmanager
def routing(handler):
    """Send this thread's ``Function.apply`` calls to ``handler.custom_function(cls, args, kwargs)``."""
    with _PATCH.use():
        previous = getattr(_local, "handler", None)
        _local.handler = handler
        try:
            yield
        finally:
            _local.handler = previous


def has_own_jvp(cls):
    """Whether the Function class defines its own ``jvp``."""
    return cls.jvp is not Function.jvp


def has_own_vmap(cls):
    """Whether the Function class defines its own ``vmap`` staticmethod."""
    return getattr(cls, "vmap", None) is not Function.vmap


def has_setup_context(cls):
    """Whether the Function class defines ``setup_context`` (torch.func needs it)."""
    return getattr(cls, "setup_context", None) is not _SingleLevelFunction.setup_context
