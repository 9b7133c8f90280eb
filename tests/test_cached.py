"""cached_backward against the naive g(stack([f(x) ...])).backward(), with dropout and BatchNorm."""
import copy

import pytest
import torch
from torch import nn

from mixedad import cached_backward
from mixedad.profiling import StorageCounter
from mixedad.testing import assert_close

F64 = torch.float64


def model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3)).to(F64).to(device).train()


def outer(Z):
    """A nonlinear g coupling all outputs."""
    return torch.logsumexp(Z.pow(2).flatten(1).sum(-1), 0) + Z.mean(0).pow(2).sum()


def inputs(n=7, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 5, generator=gen, dtype=F64).to(device).requires_grad_() for _ in range(n)]


def naive(f, xs, g):
    L = g(torch.stack([f(x) for x in xs]))
    L.backward()
    return L.detach()


def state(net, xs, rng_device):
    return ([p.grad.clone() for p in net.parameters()], [x.grad.clone() for x in xs],
            {k: b.clone() for k, b in net.named_buffers()},
            torch.cuda.get_rng_state() if rng_device == "cuda" else torch.get_rng_state())


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10])
def test_matches_naive_with_dropout_and_batchnorm(chunk_size, device):
    net_a, xs_a = model(device), inputs(device=device)
    net_b, xs_b = copy.deepcopy(net_a), inputs(device=device)
    torch.manual_seed(5)
    L_a = cached_backward(net_a, xs_a, outer, chunk_size=chunk_size)
    a = state(net_a, xs_a, device)
    torch.manual_seed(5)
    L_b = naive(net_b, xs_b, outer)
    b = state(net_b, xs_b, device)
    assert_close(L_a, L_b)
    assert_close(a[0], b[0], what="parameter gradients")
    assert_close(a[1], b[1], what="input gradients")
    assert_close(a[2], b[2], what="BatchNorm buffers")
    assert torch.equal(a[3], b[3])
    assert not L_a.requires_grad


def test_g_with_parameters_and_f_as_a_plain_function():
    net_a, net_b = model(), None
    net_b = copy.deepcopy(net_a)
    head_a = nn.Linear(3, 1).to(F64)
    head_b = copy.deepcopy(head_a)
    xs = [x.detach() for x in inputs()]

    def g_of(head):
        return lambda Z: torch.tanh(head(Z)).sum()

    torch.manual_seed(2)
    cached_backward(lambda x: net_a(x) * 2, xs, g_of(head_a), chunk_size=2)
    torch.manual_seed(2)
    naive(lambda x: net_b(x) * 2, xs, g_of(head_b))
    assert_close([p.grad for p in net_a.parameters()] + [p.grad for p in head_a.parameters()],
                 [p.grad for p in net_b.parameters()] + [p.grad for p in head_b.parameters()])
    assert_close(dict(net_a.named_buffers()), dict(net_b.named_buffers()))


def test_stacked_tensor_inputs():
    net = model().eval()
    X = torch.randn(6, 4, 5, dtype=F64)
    L = cached_backward(net, X, outer, chunk_size=4)
    ours = [p.grad.clone() for p in net.parameters()]
    for p in net.parameters():
        p.grad = None
    assert_close(L, naive(net, list(X), outer))
    assert_close(ours, [p.grad for p in net.parameters()])


def test_peak_is_one_chunk_graph_not_all():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)], nn.Linear(64, 2)).to(F64)
    xs = [torch.randn(32, 64, dtype=F64) for _ in range(16)]
    with StorageCounter() as ours:
        cached_backward(net, xs, outer, chunk_size=1)
    with StorageCounter() as full:
        naive(net, xs, outer)
    one_chunk_graph = 8 * 2 * 32 * 64 * 8  # saved inputs and outputs of 8 layers for one input
    param_grads = sum(p.numel() * 8 for p in net.parameters())  # .grad, allocated by both
    assert ours.peak < full.peak / 4, (ours.peak, full.peak)
    assert ours.peak < param_grads + one_chunk_graph, (ours.peak, param_grads, one_chunk_graph)


@pytest.mark.parametrize("args, exc, pattern", [
    ((3, [torch.ones(2)], outer), TypeError, r"expected f to be callable"),
    ((torch.sin, [], outer), ValueError, r"expected at least one input"),
    ((torch.sin, {"a": 1}, outer), TypeError, r"expected inputs to be a list, tuple or tensor, got dict"),
    ((torch.sin, [torch.ones(2)], lambda Z: Z), ValueError, r"expected g to return a scalar tensor, got \(1, 2\)"),
    ((lambda x: 1.0, [torch.ones(2)], outer), TypeError, r"expected f to return a tensor, got float"),
])
def test_errors(args, exc, pattern):
    with pytest.raises(exc, match=r"cached_backward\(f, inputs, g\): " + pattern):
        cached_backward(*args)


def test_g_that_draws_random_numbers_leaves_rng_as_naive():
    net_a = model()
    net_b = copy.deepcopy(net_a)
    xs = [x.detach() for x in inputs(4)]

    def noisy_g(Z):
        return (Z * torch.rand_like(Z)).pow(2).sum()

    torch.manual_seed(4)
    L_a = cached_backward(net_a, xs, noisy_g)
    rng_a = torch.get_rng_state()
    torch.manual_seed(4)
    L_b = naive(net_b, xs, noisy_g)
    assert torch.equal(rng_a, torch.get_rng_state())
    assert_close(L_a, L_b)
    assert_close([p.grad for p in net_a.parameters()], [p.grad for p in net_b.parameters()])
