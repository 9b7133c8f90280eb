r"""The local rule: one op's tangent by two reverse passes through that op alone.

.. math::

    \dot y = J_{\mathrm{op}}\, \dot x = \partial_u \big\langle J_{\mathrm{op}}^\top u,\ \dot x \big\rangle

For an op that forward mode cannot take (no formula, a formula that raises, one known to be
wrong, or a custom ``autograd.Function`` without ``jvp``), the op runs once on the primals of
its inputs with grad enabled, and :func:`mixedad.op_rules._double_vjp.double_vjp` differentiates its
backward. The result goes on as a dual tensor, so the rest of G stays in forward mode.

Memory: the op's own graph (its saved tensors and its backward's graph), alive only while the
op runs; nothing accumulates across G's depth. Time: about one forward, one backward and one
double backward of that op. The op runs exactly once, so it draws the random numbers and
updates the buffers that its own call would.
"""
import contextlib
import threading

import torch
import torch.nn.functional as F

from mixedad._ground.writes import in_place_targets
from mixedad._hooks.dual_level import dual, unpack
from mixedad._hooks.function_apply import direct
from mixedad._hooks.pytree import tree_flatten, tree_unflatten
from mixedad.op_rules._double_vjp import double_vjp
from mixedad._ground.errors import NeedsWholeG, OpRuleError
from mixedad.op_rules._table import Path, Rule, defrule

#: Torch ops whose forward-AD formula in PyTorch is known to be silently wrong: they take the
#: local rule although forward AD "works". name: (upstream issue, what goes wrong). The umbrella
#: issue is pytorch#198017. Checked and found consistent, so not listed: ``hardsigmoid``, whose
#: float64 derivative is float32(1/6) (3e-8 off) in forward and reverse mode alike; mixedad
#: follows reverse mode, which is the meaning.
KNOWN_WRONG = {
    "cholesky_inverse": ("pytorch#196682", "wrong tangent for a non-diagonal factor (relative error 0.45)"),
    "cholesky_solve": ("pytorch#196694", "wrong tangent for a batched factor with a broadcast right-hand side "
                                         "(relative error 113)"),
    "logcumsumexp": ("pytorch#196705", "wrong tangent for logits far apart (0.48 where 1.0 is right)"),
}

#: Torch ops whose forward-AD formula silently drops the tangent (the output comes back without
#: one although it depends on the input): ``scatter_reduce`` with ``reduce="prod"``.
DROPS_TANGENT = ("scatter_reduce",)

#: Torch ops with no forward-AD formula in PyTorch (torch 2.13), sent straight to the local rule
#: instead of being found by a failed first attempt. ``torch.cdist`` has a written formula.
NO_FORMULA = ("cholesky", "ormqr", "index_reduce", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d")


def _writes_first(func, leaves, spec):
    """Whether the op writes in place into its first argument (``x.mul_(2)``, ``F.leaky_relu(x, inplace=True)``)."""
    args, kwargs = tree_unflatten(leaves, spec)
    return any(t is leaves[0] for t in in_place_targets(func, args, kwargs))


def local_jvp(call, name, func, args, kwargs, *, custom=False, batch=None, before_write=None):
    """Run ``func(*args, **kwargs)`` with the local rule; NotImplemented if no input has a tangent.

    Args:
        call: the public call's name, for messages.
        name: the op's name, for messages.
        func: the op (a torch function, or a custom Function's ``apply`` bound to its class).
        args, kwargs: as the op was called, possibly holding dual tensors (nested in lists,
            tuples and dicts too).
        custom: keyword-only; True for a custom Function. Its inputs are then handed over as
            non-leaf copies, since it may write into them (``ctx.mark_dirty``); an output that
            is one of those copies is written back into the caller's tensor, tangent included.
        batch: keyword-only; the :class:`~mixedad._hooks.functorch.TangentBatch` of a batched
            pass, or None. The op then runs once, outside torch.func, on plain primals, and its
            backward is differentiated once per tangent of the batch.
        before_write: keyword-only; None, or ``before_write(tensors)``, called with the caller's
            tensors an op's in-place writes are about to be written back into (it may raise).

    Returns:
        The op's result with the same structure; every floating-point output that depends on
        an input with a tangent is a dual tensor.
    """
    leaves, spec = tree_flatten((args, kwargs))
    work, diff, tangents = list(leaves), [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            primal, tangent = unpack(leaf) if leaf.layout == torch.strided else (leaf, None)
            if batch is not None:
                primal = batch.lower_primal(primal)
                tangent = None if tangent is None else batch.lower_tangent(tangent, primal)
            work[i] = primal
            if tangent is not None:
                diff.append(i)
                tangents.append(tangent)
    if not diff:
        return NotImplemented
    with contextlib.nullcontext() if batch is None else batch.plain():
        work = [t.detach() if isinstance(t, torch.Tensor) else t for t in work]
        result, out_spec, written = _run_and_differentiate(call, name, func, leaves, spec, work, diff, tangents,
                                                           custom, batched=batch is not None)
    attach = dual if batch is None else batch.lift
    result = [attach(o, t) if t is not None else o for o, t in result]
    if written and before_write is not None:
        before_write([leaves[i] for i in written.values()])
    for j, i in written.items():
        leaves[i].copy_(result[j])  # forward AD carries the tangent into the caller's tensor
        result[j] = leaves[i]
    return tree_unflatten(result, out_spec)


def _run_and_differentiate(call, name, func, leaves, spec, work, diff, tangents, custom, batched):
    """The op on the primals with grad on, and its outputs' tangents: ``([(output, tangent or None)], spec, written)``."""
    inplace = _writes_first(func, leaves, spec)
    with torch.enable_grad():
        inputs = [work[i].requires_grad_() for i in diff]
        copied = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)] if custom else []
        if inplace and isinstance(leaves[0], torch.Tensor):
            copied = [0]  # the op writes into its first argument
        for i in copied:  # non-leaf copies to write into
            work[i] = work[i].clone()
        call_args, call_kwargs = tree_unflatten(work, spec)
        try:
            out = func(*call_args, **call_kwargs)
        except RuntimeError as error:  # the op itself refuses autograd (out= on inputs that require grad)
            text = str(error).strip()
            raise OpRuleError(f"{call}: {name} fails with grad enabled ({type(error).__name__}: "
                              f"{text.splitlines()[0] if text else ''}), so neither its forward-mode formula nor its "
                              f"backward gives its tangent; double backward fails there too.") from error
        if inplace and isinstance(leaves[0], torch.Tensor):
            out = work[0]
        out_leaves, out_spec = tree_flatten(out)
        # Outputs that are inputs written in place (ctx.mark_dirty, or an in-place torch op).
        written = {j: i for j, o in enumerate(out_leaves) for i in copied if o is work[i]}
        live = [j for j, o in enumerate(out_leaves)
                if isinstance(o, torch.Tensor) and o.requires_grad and (o.is_floating_point() or o.is_complex())]
        sparse = [out_leaves[j] for j in live if out_leaves[j].layout != torch.strided]
        if sparse:
            raise NeedsWholeG(f"{name} returns a {sparse[0].layout} tensor, which cannot carry a forward-mode "
                              f"tangent in PyTorch")
        out_tangents = double_vjp(call, name, [out_leaves[j] for j in live], inputs, tangents,
                                  batched=batched) if live else []
    result = [(o.detach() if isinstance(o, torch.Tensor) else o, None) for o in out_leaves]
    for j, t in zip(live, out_tangents):
        result[j] = (result[j][0], t)
    return result, out_spec, written


def local_rule(op):
    """The local rule as a tangent rule: the op's outputs come back carrying their tangents."""
    with direct():  # the op's own reverse passes see the Functions it runs as torch defines them
        value = local_jvp(op.call, op.name, op.func, op.args, op.kwargs, batch=op.batch)
    return NotImplemented if value is NotImplemented else (value, None)


def _torch_funcs(name):
    """The torch functions called ``name``: ``torch.name``, ``Tensor.name`` and ``Tensor.name_``."""
    found = [getattr(torch, name, None), getattr(torch.Tensor, name, None), getattr(torch.Tensor, name + "_", None)]
    return [f for f in found if f is not None]


for _name, (_issue, _what) in KNOWN_WRONG.items():
    defrule(Path.LOCAL, *_torch_funcs(_name), reason=f"known-wrong formula ({_issue})")(local_rule)
for _name in NO_FORMULA:
    defrule(Path.LOCAL, *_torch_funcs(_name), reason="no forward-AD formula")(local_rule)
for _name in DROPS_TANGENT:
    defrule(Path.LOCAL, *_torch_funcs(_name), reason="PyTorch's formula drops the tangent")(local_rule)
defrule(Path.LOCAL, F.grid_sample, reason="no forward-AD formula")(local_rule)

#: Torch functions whose PyTorch formula is silently wrong (a wrong tangent, or none where there
#: should be one): func -> what goes wrong. Under torch.func transforms other than mixedad's own
#: batch of tangents, where the rules step aside, they are refused rather than computed by that
#: formula.
SILENTLY_WRONG = {func: f"{issue}: {what}" for name, (issue, what) in KNOWN_WRONG.items() for func in _torch_funcs(name)}
SILENTLY_WRONG.update({func: "its formula drops the tangent" for name in DROPS_TANGENT for func in _torch_funcs(name)})

#: Ops of other namespaces than aten (``torch.library.custom_op``, torchvision's C++ ops): PyTorch
#: has no forward-AD rule for them and may drop their tangent silently, so they take the local rule,
#: which differentiates the backward they registered.
LIBRARY_OP_RULE = Rule(Path.LOCAL, local_rule, "library op: no forward-AD rule")


# Ops whose formula raised at run time: func -> {key: reason}. The key is, for an op without a
# formula (NotImplementedError), the dtypes and devices of its floating-point inputs; for any
# other failure, the input signature (dtypes, shapes, strides). Shared by every pass in the
# process, so each op and key costs one restarted pass at most. Failures are told apart by the
# exception's type, never by its text.
FAILED = {}
_FAILED_LOCK = threading.Lock()
_MAX_FAILED_SIGNATURES = 256


def _signature(args, kwargs):
    leaves, spec = tree_flatten((args, kwargs))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((leaf.dtype, leaf.device.type, tuple(leaf.shape),
                          tuple(leaf.stride()) if leaf.layout == torch.strided else None))
        else:
            try:
                hash(leaf)
                parts.append(leaf)
            except TypeError:
                parts.append(type(leaf).__name__)
    return (str(spec), tuple(parts))


def _kinds(args, kwargs):
    """The key of a "no formula" failure: the (dtype, device type) pairs of the op's floating inputs.

    PyTorch picks an op's kernel, and with it whether there is a formula, by dtype and device (a
    float32 LSTM on the CPU runs oneDNN's kernel, which has none; a float64 one does not).
    """
    kinds = {(leaf.dtype, leaf.device.type) for leaf in tree_flatten((args, kwargs))[0]
             if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())}
    return ("no formula", tuple(sorted(kinds, key=str)))


def remember_failure(func, args, kwargs, error):
    """Send ``func`` to the local rule from now on, for inputs like these."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if len(reason) > 120:
        reason = reason[:117] + "..."
    no_formula = isinstance(error, NotImplementedError)  # torch's "no forward-AD formula" type
    signature = _kinds(args, kwargs) if no_formula else _signature(args, kwargs)
    with _FAILED_LOCK:
        seen = FAILED.setdefault(func, {})
        if len(seen) < _MAX_FAILED_SIGNATURES:
            seen[signature] = f"forward-AD formula raised: {reason}"


def failed_rule(func, args, kwargs):
    """The local rule for ``func`` if its formula raised before on inputs like these, else None."""
    seen = FAILED[func]
    reason = seen.get(_kinds(args, kwargs)) or seen.get(_signature(args, kwargs))
    return None if reason is None else Rule(Path.LOCAL, local_rule, reason)


def forget_failures() -> None:
    """Clear the process-wide memory of ops whose forward-AD formula raised (for tests)."""
    with _FAILED_LOCK:
        FAILED.clear()
