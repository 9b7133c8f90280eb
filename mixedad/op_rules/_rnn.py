r"""The multi-layer RNN split: a fused ``nn.LSTM/GRU/RNN(num_layers > 1)`` call, one layer at a time.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` run all their layers in one torch function
(``torch._VF.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``; the same objects as ``torch.lstm`` and
so on). A per-op rule over that one op holds every layer at once: on the CPU in float32 an LSTM
runs oneDNN's ``mkldnn_rnn_layer``, which has no forward-AD formula, and the local double-VJP
rule then keeps all the layers' reverse graph. This rule calls the same function once per layer,
with ``num_layers=1``, and sends each call back through mixedad's dispatch, where it takes its
own path (PyTorch's formula, or the local rule for that one layer):

.. math::

    (o_\ell,\ h_\ell,\ c_\ell) = \mathrm{rnn}\big(d_\ell(o_{\ell-1}),\ h_0[\ell],\ c_0[\ell];\ W_\ell\big),
    \quad o_0 = \mathrm{input}, \qquad
    (\mathrm{output},\ h_n,\ c_n) = \big(o_L,\ [h_1; \dots; h_L],\ [c_1; \dots; c_L]\big)

where :math:`W_\ell` is layer :math:`\ell`'s slice of ``params`` (per direction ``w_ih``,
``w_hh``, then ``b_ih``, ``b_hh`` with biases, then ``w_hr`` for an LSTM with ``proj_size``),
:math:`h_0[\ell]` and :math:`c_0[\ell]` its rows of the initial state (both directions), and
:math:`d_\ell` is dropout in train mode between layers (:math:`\ell > 1`), the identity
otherwise; ``c`` only for an LSTM. Both overloads are taken: the padded one
``(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)`` and
the packed-sequence one ``(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
bidirectional)``.

Exactness. The primal is bit for bit the fused call's: PyTorch's fused kernels (the native and
the oneDNN ones) run the same single-layer computation per layer, and draw dropout with
``torch.dropout(o, p, train=True)`` on the time-major output of the layer below, as this rule
does. A ``batch_first`` input is transposed once and the layers run time-major, as in the fused
kernels, so that each mask is drawn over a tensor of the fused call's memory layout (on a
batch-first copy the same seed gives another mask).

Memory: one layer's primal and tangent (and, on the local rule, one layer's graph) at a time,
plus the final states: flat in ``num_layers``. The split's own bookkeeping (slicing the states,
dropout, concatenating the final states) runs as plain forward AD.
"""
import torch

from mixedad.op_rules._table import Path, defrule

#: The fused RNN functions that ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` call.
FUSED_RNNS = (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)

_PADDED = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first")
_PACKED = ("data", "batch_sizes", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional")


def _bind(args, kwargs):
    """``(packed, arguments by name)``, or None when the call matches neither overload."""
    packed = "data" in kwargs or "batch_sizes" in kwargs or (len(args) > 3 and isinstance(args[3], (list, tuple)))
    names = _PACKED if packed else _PADDED
    if len(args) > len(names) or any(name not in names for name in kwargs):
        return None
    bound = dict(zip(names, args), **kwargs)
    return (packed, bound) if len(bound) == len(names) else None


@defrule(Path.FORMULA, *FUSED_RNNS, reason="multi-layer RNN split per layer")
def rnn_split_rule(op):
    """A fused multi-layer RNN call as one call per layer, each through the dispatch again.

    Returns NotImplemented when ``num_layers`` is 1, or when the arguments do not have the shapes
    PyTorch expects (the plain call then raises its own error). It binds the arguments itself,
    since the padded and packed overloads name them differently.
    """
    func, dispatch = op.func, op.dispatch
    found = _bind(op.args, op.kwargs)
    if found is None:
        return NotImplemented
    packed, bound = found
    layers = bound["num_layers"]
    if not isinstance(layers, int) or layers <= 1:
        return NotImplemented
    lstm = func is torch.lstm
    states = list(bound["hx"]) if lstm else [bound["hx"]]
    x = bound["data"] if packed else bound["input"]
    directions = 2 if bound["bidirectional"] else 1
    if not all(isinstance(t, torch.Tensor) for t in (x, *states)) or (not packed and x.dim() != 3):
        return NotImplemented
    projections = lstm and len(states) == 2 and states[0].shape[-1] != states[1].shape[-1]
    per_layer = directions * (2 + 2 * bool(bound["has_biases"]) + projections)
    params = list(bound["params"])
    if len(params) != layers * per_layer or any(t.dim() != 3 or t.shape[0] != layers * directions for t in states):
        return NotImplemented
    p, train = bound["dropout"], bound["train"]
    batch_first = not packed and bound["batch_first"]
    if batch_first:
        x = x.transpose(0, 1)  # time-major, as the fused kernels run: dropout masks depend on the layout
    finals = [[] for _ in states]
    for layer in range(layers):
        if layer and p and train:
            x = torch.dropout(x, p, True)
        rows = slice(layer * directions, (layer + 1) * directions)
        hx = [t[rows] for t in states] if lstm else states[0][rows]
        weights = params[layer * per_layer:(layer + 1) * per_layer]
        if packed:
            out = dispatch(func, x, bound["batch_sizes"], hx, weights, bound["has_biases"], 1, 0.0, train,
                           bound["bidirectional"])
        else:
            out = dispatch(func, x, hx, weights, bound["has_biases"], 1, 0.0, train, bound["bidirectional"], False)
        x = out[0]
        for final, t in zip(finals, out[1:]):
            final.append(t)
    if batch_first:
        x = x.transpose(0, 1)
    return (x, *(torch.cat(final, 0) for final in finals)), None  # the outputs carry their tangents
