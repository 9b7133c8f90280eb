"""Contexts a call may be made in: reverse mode's meaning, or mixedad's own error (issue: no silent wrong answers)."""
import pytest
import torch

import mixedad
from mixedad import zoo
from mixedad.reference import double_backward_input_grad, double_backward_mixed_grad
from mixedad.testing import assert_close

F64 = torch.float64


def cubic(y, g):
    return ((y + g) ** 3).sum()


def problem(seed=0):
    G = zoo.mlp(2, 4, seed=seed, dtype=F64)
    gen = torch.Generator().manual_seed(seed)
    z, y, v = (torch.randn(3, 4, generator=gen, dtype=F64) for _ in range(3))
    return G, z, y, v


def test_inference_mode_gives_the_numbers_not_zeros():
    G, z, y, v = problem()
    expected = double_backward_mixed_grad(cubic, G, z, y, v)
    assert expected.abs().max() > 1
    with torch.inference_mode():
        ours = mixedad.mixed_grad(cubic, G, z, y, v)
        reference = double_backward_mixed_grad(cubic, G, z, y, v)
        jacobian = mixedad.mixed_jacobian(cubic, G, z, y)
    assert_close(ours, expected)
    assert_close(reference, expected)
    assert_close(jacobian, mixedad.mixed_jacobian(cubic, G, z, y))
    assert not ours.is_inference()


def test_tensors_made_in_inference_mode_work_outside_it():
    G, z, y, v = problem()
    with torch.inference_mode():
        zi, yi, vi = z.clone(), y.clone(), v.clone()
    assert zi.is_inference()
    assert_close(mixedad.mixed_grad(cubic, G, zi, yi, vi), double_backward_mixed_grad(cubic, G, z, y, v))
    assert zi.is_inference()  # the user's tensor is left as it was


def test_input_grad_called_in_inference_mode_stays_differentiable():
    G, z, y, _ = problem()
    w = torch.randn(3, 4, dtype=F64)
    y_ours, y_naive = y[0].clone().requires_grad_(), y[0].clone().requires_grad_()
    with torch.inference_mode():
        zi = z.clone()
        dfdz = mixedad.input_grad(cubic, G, zi, y_ours)
    (dfdz * w).sum().backward()
    (double_backward_input_grad(cubic, G, z, y_naive) * w).sum().backward()
    assert_close(y_ours.grad, y_naive.grad)


def reference_jacobian_in_y(G, z, v, y):
    return torch.autograd.functional.jacobian(
        lambda y_: double_backward_mixed_grad(cubic, G, z, y_, v, create_graph=True), y)


def test_torch_func_grad_jvp_and_jacrev_over_mixed_grad_without_create_graph():
    """A torch.func user never passes create_graph; the outer transform must still see the graph."""
    G, z, y, v = problem()
    J = reference_jacobian_in_y(G, z, v, y).reshape(y.numel(), y.numel())
    ours = torch.func.jacrev(lambda y_: mixedad.mixed_grad(cubic, G, z, y_, v))(y)
    assert_close(ours.reshape(J.shape), J)
    w = torch.randn(3, 4, dtype=F64)
    _, tangent = torch.func.jvp(lambda y_: mixedad.mixed_grad(cubic, G, z, y_, v), (y,), (w,))
    assert_close(tangent, (J @ w.reshape(-1)).reshape(3, 4))
    g = torch.func.grad(lambda y_: mixedad.mixed_grad(cubic, G, z, y_, v).sum())(y)
    assert_close(g, J.sum(0).reshape(3, 4))


def test_vmap_over_mixed_grad_still_returns_no_graph():
    G, z, y, _ = problem()
    y = y.clone().requires_grad_()
    V = torch.randn(2, 3, 4, dtype=F64)
    rows = torch.func.vmap(lambda v: mixedad.mixed_grad(cubic, G, z, y, v))(V)
    assert not rows.requires_grad
    assert_close(rows[1], double_backward_mixed_grad(cubic, G, z, y.detach(), V[1]))


def test_threads_calling_at_once_get_forward_mode_and_the_right_numbers():
    """Two threads for real, 2 x 40 calls: no collision, no whole-G fallback (its warning is an error here)."""
    import threading
    import warnings

    G, z, y, v = problem()
    expected = double_backward_mixed_grad(cubic, G, z, y, v)
    errors, results = [], []

    def work():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for _ in range(40):
                    results.append(mixedad.mixed_grad(cubic, G, z, y, v, strategy="forward"))
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(results) == 80
    for r in results:
        assert_close(r, expected)


def _waits_while_another_thread_starts_one(G_inner):
    """A G that waits, inside the pass, until a thread that is not G's has started a thread."""
    import threading

    inside, started = threading.Event(), threading.Event()

    def G(z):
        inside.set()
        assert started.wait(10)
        return G_inner(z)

    def outsider():
        assert inside.wait(10)
        worker = threading.Thread(target=lambda: None)
        worker.start()
        worker.join()
        started.set()

    return G, threading.Thread(target=outsider)


def test_a_thread_started_by_another_thread_during_the_pass_is_not_gs():
    """The watch is on the pass's own thread: a thread another thread starts meanwhile is not G's."""
    G_inner, z, y, v = problem()
    G, other = _waits_while_another_thread_starts_one(G_inner)
    other.start()
    try:
        result = mixedad.mixed_grad(cubic, G, z, y, v, strategy="forward")
    finally:
        other.join()
    assert_close(result, double_backward_mixed_grad(cubic, G_inner, z, y, v))


def _starts_its_own_thread(G_inner):
    import concurrent.futures

    def G(z):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(G_inner, z).result()

    return G


def test_a_thread_g_starts_is_seen_and_a_profile_function_is_left_alone():
    import sys

    G_inner, z, y, v = problem()
    G = _starts_its_own_thread(G_inner)
    calls = []

    def user_profile(frame, event, arg):
        calls.append(event)

    sys.setprofile(user_profile)
    try:
        with pytest.raises(RuntimeError, match="starts threads"):
            mixedad.mixed_grad(cubic, G, z, y, v, strategy="forward")
        assert sys.getprofile() is user_profile
    finally:
        sys.setprofile(None)
    assert "c_call" in calls  # the user's profile function kept receiving events during the pass
    with pytest.warns(RuntimeWarning, match="starts threads"):
        result = mixedad.mixed_grad(cubic, G, z, y, v)
    assert_close(result, double_backward_mixed_grad(cubic, G_inner, z, y, v))


def test_two_watches_at_once_each_see_only_their_own_threads_and_the_last_one_out_restores():
    """mixedad's forward passes take turns today, but the watch must not rely on it."""
    import threading

    from mixedad._hooks.threads import _STARTERS, watching_threads

    original = {name: getattr(threading, name) for name in _STARTERS}
    a_inside, b_done = threading.Event(), threading.Event()
    seen = {}

    def start_one():
        worker = threading.Thread(target=lambda: None)
        worker.start()
        worker.join()

    def a():
        with watching_threads() as started:
            a_inside.set()
            assert b_done.wait(10)
            start_one()  # after b's watch has ended
        seen["a"] = len(started)

    def b():
        assert a_inside.wait(10)
        with watching_threads() as started:
            pass
        seen["b"] = len(started)
        b_done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    with watching_threads() as main_started:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert seen == {"a": 1, "b": 0}
    assert len(main_started) == 2  # the two threads this thread started
    assert {name: getattr(threading, name) for name in _STARTERS} == original


def test_threading_is_left_as_found_after_a_pass_even_one_that_raises():
    import threading

    before = {name: getattr(threading, name) for name in ("_start_new_thread", "_start_joinable_thread")
              if hasattr(threading, name)}
    G_inner, z, y, v = problem()

    def G(z):
        raise ValueError("G fails")

    with pytest.raises(ValueError, match="G fails"):
        mixedad.mixed_grad(cubic, G, z, y, v)
    mixedad.mixed_grad(cubic, G_inner, z, y, v)
    assert {name: getattr(threading, name) for name in before} == before


def test_under_cprofile_a_thread_g_starts_is_seen_and_the_profiler_keeps_running():
    import cProfile
    import sys

    G_inner, z, y, v = problem()
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        with pytest.raises(RuntimeError, match="starts threads"):
            mixedad.mixed_grad(cubic, _starts_its_own_thread(G_inner), z, y, v, strategy="forward")
        still_profiling = sys.getprofile() is profiler
        plain = mixedad.mixed_grad(cubic, G_inner, z, y, v, strategy="forward")
    finally:
        profiler.disable()
    assert still_profiling
    assert_close(plain, double_backward_mixed_grad(cubic, G_inner, z, y, v))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_one_tensor_twice_in_y_gives_per_position_partials(requires_grad):
    """The same answer whether the repeated leaf requires grad or not: as with two distinct copies."""
    G, z, _, v = problem()
    t = torch.randn(3, 4, dtype=F64, requires_grad=requires_grad)

    def f(y, g):
        return ((y["a"] + g) ** 3).sum() + (y["b"] * g.sin()).sum()

    separate = {"a": t.detach().clone(), "b": t.detach().clone()}
    expected = double_backward_mixed_grad(f, G, z, separate, v)
    for compute in (mixedad.mixed_grad, double_backward_mixed_grad):
        result = compute(f, G, z, {"a": t, "b": t}, v)
        assert_close(result, expected)


def test_v_requiring_grad_with_create_graph_is_refused():
    G, z, y, v = problem()
    with pytest.raises(ValueError, match=r"mixed_grad\(f, G, z, y\): v requires grad and create_graph=True"):
        mixedad.mixed_grad(cubic, G, z, y, v.requires_grad_(), create_graph=True)


@pytest.mark.parametrize("f", [lambda y, g: ((y + g) ** 3).mean(), lambda y, g: ((y + g - g.mean(0)) ** 3).sum()],
                         ids=["mean over codes", "codes coupled"])
def test_input_grad_refuses_chunks_when_f_is_not_a_sum_over_codes(f):
    G, z, y, _ = problem()
    z = torch.cat([z, z.flip(0)])  # 6 codes
    with pytest.raises(ValueError, match=r"input_grad\(f, G, z, y\): f is not a sum over latent codes"):
        mixedad.input_grad(f, G, z, y[0], chunk_size=2)
    mixedad.input_grad(f, G, z, y[0])  # without chunks the objective is f itself: fine


def test_input_grad_chunks_accept_a_sum_over_codes_and_leave_the_rng():
    G, z, y, _ = problem()
    f = lambda y, g: ((y + g) ** 3).sum() / 6 + torch.rand(()) * 0  # noqa: E731  (draws a random number)
    torch.manual_seed(0)
    ours = mixedad.input_grad(f, G, z, y[0], chunk_size=1)
    state = torch.get_rng_state()
    torch.manual_seed(0)
    naive = double_backward_input_grad(f, G, z, y[0].clone().requires_grad_(), chunk_size=1)
    assert_close(ours, naive.detach())
    assert torch.equal(state, torch.get_rng_state())


class EmaNorm(torch.nn.Module):
    """Normalises by a running mean it updates on every train-mode forward, as EMA buffers do."""

    def __init__(self, n):
        super().__init__()
        self.register_buffer("ema", torch.ones(n, dtype=F64))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * x.detach().abs().mean(0))
        return x / self.ema.clone()  # a copy in the graph: the naive code updates ema in place later


def buffer_changing(kind):
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "ema":
            return nn.Sequential(nn.Linear(4, 4), EmaNorm(4), nn.Tanh(), nn.Linear(4, 4)).to(F64).train()
        wrap = nn.utils.parametrizations.spectral_norm if kind == "spectral_norm" else nn.utils.spectral_norm
        return nn.Sequential(wrap(nn.Linear(4, 4)), nn.Tanh(), wrap(nn.Linear(4, 4))).to(F64).train()


@pytest.mark.parametrize("as_function", [False, True], ids=["module", "function around modules"])
@pytest.mark.parametrize("kind", ["spectral_norm", "spectral_norm_hooks", "ema"])
def test_input_grad_replays_each_chunk_from_the_buffers_it_saw(kind, as_function):
    """Spectral norm's power iteration and EMAs move buffers on every train-mode forward."""
    import copy

    G = buffer_changing(kind)
    naive = copy.deepcopy(G)
    z, w = torch.randn(6, 4, dtype=F64), torch.randn(6, 4, dtype=F64)
    y_ours = torch.randn(4, dtype=F64, requires_grad=True)
    y_naive = y_ours.detach().clone().requires_grad_()
    call = (lambda z_: G(z_)) if as_function else G
    (mixedad.input_grad(cubic, call, z, y_ours, chunk_size=2) * w).sum().backward()
    (double_backward_input_grad(cubic, naive, z, y_naive, chunk_size=2) * w).sum().backward()
    assert_close(y_ours.grad, y_naive.grad)
    for (name, ours), (_, theirs) in zip(G.named_buffers(), naive.named_buffers()):
        assert torch.equal(ours, theirs), name  # the buffers end as after the naive code


def no_grad_inside(kind):
    net, net2 = zoo.mlp(2, 4, dtype=F64, seed=1), zoo.mlp(2, 4, dtype=F64, seed=2)

    @torch.no_grad()
    def constant(z):
        return net2(z).sin()

    def with_block(z):
        with torch.no_grad():
            c = net2(z) ** 2
        return net(z) + c

    from tests.op_rule_generators import SinWithoutJvp

    def custom_function_inside(z):
        with torch.no_grad():
            c = SinWithoutJvp.apply(net2(z))
        return net(z) * c

    def set_grad_enabled_block(z):
        with torch.set_grad_enabled(False):
            c = net2(z).tanh()
        with torch.set_grad_enabled(True):  # a region that stays differentiable
            d = net2(z) * 0.5
        return net(z) * c + d

    return {"block": with_block, "decorator": lambda z: net(z) * constant(z),
            "custom Function": custom_function_inside, "set_grad_enabled": set_grad_enabled_block}[kind]


@pytest.mark.parametrize("kind", ["block", "decorator", "custom Function", "set_grad_enabled"])
def test_no_grad_region_inside_G_is_a_constant_as_in_reverse_mode(kind):
    G = no_grad_inside(kind)
    _, z, y, v = problem()
    expected = double_backward_mixed_grad(cubic, G, z, y, v)
    assert_close(mixedad.mixed_grad(cubic, G, z, y, v), expected)
    w = torch.randn(3, 4, dtype=F64)
    y_ours, y_naive = y[0].clone().requires_grad_(), y[0].clone().requires_grad_()
    (mixedad.input_grad(cubic, G, z, y_ours, chunk_size=1) * w).sum().backward()
    (double_backward_input_grad(cubic, G, z, y_naive, chunk_size=1) * w).sum().backward()
    assert_close(y_ours.grad, y_naive.grad)
    if kind != "custom Function":  # torch.func needs setup_context for custom Functions under vmap
        from mixedad.reference import double_backward_mixed_jacobian

        assert_close(mixedad.mixed_jacobian(cubic, G, z, y), double_backward_mixed_jacobian(cubic, G, z, y))
    assert torch.no_grad.__enter__.__module__ == "torch.autograd.grad_mode"  # restored after the pass


@pytest.mark.parametrize("kind", ["spectral_norm", "spectral_norm_hooks", "ema"])
def test_cached_backward_second_pass_sees_the_buffers_of_the_first(kind):
    import copy

    net = buffer_changing(kind)
    naive = copy.deepcopy(net)
    inputs = [torch.randn(4, dtype=F64) for _ in range(5)]
    g = lambda Z: (Z.tanh() ** 2).sum()  # noqa: E731
    mixedad.cached_backward(net, inputs, g, chunk_size=2)
    g(torch.stack([naive(x) for x in inputs])).backward()
    for (name, p), (_, q) in zip(net.named_parameters(), naive.named_parameters()):
        assert_close(p.grad, q.grad, what=name)
    for (name, ours), (_, theirs) in zip(net.named_buffers(), naive.named_buffers()):
        assert torch.equal(ours, theirs), name


def test_a_slow_whole_g_fallback_in_one_thread_does_not_hold_up_forward_passes_in_others():
    """The forward-pass lock covers the dual-level block only, not the fallback's reverse passes."""
    import threading
    import warnings

    G_inner, z, y, v = problem()
    inside, other_done = threading.Event(), threading.Event()
    results, errors = [], []

    def G_with_a_hook(z):  # a gradient hook: the whole-G fallback takes this G
        h = G_inner(z)
        if h.requires_grad and not inside.is_set():
            h.register_hook(lambda g: g)
            inside.set()
            assert other_done.wait(20), "another thread's forward pass waited for this fallback"
        return h

    def other():
        try:
            assert inside.wait(20)
            results.append(mixedad.mixed_grad(cubic, G_inner, z, y, v, strategy="forward"))
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)
        finally:
            other_done.set()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            slow = mixedad.mixed_grad(cubic, G_with_a_hook, z, y, v)
    finally:
        thread.join()
    assert not errors, errors
    expected = double_backward_mixed_grad(cubic, G_inner, z, y, v)
    assert_close(results[0], expected)
    assert_close(slow, expected)
