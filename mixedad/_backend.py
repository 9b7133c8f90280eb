r"""Differentiating the cheap f twice: mixedad's reverse-mode back end.

Given :math:`g = G(z)` and the tangent :math:`\dot g = J_G(z)\, v` from the front end
(:mod:`mixedad._frontend.tangents`), the mixed derivative is

.. math::

    \partial_y \big\langle \nabla_g f(y, g),\ \dot g \big\rangle
    = \Big(\frac{\partial^2 f}{\partial g\, \partial y}\Big)^{\!\top} J_G(z)\, v

Only f's graph is built, never G's. Memory: f's graph and its gradient's graph, about a small
multiple of G's output.
"""
import contextlib

import torch
from torch.func import grad, jvp

from mixedad import _checks
from mixedad._ground.grad_mode import as_in_a_plain_call
from mixedad._ground.inputs import writable
from mixedad._ground import watch
from mixedad._ground.random_state import undone
from mixedad._entry import frozen
from mixedad._hooks.function_apply import routing
from mixedad.op_rules._custom_functions import CheckpointsRunDirectly
from mixedad.op_rules._attention import MathBackendWhereFusedDiffers
from mixedad._hooks.functorch import in_functorch_transform, is_wrapped, under_differentiating_transform
from mixedad._hooks.pytree import differentiable, graph_inputs, tree_flatten, tree_unflatten


def contract_f_with_tangent(call, f, y_leaves, y_spec, g_leaves, tangent_leaves, g_spec, *, create_graph,
                            batched=False):
    r"""Reverse-mode back end: :math:`\partial_y \langle \nabla_g f(y, g), \dot g\rangle`.

    Only f's (cheap) graph is ever built. Neither path touches the requires_grad flags of y, and
    both work under an outer ``torch.no_grad()``. Returns a list of tensors, one per leaf of y:
    zeros for leaves the result does not depend on.

    Outside torch.func transforms: ``torch.autograd.grad`` of f once with create_graph, then
    once more along :math:`\dot g`. Inside them (``torch.func.vmap`` over mixed_grad, say), where
    ``torch.autograd.grad`` cannot be batched: the directional derivative of f along
    :math:`\dot g` by ``torch.func.jvp`` and its gradient in y by ``torch.func.grad``.

    With ``batched`` (outside transforms only), each tangent leaf carries a leading dimension k
    (a batch of tangents): f's gradient is built once and differentiated once per tangent, and
    each result has that leading dimension.
    """
    if in_functorch_transform():
        return _contract_functorch(call, f, y_leaves, y_spec, g_leaves, tangent_leaves, g_spec, create_graph)
    with torch.enable_grad():
        y_work = _checks.y_aliases(y_leaves)
        g_in, g_work, index = graph_inputs(g_leaves)
        try:  # y_work are leaves or views of leaves that require grad: autograd refuses a write into them
            out = f(tree_unflatten(y_work, y_spec), tree_unflatten(g_in, g_spec))
        except RuntimeError:
            _refuse_writes_into_y(call, f, y_work, y_spec, g_in, g_spec)  # in mixedad's words, if that was it
            raise
        _checks.check_scalar_output(call, out)
        out = out.reshape(())
        df_dg = (torch.autograd.grad(out, g_work, create_graph=True, allow_unused=True)
                 if out.requires_grad and g_work else [])
        tangents = [tangent_leaves[i] for i in index]
        pairs = [(d, t) for d, t in zip(df_dg, tangents) if d is not None and d.requires_grad]
        if batched:
            size = tangent_leaves[0].shape[0]
            rows = [_along([d for d, _ in pairs], y_work, [t[i] for _, t in pairs], create_graph, i + 1 < size)
                    for i in range(size)]
            return [torch.stack([row[j] for row in rows]) for j in range(len(y_leaves))]
        return _along([d for d, _ in pairs], y_work, [t for _, t in pairs], create_graph, False)


def evaluate_f(call, f, y_leaves, y_tree, g_tree, refused=None):
    """``f(y_tree, g_tree)``, refused before f writes into the caller's y in place (``y.add_(1)``).

    The leaves of ``y_tree`` view ``y_leaves``, the caller's: mixedad writes nothing the caller passed, and a
    derivative in y cannot go through a write into y (double backward refuses there too). ``refused``: a list the
    refusal is appended to before it is raised.
    """
    def refuse(op):
        error = ValueError(f"{call}: f writes y in place ({op}), where its derivative in y cannot go through, and "
                           f"which would change the caller's y; clone it inside f first (y = y.clone()).")
        if refused is not None:
            refused.append(error)
        raise error

    watch.handed(y_tree, g_tree)
    with watch.observing("guards", watch.WriteGuard([t for t in y_leaves if not is_wrapped(t)], refuse)):
        return f(y_tree, g_tree)


def _refuse_writes_into_y(call, f, y_work, y_spec, g_in, g_spec):
    """After f failed on y's leaves (which autograd does not let it write): f once more on copies, under the guard of
    :func:`evaluate_f`, so that a write into y is refused in mixedad's words; any other failure is left to the caller."""
    copies, refused = [t.detach().clone() for t in y_work], []
    g_tree = tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in g_in], g_spec)
    try:
        with undone(), torch.no_grad():
            evaluate_f(call, f, copies, tree_unflatten(copies, y_spec), g_tree, refused)
    except Exception as error:  # noqa: BLE001 - only the guard's refusal is ours to raise
        if refused and error is refused[0]:
            raise


def _along(df_dg, y_work, tangents, create_graph, retain_graph):
    r""":math:`\partial_y \langle \nabla_g f, \dot g\rangle` from f's gradient ``df_dg`` (zeros where y is unused)."""
    grads = [None] * len(y_work)
    if df_dg:
        grads = torch.autograd.grad(df_dg, y_work, grad_outputs=tangents, create_graph=create_graph,
                                    retain_graph=retain_graph or create_graph, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, y_work)]


def _contract_functorch(call, f, y_leaves, y_spec, g_leaves, tangent_leaves, g_spec, create_graph):
    index = [i for i, leaf in enumerate(g_leaves) if differentiable(leaf)]
    g_primals, g_tangents = tuple(g_leaves[i] for i in index), tuple(tangent_leaves[i] for i in index)

    def directional(y_work):
        y_tree = tree_unflatten(list(y_work), y_spec)

        def f_of_g(*g_work):
            g_in = list(g_leaves)
            for i, g in zip(index, g_work):
                g_in[i] = g.clone()  # f may write into g
            out = f(y_tree, tree_unflatten(g_in, g_spec))
            _checks.check_scalar_output(call, out)
            return out.reshape(())

        return jvp(f_of_g, g_primals, g_tangents)[1]

    grads = grad(directional)(tuple(y_leaves))
    # torch.func.grad's result stays connected to the outer autograd graph of y's leaves. Cut
    # it unless create_graph asks for it, or an outer torch.func transform differentiates the
    # result (torch.func.grad / jvp / jacrev over mixed_grad): detach() would zero that.
    if create_graph or under_differentiating_transform():
        return list(grads)
    return [g.detach() for g in grads]


def f_cotangent(call, f, y_leaves, y_spec, *, create_graph=False):
    r"""Double backward's own cotangent at G's output, for the whole-G fallback.

    .. math::

        u^* = \nabla_g f(y, g)

    Returns ``cotangent(g_leaves, g_spec)``, a list with one tensor per leaf of g (no graph).
    Where G's backward is not linear in its incoming gradient (a gradient hook, a custom
    Function that clips or normalises its gradient), the whole-G fallback differentiates it at
    this u to give exactly what double backward gives. f is evaluated once more; the random
    state is restored afterwards. With ``create_graph`` the result would also depend on y
    through :math:`u^*`, which mixedad does not track: that raises.
    """

    def cotangent(g_leaves, g_spec):
        if create_graph:
            raise RuntimeError(
                f"{call}: G's backward is not linear in its incoming gradient (a gradient hook, or a "
                f"custom Function that clips or normalises its gradient), so its derivative depends on "
                f"y through f's gradient, and create_graph=True would miss that part. Use "
                f"create_graph=False, or mixedad.reference.double_backward_mixed_grad."
            )
        with undone(), torch.enable_grad():
            g_in, g_work, index = graph_inputs(g_leaves)
            y_tree = tree_unflatten([leaf.detach() for leaf in y_leaves], y_spec)
            out = evaluate_f(call, f, y_leaves, y_tree, tree_unflatten(g_in, g_spec))
            _checks.check_scalar_output(call, out)
            out = out.reshape(())
            grads = (torch.autograd.grad(out, g_work, allow_unused=True) if out.requires_grad and g_work
                     else [None] * len(g_work))
        result = [None] * len(g_leaves)
        for i, g, w in zip(index, grads, g_work):
            result[i] = torch.zeros_like(w) if g is None else g
        return result

    return cotangent


# input_grad's reverse pass: the gradient in z of one chunk, and the check that f sums over codes.


def gradient_chunk(call, f, G, z_chunks, y_leaves, y_spec, *, watch_G=True):
    """∂f(y, G(*z_chunks))/∂z_chunks by one reverse pass through G, with y treated as constant.

    G and f run under the watch of :mod:`mixedad._ground.watch` where observers are registered (G only with
    ``watch_G``: a G of torch.nn's own layers draws from no generator and reads nothing the caller must see)."""
    # The user's kernels (fused attention has a first-order backward), with attention dropout on
    # the math backend, which the backward's replay uses, and so masks whose rows see only keys
    # masked by large finite numbers (the fused backward is inexact there); reentrant checkpoints
    # run directly (they refuse .grad()).
    with torch.enable_grad(), MathBackendWhereFusedDiffers(), routing(CheckpointsRunDirectly()):
        z_work = [zc.detach().requires_grad_() for zc in z_chunks]
        with as_in_a_plain_call():  # and grad mode back on after G, even if G leaves it off
            try:
                with watch.ops() if watch_G else contextlib.nullcontext():
                    g_leaves, g_spec = tree_flatten(frozen(G)(*writable(z_work)))
            except RuntimeError as error:  # G refuses autograd (out= on a tensor that requires grad, ...)
                raise _refused_by_autograd(call, "G's forward", error) from error
        _checks.check_no_foreign_leaves(call, g_leaves, z_work, who="G")
        g_in, g_work, index = graph_inputs(g_leaves)
        y_work = [leaf.detach().requires_grad_() for leaf in y_leaves]
        try:  # leaves that require grad: autograd refuses a write into them
            watch.handed(y_work, g_in)
            with watch.ops():
                out = f(tree_unflatten(y_work, y_spec), tree_unflatten(g_in, g_spec))
        except RuntimeError:
            _refuse_writes_into_y(call, f, y_work, y_spec, g_in, g_spec)  # in mixedad's words, if that was it
            raise
        _checks.check_scalar_output(call, out)
        _checks.check_no_foreign_leaves(call, out, y_work + g_work)
        df_dg = (torch.autograd.grad(out.reshape(()), g_work, allow_unused=True) if out.requires_grad and g_work
                 else [None] * len(g_work))
        pairs = [(g_leaves[i], d) for i, d in zip(index, df_dg) if d is not None and g_leaves[i].requires_grad]
        grads = [None] * len(z_work)
        if pairs:
            try:
                grads = torch.autograd.grad(
                    [g for g, _ in pairs], z_work, grad_outputs=[d for _, d in pairs], allow_unused=True
                )
            except RuntimeError as error:  # G's own backward fails: double backward would fail there too
                raise _refused_by_autograd(call, "G's backward", error) from error
    pieces = [torch.zeros_like(zc) if d is None else d for d, zc in zip(grads, z_chunks)]
    return pieces, ([leaf.detach() if differentiable(leaf) else leaf for leaf in g_leaves], g_spec,
                    out.detach().reshape(()))


def _refused_by_autograd(call, what, error):
    """mixedad's error for a failure of G's reverse pass, which input_grad needs as double backward does."""
    text = str(error).strip()
    return RuntimeError(f"{call}: {what} raised {type(error).__name__}{': ' + text.splitlines()[0] if text else ''}. "
                        f"The gradient in z needs G's reverse pass, which double backward runs too.")


def check_sum_over_codes(call, f, y_leaves, y_spec, first, second):
    r"""Refuse an f that is not a sum over latent codes, which chunking would silently change.

    .. math::

        f\big(y, [g_1; g_2]\big) \overset{?}{=} f(y, g_1) + f(y, g_2)

    for the outputs of the first two chunks joined along dim 0. f is cheap; the random state
    is restored afterwards. Outputs that cannot be joined along dim 0 are not checked, nor is an f
    that draws random numbers (dropout in f): on the chunks joined it draws other numbers than on
    each, so the comparison says nothing.
    """
    (g1, spec, f1), (g2, _, f2) = first, second
    if any(not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[1:] != b.shape[1:] for a, b in zip(g1, g2)):
        return
    with undone() as sources, torch.no_grad():
        joined = evaluate_f(call, f, y_leaves, tree_unflatten([leaf.detach() for leaf in y_leaves], y_spec),
                            tree_unflatten([torch.cat([a, b]) for a, b in zip(g1, g2)], spec)).reshape(())
        if sources.drawn():
            return
    total = f1 + f2
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-5}.get(total.dtype, 1e-2)
    scale = max(f1.abs().item() + f2.abs().item(), torch.finfo(torch.float64).tiny)
    if not abs(joined.item() - total.item()) <= tolerance * scale:
        raise ValueError(
            f"{call}: f is not a sum over latent codes: on the first two chunks joined it gives "
            f"{joined.item():.6g}, but the two chunks apart sum to {total.item():.6g}. With chunk_size, "
            f"input_grad differentiates the sum over chunks of f, a different objective here (f "
            f"averages or couples codes, e.g. g.mean() or g - g.mean(0)). Use chunk_size=None, or "
            f"write f as a sum over codes (a mean over N codes: a sum divided by N)."
        )
