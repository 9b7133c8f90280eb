"""Grad mode inside G is read from torch at every op: every form of turning it off is a constant.

Each G below turns grad off (and maybe on again) in its own way; mixedad must give what double
backward gives (reverse mode is the meaning), leave grad mode and torch's classes as they were,
and push no mode onto the thread's stacks.
"""
import threading

import pytest
import torch

import mixedad
from mixedad.reference import double_backward_mixed_grad
from mixedad.testing import assert_close

F64 = torch.float64
W = torch.randn(5, 5, dtype=F64, generator=torch.Generator().manual_seed(1)) / 2


def layer(h):
    return torch.tanh(h @ W)


def with_no_grad(z):
    h = layer(z)
    with torch.no_grad():
        c = layer(h) * 2
    return layer(h) + c * h


@torch.no_grad()
def _decorated(h):
    return layer(h).exp()


def decorator(z):
    h = layer(z)
    return h * _decorated(h)


def with_set_grad_enabled(z):
    h = layer(z)
    with torch.set_grad_enabled(False):
        c = layer(h)
    return h * c


def plain_set_grad_enabled(z):
    h = layer(z)
    torch.set_grad_enabled(False)
    c = layer(h)
    torch.set_grad_enabled(True)
    return h.sin() * c


def c_set_grad_enabled(z):
    h = layer(z)
    torch._C._set_grad_enabled(False)
    try:
        c = layer(h)
    finally:
        torch._C._set_grad_enabled(True)
    return h * c


def enable_inside_no_grad(z):
    h = layer(z)
    with torch.no_grad():
        c = layer(h)  # constant
        with torch.enable_grad():
            d = layer(h)  # carries the tangent again
    return h * c + d


def no_grad_inside_enable_grad(z):
    with torch.enable_grad():
        h = layer(z)
        with torch.no_grad():
            c = layer(h)
    return h * c


def set_grad_enabled_true_inside_no_grad(z):
    h = layer(z)
    with torch.no_grad():
        torch.set_grad_enabled(True)
        d = layer(h)  # grad is on again here: carries the tangent
        torch.set_grad_enabled(False)
        c = layer(h)
    return d * c


def left_off_at_return(z):
    h = layer(z)
    torch.set_grad_enabled(False)  # G never turns it back on
    return h * layer(h)


def inference_mode_region(z):
    h = layer(z)
    with torch.inference_mode():
        c = layer(h.detach()).clone()
    return h * c.clone()


def no_grad_in_custom_forward(z):
    return _Scale.apply(layer(z)) * layer(z)


def in_place_write_in_no_grad(z):
    h = layer(z) + 0.0
    with torch.no_grad():
        k = h.mul_(2)  # k is h: values doubled, derivative unchanged (autograd does not see the write)
    return k * layer(h)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():  # as every Function's forward runs: no effect on its derivative
            return x * 3.0

    @staticmethod
    def backward(ctx, g):
        return g * 3.0


class _NoGradModule(torch.nn.Module):
    """A module whose forward is decorated (timm's and diffusers' style)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 5, dtype=F64)

    @torch.no_grad()
    def stats(self, h):
        return self.lin(h).pow(2).mean(-1, keepdim=True)

    def forward(self, z):
        h = torch.tanh(self.lin(z))
        return h / (1 + self.stats(h))


CASES = {
    "with no_grad": with_no_grad,
    "decorator": decorator,
    "with set_grad_enabled(False)": with_set_grad_enabled,
    "plain set_grad_enabled(False) call": plain_set_grad_enabled,
    "torch._C._set_grad_enabled(False)": c_set_grad_enabled,
    "enable_grad nested in no_grad": enable_inside_no_grad,
    "no_grad nested in enable_grad": no_grad_inside_enable_grad,
    "set_grad_enabled(True) inside no_grad": set_grad_enabled_true_inside_no_grad,
    "grad left off at G's return": left_off_at_return,
    "inference_mode region": inference_mode_region,
    "no_grad in a custom Function's forward": no_grad_in_custom_forward,
    "in-place write in no_grad": in_place_write_in_no_grad,
}


def f(y, g):
    return ((y + g) ** 3).sum()


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(4, 5, dtype=F64, generator=gen) for _ in range(3))


def _state():
    return (torch.is_grad_enabled(), torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack(),
            torch.no_grad.__dict__["__enter__"], torch.no_grad.__dict__["__exit__"],
            torch.set_grad_enabled.__dict__["__enter__"], torch.set_grad_enabled.__dict__["__exit__"],
            torch.enable_grad.__dict__["__enter__"])


@pytest.mark.parametrize("strategy", ["auto", "forward", "reverse"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_grad_mode_form_matches_double_backward(name, strategy):
    G = CASES[name]
    z, y, v = _problem()
    before = _state()
    if name == "grad left off at G's return" and strategy == "forward":
        # G(z) is a constant, and strategy="forward" cannot tell a constant from a lost tangent.
        with pytest.raises(RuntimeError, match="without a forward-mode tangent.*strategy='forward' cannot tell"):
            mixedad.mixed_grad(f, G, z, y, v, strategy=strategy)
        assert _state() == before
        return
    ours = mixedad.mixed_grad(f, G, z, y, v, strategy=strategy)
    after = _state()
    torch.set_grad_enabled(True)  # the reference runs G too, and some G leave grad off
    expected = double_backward_mixed_grad(f, G, z, y, v)
    torch.set_grad_enabled(True)
    assert_close(ours, expected, rtol=1e-10, what=name)
    assert after == before


@pytest.mark.parametrize("name", ["with no_grad", "enable_grad nested in no_grad", "plain set_grad_enabled(False) call"])
def test_grad_mode_forms_under_mixed_jacobian_and_input_grad(name):
    G = CASES[name]
    z, y, _ = _problem(1)
    jac = mixedad.mixed_jacobian(f, G, z, y, chunk_size=7)
    expected = mixedad.reference.double_backward_mixed_jacobian(f, G, z, y)
    assert_close(jac, expected, rtol=1e-10, what=name)
    y1, y2 = y[0].clone().requires_grad_(), y[0].clone().requires_grad_()  # shared by the codes
    mixedad.input_grad(f, G, z, y1, chunk_size=2).pow(2).sum().backward()
    mixedad.reference.double_backward_input_grad(f, G, z, y2, chunk_size=2).pow(2).sum().backward()
    assert_close(y1.grad, y2.grad, rtol=1e-10, what=name)


def test_a_decorated_module_method_is_a_constant():
    G = _NoGradModule()
    z, y, v = _problem(2)
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward_mixed_grad(f, G, z, y, v), rtol=1e-10)
    assert all(p.requires_grad and p.grad is None for p in G.parameters())


def test_the_caller_s_no_grad_does_not_make_g_constant():
    """An outer torch.no_grad() around the call is the caller's business: G runs with grad on."""
    z, y, v = _problem(3)
    expected = double_backward_mixed_grad(f, with_no_grad, z, y, v)
    with torch.no_grad():
        ours = mixedad.mixed_grad(f, with_no_grad, z, y, v)
        assert not torch.is_grad_enabled()
    assert_close(ours, expected, rtol=1e-10)


def test_g_sees_grad_enabled_as_in_a_plain_call():
    seen = []

    def G(z):
        seen.append(torch.is_grad_enabled())
        return layer(z)

    z, y, _ = _problem(4)
    with torch.no_grad():
        mixedad.mixed_grad(f, G, z, y)
    assert seen == [True]


def test_no_reverse_graph_is_recorded_for_parameters_or_closed_over_tensors():
    """Ops run with grad disabled unless G disabled it: nothing G computes has a grad_fn."""
    w = torch.randn(5, 5, dtype=F64, requires_grad=True)
    lin = torch.nn.Linear(5, 5, dtype=F64)
    outputs = []

    def G(z):
        h = torch.tanh(lin(z) @ w)
        outputs.append(h)
        return h

    z, y, _ = _problem(5)
    mixedad.mixed_grad(f, G, z, y)
    assert outputs[0].grad_fn is None and not outputs[0].requires_grad


def test_threads_each_read_their_own_grad_mode():
    """Two threads, each G turning grad off its own way; a third thread runs no_grad plainly."""
    z, y, v = _problem(6)
    names = ["plain set_grad_enabled(False) call", "enable_grad nested in no_grad"]
    expected = {n: double_backward_mixed_grad(f, CASES[n], z, y, v) for n in names}
    results, errors, plain = {}, [], []
    start = threading.Barrier(3)

    def run(name):
        try:
            start.wait()
            for _ in range(3):
                results[name] = mixedad.mixed_grad(f, CASES[name], z, y, v)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def bystander():
        start.wait()
        for _ in range(50):
            with torch.no_grad():
                plain.append(torch.is_grad_enabled())
            plain.append(torch.is_grad_enabled())

    threads = [threading.Thread(target=run, args=(n,)) for n in names] + [threading.Thread(target=bystander)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for n in names:
        assert_close(results[n], expected[n], rtol=1e-10, what=n)
    assert plain == [False, True] * 50


def test_a_generator_left_open_inside_no_grad_leaves_nothing_behind():
    """G pulls from a Python generator that stays suspended inside ``with torch.no_grad():``."""

    def stream(h):
        with torch.no_grad():
            yield layer(h)
            yield layer(h)

    kept = []

    def G(z):
        h = layer(z)
        gen = stream(h)
        kept.append(gen)
        return h * next(gen)

    z, y, v = _problem(7)
    before = _state()
    ours = mixedad.mixed_grad(f, G, z, y, v)
    assert _state() == before
    expected = double_backward_mixed_grad(f, G, z, y, v)
    torch.set_grad_enabled(True)
    assert_close(ours, expected, rtol=1e-10)
    kept.clear()  # the generators close now, with their own __exit__
    assert _state() == before


@pytest.mark.parametrize("call", ["mixed_grad", "input_grad", "mixed_jacobian", "tangent_report"])
def test_nothing_left_behind_when_g_raises(call):
    def G(z):
        layer(z)
        with torch.no_grad():
            torch.set_grad_enabled(False)
            raise KeyError("boom inside G")

    z, y, _ = _problem(8)
    before = _state()
    run = {
        "mixed_grad": lambda: mixedad.mixed_grad(f, G, z, y),
        "input_grad": lambda: mixedad.input_grad(f, G, z, y, chunk_size=2),
        "mixed_jacobian": lambda: mixedad.mixed_jacobian(f, G, z, y),
        "tangent_report": lambda: mixedad.tangent_report(G, z),
    }[call]
    with pytest.raises(KeyError, match="boom inside G"):
        run()
    assert _state() == before
    assert torch.autograd.forward_ad._current_level == -1


def test_torch_s_classes_are_untouched_while_g_runs():
    seen = []

    def G(z):
        seen.append(_state()[3:])
        return layer(z)

    z, y, _ = _problem(9)
    mixedad.mixed_grad(f, G, z, y)
    assert seen == [_state()[3:]]
