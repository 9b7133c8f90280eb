"""A two-pass cached backward for L = g(f(x_1), ..., f(x_n)): one chunk's graph at a time."""
from typing import Callable, Sequence, Union
import torch

from mixedad._checks import check_callable, check_chunk_size
from mixedad._ground import watch
from mixedad._ground.state import Snapshot
from mixedad._ground.versions import Versions

__all__ = ["cached_backward"]

CALL = "cached_backward(f, inputs, g)"


def cached_backward(f: Callable[[torch.Tensor], torch.Tensor], inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
                    g: Callable[[torch.Tensor], torch.Tensor], *, chunk_size: int = 1) -> torch.Tensor:
    r"""Backpropagate :math:`L = g(f(x_1), \ldots, f(x_n))` holding one chunk's graph at a time.

    .. math::

        \frac{\partial L}{\partial \theta} = \sum_{i} \Big(\frac{\partial L}{\partial z_i}\Big)^{\!\top}
            \frac{\partial f(x_i)}{\partial \theta}, \qquad z_i = f(x_i)

    Pass 1 runs f on every input without a graph, stacks the outputs
    :math:`Z = [z_1; \ldots; z_n]` and backpropagates :math:`L = g(Z)` to get
    :math:`\partial L / \partial Z` (and the gradients of g's own parameters). Pass 2 recomputes f
    chunk by chunk, with its graph, and backpropagates each chunk's rows of
    :math:`\partial L/\partial Z`, accumulating into the ``.grad`` of f's parameters and of any
    leaves that require grad, exactly as ``g(torch.stack([f(x) for x in inputs])).backward()``
    would. Peak memory: one chunk's graph instead of all n, plus Z.

    **State.** Pass 2 sees what pass 1 saw: the random state (CPU and CUDA) and the buffers of
    train-mode modules (and the small ones of eval-mode modules, such as step counters) recorded
    before each chunk are replayed, so dropout draws the same masks,
    BatchNorm in train mode normalises with the same batch statistics, and spectral norm's
    ``u``/``v`` and EMA buffers hold the values pass 1 used. Afterwards the running statistics, ``num_batches_tracked``
    and the RNG are as pass 1, that is the naive code, left them: pass 2's updates are undone
    (see :mod:`mixedad._ground.state`; f may be any callable, its modules are found as they run).
    What pass 2 reads again without a copy (f's parameters, eval-mode buffers too large to copy,
    the inputs) is checked against its version after pass 1 (``tensor._version``): g changing
    one in place, or replacing a parameter, raises :class:`mixedad.StateChangedError`.

    Args:
        f: callable mapping one input to a tensor; the outputs must stack.
        inputs: a sequence of inputs (tensors or anything f takes), or a tensor whose first
            dimension indexes them.
        g: callable mapping the stacked outputs (n, ...) to a scalar tensor.
        chunk_size: keyword-only; how many inputs pass 2 recomputes at once (default 1).

    Returns:
        L, detached.

    Example:
        >>> import torch
        >>> from mixedad import cached_backward
        >>> net = torch.nn.Linear(3, 2)
        >>> L = cached_backward(net, [torch.randn(3) for _ in range(4)], lambda Z: Z.pow(2).sum(), chunk_size=2)
        >>> L.requires_grad, net.weight.grad.shape
        (False, torch.Size([2, 3]))
    """
    check_callable(CALL, "f", f)
    check_callable(CALL, "g", g)
    step = check_chunk_size(CALL, chunk_size)
    if isinstance(inputs, torch.Tensor):
        items = list(inputs.unbind(0))
    elif isinstance(inputs, (list, tuple)):
        items = list(inputs)
    else:
        raise TypeError(f"{CALL}: expected inputs to be a list, tuple or tensor, got {type(inputs).__name__}.")
    if not items:
        raise ValueError(f"{CALL}: expected at least one input, got none.")
    chunks = [items[i : i + step] for i in range(0, len(items), step)]

    def refuse(op):
        raise ValueError(f"{CALL}: f writes its input in place ({op}), and pass 2 would run it again on the input it "
                         f"changed; clone the input inside f (x = x.clone()) first.")

    guard = watch.WriteGuard(items, refuse)
    states: list = []  # RNG and train-mode buffers before each chunk of pass 1, replayed by pass 2
    outputs = []
    with torch.no_grad():
        for chunk in chunks:
            state = Snapshot(f, modules=states[0].modules if states else (), call=CALL)
            states.append(state)
            with state.watching(reads=True), watch.observing("guards", guard):
                outputs += [_output(f, x) for x in chunk]
    # g runs between the passes: pass 2 must find f's parameters, its uncopied buffers and the inputs as pass 1 did.
    versions = Versions(CALL, f, states, [(f"inputs[{i}]", x) for i, x in enumerate(items)], owner="f",
                        after="pass 1 ran f on the inputs",
                        fix="g runs between the two passes and must not change f's parameters or the inputs in "
                            "place; change them after cached_backward returns.")
    Z = torch.stack(outputs).requires_grad_()
    del outputs  # one copy of the outputs from here on
    with torch.enable_grad():
        L = g(Z)
        if not isinstance(L, torch.Tensor) or L.numel() != 1:
            raise ValueError(f"{CALL}: expected g to return a scalar tensor, got "
                             f"{tuple(L.shape) if isinstance(L, torch.Tensor) else type(L).__name__}.")
        L.backward()
    dL_dZ = torch.zeros_like(Z) if Z.grad is None else Z.grad
    del Z
    versions.check()
    after_first_pass = Snapshot(f, modules=states[0].modules, call=CALL)  # after g too: g may draw random numbers
    try:
        with after_first_pass.watching(), torch.enable_grad():
            start = 0
            for chunk, state in zip(chunks, states):
                state.restore()  # what this chunk saw in pass 1: its dropout masks, its buffers
                z = torch.stack([_output(f, x) for x in chunk])
                if z.requires_grad:
                    torch.autograd.backward(z, dL_dZ[start : start + len(chunk)])
                start += len(chunk)
    finally:
        after_first_pass.restore()
    return L.detach()


def _output(f, x):
    z = f(x)
    if not isinstance(z, torch.Tensor):
        raise TypeError(f"{CALL}: expected f to return a tensor, got {type(z).__name__}.")
    return z
