"""Mixed second derivatives through a frozen G: mixed_grad."""
import functools
from typing import Any, Callable, Optional, Sequence, Union
import torch
from torch.func import vmap

from mixedad import _checks
from mixedad._entry import public_call
from mixedad._hooks.pytree import tree_flatten, tree_unflatten
from mixedad.op_rules import UnderTransformError
from mixedad._backend import contract_f_with_tangent, f_cotangent
from mixedad._ground.state import Snapshot
from mixedad._entry import eager, warn_once
from mixedad._ground.nesting import check_not_nested
from mixedad._frontend.batched import push_tangents, push_under_vmap
from mixedad._frontend.tangents import push_tangent
from mixedad._hooks.functorch import in_functorch_transform

__all__ = ["mixed_grad", "mixed_jacobian"]


@public_call
def mixed_grad(f: Callable[..., torch.Tensor], G: Callable[..., Any], z: Union[torch.Tensor, Sequence[torch.Tensor]],
               y: Any, v: Any = None, *, create_graph: bool = False, strategy: str = "auto",
               compile: bool = False) -> Any:
    r"""Mixed derivative d/dy of the input gradient ∂f(y, G(z))/∂z, contracted with v.

    .. math::

        \mathrm{mixed\_grad}(f, G, z, y, v)
            = \frac{\partial}{\partial y}\Big\langle v,\ \frac{\partial f(y, G(z))}{\partial z}\Big\rangle
            = \Big(\frac{\partial^2 f}{\partial g\,\partial y}\Big)^{\!\top} J_G(z)\, v

    where :math:`J_G(z)` is the Jacobian of the generator G at z and :math:`g = G(z)`.

    The tangent v goes forward through G with forward-mode AD (see :mod:`mixedad.op_rules` for
    which ops take which path); only the cheap f is differentiated twice. No reverse graph through G is ever
    built, so peak memory is that of one forward pass of G holding primal and tangent plus
    f's graph, and does not grow with G's depth. Double backward
    (:func:`mixedad.reference.double_backward_mixed_grad`) keeps all of G's activations.

    G is left as it was: no ``.grad`` is written, requires_grad flags and the module mode are
    untouched. The result is returned, never accumulated into ``y.grad``.

    Under ``torch.func.vmap`` over v alone, the batch of tangents goes through G in one pass of
    mixedad's own, on the per-op rules (as in :func:`mixed_jacobian`); a vmap that batches z
    too runs on torch.func's formulas (see :mod:`mixedad._frontend.batched`).

    Args:
        f: callable ``f(y, g)`` returning a scalar tensor, where g has the structure of G's
            output.
        G: callable (an ``nn.Module`` or a function) mapping z to a tensor or a pytree of
            tensors. It is treated as frozen: its parameters get no gradient. In train mode,
            dropout and BatchNorm behave as in one plain forward pass (:mod:`mixedad._ground.state`).
        z: floating-point tensor, the input of G, or a tuple of them that G takes positionally
            (``G(*z)``). Batch dimensions may sit anywhere; z is treated as one point. z is a
            constant here: the result carries no graph to z.
        y: floating-point tensor, or a tuple, list or dict (nested freely) of them. Leaves
            need not require grad. Each leaf is an argument of its own: where y holds one tensor
            twice, each position gets the partial derivative through that position.
        v: tangent with z's structure, shapes, dtypes and device. Defaults to ones, which
            gives ∂/∂y of the sum of all entries of ∂f/∂z.
        create_graph: keyword-only. If True, the result is differentiable further with
            respect to y (and anything else f closes over).
        strategy: keyword-only. "auto" (default) pushes the tangent forward, each op on its
            per-op rule (:mod:`mixedad.op_rules`: fast frozen layers, written formulas, the local
            double-VJP rule for ops forward mode cannot take, PyTorch's formulas), all flat in
            memory; where no per-op rule can go on (an output that loses its tangent, a sparse
            output), all of G falls back to two reverse passes, with a warning. "forward" allows
            every per-op rule and raises instead of that whole-G fallback; "reverse" always
            uses the two reverse passes (memory grows with depth).
        compile: keyword-only. If True, the tangent pass runs G's tangent program compiled with
            ``torch.compile``, once per G and per input shapes and dtypes (and cached): faster
            after the first call, which compiles and checks the compiled tangent against the
            eager pass (a compiler that drops a tangent is caught there, and that G and shape
            run eager from then on, with a warning). G must be an ``nn.Module`` that
            ``torch.fx`` can trace, made of layers and ops tangent programs have rules for
            (:mod:`mixedad._programs`); any other G runs eager, with a warning.
            :func:`mixedad.programs.compiled_tangents` lists what was compiled and the compile times.

    Returns:
        Tensors with the structure, shapes and dtypes of y. A leaf of y that the mixed
        derivative does not depend on (unused by f, or entering f separately from g) gets
        zeros, which is the exact mixed partial.

    Raises:
        TypeError: f or G not callable; z, v or a leaf of y not a floating-point tensor;
            v of another dtype; f not returning a floating-point tensor.
        ValueError: v of another shape or device; v requiring grad with create_graph=True (the
            result is not differentiable in v); f returning more than one element; y empty;
            z, y or G on different devices; an unknown strategy.
        RuntimeError: strategy="forward" and G needs the whole-G fallback; an op of G whose
            tangent can be computed neither by forward mode nor by reverse mode (a custom
            Function with a ``@once_differentiable`` backward and no ``jvp``).

    Example:
        >>> import torch, mixedad
        >>> G = lambda x: x.sum(dim=1).exp()
        >>> f = lambda y, g: ((y.sum(dim=1) + g) ** 3).sum()
        >>> z, y = torch.rand(3, 4), torch.rand(3, 4)
        >>> mixedad.mixed_grad(f, G, z, y).shape
        torch.Size([3, 4])
    """
    return _mixed_grad("mixed_grad(f, G, z, y)", f, G, z, y, v, create_graph, strategy, compile)


def _mixed_grad(call, f, G, z, y, v, create_graph, strategy, compile=False):
    zs, y_leaves, y_spec, vs = _checks.mixed_args(call, f, G, z, y, v)
    check_not_nested(call)
    _checks.check_no_forward_tangents(call, [*zs, *y_leaves, *vs])
    _checks.check_strategy(call, strategy)
    _checks.check_v_constant(call, vs, create_graph)
    _checks.check_compile(call, compile, strategy)
    G = eager(G)
    _checks.check_devices(call, G, zs, y_leaves, y_spec)
    pushed = push_under_vmap(call, G, zs, vs) if strategy != "reverse" and in_functorch_transform() else None
    if pushed is not None and compile:
        warn_once(("compile under vmap", call), f"mixedad: {call} with compile=True inside torch.func.vmap runs the "
                                               f"batch of tangents eagerly, on the per-op rules; mixed_jacobian("
                                               f"..., compile=True) compiles a batch of tangents.")
    if pushed is None:
        cotangent = f_cotangent(call, f, y_leaves, y_spec, create_graph=create_graph)
        pushed = push_tangent(call, G, zs, vs, strategy=strategy, cotangent=cotangent, compile=compile)
    g_leaves, tangent_leaves, g_spec = pushed
    result = contract_f_with_tangent(
        call, f, y_leaves, y_spec, g_leaves, tangent_leaves, g_spec, create_graph=create_graph
    )
    return tree_unflatten(result, y_spec)


def _rows(call, f, G, z, y, compile, basis):
    """Rows of the mixed Jacobian along the tangents ``basis`` (one tensor per z, leading dimension k), in one
    pass of G: one tensor per leaf of y, each with the leading k."""
    zs, y_leaves, y_spec, _ = _checks.mixed_args(call, f, G, z, y, None)
    check_not_nested(call)
    _checks.check_no_forward_tangents(call, [*zs, *y_leaves])
    _checks.check_devices(call, G, zs, y_leaves, y_spec)
    g_leaves, tangents, g_spec = push_tangents(call, G, zs, list(basis), compile=compile)
    return contract_f_with_tangent(call, f, y_leaves, y_spec, g_leaves, tangents, g_spec, create_graph=False,
                                   batched=True)


def _basis(zs, start, stop):
    """Basis vectors ``start`` to ``stop`` of z-space (the z's flattened and joined): one tensor per z, leading k."""
    rows, offset = [], 0
    k = stop - start
    for zi in zs:
        n = zi.numel()
        block = torch.zeros(k, n, dtype=zi.dtype, device=zi.device)
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            index = torch.arange(lo, hi, device=zi.device)
            block[index - start, index - offset] = 1.0
        rows.append(block.reshape(k, *zi.shape))
        offset += n
    return rows


@public_call
def mixed_jacobian(f: Callable[..., torch.Tensor], G: Callable[..., Any], z: Union[torch.Tensor, Sequence[torch.Tensor]],
                   y: Any, *,
                   chunk_size: Optional[int] = None, strategy: str = "auto", compile: bool = False) -> Any:
    r"""The full mixed second derivative of f(y, G(z)) in z and y.

    .. math::

        \mathrm{mixed\_jacobian}(f, G, z, y)[i\ldots, j\ldots]
            = \frac{\partial^2 f(y, G(z))}{\partial z_{i\ldots}\,\partial y_{j\ldots}}

    Row i is :func:`mixed_grad` with v the i-th basis vector of z's space. The rows are computed
    a batch of basis vectors at a time, each batch one forward pass of G that computes the
    primal once and every op's tangent for the whole batch at once
    (:mod:`mixedad._frontend.batched`), on the same per-op rules as mixed_grad: frozen layers,
    blockwise attention, written formulas, the local double-VJP rule (custom
    ``autograd.Function``\ s without ``jvp`` or ``setup_context``, as StyleGAN-style ops).

    Memory: a batch of b tangents costs b times the tangent part of one mixed_grad call, plus
    the result, which holds ``z.numel() * y.numel()`` numbers. ``chunk_size`` bounds b (the
    default, None, pushes all ``z.numel()`` tangents at once). Peak memory does not grow with
    G's depth. z and y may be what :func:`mixed_grad` takes: a tuple of z's (their entries counted
    in order), and a pytree y.

    A G that a batch cannot take (what needs the whole-G fallback: gradient hooks,
    ``torch.autograd.grad`` inside G, a backward that is not linear; inference mode inside G;
    threads started by G; grad left off at return) is computed one tangent per pass instead,
    each with mixedad's per-op rules and fallbacks: exact, at one forward pass of G per entry of
    z. Called inside a torch.func transform of the caller's (a vmap over codes),
    ``torch.func.vmap`` batches the rows instead.

    A G that draws random numbers (dropout in train mode) is computed one tangent per pass too:
    a batched pass need not draw them in the order a plain call does.

    Every batch replays the random state and the buffers the first saw, so dropout masks and
    spectral norm's vectors agree across rows, and the RNG and buffers end where one forward pass
    leaves them. A G that updates buffers in place (BatchNorm in train mode, counters) cannot run
    in a batch: it takes one pass per tangent, each from that same state.

    Args:
        f, G: as for :func:`mixed_grad`.
        z: floating-point tensor, or a tuple of them that G takes positionally (``G(*z)``).
        y: floating-point tensor, or a tuple, list or dict (nested freely) of them, as for
            :func:`mixed_grad`.
        chunk_size: keyword-only; None or the number of basis tangents per batch.
        strategy: keyword-only; as for :func:`mixed_grad`.
        compile: keyword-only; as for :func:`mixed_grad`. A batch of tangents runs ``torch.vmap``
            of G's tangent program over the tangents, compiled once per chunk size.

    Returns:
        A tensor of shape ``z.shape + y.shape`` with y's dtype. For a pytree y, y's structure with
        a tensor of shape ``z.shape + leaf.shape`` for each leaf; for a tuple z, a tuple with one
        such result per ``z[i]`` (shapes ``z[i].shape + leaf.shape``).

    Example:
        >>> import torch, mixedad
        >>> G = lambda x: x.sum(dim=1).exp()
        >>> f = lambda y, g: ((y.sum(dim=1) + g) ** 3).sum()
        >>> mixedad.mixed_jacobian(f, G, torch.rand(3, 4), torch.rand(3, 4), chunk_size=5).shape
        torch.Size([3, 4, 3, 4])
    """
    call = "mixed_jacobian(f, G, z, y)"
    zs, y_leaves, y_spec, _ = _checks.mixed_args(call, f, G, z, y, None)
    _checks.check_strategy(call, strategy)
    _checks.check_compile(call, compile, strategy)
    G = eager(G)
    as_tuple = isinstance(z, (tuple, list))
    n = sum(zi.numel() for zi in zs)
    step = _checks.check_chunk_size(call, chunk_size) or n

    def structured(per_leaf):  # rows (n, *leaf.shape) per leaf of y -> the result's structure
        blocks, offset = [], 0
        for zi in zs:
            blocks.append(tree_unflatten([rows[offset:offset + zi.numel()].reshape(*zi.shape, *leaf.shape)
                                          for rows, leaf in zip(per_leaf, y_leaves)], y_spec))
            offset += zi.numel()
        return tuple(blocks) if as_tuple else blocks[0]

    if n == 0:  # no rows
        return structured([leaf.new_zeros(0, *leaf.shape) for leaf in y_leaves])
    if strategy == "reverse" or in_functorch_transform():
        # inside the user's own transform (vmap over codes): torch.func batches the tangents
        def batched(basis):
            v = tuple(basis) if as_tuple else basis[0]
            return tree_flatten(_mixed_grad(call, f, G, z, y, v, False, strategy))[0]

        batched = vmap(batched, randomness="same")
    else:
        batched = functools.partial(_rows, call, f, G, z, y, compile)

    state = Snapshot(G, call=call)  # every batch (or row) starts from the state the first one saw

    def one_by_one(basis):  # each tangent in its own pass, with mixedad's per-op rules
        rows = []
        for i in range(basis[0].shape[0]):
            v = tuple(b[i] for b in basis) if as_tuple else basis[0][i]
            state.restore()
            with state.watching():
                rows.append(tree_flatten(_mixed_grad(call, f, G, z, y, v, False, strategy, compile))[0])
        return [torch.stack(leaf_rows) for leaf_rows in zip(*rows)]

    rows_of = batched
    rows = []
    for start in range(0, n, step):
        basis = _basis(zs, start, min(start + step, n))
        state.restore()
        try:
            with state.watching():
                batch = rows_of(basis)
            if rows_of is batched and not state.rng.is_current():
                # G draws random numbers: vmap(randomness="same") need not draw them in the order a
                # plain call does (dropout on a non-contiguous tensor), so double backward's masks
                # come only from one pass per tangent.
                raise UnderTransformError(f"{call}: G draws random numbers")
        except UnderTransformError:
            if rows_of is one_by_one:
                raise
            rows_of = one_by_one  # G does what torch.func cannot batch: one pass per tangent
            batch = rows_of(basis)
        rows.append(batch)
    return structured([torch.cat(leaf_rows) for leaf_rows in zip(*rows)])
