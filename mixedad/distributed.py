r"""Sharding latent codes across processes with torch.distributed.

Every rank holds a slice of the latent codes z and a replica of y; torch.distributed is the
engine. The recipe, for an outer objective ``t = g(dfdz, x)`` over all N codes:

.. code-block:: python

    import torch.distributed as dist
    from mixedad import distributed, input_grad

    z_local = distributed.shard(z)                        # this rank's codes
    dfdz_local = input_grad(f, G, z_local, y, chunk_size=64)
    dfdz = distributed.all_gather_codes(dfdz_local)       # all N codes, differentiable
    t = g(dfdz, x) / dist.get_world_size()                # each rank's share of the same t
    t.backward()
    distributed.all_reduce_grads([y, x])                  # y.grad, x.grad as in one process

Why it is exact: every rank computes the same t and backpropagates 1/W of it. The backward of
:func:`all_gather_codes` sums the incoming gradient over ranks, giving each rank exactly
∂t/∂dfdz for its own codes, so y's gradient on each rank is the part owed to its codes, and x's
is 1/W of the whole. :func:`all_reduce_grads` sums both over ranks. When g is a sum over codes,
the gather can be skipped: ``t = g(dfdz_local, x_share)`` on each rank, then the same all-reduce.
"""
from typing import Any, Iterable
import torch
import torch.distributed as dist

from mixedad._hooks.pytree import tree_leaves

__all__ = ["shard", "all_gather_codes", "all_reduce_grads"]


def _world(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "mixedad.distributed: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first."
        )
    return dist.get_world_size(group), dist.get_rank(group)


def shard(z: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    r"""This rank's slice of z's leading dimension (contiguous, sizes differ by at most one).

    .. math::

        \mathrm{shard}(z)_r = z[\,o_r : o_{r+1}\,], \qquad o_r = r \lfloor N / W \rfloor + \min(r, N \bmod W)

    Returns a view of z: rank r of W gets ``torch.tensor_split(z, W)[r]``.

    Example:
        >>> from mixedad import distributed
        >>> # inside an initialised process group:
        >>> z_local = distributed.shard(z)  # doctest: +SKIP
    """
    world, rank = _world(group)
    return torch.tensor_split(z, world, dim=0)[rank]


class _AllGatherCodes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, local):
        world, rank = _world(group)
        size = torch.tensor([local.shape[0]], device=local.device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        counts = [int(s) for s in sizes]
        padded = local.new_zeros((max(counts), *local.shape[1:]))
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
        ctx.group, ctx.start, ctx.stop = group, sum(counts[:rank]), sum(counts[: rank + 1])
        return torch.cat([piece[:n] for piece, n in zip(gathered, counts)])

    @staticmethod
    def backward(ctx, grad_all):
        grad_all = grad_all.contiguous().clone()
        dist.all_reduce(grad_all, op=dist.ReduceOp.SUM, group=ctx.group)
        return None, grad_all[ctx.start : ctx.stop]


def all_gather_codes(local: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    r"""Concatenate every rank's ``local`` along dim 0, in rank order; differentiable.

    .. math::

        \mathrm{out} = [\mathrm{local}_0; \ldots; \mathrm{local}_{W-1}],\qquad
        \frac{\partial L}{\partial\,\mathrm{local}_r} = \sum_{s} \frac{\partial L_s}{\partial\,\mathrm{out}}\Big|_{\text{rows of } r}

    where :math:`L_s` is the loss rank s backpropagates. Shards may differ in length. Backward
    is an all-reduce (supported by gloo and NCCL), so every rank must call backward.

    Example:
        >>> dfdz = distributed.all_gather_codes(input_grad(f, G, z_local, y))  # doctest: +SKIP
    """
    return _AllGatherCodes.apply(group, local)


def all_reduce_grads(tensors: Iterable[torch.Tensor], *, group: Any = None) -> None:
    r"""Sum ``.grad`` of every tensor (a tensor or pytree of tensors) over ranks, in place.

    .. math::

        \mathrm{grad}(t) \leftarrow \sum_{r=0}^{W-1} \mathrm{grad}_r(t)

    Tensors whose ``.grad`` is None on this rank get a zero gradient first, so every rank joins
    every collective in the same order.

    Example:
        >>> distributed.all_reduce_grads([y, x])  # doctest: +SKIP
    """
    _world(group)
    for t in tree_leaves(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce_grads(tensors): expected tensors, got {type(t).__name__}.")
        if t.grad is None:
            t.grad = torch.zeros_like(t)
        dist.all_reduce(t.grad, op=dist.ReduceOp.SUM, group=group)
