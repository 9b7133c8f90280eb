"""The references themselves: double backward against finite differences, and they import no implementation."""
import ast
import pathlib

import torch

from mixedad import reference, zoo
from mixedad.testing import assert_close

F64 = torch.float64


def f(y, g):
    return ((y + g) ** 3).sum() + (y * g.sin()).sum()


def test_double_backward_agrees_with_finite_differences():
    G = zoo.mlp(2, 4, dtype=F64)
    z, y, v = (torch.randn(3, 4, dtype=F64) for _ in range(3))
    assert_close(reference.double_backward_mixed_grad(f, G, z, y, v),
                 reference.finite_difference_mixed_grad(f, G, z, y, v), rtol=1e-6)


def test_the_jacobian_rows_are_mixed_grads_of_basis_vectors():
    G = zoo.mlp(2, 3, dtype=F64)
    z, y = torch.randn(2, 3, dtype=F64), torch.randn(2, 3, dtype=F64)
    J = reference.double_backward_mixed_jacobian(f, G, z, y)
    basis = torch.zeros(6, dtype=F64)
    basis[4] = 1
    assert_close(J.reshape(6, *y.shape)[4], reference.double_backward_mixed_grad(f, G, z, y, basis.reshape(2, 3)))


def test_the_reference_imports_no_implementation():
    """Ground truth must not share code with what it checks: only argument checks, entry and torch hooks."""
    tree = ast.parse(pathlib.Path(reference.__file__).read_text())
    modules = {n.module if n.module != "mixedad" else f"mixedad.{a.name}"
               for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {m for m in modules if m.startswith("mixedad")}
    allowed = ("mixedad._checks", "mixedad._entry", "mixedad._hooks")
    assert all(m.startswith(allowed) for m in ours), sorted(ours)
