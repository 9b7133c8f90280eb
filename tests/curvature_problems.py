"""Small problems and references for z-space curvature and implicit differentiation, shared by tests."""
import torch
from torch import nn

import mixedad

F64 = torch.float64


def f_cubic(y, g):
    """A non-quadratic f: its Hessian in g depends on g, and G's curvature matters (GGN != Hessian)."""
    return ((g - y) ** 2).sum() + 0.3 * (torch.tanh(g) * y).sum()


def f_with_prior(y, g):
    """For G returning (image, z): a data term and a Gaussian prior on z."""
    image, z = g
    return ((image - y) ** 2).sum() + 0.5 * (z ** 2).sum() + 0.1 * (image ** 3).sum()


def f_of_pair(y, g):
    return ((g - y) ** 2).sum() + 0.2 * (g.sin() * y).sum()


class TwoInputs(nn.Module):
    """G(z1, z2) for a tuple z."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(2, 4)

    def forward(self, z1, z2):
        return torch.tanh(self.a(z1) + self.b(z2)).pow(2)


def problem(name, seed=0):
    """``(f, G, z, y)`` in float64; z small enough for dense references."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "mlp":
            G, z = mixedad.zoo.mlp(4, 3, dtype=F64), torch.randn(2, 3, generator=gen, dtype=F64)
            return f_cubic, G, z, torch.randn(2, 3, generator=gen, dtype=F64)
        if name == "batchnorm_eval":
            G = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh()).to(F64).eval()
            G[1].running_mean.normal_(generator=gen)
            G[1].running_var.uniform_(0.5, 2.0, generator=gen)
            return f_cubic, G, torch.randn(2, 3, generator=gen, dtype=F64), torch.randn(2, 4, generator=gen, dtype=F64)
        if name == "tuple_z":
            G = TwoInputs().to(F64)
            z = (torch.randn(2, 3, generator=gen, dtype=F64), torch.randn(2, 2, generator=gen, dtype=F64))
            return f_of_pair, G, z, torch.randn(2, 4, generator=gen, dtype=F64)
        if name == "image_and_z":
            net = mixedad.zoo.mlp(3, 3, dtype=F64)
            G = lambda z: (net(z), z)  # noqa: E731
            return f_with_prior, G, torch.randn(2, 3, generator=gen, dtype=F64), torch.randn(2, 3, generator=gen, dtype=F64)
    raise ValueError(name)


NAMES = ["mlp", "batchnorm_eval", "tuple_z", "image_and_z"]


def split_flat(flat, shapes):
    """The tensors of ``shapes`` from one flat vector, in order."""
    parts, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        parts.append(flat[offset:offset + n].reshape(shape))
        offset += n
    return parts


def flat_loss(f, G, z, y):
    """L as a function of z flattened (a tuple z concatenated in order)."""
    zs = z if isinstance(z, tuple) else (z,)
    return (lambda flat: f(y, G(*split_flat(flat, [t.shape for t in zs])))), torch.cat([t.reshape(-1) for t in zs])


def reference_hessian(f, G, z, y):
    loss, flat = flat_loss(f, G, z, y)
    return torch.func.hessian(loss)(flat).detach()


def reference_ggn(f, G, z, y):
    """J^T H_g J with J from torch.func.jacrev and H_g from torch.func.hessian, over G's flattened output."""
    zs = z if isinstance(z, tuple) else (z,)
    _, flat = flat_loss(f, G, z, y)

    def g_of(flat_z):
        leaves, spec = torch.utils._pytree.tree_flatten(G(*split_flat(flat_z, [t.shape for t in zs])))
        return torch.cat([leaf.reshape(-1) for leaf in leaves]), spec, [leaf.shape for leaf in leaves]

    g_flat, spec, shapes = g_of(flat)
    J = torch.func.jacrev(lambda v: g_of(v)[0])(flat)

    def f_of_flat_g(gf):
        return f(y, torch.utils._pytree.tree_unflatten(split_flat(gf, shapes), spec))

    Hg = torch.func.hessian(f_of_flat_g)(g_flat.detach())
    return (J.T @ Hg @ J).detach()
