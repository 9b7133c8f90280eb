"""graph_report against an independent count through saved_tensors_hooks."""
import pytest
import torch
from torch import nn

import mixedad
from mixedad import graph_report, zoo
from mixedad.reference import double_backward_input_grad


def independent_saved_bytes(fn):
    """Storage bytes of every tensor autograd saves while fn runs, each storage once."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


MODELS = {
    "mlp": (lambda: zoo.mlp(4, 16).train(), (8, 16)),
    "conv": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.ConvTranspose2d(8, 4, 4, 2, 1), nn.Tanh()).train(), (2, 3, 8, 8)),
    "dcgan": (lambda: zoo.dcgan(latent_dim=8, channels=4, image_size=16, extra_blocks=1).train(), (2, 8)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_saved_bytes_match_saved_tensors_hooks(name):
    build, shape = MODELS[name]
    net = build()
    x = torch.randn(shape, requires_grad=True)
    out, expected = independent_saved_bytes(lambda: net(x).pow(2).sum())
    report = graph_report(out)
    assert report.saved_bytes == expected
    assert expected > 0
    n_params = sum(1 for _ in net.parameters())
    assert len(report.leaves) == n_params + 1  # the parameters and x
    assert sum(b for _, b in report.by_op.values()) == report.saved_bytes


def test_no_grad_and_detach_report_zero():
    net = zoo.mlp(3, 8)
    x = torch.randn(4, 8)
    with torch.no_grad():
        a = net(x)
    for t in (a, net(x).detach()):
        report = graph_report(t)
        assert report.nodes == 0 and report.saved_bytes == 0 and report.leaves == []


def test_freed_graph_reports_nodes_but_no_saved_bytes():
    w = torch.randn(50, requires_grad=True)
    out = w.exp().sum()
    assert graph_report(out).saved_bytes == 200
    out.backward()
    report = graph_report(out)
    assert report.nodes == 3 and report.saved_bytes == 0


def test_table_and_errors():
    w = torch.randn(10, requires_grad=True)
    text = str(graph_report([w.exp().sum(), (w * 2).sum()]))
    assert text.startswith("graph: ") and "ExpBackward0" in text and "leaf: (10,)" in text
    with pytest.raises(TypeError, match=r"graph_report\(t\): expected a tensor or a sequence of tensors, got int"):
        graph_report(3)


def test_the_forum_users_graph_check():
    """What seed 003's user saw: naive dfdz keeps G's graph; input_grad's result does not."""
    f = lambda y, g: ((y + g) ** 3).sum()  # noqa: E731
    y = torch.randn(16, requires_grad=True)
    z = torch.randn(8, 16)
    saved = {}
    for depth in (4, 32):
        G = zoo.mlp(depth, 16)
        saved[depth] = (graph_report(double_backward_input_grad(f, G, z, y)).saved_bytes,
                        graph_report(mixedad.input_grad(f, G, z, y)).saved_bytes)
    assert saved[32][0] > 4 * saved[4][0]  # naive: grows with depth
    assert saved[32][1] == saved[4][1]  # input_grad: the same at any depth
