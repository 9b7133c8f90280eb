r"""Meta copies for memory plans: every tensor with its size and dtype, none with memory or values.

.. math::

    \mathrm{bytes}(t_{\mathrm{meta}}) = \mathrm{bytes}(t), \qquad \text{no allocation, no compute}

G is called through ``torch.func.functional_call`` with a meta tensor in place of each parameter
and buffer, so the user's module is not touched (nothing moved, no buffer written). A G already
on meta (built under ``torch.device("meta")``) runs as it is.
"""
import torch
from torch import nn

from mixedad._hooks.pytree import tree_map

__all__ = ["PlanError", "meta_tree", "meta_generator"]


class PlanError(Exception):
    r"""Something G does that a plan on meta tensors cannot follow.

    .. math::

        \mathrm{shape}(\mathrm{op}(x)) \text{ depends on the values of } x \quad\text{(unknown on meta)}

    An op without a meta kernel, a value read with ``.item()``, a data-dependent shape
    (``nonzero``, boolean-mask indexing). Not a RuntimeError, so that no pass mistakes it for a
    formula that raised.

    Example:
        >>> import torch, mixedad
        >>> G = lambda z: z[z > 0]                          # a shape that depends on the values
        >>> try:
        ...     mixedad.profiling.plan(lambda y, g: g.sum(), G, torch.randn(4), torch.randn(1))
        ... except mixedad.profiling.PlanError as error:
        ...     print("cannot run on meta tensors" in str(error))
        True
    """


def _meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_meta:
        return t
    copy = torch.empty_like(t, device="meta")
    return copy.requires_grad_() if t.requires_grad and copy.is_floating_point() else copy


def meta_tree(tree):
    """``tree`` with every tensor replaced by an empty meta tensor of its size, dtype and requires_grad."""
    return tree_map(_meta, tree)


def meta_generator(call, G):
    """G running on meta: a module called with meta parameters and buffers, or G itself if already there."""
    if not isinstance(G, nn.Module):
        return G  # a function: it must build or capture only meta tensors (PlanError names what is not)
    state = {**dict(G.named_parameters(remove_duplicate=False)), **dict(G.named_buffers(remove_duplicate=False))}
    if all(t.is_meta for t in state.values()):
        return G
    # Parameters stay parameters (G's, which mixedad keeps frozen), buffers plain tensors, as in G.
    meta_state = {name: nn.Parameter(_meta(t), requires_grad=t.requires_grad) if isinstance(t, nn.Parameter)
                  else _meta(t) for name, t in state.items()}

    def on_meta(*args):
        return torch.func.functional_call(G, meta_state, args, tie_weights=False)

    on_meta.__qualname__ = f"{type(G).__qualname__} (on meta)"
    return on_meta
