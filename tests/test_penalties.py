"""EagerPenalties against the naive loss = main + sum(alpha * penalty), in float64."""
import pytest
import torch

from mixedad import EagerPenalties
from mixedad.profiling import StorageCounter
from mixedad.testing import assert_close

F64 = torch.float64


def penalty(h):
    return (torch.tanh(h) ** 2).sum(1) + h.pow(4).mean(1)


def backbone(seed=0, width=6, depth=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(width, width, generator=gen, dtype=F64).requires_grad_() for _ in range(depth)]


def run(weights, x, *, eager, s=None):
    for w in weights:
        w.grad = None
    ep, h, terms = EagerPenalties(), x, []
    for i, w in enumerate(weights):
        h = torch.tanh(h @ w)
        alpha = 0.3 * (i + 1)
        if eager:
            h = ep.add(h, penalty, weight=alpha)
        else:
            terms.append(alpha * ((1 if s is None else s) * penalty(h)).sum())
    main = (h ** 2).sum() + h.sum(0).pow(2).sum()
    if eager:
        if s is not None:
            ep.scale(s)
        main.backward()
        assert ep.pending == 0
        return [w.grad for w in weights], ep.value
    (main + sum(terms)).backward()
    return [w.grad for w in weights], sum(terms).detach()


@pytest.mark.parametrize("scaled", [False, True])
def test_matches_naive_loss(scaled):
    weights, x = backbone(), torch.randn(5, 6, dtype=F64)
    s = torch.rand(5, dtype=F64) if scaled else None
    ours, value = run(weights, x, eager=True, s=s)
    naive, naive_value = run(weights, x, eager=False, s=s)
    assert_close(ours, naive)
    assert_close(value, naive_value)


def test_scalar_penalty_and_input_gradient():
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    w = backbone(depth=1)[0]

    def scalar(h):
        return h.pow(2).mean()

    ep = EagerPenalties()
    h = ep.add(x @ w, scalar, weight=2.0)
    h.sum().backward()
    ours = (w.grad.clone(), x.grad.clone())
    w.grad = x.grad = None
    h = x @ w
    (h.sum() + 2.0 * scalar(h)).backward()
    assert_close(ours, (w.grad, x.grad))


def test_wire_used_twice_downstream_adds_penalty_once():
    w = backbone(depth=1)[0]
    x = torch.randn(3, 6, dtype=F64)
    ep = EagerPenalties()
    h = ep.add(x @ w, penalty, weight=0.5)
    (h.sum() + (h ** 2).sum()).backward()
    ours = w.grad.clone()
    w.grad = None
    h = x @ w
    (h.sum() + (h ** 2).sum() + 0.5 * penalty(h).sum()).backward()
    assert_close(ours, w.grad)


def test_second_backward_through_retained_graph_adds_nothing_more():
    w = backbone(depth=1)[0]
    x = torch.randn(3, 6, dtype=F64)
    ep = EagerPenalties()
    h = ep.add(x @ w, penalty, weight=0.5)
    loss = (h ** 2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    ours = w.grad.clone()
    w.grad = None
    h = x @ w
    (2 * (h ** 2).sum() + 0.5 * penalty(h).sum()).backward()
    assert_close(ours, w.grad)


def test_unused_wire_is_visible_as_pending():
    w = backbone(depth=1)[0]
    x = torch.randn(3, 6, dtype=F64)
    ep = EagerPenalties()
    h = x @ w
    ep.add(h, penalty)  # the wired tensor is dropped: its gradient never reaches the backbone
    h.sum().backward()
    assert ep.pending == 1


def test_h_without_grad_passes_through_and_counts_in_value():
    ep = EagerPenalties()
    h = torch.ones(2, 3, dtype=F64)
    assert ep.add(h, lambda h: h.sum(1), weight=2.0) is h
    assert ep.value.item() == 12.0 and ep.pending == 0


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda ep, h: ep.add([1.0], penalty), TypeError, r"expected h to be a floating-point tensor, got list"),
    (lambda ep, h: ep.add(h, 3), TypeError, r"expected penalty_fn to be callable, got int"),
    (lambda ep, h: ep.add(h, lambda h: 1.0), TypeError, r"expected penalty_fn to return a tensor, got float"),
    (lambda ep, h: ep.add(h, lambda h: h), ValueError, r"scalar or per-sample values of shape \(3,\), got \(3, 6\)"),
    (lambda ep, h: ep.add(h, penalty, weight="big"), TypeError, r"expected weight to be a number, got str"),
    (lambda ep, h: ep.add(h, penalty, weight=torch.ones((), requires_grad=True)), ValueError, r"constant number"),
    (lambda ep, h: ep.scale(torch.ones(4, dtype=F64)), ValueError, r"expected s of shape \(3,\), got \(4,\)"),
    (lambda ep, h: ep.scale(torch.ones(3, requires_grad=True)), ValueError, r"s requires grad"),
    (lambda ep, h: ep.scale(torch.ones(3, 1)), ValueError, r"1-d tensor of per-sample weights"),
])
def test_errors(call, exc, pattern):
    ep = EagerPenalties()
    h = torch.randn(3, 6, dtype=F64, requires_grad=True)
    ep.add(h * 1.0, penalty)
    with pytest.raises(exc, match=r"EagerPenalties\.\w+\(.*\): .*" + pattern):
        call(ep, h)


def test_scale_after_backward_and_scalar_scale_raise():
    ep = EagerPenalties()
    h = ep.add(torch.randn(3, 6, dtype=F64, requires_grad=True) * 1.0, penalty)
    h.sum().backward()
    with pytest.raises(RuntimeError, match=r"called after backward"):
        ep.scale(torch.ones(3, dtype=F64))
    ep2 = EagerPenalties()
    ep2.add(torch.randn(3, 6, dtype=F64, requires_grad=True) * 1.0, lambda h: h.pow(2).sum())
    with pytest.raises(ValueError, match=r"a penalty returned a scalar"):
        ep2.scale(torch.ones(3, dtype=F64))


def heavy_penalty(h):
    """A penalty whose graph is much larger than h: pairwise distances of all samples."""
    d = (h[:, None, :] - h[None, :, :]).pow(2).sum(-1)
    return torch.exp(-d).sum(1)


def test_peak_memory_lower_than_naive_when_penalty_graphs_are_large():
    weights = backbone(width=32, depth=6)
    x = torch.randn(64, 32, dtype=F64)

    def step(eager):
        ep, h, terms = EagerPenalties(), x, []
        for w in weights:
            h = torch.tanh(h @ w)
            if eager:
                h = ep.add(h, heavy_penalty, weight=0.1)
            else:
                terms.append(0.1 * heavy_penalty(h).sum())
        loss = (h ** 2).sum() + (sum(terms) if terms else 0)
        loss.backward()

    with StorageCounter() as eager:
        step(True)
    eager_grads = [w.grad.clone() for w in weights]
    for w in weights:
        w.grad = None
    with StorageCounter() as naive:
        step(False)
    assert_close(eager_grads, [w.grad for w in weights])
    assert eager.peak < 0.5 * naive.peak, (eager.peak, naive.peak)
