"""Differentiable input gradients through a frozen G: input_grad."""
from typing import Any, Callable, Optional, Sequence, Tuple, Union
import torch
from torch.autograd.function import once_differentiable

from mixedad import _checks
from mixedad._backend import check_sum_over_codes, contract_f_with_tangent, f_cotangent, gradient_chunk
from mixedad._entry import public_call
from mixedad._ground.state import Snapshot
from mixedad._ground.versions import Versions, input_labels
from mixedad._entry import eager
from mixedad._ground.nesting import check_not_nested
from mixedad._frontend.tangents import push_tangent

__all__ = ["input_grad"]

CALL = "input_grad(f, G, z, y)"


@public_call
def input_grad(f: Callable[..., torch.Tensor], G: Callable[..., Any], z: Union[torch.Tensor, Sequence[torch.Tensor]],
               y: Any, *, chunk_size: Optional[int] = None,
               strategy: str = "auto", compile: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    r"""The input gradient ∂f(y, G(z))/∂z, differentiable with respect to y at O(1) memory in depth.

    .. math::

        \mathrm{input\_grad}(f, G, z, y) = \frac{\partial}{\partial z} \sum_{c}
            f\big(y, G(z_c)\big),
        \qquad
        \frac{\partial \langle u, \mathrm{input\_grad}\rangle}{\partial y}
            = \sum_c \mathrm{mixed\_grad}(f, G, z_c, y, u_c)

    where :math:`z_c` runs over chunks of ``chunk_size`` latent codes along z's leading
    dimension (one chunk, all of z, when ``chunk_size`` is None) and :math:`u` is the gradient
    flowing back into the result.

    The forward pass computes each chunk's gradient with one ordinary reverse pass through G,
    whose graph is freed before the next chunk: no graph through G outlives the call. The
    backward pass pushes the incoming gradient forward through G (:func:`mixedad.mixed_grad`
    with ``v`` = that gradient), chunk by chunk, so its peak memory does not grow with G's
    depth. This is the naive ``torch.autograd.grad(f(y, G(z)), z, create_graph=True)`` without
    keeping G's graph alive for every latent code.

    **Chunks.** With ``chunk_size=K``, z's leading dimension indexes independent latent codes
    that share y, and f is evaluated as ``f(y, G(z[i:i+K]))``; the objective is the sum over
    chunks. That equals the unchunked ``f(y, G(z))`` whenever f sums over the batch (as the
    forum thread's objectives do). Peak memory is then set by K, not by the number of codes.

    **What gets gradients.** Backward fills the gradients of y's leaves that require grad, and
    of anything downstream code uses the result with. G is frozen: its parameters get no
    gradient. z must not require grad: a derivative in z would need G's curvature. f must not
    read tensors that require grad other than y's leaves (they would get no gradient); this is
    checked. The result can be differentiated once (``create_graph=True`` through it raises).

    **Train mode.** Each chunk's backward replay starts from the state its forward saw: the
    random state (so dropout draws the same masks), the buffers of train-mode modules
    (BatchNorm statistics, spectral norm's ``u``/``v``, EMAs) and the small buffers of eval-mode
    modules (step counters), recorded before every chunk; that record costs one copy of those
    buffers per chunk. Buffers are updated once per chunk by the
    forward, as the naive code updates them, and end as it leaves them (see :mod:`mixedad._ground.state`).
    With ``chunk_size``, f must be a sum over latent codes; this is checked on the first two chunks.
    What the backward reads again without a copy (G's parameters, eval-mode buffers too large to
    copy, z and y's leaves) is checked against its version at this call (``tensor._version``, as
    autograd does): a change in place, or a replaced parameter, raises
    :class:`mixedad.StateChangedError` instead of mixing old and new state.

    Args:
        f: callable ``f(y, g)`` returning a scalar tensor.
        G: callable or ``nn.Module`` mapping a chunk of z to a tensor or pytree of tensors.
        z: floating-point tensor that does not require grad, or a tuple of them that G takes
            positionally (``G(*z)``; chunks then split every one along dim 0).
        y: floating-point tensor or pytree of tensors.
        chunk_size: keyword-only; None, or the number of latent codes per chunk.
        strategy: keyword-only; how the backward pushes tangents through G, as for
            :func:`mixedad.mixed_grad` ("auto", "forward" or "reverse").
        compile: keyword-only; whether the backward's tangent passes run G's compiled tangent
            program, as for :func:`mixedad.mixed_grad` (the forward's reverse pass stays eager).

    Returns:
        Tensors with z's structure, shapes and dtypes, connected to autograd through y's leaves.

    Example:
        >>> import torch, mixedad
        >>> G = mixedad.zoo.mlp(4, 8)
        >>> f = lambda y, g: ((y + g) ** 3).sum()
        >>> z, y = torch.randn(6, 8), torch.randn(8, requires_grad=True)
        >>> dfdz = mixedad.input_grad(f, G, z, y, chunk_size=2)
        >>> (dfdz ** 2).sum().backward()
        >>> y.grad.shape
        torch.Size([8])
    """
    zs, y_leaves, y_spec, _ = _checks.mixed_args(CALL, f, G, z, y, None)
    _checks.check_z_constant(CALL, zs)
    check_not_nested(CALL)
    _checks.check_no_forward_tangents(CALL, [*zs, *y_leaves])
    _checks.check_strategy(CALL, strategy)
    _checks.check_compile(CALL, compile, strategy)
    G = eager(G)
    _checks.check_devices(CALL, G, zs, y_leaves, y_spec)
    chunks = _checks.chunk_slices(CALL, zs, chunk_size)
    meta = _Meta(f, G, y_spec, chunks, len(zs), strategy, compile)
    meta.labels = input_labels("z", z) + input_labels("y", y)
    out = _InputGrad.apply(meta, *zs, *y_leaves)
    return tuple(out) if isinstance(z, (tuple, list)) else out[0]


class _Meta:
    """What the autograd.Function needs besides tensors."""

    def __init__(self, f, G, y_spec, chunks, n_z, strategy, compile):
        self.f, self.G, self.y_spec, self.chunks, self.n_z, self.strategy = f, G, y_spec, chunks, n_z, strategy
        self.compile = compile
        # RNG and train-mode buffers (BatchNorm statistics, spectral norm's u and v, EMAs) before
        # each chunk's forward pass: the backward replays each chunk from the state it saw.
        self.states = []
        self.labels = []  # how messages name z's and y's leaves
        self.versions = None  # what the backward reads again without a copy, checked before it runs


class _InputGrad(torch.autograd.Function):
    @staticmethod
    def forward(meta, *tensors):
        zs, y_leaves = tensors[: meta.n_z], tensors[meta.n_z :]
        outs = [torch.empty_like(zi) for zi in zs] if len(meta.chunks) > 1 else None
        seen: list = []  # the first two chunks' outputs and values, to check that f sums over codes
        for c in meta.chunks:
            state = Snapshot(meta.G, modules=meta.states[0].modules if meta.states else (), call=CALL)
            meta.states.append(state)
            with state.watching(reads=True, mode=False):  # watched where G and f run
                pieces, evaluated = gradient_chunk(CALL, meta.f, meta.G, [zi[c] for zi in zs], y_leaves, meta.y_spec,
                                                   watch_G=not state.torch_only)
            if outs is None:
                _record(meta, tensors)
                return tuple(pieces)
            if len(seen) < 2:
                seen.append(evaluated)
                if len(seen) == 2:
                    check_sum_over_codes(CALL, meta.f, y_leaves, meta.y_spec, *seen)
                    seen[:] = [None, None]  # checked: let the two outputs go
            for out, piece in zip(outs, pieces):  # outs is a list here (returned above when None)
                out[c] = piece  # filled chunk by chunk: one copy of the result, not two
        _record(meta, tensors)
        return tuple(outs or ())

    @staticmethod
    def setup_context(ctx, inputs, output):  # a separate setup_context: torch.func.grad can run it
        meta, *tensors = inputs
        ctx.meta = meta
        ctx.save_for_backward(*tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outs):
        meta = ctx.meta
        # Checked before autograd's own check of z and y, with the parameter's or input's name. The replays leave
        # no trace: RNG and buffers end as the forward left them. The forward watched every op, so the replays, of
        # the same ops from the same state, draw from the sources it saw (every_op=False); each pass restarts from
        # its chunk's snapshot, just restored, rather than a new one.
        with meta.versions.replaying(meta.states[0], every_op=False):
            tensors = ctx.saved_tensors
            zs, y_leaves = tensors[: meta.n_z], tensors[meta.n_z :]
            cotangents = [torch.zeros_like(zi) if g is None else g for g, zi in zip(grad_outs, zs)]
            totals: Optional[list] = None
            for c, state in zip(meta.chunks, meta.states):
                state.restore()  # the RNG and buffers this chunk's forward pass saw
                g_leaves, tangents, g_spec = push_tangent(
                    CALL, meta.G, [zi[c] for zi in zs], [g[c] for g in cotangents], strategy=meta.strategy,
                    cotangent=f_cotangent(CALL, meta.f, y_leaves, meta.y_spec), compile=meta.compile, snapshot=state,
                )
                grads = contract_f_with_tangent(
                    CALL, meta.f, y_leaves, meta.y_spec, g_leaves, tangents, g_spec, create_graph=False
                )
                totals = grads if totals is None else [t + g for t, g in zip(totals, grads)]
        assert totals is not None  # there is at least one chunk
        needs = ctx.needs_input_grad[1 + meta.n_z :]
        return (None,) + (None,) * meta.n_z + tuple(t if n else None for t, n in zip(totals, needs))


def _record(meta, tensors):
    """The versions of G's parameters, its buffers that no snapshot copied, and z and y, after the forward pass."""
    meta.versions = Versions(CALL, meta.G, meta.states, list(zip(meta.labels, tensors)),
                             after="the call that saved this backward pass",
                             fix="Call input_grad again after the change and backpropagate through the new result.")
