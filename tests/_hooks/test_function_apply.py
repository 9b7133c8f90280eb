"""Pins for mixedad._hooks.function_apply: the shape of ``Function.apply`` that the trampoline needs."""
import threading

import torch
from torch.autograd.function import Function, _SingleLevelFunction

from mixedad._hooks import function_apply


class Double(Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_apply_is_a_classmethod_over_a_function_with_one_free_variable():
    descriptor = Function.__dict__["apply"]
    assert isinstance(descriptor, classmethod)
    assert len(descriptor.__func__.__code__.co_freevars) == 1  # __class__, for super()


def test_the_defaults_a_function_inherits():
    assert Double.jvp is Function.jvp
    assert getattr(Double, "vmap") is Function.vmap
    assert Double.setup_context is _SingleLevelFunction.setup_context
    assert not function_apply.has_own_jvp(Double) and not function_apply.has_setup_context(Double)


def test_nothing_is_patched_at_import_and_routing_restores_the_code():
    func = Function.__dict__["apply"].__func__
    code = func.__code__
    seen = []

    class Handler:
        def custom_function(self, cls, args, kwargs):
            seen.append(cls)
            return function_apply.original_apply(cls, *args, **kwargs)

    apply = Double.apply  # kept in a variable before the pass, as users do
    with function_apply.routing(Handler()):
        assert func.__code__ is not code
        out = apply(torch.ones(2))
    assert func.__code__ is code
    assert seen == [Double] and out.tolist() == [2.0, 2.0]


def test_other_threads_reach_the_original_apply_while_a_pass_routes():
    seen, other = [], []

    class Handler:
        def custom_function(self, cls, args, kwargs):
            seen.append(cls)
            return function_apply.original_apply(cls, *args, **kwargs)

    with function_apply.routing(Handler()):
        thread = threading.Thread(target=lambda: other.append(Double.apply(torch.ones(1))))
        thread.start()
        thread.join()
    assert seen == [] and other[0].item() == 2.0
