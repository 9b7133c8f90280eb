"""Eager penalty gradients: regularisers whose graphs are freed as soon as they are computed."""
from typing import Callable
import torch

__all__ = ["EagerPenalties"]


class _Entry:
    def __init__(self, grad, weight, values):
        self.grad, self.weight, self.values = grad, weight, values
        self.injected = False


class _Inject(torch.autograd.Function):
    """Identity in the forward; in the backward, adds a stored gradient once."""

    @staticmethod
    def forward(ctx, owner, entry, h):
        ctx.owner, ctx.entry = owner, entry
        # A copy, not a view: code after add() may modify h in place (F.relu(h, inplace=True)),
        # which PyTorch forbids on a custom Function's view outputs.
        return h.clone()

    @staticmethod
    def backward(ctx, grad_out):
        entry = ctx.entry
        if entry.injected or entry.grad is None:
            return None, None, grad_out
        entry.injected = True
        ctx.owner._backward_started = True
        extra = ctx.owner._scaled(entry)
        entry.grad = None  # injected exactly once; free the stored gradient
        return None, None, extra if grad_out is None else grad_out + extra


class EagerPenalties:
    r"""Penalties on intermediate activations whose gradients are taken at once and injected later.

    .. math::

        \mathcal{L} = \mathrm{main} + \sum_k \alpha_k \sum_i s_i\, p_{k,i}(h_k)

    ``h = ep.add(h, penalty_fn, weight=alpha)`` evaluates ``penalty_fn`` on a detached copy of h,
    takes :math:`\alpha\, \partial p / \partial h` immediately and frees the penalty's graph, so
    nothing the penalty computed stays alive. It returns h wired through an identity whose
    backward adds that gradient into the backbone, exactly once, when the main loss is
    backpropagated. Memory: one h-sized gradient per penalty instead of the penalty's graph.

    ``ep.scale(s)``, optional and called before backward, multiplies each sample's stored
    penalty gradient by ``s[i]`` (the per-sample weight known only at the end of the network).
    For it, ``penalty_fn`` returns per-sample values of shape (B,), where B is h's first
    dimension and sample i's value depends only on ``h[i]``. A scalar penalty is allowed without
    scaling.

    Rules of use:

    - Use the returned tensor in place of h (``h = ep.add(h, ...)``). The original h, if used
      downstream too, carries no penalty gradient; ``ep.pending`` counts penalties whose gradient
      has not been injected yet, so ``assert ep.pending == 0`` after backward catches a wire
      that was never reached.
    - The wired tensor may be used several times downstream: autograd sums its gradients and
      the penalty is still added once. A second backward through the same graph
      (``retain_graph=True``) adds nothing more.
    - After backward, ``ep.value`` still holds the total for logging; ``scale`` then raises.
      Use one EagerPenalties per training step.

    Attributes:
        value: the weighted (and scaled) total of all penalties, a detached scalar tensor.
        pending: number of penalties whose gradient is still waiting for the backward.

    Example:
        >>> import torch
        >>> from mixedad import EagerPenalties
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> ep = EagerPenalties()
        >>> h = ep.add(torch.randn(3, 4) @ w, lambda h: (h ** 2).sum(dim=1), weight=0.1)
        >>> ep.scale(torch.tensor([1.0, 0.5, 2.0]))
        >>> h.sum().backward()
        >>> ep.pending, w.grad.shape
        (0, torch.Size([4, 4]))
    """

    def __init__(self) -> None:
        self._entries: list = []
        self._s = None
        self._backward_started = False

    def add(self, h: torch.Tensor, penalty_fn: Callable[[torch.Tensor], torch.Tensor], *,
            weight: float = 1.0) -> torch.Tensor:
        """Take ``weight * d penalty_fn(h) / dh`` now; return h wired to add it in the backward.

        The returned tensor is a copy of h (one activation of memory), so later code may modify
        it in place. ``weight`` is any number: int, float, numpy number or 0-d constant tensor.
        """
        call = "EagerPenalties.add(h, penalty_fn)"
        if not isinstance(h, torch.Tensor) or not h.is_floating_point():
            raise TypeError(f"{call}: expected h to be a floating-point tensor, got {type(h).__name__}.")
        if not callable(penalty_fn):
            raise TypeError(f"{call}: expected penalty_fn to be callable, got {type(penalty_fn).__name__}.")
        if isinstance(weight, torch.Tensor):
            if weight.requires_grad or weight.numel() != 1:
                raise ValueError(f"{call}: expected weight to be a constant number, got a tensor of shape "
                                 f"{tuple(weight.shape)} (requires_grad={weight.requires_grad}).")
            weight = weight.item()
        elif isinstance(weight, bool):
            raise TypeError(f"{call}: expected weight to be a number, got bool.")
        else:
            try:  # ints, floats, numpy numbers: anything float() takes as a number
                weight = float(weight)
            except (TypeError, ValueError):
                raise TypeError(f"{call}: expected weight to be a number, got {type(weight).__name__}.") from None
        with torch.enable_grad():
            h_work = h.detach().requires_grad_()
            values = penalty_fn(h_work)
            if not isinstance(values, torch.Tensor):
                raise TypeError(f"{call}: expected penalty_fn to return a tensor, got {type(values).__name__}.")
            if values.dim() > 1 or (values.dim() == 1 and (h.dim() == 0 or values.shape[0] != h.shape[0])):
                raise ValueError(
                    f"{call}: expected penalty_fn to return a scalar or per-sample values of shape "
                    f"({h.shape[0] if h.dim() else 'B'},), got {tuple(values.shape)}."
                )
            grad = None
            if values.requires_grad:
                (grad,) = torch.autograd.grad(values.sum(), h_work, allow_unused=True)
        entry = _Entry(None if grad is None else weight * grad, weight, values.detach())
        self._entries.append(entry)
        if not h.requires_grad:
            entry.injected = True  # nothing upstream to inject into
            return h
        return _Inject.apply(self, entry, h)

    def scale(self, s: float) -> None:
        """Multiply each sample's stored penalty gradient (and value) by ``s[i]``; before backward."""
        call = "EagerPenalties.scale(s)"
        if self._backward_started:
            raise RuntimeError(f"{call}: called after backward; the penalty gradients were already added.")
        if not isinstance(s, torch.Tensor) or s.dim() != 1:
            raise ValueError(f"{call}: expected s to be a 1-d tensor of per-sample weights, got {s!r:.60}.")
        if s.requires_grad:
            raise ValueError(
                f"{call}: s requires grad, but its gradient would be lost. Pass s.detach() if the "
                f"weights are constants, or add (s * per_sample_penalty).sum() to your loss instead."
            )
        for e in self._entries:
            if e.values.dim() == 0:
                raise ValueError(f"{call}: a penalty returned a scalar; per-sample scaling needs values of shape (B,).")
            if e.values.shape[0] != s.shape[0]:
                raise ValueError(f"{call}: expected s of shape ({e.values.shape[0]},), got {tuple(s.shape)}.")
        self._s = s.detach()

    def _scaled(self, entry):
        if self._s is None or entry.values.dim() == 0:
            return entry.grad
        s = self._s.to(entry.grad.dtype).reshape(-1, *([1] * (entry.grad.dim() - 1)))
        return entry.grad * s

    @property
    def value(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for e in self._entries:
            v = e.values if self._s is None or e.values.dim() == 0 else e.values * self._s.to(e.values.dtype)
            total = total + e.weight * v.sum().double().cpu()
        return total

    @property
    def pending(self) -> int:
        return sum(1 for e in self._entries if not e.injected)
