"""Naive double-backward implementations: mixedad's public ground truth.

These build the full reverse graph through G with ``create_graph=True`` and differentiate it
again, exactly as the straightforward PyTorch code does. They are slow and their memory grows
with G's depth; use them to verify mixedad's results, not in production.
"""
from typing import Any, Callable, Optional, Sequence, Tuple, Union
import torch

from mixedad import _checks
from mixedad._hooks.autograd_graph import once_differentiable_node
from mixedad._entry import public_call
from mixedad._hooks.pytree import tree_unflatten
from mixedad._entry import frozen
from mixedad._hooks.attention_backends import differentiable_attention

__all__ = [
    "double_backward_mixed_grad",
    "double_backward_input_grad",
    "double_backward_mixed_jacobian",
    "finite_difference_mixed_grad",
    "finite_difference_mixed_directional",
]


@public_call
def double_backward_mixed_grad(f: Callable[..., torch.Tensor], G: Callable[..., Any],
                               z: Union[torch.Tensor, Sequence[torch.Tensor]], y: Any, v: Any = None, *,
                               create_graph: bool = False) -> Any:
    r"""Reference for :func:`mixedad.mixed_grad` by double backward through G.

    .. math::

        \frac{\partial}{\partial y}\Big\langle v,\ \frac{\partial f(y, G(z))}{\partial z}\Big\rangle

    computed as ``grad(grad(f(y, G(z)), z, create_graph=True), y, grad_outputs=v)``. Same
    arguments and result structure as :func:`mixedad.mixed_grad`; leaves of y the result does
    not depend on get zeros. Memory: all of G's activations and its backward graph are kept
    alive, so peak memory grows linearly with G's depth.

    G's parameters get no ``.grad`` (``torch.autograd.grad`` returns, never accumulates).

    Example:
        >>> import torch
        >>> from mixedad.reference import double_backward_mixed_grad
        >>> G = lambda x: x.sum(dim=1).exp()
        >>> f = lambda y, g: ((y.sum(dim=1) + g) ** 3).sum()
        >>> double_backward_mixed_grad(f, G, torch.rand(3, 4), torch.rand(3, 4)).shape
        torch.Size([3, 4])
    """
    call = "double_backward_mixed_grad(f, G, z, y)"
    zs, y_leaves, y_spec, vs = _checks.mixed_args(call, f, G, z, y, v)

    with torch.enable_grad(), differentiable_attention():
        z_work = [zi.detach().requires_grad_() for zi in zs]
        y_work = _checks.y_aliases(y_leaves)
        out = f(tree_unflatten(y_work, y_spec), G(*z_work))
        _checks.check_scalar_output(call, out)
        out = out.reshape(())
        df_dz: Sequence[Optional[torch.Tensor]] = [None] * len(z_work)
        if out.requires_grad:
            df_dz = torch.autograd.grad(out, z_work, create_graph=True, allow_unused=True)
        pairs = [(d, vi) for d, vi in zip(df_dz, vs) if d is not None and d.requires_grad]
        if once_differentiable_node([d for d, _ in pairs]) is not None:
            raise RuntimeError(
                f"{call}: G contains a custom autograd.Function whose backward is marked "
                f"@once_differentiable, so ∂f/∂z cannot be differentiated again (the naive code "
                f"raises here; with allow_unused it would silently give zeros)."
            )
        grads: Sequence[Optional[torch.Tensor]]
        if pairs:
            grads = torch.autograd.grad(
                [d for d, _ in pairs], y_work, grad_outputs=[vi for _, vi in pairs],
                create_graph=create_graph, allow_unused=True,
            )
        else:
            grads = [None] * len(y_work)
    result = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, y_leaves)]
    return tree_unflatten(result, y_spec)


@public_call
def double_backward_input_grad(f: Callable[..., torch.Tensor], G: Callable[..., Any],
                               z: Union[torch.Tensor, Sequence[torch.Tensor]], y: Any, *,
                               chunk_size: Optional[int] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    r"""Reference for :func:`mixedad.input_grad`: the naive create_graph code.

    .. math::

        \frac{\partial}{\partial z} \sum_c f\big(y, G(z_c)\big)
        \quad\text{via}\quad
        \texttt{torch.autograd.grad}(f(y, G(z_c)), z_c, \texttt{create\_graph=True})

    for each chunk :math:`z_c` of ``chunk_size`` codes (all of z when None), concatenated. Every
    chunk's graph through G stays alive until the result is freed, so memory grows with G's
    depth times the number of codes: this is the code that runs out of memory. G's parameters
    are treated as constants, as in :func:`mixedad.input_grad`. Unlike it, the result may be
    differentiated in z (pass a z that requires grad) and any number of times.

    Example:
        >>> import torch, mixedad
        >>> from mixedad.reference import double_backward_input_grad
        >>> G, f = mixedad.zoo.mlp(2, 4), lambda y, g: ((y + g) ** 2).sum()
        >>> double_backward_input_grad(f, G, torch.randn(6, 4), torch.randn(4), chunk_size=2).shape
        torch.Size([6, 4])
    """
    call = "double_backward_input_grad(f, G, z, y)"
    zs, y_leaves, y_spec, _ = _checks.mixed_args(call, f, G, z, y, None)
    pieces = []
    with torch.enable_grad(), differentiable_attention():
        for c in _checks.chunk_slices(call, zs, chunk_size):
            z_c = [zi[c] if zi.requires_grad else zi[c].detach().requires_grad_() for zi in zs]
            out = f(tree_unflatten(list(y_leaves), y_spec), frozen(G)(*z_c))
            _checks.check_scalar_output(call, out)
            d = torch.autograd.grad(out.reshape(()), z_c, create_graph=True, allow_unused=True)
            pieces.append([torch.zeros_like(zc) if di is None else di for di, zc in zip(d, z_c)])
    result = [torch.cat(column) for column in zip(*pieces)]
    return tuple(result) if isinstance(z, (tuple, list)) else result[0]


@public_call
def double_backward_mixed_jacobian(f: Callable[..., torch.Tensor], G: Callable[..., Any], z: torch.Tensor,
                                   y: Any) -> Any:
    r"""Reference for :func:`mixedad.mixed_jacobian`, one double-backward row at a time.

    .. math::

        J[i\ldots, j\ldots] = \frac{\partial^2 f(y, G(z))}{\partial z_{i\ldots}\, \partial y_{j\ldots}}

    Returns a tensor of shape ``z.shape + y.shape``. It differentiates every entry of
    ∂f/∂z separately, so use it on small cases.

    Example:
        >>> import torch
        >>> from mixedad.reference import double_backward_mixed_jacobian
        >>> G = lambda x: x.sum(dim=1).exp()
        >>> f = lambda y, g: ((y.sum(dim=1) + g) ** 3).sum()
        >>> double_backward_mixed_jacobian(f, G, torch.rand(3, 4), torch.rand(3, 4)).shape
        torch.Size([3, 4, 3, 4])
    """
    call = "double_backward_mixed_jacobian(f, G, z, y)"
    _checks.check_float_tensor(call, "z", z)
    _checks.mixed_args(call, f, G, z, y, None)
    _checks.check_float_tensor(call, "y", y)
    with torch.enable_grad(), differentiable_attention():
        z_work = z.detach().requires_grad_()
        y_work = y if y.requires_grad else y.detach().requires_grad_()
        out = f(y_work, G(z_work))
        _checks.check_scalar_output(call, out)
        (df_dz,) = torch.autograd.grad(out.reshape(()), z_work, create_graph=True, allow_unused=True)
        if df_dz is None or not df_dz.requires_grad:  # f does not depend on z (or not on z and y together)
            return torch.zeros(*z.shape, *y.shape, dtype=y.dtype, device=y.device)
        rows = []
        for entry in df_dz.reshape(-1):
            (row,) = torch.autograd.grad(entry, y_work, retain_graph=True, allow_unused=True)
            rows.append(torch.zeros_like(y) if row is None else row.detach())
    if not rows:  # an empty z
        return torch.zeros(*z.shape, *y.shape, dtype=y.dtype, device=y.device)
    return torch.stack(rows).reshape(*z.shape, *y.shape)


def _second_difference(call, f, y_spec, g_plus, g_minus, eps):
    """(F(+,+) - F(+,-) - F(-,+) + F(-,-)) / (4 eps^2) for y leaves shifted by +-eps * w."""

    def F(leaves, g):
        out = f(tree_unflatten(leaves, y_spec), g)
        _checks.check_scalar_output(call, out)
        return out.reshape(()).item()

    def difference(y_leaves, w_leaves):
        plus = [leaf + eps * w for leaf, w in zip(y_leaves, w_leaves)]
        minus = [leaf - eps * w for leaf, w in zip(y_leaves, w_leaves)]
        return (F(plus, g_plus) - F(plus, g_minus) - F(minus, g_plus) + F(minus, g_minus)) / (4 * eps * eps)

    return difference


def _shifted_outputs(G, zs, vs, eps):
    return (G(*(zi + eps * vi for zi, vi in zip(zs, vs))),
            G(*(zi - eps * vi for zi, vi in zip(zs, vs))))


def finite_difference_mixed_directional(f: Callable[..., torch.Tensor], G: Callable[..., Any],
                                        z: Union[torch.Tensor, Sequence[torch.Tensor]], y: Any, v: Any = None, *,
                                        w: Any, eps: float = 1e-4) -> float:
    r"""Reference for :math:`\langle w, \mathrm{mixed\_grad}(f, G, z, y, v)\rangle`, no autograd.

    .. math::

        \langle w, \mathrm{result}\rangle \approx
            \frac{F(+,+) - F(+,-) - F(-,+) + F(-,-)}{4\,\epsilon^2},
        \qquad F(s, t) = f\big(y + s\,\epsilon\, w,\ G(z + t\,\epsilon\, v)\big)

    One mixed second difference: four evaluations of f and two of G, whatever the size, so it
    checks large cases too. Truncation error is :math:`O(\epsilon^2)`; use float64. f and G
    must be smooth near (y, z): a step across a ReLU kink makes the difference wrong.

    Args:
        w: keyword-only, a direction with y's structure.

    Returns:
        A Python float.

    Example:
        >>> import torch, mixedad
        >>> from mixedad.reference import finite_difference_mixed_directional
        >>> G = mixedad.zoo.mlp(8, 16, dtype=torch.float64)
        >>> f = lambda y, g: ((y + g) ** 3).sum()
        >>> z, y, w = (torch.randn(4, 16, dtype=torch.float64) for _ in range(3))
        >>> fd = finite_difference_mixed_directional(f, G, z, y, w=w)
        >>> abs(fd - (w * mixedad.mixed_grad(f, G, z, y)).sum().item()) < 1e-5 * abs(fd)
        True
    """
    call = "finite_difference_mixed_directional(f, G, z, y)"
    zs, y_leaves, y_spec, vs = _checks.mixed_args(call, f, G, z, y, v)
    w_leaves, w_spec = _checks.flatten_y(call, w)
    if w_spec != y_spec:
        raise ValueError(f"{call}: expected w to have y's structure {y_spec}, got {w_spec}.")
    for w_name, y_name, wl, yl in zip(_checks.leaf_names("w", w_spec), _checks.leaf_names("y", y_spec),
                                      w_leaves, y_leaves):
        _checks.check_like(call, w_name, wl, yl, y_name)
    with torch.no_grad():
        g_plus, g_minus = _shifted_outputs(G, zs, vs, eps)
        difference = _second_difference(call, f, y_spec, g_plus, g_minus, eps)
        return difference(y_leaves, w_leaves)


def finite_difference_mixed_grad(f: Callable[..., torch.Tensor], G: Callable[..., Any],
                                 z: Union[torch.Tensor, Sequence[torch.Tensor]], y: Any, v: Any = None, *,
                                 eps: float = 1e-4) -> Any:
    r"""Reference for :func:`mixedad.mixed_grad` by central finite differences, no autograd.

    .. math::

        \mathrm{result}[j] \approx \frac{F(+,+) - F(+,-) - F(-,+) + F(-,-)}{4\,\epsilon^2},
        \qquad F(s, t) = f\big(y + s\,\epsilon\, e_j,\ G(z + t\,\epsilon\, v)\big)

    for every entry j of every leaf of y. Truncation error is :math:`O(\epsilon^2)`. It costs
    four evaluations of f per entry of y, so use it on tiny cases, in float64. f and G must be
    smooth near (y, z): a step across a ReLU kink makes the difference wrong.

    Returns:
        Tensors with the structure of y.

    Example:
        >>> import torch, mixedad
        >>> from mixedad.reference import finite_difference_mixed_grad
        >>> G = lambda x: x.sum(dim=1).exp()
        >>> f = lambda y, g: ((y.sum(dim=1) + g) ** 3).sum()
        >>> z, y = torch.rand(3, 4, dtype=torch.float64), torch.rand(3, 4, dtype=torch.float64)
        >>> bool(torch.allclose(finite_difference_mixed_grad(f, G, z, y), mixedad.mixed_grad(f, G, z, y), rtol=1e-6))
        True
    """
    call = "finite_difference_mixed_grad(f, G, z, y)"
    zs, y_leaves, y_spec, vs = _checks.mixed_args(call, f, G, z, y, v)
    with torch.no_grad():
        g_plus, g_minus = _shifted_outputs(G, zs, vs, eps)
        difference = _second_difference(call, f, y_spec, g_plus, g_minus, eps)
        result = []
        for i, leaf in enumerate(y_leaves):
            out = torch.empty_like(leaf)
            for j in range(leaf.numel()):
                basis = [torch.zeros_like(other) for other in y_leaves]
                basis[i].view(-1)[j] = 1.0
                out.view(-1)[j] = difference(y_leaves, basis)
            result.append(out)
    return tree_unflatten(result, y_spec)
