r"""Pushing tangents forward through a frozen generator G.

mixedad's front end computes :math:`g = G(z)` and :math:`\dot g = J_G(z)\, v` together. Which
ops take which path:

- **forward** (the default): forward-mode AD under ``torch.no_grad()``. Outside torch.func
  transforms it uses ``torch.autograd.forward_ad`` (dual tensors), which also runs BatchNorm in
  train mode (its running statistics are updated once and never become dual); frozen linear,
  convolution and eval-mode batch-norm layers take the fast rules of
  :mod:`mixedad._frozen_layers` (two plain calls each; a float32 Linear tangent on the CPU runs
  on oneDNN). Inside
  ``torch.func.vmap`` and the other transforms it uses ``torch.func.jvp``, which vmap can batch.
  Memory: one forward pass holding primal and tangent, flat in G's depth. Attention runs through
  the math SDPA backend and the nn.MultiheadAttention / TransformerEncoderLayer fast path is
  switched off during the pass, because the fused kernels have no forward-AD formula.
- **reverse** (the fallback): the double-VJP trick. With u a zero cotangent, :math:`u \mapsto
  J_G^\top u` is linear, so :math:`J_G v = \partial_u \langle J_G^\top u, v\rangle` needs two
  reverse passes and no forward-mode formula, but keeps G's graph: memory grows with depth.
  ``strategy="auto"`` takes it, with a warning once per op, when an op in G has no forward-AD
  formula (a custom ``autograd.Function`` without ``jvp``, an ``out=`` kernel, ...) or when G
  returns an output without a tangent (G detaches its input, or a compiler dropped the tangent).

A ``torch.compile``'d G is replaced by its original eager module or function, with a warning:
compiled graphs do not carry forward-mode tangents reliably, and compiled dropout draws
different random numbers than eager replays would.
"""
import contextlib
import re
import warnings

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.func import functional_call, jvp, vjp

from mixedad._frozen_layers import FrozenLayerRules
from mixedad._transforms import in_functorch_transform
from mixedad._trees import describe, tree_flatten, tree_unflatten
from mixedad.state import Snapshot

STRATEGIES = ("auto", "forward", "reverse")

_UNSUPPORTED = [
    re.compile(r"Trying to use forward AD with (\S+) that does not support it"),
    re.compile(r"(custom autograd\.Function)"),  # "You must implement the jvp function for custom ..."
    re.compile(r"autograd\.Function with (functorch) transforms"),  # needs setup_context for torch.func
]
_warned = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def unsupported_op(error):
    """The op named by a 'no forward-AD formula' error, or None for any other error."""
    for pattern in _UNSUPPORTED:
        match = pattern.search(str(error))
        if match:
            name = match.group(1)
            return "a custom autograd.Function without a jvp staticmethod" if "autograd" in name or name == "functorch" else name
    return None


def eager(G):
    """G itself, or the original eager module/function behind a ``torch.compile`` wrapper."""
    orig = getattr(G, "_orig_mod", None) if isinstance(G, nn.Module) else getattr(G, "_torchdynamo_orig_callable", None)
    if orig is None:
        return G
    _warn_once(("compiled", id(orig)),
               "mixedad: G is compiled with torch.compile; mixedad runs its original eager module or "
               "function instead, because compiled graphs do not carry forward-mode tangents reliably.")
    return orig


def frozen(G):
    """G as a callable whose parameters are constants for autograd.

    For an ``nn.Module``, the call goes through ``torch.func.functional_call`` with detached
    parameters: autograd then neither records G's parameters nor keeps the activations their
    gradients would need, and the module's requires_grad flags are never touched. Other
    callables are returned as they are.
    """
    if not isinstance(G, nn.Module):
        return G

    def call(*args):
        params = {name: p.detach() for name, p in G.named_parameters()}
        return functional_call(G, params, args)

    return call


@contextlib.contextmanager
def differentiable_attention():
    """Attention kernels with every derivative: math SDPA, and no MHA / encoder-layer fast path.

    The fused kernels (flash and memory-efficient SDPA, the fused TransformerEncoderLayer) have
    neither forward-AD formulas nor double-backward formulas. Restores the global fast-path
    flag on exit.
    """
    with contextlib.ExitStack() as stack:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        except ImportError:  # torch < 2.3
            stack.enter_context(torch.backends.cuda.sdp_kernel(
                enable_flash=False, enable_math=True, enable_mem_efficient=False))
        mha = getattr(torch.backends, "mha", None)
        if mha is not None and hasattr(mha, "get_fastpath_enabled"):
            previous = mha.get_fastpath_enabled()
            mha.set_fastpath_enabled(False)
            stack.callback(mha.set_fastpath_enabled, previous)
        yield


def _check_outputs(call, g_leaves):
    for i, leaf in enumerate(g_leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            where = "G(z)" if len(g_leaves) == 1 else f"G(z)'s leaf {i}"
            raise TypeError(f"{call}: expected {where} to be a floating-point tensor, got {describe(leaf)}.")


def _forward(call, G, zs, vs, fast_rules=True):
    """Forward-mode pass. Returns (primal leaves, tangent leaves or None where lost, spec).

    ``fast_rules`` turns on :mod:`mixedad._frozen_layers` (two plain calls per frozen linear,
    convolution or eval-mode batch-norm layer instead of PyTorch's general forward-AD formula).
    """
    if in_functorch_transform():
        try:
            with torch.no_grad(), differentiable_attention():
                g, g_dot = jvp(G, tuple(z.detach() for z in zs), tuple(v.detach() for v in vs))
        except RuntimeError as error:
            if "mutate a captured Tensor" in str(error):
                raise RuntimeError(
                    f"{call}: G updates a buffer in place (BatchNorm in train mode updates its running "
                    f"statistics), which torch.func transforms such as vmap cannot do. Call G.eval(), "
                    f"or loop over mixed_grad instead of vmapping it."
                ) from error
            raise
        g_leaves, spec = tree_flatten(g)
        _check_outputs(call, g_leaves)
        return g_leaves, tree_flatten(g_dot)[0], spec
    rules = FrozenLayerRules() if fast_rules else contextlib.nullcontext()
    with torch.no_grad(), differentiable_attention(), forward_ad.dual_level():
        duals = [forward_ad.make_dual(z.detach(), v.detach()) for z, v in zip(zs, vs)]
        with rules:
            out = G(*duals)
        out_leaves, spec = tree_flatten(out)
        _check_outputs(call, out_leaves)
        unpacked = [forward_ad.unpack_dual(leaf) for leaf in out_leaves]
    return [u.primal for u in unpacked], [u.tangent for u in unpacked], spec


def _reverse(call, G, zs, vs):
    """Double-VJP pass: J v = d/du <J^T u, v> at u = 0. Keeps G's graph (memory grows with depth)."""
    if in_functorch_transform():
        out, pullback = vjp(lambda *z: G(*z), *zs)
        g_leaves, spec = tree_flatten(out)
        _check_outputs(call, g_leaves)
        zeros = tree_unflatten([torch.zeros_like(leaf) for leaf in g_leaves], spec)
        _, pullback_of_pullback = vjp(pullback, zeros)
        (g_dot,) = pullback_of_pullback(tuple(vs))
        return [leaf.detach() for leaf in g_leaves], tree_flatten(g_dot)[0], spec
    with torch.enable_grad(), differentiable_attention():
        z_work = [z.detach().requires_grad_() for z in zs]
        g_leaves, spec = tree_flatten(frozen(G)(*z_work))
        _check_outputs(call, g_leaves)
        live = [i for i, leaf in enumerate(g_leaves) if leaf.requires_grad]
        us = [torch.zeros_like(g_leaves[i], requires_grad=True) for i in live]
        tangents = [torch.zeros_like(leaf) for leaf in g_leaves]
        if live:
            pulled = torch.autograd.grad([g_leaves[i] for i in live], z_work, grad_outputs=us,
                                         create_graph=True, allow_unused=True)
            pairs = [(p, v) for p, v in zip(pulled, vs) if p is not None and p.requires_grad]
            if pairs:
                jv = torch.autograd.grad([p for p, _ in pairs], us, grad_outputs=[v for _, v in pairs],
                                         allow_unused=True)
                for i, t in zip(live, jv):
                    if t is not None:
                        tangents[i] = t
    return [leaf.detach() for leaf in g_leaves], tangents, spec


def push_tangent(call, G, zs, vs, *, strategy="auto"):
    r"""Evaluate G at z and push the tangent v through it.

    .. math::

        g = G(z_1, \ldots, z_k), \qquad \dot g = \sum_i \partial_{z_i} G\; v_i

    Args:
        call: the public call's name, for messages.
        G: callable taking the tensors of ``zs`` positionally.
        zs, vs: sequences of primal tensors and matching tangents.
        strategy: "auto", "forward" or "reverse" (see the module docstring).

    Returns:
        ``(g_leaves, tangent_leaves, spec)``: G's flattened output, the matching tangents
        (detached, no graph), and the pytree spec of G's output.
    """
    if strategy == "reverse":
        return _reverse(call, G, zs, vs)
    if forward_ad._current_level >= 0 and not in_functorch_transform():
        # PyTorch has one forward-AD level: inside the caller's own dual_level() neither dual
        # tensors nor torch.func.jvp can open another.
        if strategy == "forward":
            raise RuntimeError(
                f"{call}: called inside an open torch.autograd.forward_ad.dual_level(), and PyTorch "
                f"cannot nest forward-mode AD, so strategy='forward' cannot run. Call mixedad outside "
                f"the dual level, or use strategy='auto' or 'reverse' (two reverse passes; memory grows "
                f"with G's depth)."
            )
        _warn_once(("nested",),
                   "mixedad: called inside an open forward_ad.dual_level(); PyTorch cannot nest forward-mode "
                   "AD, so tangents are pushed through G with two reverse passes instead (the double-VJP "
                   "trick). Memory now grows with G's depth.")
        return _reverse(call, G, zs, vs)
    snapshot = Snapshot(G) if strategy == "auto" else None
    try:
        with snapshot.watching() if snapshot is not None else contextlib.nullcontext():
            g_leaves, tangents, spec = _forward(call, G, zs, vs)
    except (RuntimeError, NotImplementedError) as error:
        op = unsupported_op(error)
        if op is None:
            raise
        if strategy == "forward":
            raise RuntimeError(
                f"{call}: G uses {op}, which has no forward-mode AD formula, and strategy='forward' "
                f"forbids the fallback. Use strategy='auto' (double-VJP fallback, memory grows with G's "
                f"depth), or give the op a forward-AD formula."
            ) from error
        snapshot.restore()
        _warn_once(("op", op),
                   f"mixedad: {op} has no forward-mode AD formula; pushing tangents through G with two "
                   f"reverse passes instead (the double-VJP trick). Memory now grows with G's depth.")
        return _reverse(call, G, zs, vs)
    lost = [i for i, t in enumerate(tangents) if t is None]
    if not lost:
        return g_leaves, tangents, spec
    where = "G(z)" if len(tangents) == 1 else f"G(z)'s leaves {lost}"
    if strategy == "forward":
        raise RuntimeError(
            f"{call}: {where} came back without a forward-mode tangent: G does not depend on z there, "
            f"or it drops tangents (detach(), a compiled graph, a custom op). strategy='forward' "
            f"cannot tell which; use strategy='auto' or 'reverse'."
        )
    snapshot.restore()
    g_leaves, tangents, spec = _reverse(call, G, zs, vs)
    if any(tangents[i].ne(0).any() for i in lost):
        _warn_once(("lost", id(G)),
                   f"mixedad: {where} lost its forward-mode tangent although it depends on z (detach() "
                   f"inside G, a compiled graph, or a custom op?); computed it with two reverse passes "
                   f"instead. Memory now grows with G's depth.")
    return g_leaves, tangents, spec
