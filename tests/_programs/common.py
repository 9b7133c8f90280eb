"""Helpers for the tangent-program tests: a program's tangent against double backward's, and small problems."""
import torch

import mixedad

from mixedad._ground.state import Snapshot
from mixedad.reference import differentiable_attention
from mixedad._programs.program import write


def reverse_mode_jvp(G, zs, vs):
    """J_G v by double backward (torch.autograd.functional.jvp), G's state left as found."""
    state = Snapshot(G)
    try:
        with differentiable_attention():  # the fused kernels have no double backward
            out, tangent = torch.autograd.functional.jvp(lambda *z: G(*z), tuple(zs), tuple(vs))
    finally:
        state.restore()
    return out, tangent


def program_jvp(G, zs, vs):
    """G's output and tangent by its tangent program (eager), G's state left as found."""
    program = write(G, zs)
    state = Snapshot(G)
    try:
        with torch.no_grad():
            primals, tangents = program(*zs, *vs)
    finally:
        state.restore()
    return primals, tangents


def assert_program_matches(G, *zs, tol=1e-10, primal_rtol=0.0):
    """The program's tangents are reverse mode's to ``tol``; its primal is G's own output, bit for bit, or to
    ``primal_rtol`` (attention on the CPU computes its primal in the tangent's blocks: round-off)."""
    gen = torch.Generator().manual_seed(0)
    vs = [torch.randn(z.shape, dtype=z.dtype, generator=gen) for z in zs]
    primals, tangents = program_jvp(G, zs, vs)
    out, expected = reverse_mode_jvp(G, zs, vs)
    outs = out if isinstance(out, tuple) else (out,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(primals) == len(outs)
    state = Snapshot(G)
    with torch.no_grad():
        plain = G(*zs)
    state.restore()
    plain = plain if isinstance(plain, tuple) else (plain,)
    for p, o in zip(primals, plain):
        if primal_rtol:
            assert (p - o).abs().max().item() <= primal_rtol * max(o.abs().max().item(), 1.0)
        else:
            assert torch.equal(p, o), "the program's primal is G's own output, bit for bit"
    for t, e in zip(tangents, expected):
        scale = max(e.abs().max().item(), 1.0)
        assert (t - e).abs().max().item() <= tol * scale, (t - e).abs().max().item()


D = torch.float64


def f(y, g):
    """The tests' objective: cubic, so that its second derivative depends on g."""
    return ((y + g) ** 3).sum()


def problem(G, batch=3, seed=0):
    """``(z, y, v)`` in float64 for a zoo member G (``zoo.latent_shape``)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*mixedad.zoo.latent_shape(G, batch), dtype=D, generator=gen)
    with torch.no_grad():
        shape = G(z).shape
    return z, torch.randn(shape, dtype=D, generator=gen), torch.randn(z.shape, dtype=D, generator=gen)
