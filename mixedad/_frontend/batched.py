r"""Many tangents at once: one forward pass of G with a batch of k tangents, on the per-op rules.

.. math::

    (g, \dot g_1, \ldots, \dot g_k) = \big(G(z),\ J_G(z)\, v_1, \ldots, J_G(z)\, v_k\big)

``mixed_jacobian`` and ``torch.func.vmap`` over ``mixed_grad`` push their tangents here. The pass
is torch.func's ``jvp`` inside a ``vmap`` over the tangents only
(:class:`mixedad._hooks.functorch.TangentBatch`): the primal is computed once, and each op's
tangent for the whole batch at once. The op rules (:mod:`mixedad.op_rules`) stay on, as in a
pass with one tangent:

- frozen layers and attention take the batch as a leading dimension of plain tensors (a
  convolution of k tangents is one call with k times the batch; attention's probabilities are
  computed once per block for all k, and the block budget is shared by them);
- the local double-VJP rule and custom Functions (with or without ``jvp``, with or without
  ``setup_context``) run once, outside torch.func, and differentiate their backward once per
  tangent;
- written formulas, users' rules and PyTorch's formulas run on torch.func's batched tensors.

Memory: one forward pass holding the primal and k tangents, flat in G's depth. Grad mode is read
at each op, as in a pass with one tangent.

What a batch cannot take raises :class:`~mixedad.op_rules.UnderTransformError` (its callers then
push one tangent per pass, with every rule and fallback): G needing the whole-G fallback (gradient
hooks, ``torch.autograd.grad`` inside G, a backward that is not linear), G updating a buffer in
place, attention with dropout, threads started by G, or a primal that depends on a transform
outside mixedad's (G closing over a tensor that a user's vmap batches).
"""
import functools
import torch

from mixedad._ground.nesting import one_pass
from mixedad._programs.cache import push_compiled
from mixedad._ground import random_state
from mixedad._ground.state import Snapshot, torch_layers_only
from mixedad._ground.inputs import PassInputs
from mixedad._frontend.restarts import run_restarting
from mixedad._frontend.tangents import _HOOKED, _THREADS, _tensors_only
from mixedad._ground.forward_pass import forward_pass
from mixedad._hooks.function_apply import routing
from mixedad._hooks.functorch import TangentBatch, batched_at, tangents_of_innermost_vmap
from mixedad._hooks.module_hooks import backward_hooks
from mixedad._hooks.threads import watching_threads
from mixedad.op_rules import OpRules, PathRecorder
from mixedad._ground.errors import NeedsWholeG, UnderTransformError

__all__ = ["push_tangents", "push_under_vmap"]


def push_tangents(call, G, zs, vs, *, recorder=None, compile=False):
    r"""Evaluate G at z and push a batch of tangents through it in one pass.

    Args:
        call: the public call's name, for messages.
        G: callable taking the tensors of ``zs`` positionally.
        zs: primal tensors (plain: not a torch.func transform's).
        vs: one tensor per primal, each of shape ``(k, *z.shape)``: the k tangents.
        recorder: None, or a :class:`mixedad.op_rules.PathRecorder`.
        compile: run the batch through G's compiled tangent program (``torch.vmap`` of it over the
            tangents; :mod:`mixedad._programs.cache`), checked against this pass on first use.

    Returns:
        ``(g_leaves, tangent_leaves, spec)``: G's flattened output, the tangents of each leaf with
        a leading dimension k (detached), and the pytree spec of G's output.

    Raises:
        UnderTransformError: the batch cannot be pushed in one pass (see the module docstring).
    """
    with one_pass(call):
        forward = functools.partial(_push_batch, call, G, zs, vs, recorder=recorder)
        if compile:
            return push_compiled(call, G, zs, vs, forward, batch=vs[0].shape[0])
        return forward()


def _push_batch(call, G, zs, vs, *, recorder=None):
    snapshot = Snapshot(G, call=call)
    if backward_hooks(snapshot.modules):
        raise UnderTransformError(f"{call}: {_HOOKED}")
    rules, inputs = OpRules(call, recorder, batch=TangentBatch()), PassInputs(zs, vs)

    def refuse(reason, at_cotangent=False):  # one pass per tangent takes G instead, with every fallback
        raise UnderTransformError(f"{call}: {reason}")

    return run_restarting(lambda: _forward(call, G, inputs, rules), snapshot, refuse, recorder=recorder,
                          inputs=inputs)


def _forward(call, G, inputs, rules):
    def refusal(reason):
        return UnderTransformError(f"{call}: {reason}")

    rules.inputs = inputs
    with forward_pass(rules):
        G_flat, spec = _tensors_only(call, G, refusal)
        with watching_threads() as threads:
            with rules, routing(rules):
                g, g_dot = rules.batch.push(G_flat, inputs.primals(), inputs.tangents())
            if not torch.is_grad_enabled():
                raise refusal("G leaves grad mode off when it returns")
        if threads:
            raise NeedsWholeG(_THREADS)
    return list(g), [t.detach() for t in g_dot], spec[0]


def push_under_vmap(call, G, zs, vs, *, recorder=None):
    """A user's ``torch.func.vmap`` over tangents only: the batch in one pass of mixedad's own.

    Returns ``(g_leaves, tangent_leaves, spec)`` with the tangents batched at the user's vmap, as
    a pass under it would give them, but computed with the op rules; or None where that cannot
    be (the vmap batches z too, G closes over a tensor it batches, G draws random numbers, or
    :func:`push_tangents` cannot take G), and the caller's pass under the transform goes on.
    """
    found = tangents_of_innermost_vmap(vs, zs)
    if found is None:
        return None
    level, batch = found
    rng, recorded = random_state.RandomState(G, host=not torch_layers_only(G)), PathRecorder()
    try:
        with random_state.watching(rng):
            g_leaves, tangents, spec = push_tangents(call, G, zs, batch, recorder=recorded)
    except UnderTransformError:
        return None
    if not rng.is_current():  # G draws random numbers: the user's vmap says how (randomness=...)
        rng.restore()
        return None
    if recorder is not None:
        for key, n in recorded.counts.items():
            recorder.counts[key] = recorder.counts.get(key, 0) + n
    return g_leaves, [batched_at(t, level) for t in tangents], spec
