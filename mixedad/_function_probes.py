r"""Two checks on a custom ``autograd.Function`` class, made once, the first time a pass meets it.

Reverse mode is the meaning: a Function's ``backward`` says what its derivative is. mixedad
relies on two properties of it that a user's Function may lack:

- **A backward linear in its incoming gradient.** The double-VJP trick (the local rule and the
  whole-G fallback) evaluates :math:`u \mapsto B(u)` at any u. Gradient clipping
  (``g.clamp(-c, c)``) and gradient normalisation (``g / g.norm()``) are not linear, and then
  only the cotangent that double backward itself feeds in, :math:`u^* = \nabla_g f(y, g)`, gives
  its answer. Probe: :math:`B(a u_1 + b u_2) = a B(u_1) + b B(u_2)` for random :math:`u_1` (unit
  scale) and :math:`u_2` (scale 1000), a = 0.5, b = -2.
- **A jvp that agrees with the backward.** Forward AD would trust a wrong ``jvp``. Probe, the
  dot-product test on random t and u:

  .. math::

      \langle \mathrm{jvp}(t), u \rangle = \langle t, B(u) \rangle

The probes run the Function once more on copies of its inputs (its in-place writes go to the
copies), with the random state restored afterwards, and draw their random vectors from a private
generator: the user's RNG is untouched. They cost one forward, three backwards and, for a
Function with ``jvp``, one jvp of that op, once per class. A probe cannot prove linearity: a
clipping threshold far beyond both scales passes it. On meta and fake tensors, which hold no
values, nothing is probed (the class is probed on the first call with real tensors).
"""
import threading
import weakref
from typing import NamedTuple

import torch
from torch.autograd import forward_ad

from mixedad._duals import dual, unpack
from mixedad._trees import tree_flatten, tree_unflatten
from mixedad.state import RngState

#: Relative tolerance of both probes, by dtype (round-off of a few sums of products).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_A, _B, _SCALE_2 = 0.5, -2.0, 1e3


class Verdict(NamedTuple):
    """What the probes found for one Function class.

    ``linear``: the backward passed the linearity probe (True where it could not be probed).
    ``jvp_agrees``: the class's own jvp passed the dot-product test (True without a jvp, or
    where it could not be probed). ``numbers``: the two sides of the test that failed, or None.
    ``jvp_tested``: whether the dot-product test ran (or could not run) for this verdict.
    """

    linear: bool
    jvp_agrees: bool
    numbers: tuple = None
    jvp_tested: bool = True


_UNPROBED = Verdict(True, True)
_verdicts = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def forget():
    """Clear the remembered verdicts (for tests)."""
    with _lock:
        _verdicts.clear()


def verdict(cls, apply, args, kwargs, *, with_jvp):
    """The verdict for ``cls``, probing on these arguments the first time the class is seen.

    Args:
        cls: the Function class (the cache key).
        apply: ``apply(*args, **kwargs)`` runs the Function as torch defines it.
        args, kwargs: the call's arguments. In a forward-AD pass (``with_jvp`` given either
            way) the inputs probed are those carrying a tangent; in a reverse pass, those that
            require grad.
        with_jvp: also run the dot-product test (the class has its own jvp and mixedad's
            forward-AD level is open).
    """
    if not _has_data((args, kwargs)):
        return _UNPROBED  # meta or fake tensors: nothing to probe with, and nothing remembered
    with _lock:
        found = _verdicts.get(cls)
    if found is None or (with_jvp and not found.jvp_tested):
        found = _probe(apply, args, kwargs, with_jvp)
        with _lock:
            _verdicts[cls] = found
    return found


def _has_data(tree):
    """Whether the tensors in ``tree`` hold values (not meta tensors, not fake tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(isinstance(t, torch.Tensor) and (t.device.type == "meta" or is_fake(t))
                   for t in tree_flatten(tree)[0])


def _carries_derivative(leaf):
    """Whether an input takes part in the derivative: a tangent at mixedad's level, or requires_grad."""
    if forward_ad._current_level >= 0:
        return unpack(leaf)[1] is not None
    return leaf.requires_grad


def _tolerance(dtype):
    return TOLERANCE.get(dtype, 1e-2)


def _close(lhs, rhs, scale, dtype):
    return abs(lhs - rhs) <= _tolerance(dtype) * scale + torch.finfo(dtype).tiny


def _probe(apply, args, kwargs, with_jvp):
    leaves, spec = tree_flatten((args, kwargs))
    work, bases, positions = list(leaves), [], []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
            continue
        primal = unpack(leaf)[0] if forward_ad._current_level >= 0 else leaf
        if _carries_derivative(leaf) and primal.is_floating_point():
            base = primal.detach().requires_grad_()
            bases.append(base)
            positions.append(i)
            work[i] = base.clone()  # a non-leaf copy: the Function may write into it (mark_dirty)
        else:
            work[i] = primal.detach().clone()
    if not bases:
        return _UNPROBED
    rng = RngState()
    try:
        with torch.enable_grad():
            call_args, call_kwargs = tree_unflatten(work, spec)
            out_leaves = tree_flatten(apply(*call_args, **call_kwargs))[0]
    except Exception:  # noqa: BLE001 - the real call will raise it again, with its own context
        return _UNPROBED
    finally:
        rng.restore()
    live = [j for j, o in enumerate(out_leaves)
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
    if not live:
        return _UNPROBED
    outs = [out_leaves[j] for j in live]
    dtype = outs[0].dtype
    generator = torch.Generator(device=outs[0].device).manual_seed(0)

    def rand(like, scale=1.0):
        return torch.randn(like.shape, generator=generator, dtype=like.dtype, device=like.device) * scale

    def backward(us):
        grads = torch.autograd.grad(outs, bases, us, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(b) if g is None else g for g, b in zip(grads, bases)]

    u1, u2 = [rand(o) for o in outs], [rand(o, _SCALE_2) for o in outs]
    try:
        b1, b2 = backward(u1), backward(u2)
        mixed = backward([_A * p + _B * q for p, q in zip(u1, u2)])
    except RuntimeError:
        return _UNPROBED  # the backward itself fails: the rules that need it will say so
    for m, p, q in zip(mixed, b1, b2):
        expected = _A * p + _B * q
        scale = (_A * p).abs().max().item() + (-_B * q).abs().max().item()
        if not _close(m.sub(expected).abs().max().item(), 0.0, scale, dtype):
            return Verdict(False, True)
    if not with_jvp:
        return Verdict(True, True, jvp_tested=False)
    return Verdict(True, *_dot_product_test(apply, leaves, spec, positions, bases, live, u1, b1, rand, dtype))


def _dot_product_test(apply, leaves, spec, positions, bases, live, us, pulled, rand, dtype):
    """(agrees, (<jvp(t), u>, <t, B(u)>)) for random t, at the open forward-AD level."""
    ts = [rand(b) for b in bases]
    work = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    for i, b, t in zip(positions, bases, ts):
        work[i] = dual(b.detach().clone(), t.clone())  # the jvp may write into its tangent
    rng = RngState()
    try:
        with torch.no_grad():
            call_args, call_kwargs = tree_unflatten(work, spec)
            out_leaves = tree_flatten(apply(*call_args, **call_kwargs))[0]
    except Exception:  # noqa: BLE001 - no verdict on the jvp; the real call will show its error
        return True, None
    finally:
        rng.restore()
    pushed = [unpack(out_leaves[j])[1] for j in live]
    lhs = sum(0.0 if p is None else (p * u).sum().item() for p, u in zip(pushed, us))
    rhs = sum((t * g).sum().item() for t, g in zip(ts, pulled))
    scale = (sum(0.0 if p is None else (p * u).abs().sum().item() for p, u in zip(pushed, us))
             + sum((t * g).abs().sum().item() for t, g in zip(ts, pulled)))
    return _close(lhs, rhs, scale, dtype), (lhs, rhs)
