"""Where a call stands relative to torch.func transforms (vmap, grad, jvp, ...).

What this relies on in torch (pinned by ``tests/_hooks/test_functorch.py``):

- ``torch._C._functorch.maybe_current_level()`` is None outside every transform, and the
  innermost transform's level inside;
- ``torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()`` lists the transforms
  in force, each with ``key()`` a ``torch._C._functorch.TransformType``;
- ``torch._C._functorch.is_functorch_wrapped_tensor(t)`` tells the transforms' tensors (batched
  or dual) from tensors captured from outside (a module's buffers).
"""
import torch


def current_level():
    """The innermost torch.func transform's level, or None outside every transform."""
    return torch._C._functorch.maybe_current_level()


def in_functorch_transform():
    """True inside torch.func.vmap, grad, jvp, ... (where dual tensors cannot be used)."""
    return current_level() is not None


def is_wrapped(t):
    """Whether ``t`` is a transform's tensor (batched or dual), not one captured from outside."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def under_differentiating_transform():
    """True inside torch.func.grad, vjp, jacrev, jvp, jacfwd, ... (a transform that differentiates).

    Results computed there must keep the transform's tracking: ``detach()`` would cut it and
    the outer derivative would be silently zero.
    """
    if not in_functorch_transform():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() in (TransformType.Grad, TransformType.Jvp) for i in retrieve_all_functorch_interpreters())


def under_vmap():
    """True inside torch.func.vmap (at any level)."""
    if not in_functorch_transform():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


class NotLowerable(Exception):
    """A value of a batched pass that :class:`TangentBatch` cannot take apart (see ``lower_primal``)."""


class TangentBatch:
    r"""mixedad's own batch of tangents: ``vmap`` over k tangents with a ``jvp`` inside it.

    .. math::

        (g, \dot g_1, \ldots, \dot g_k) = (G(z),\ J_G v_1, \ldots, J_G v_k)

    The primal is computed once: inside the vmap only the tangents are batched. The op rules see
    the jvp's tensors and run on them as on any tensor (torch.func batches their tangent
    arithmetic); a rule that needs plain autograd (the local double-VJP rule, a custom Function)
    *lowers* its arguments to plain tensors and a tangent with a leading dimension k, computes
    outside every transform (:meth:`plain`), and *lifts* the result back (:meth:`lift`). Every op
    on lowered tensors must run inside :meth:`plain`: under the transforms its result would be
    wrapped again.

    What this relies on in torch (pinned by ``tests/_hooks/test_functorch.py``):

    - ``torch.func.jvp`` inside ``torch.func.vmap`` over the tangents only keeps the primal
      unbatched, and its dual tensors unpack (``torch._unpack_dual``) inside the function into a
      tensor wrapped at the jvp's level and a tangent batched at the vmap's level;
    - ``torch._C._functorch._unwrap_for_grad(t, level)`` takes a tensor out of the jvp's wrapper,
      ``_unwrap_batched(t, level)`` gives a batched tensor's plain tensor and batch dimension, and
      ``_add_batch_dim(t, dim, level)`` makes a plain tensor batched at a vmap level;
    - ``torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack()`` runs a block outside
      every transform (plain autograd works there), restoring the stack after it;
    - ``torch._VF._make_dual(primal, tangent)`` at the jvp's level, with a plain primal and a
      tangent batched at the vmap's level, is a dual tensor of that jvp.
    """

    def __init__(self) -> None:
        self.vmap_level = self.jvp_level = None
        self.size = 0

    def push(self, fn, primals, tangents, *, randomness="same"):
        """``(fn(*primals), the tangents of its outputs, each with a leading dimension k)``.

        ``fn`` returns a tuple of tensors; ``tangents`` hold one tensor per primal, each with a
        leading dimension k (the same k for all).
        """
        self.size = tangents[0].shape[0]

        def per_tangent(*vs):
            self.vmap_level = current_level()

            def inner(*xs):
                self.jvp_level = current_level()
                return fn(*xs)

            out, out_tangents = torch.func.jvp(inner, tuple(primals), vs)
            if any(is_wrapped(t) for t in out):
                raise NotLowerable("G's output depends on a torch.func transform outside mixedad's pass")
            return out, out_tangents

        try:
            out, out_tangents = torch.func.vmap(per_tangent, out_dims=(None, 0), randomness=randomness)(*tangents)
        finally:
            self.vmap_level = self.jvp_level = None
        if any(is_wrapped(t) for t in out_tangents):
            raise NotLowerable("G's output depends on a torch.func transform outside mixedad's pass")
        return out, out_tangents

    def active(self) -> bool:
        """Whether the innermost transform is this batch's jvp (not one G runs inside itself)."""
        return self.jvp_level is not None and current_level() == self.jvp_level

    def lower_primal(self, primal):
        """The plain tensor behind a primal of the batched pass (a parameter passes as it is).

        Raises NotLowerable for a primal that differs across the batch or comes from an outer
        transform (G closing over a tensor a user's vmap batches): that pass cannot be lowered.
        """
        plain = torch._C._functorch._unwrap_for_grad(primal, self.jvp_level)
        if is_wrapped(plain):
            raise NotLowerable("a primal of G depends on a torch.func transform outside mixedad's pass")
        return plain

    def lower_tangent(self, tangent, like):
        """The plain tangents behind ``tangent``: one tensor with a leading dimension k."""
        inner = torch._C._functorch._unwrap_for_grad(tangent, self.jvp_level)
        dim = None
        if torch._C._functorch.is_batchedtensor(inner):
            inner, dim = torch._C._functorch._unwrap_batched(inner, self.vmap_level)
        if is_wrapped(inner):
            raise NotLowerable("a tangent of G depends on a torch.func transform outside mixedad's pass")
        with self.plain():  # an op under the transforms would wrap its plain result again
            # bdim None: the same tangent for every member of the batch
            return inner.movedim(dim, 0) if dim is not None else inner.expand(self.size, *like.shape)

    def lift(self, primal, tangents):
        """A dual tensor of the batch's jvp: ``primal`` (plain) with the k ``tangents`` (leading dim)."""
        batched = torch._C._functorch._add_batch_dim(tangents, 0, self.vmap_level)
        return torch._VF._make_dual(primal, batched, level=torch.autograd.forward_ad._current_level)

    @staticmethod
    def plain():
        """A block that runs outside every torch.func transform (plain tensors, plain autograd)."""
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

        return temporarily_clear_interpreter_stack()


def tangents_of_innermost_vmap(tangents, constants):
    """A user's ``vmap`` over a batch of tangents only: ``(level, plain tangents)``, or None.

    ``(level, [t with a leading dimension k])`` when the innermost transform is a vmap, every
    tensor in ``tangents`` is batched at it (or not batched at all; then repeated), at least one
    is, and no tensor in ``constants`` (the primals) is a transform's. Then mixedad can push the
    whole batch through G in one :class:`TangentBatch` of its own and hand back tangents batched
    at ``level`` (:func:`batched_at`). Else None.
    """
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    if not in_functorch_transform() or any(is_wrapped(t) for t in constants):
        return None
    interpreter = retrieve_current_functorch_interpreter()
    if interpreter.key() != TransformType.Vmap:
        return None
    level, size = interpreter.level(), interpreter.batch_size()
    unwrapped = []
    for t in tangents:
        dim = None
        if torch._C._functorch.is_batchedtensor(t) and torch._C._functorch.maybe_get_level(t) == level:
            t, dim = torch._C._functorch._unwrap_batched(t, level)
        if is_wrapped(t):
            return None
        unwrapped.append((t, dim))
    if all(dim is None for _, dim in unwrapped):
        return None
    with TangentBatch.plain():
        return level, [t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape) for t, dim in unwrapped]


def batched_at(tensor, level):
    """A plain tensor with a leading batch dimension as a tensor batched at the vmap ``level``."""
    return torch._C._functorch._add_batch_dim(tensor, 0, level)


def plain_example(tensor):
    """A plain tensor with ``tensor``'s logical shape and values: under every transform, the first example of each batch.

    Unwraps the transforms' wrappers from the innermost out (``_unwrap_for_grad`` for grad and jvp
    levels, ``_unwrap_batched`` for vmap levels), then selects index 0 of each batch dimension,
    outermost first, outside every transform.
    """
    dims = []
    while is_wrapped(tensor):
        level = torch._C._functorch.maybe_get_level(tensor)
        if torch._C._functorch.is_batchedtensor(tensor):
            tensor, dim = torch._C._functorch._unwrap_batched(tensor, level)
            dims.append(dim)
        else:
            tensor = torch._C._functorch._unwrap_for_grad(tensor, level)
    with TangentBatch.plain():
        for dim in reversed(dims):
            if dim is not None:
                tensor = tensor.select(dim, 0)
        return tensor.detach()
