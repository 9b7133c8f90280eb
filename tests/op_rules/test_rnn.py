"""Fused multi-layer nn.LSTM / GRU / RNN calls, split per layer: exact, flat in num_layers, primal bit for bit."""
from typing import NamedTuple

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import mixedad
from mixedad.op_rules._rnn import rnn_split_rule
from mixedad.profiling import cpu_peak_memory
from mixedad.reference import double_backward_mixed_grad
from mixedad._frontend.tangents import push_tangent
from mixedad.testing import assert_close

F64, F32 = torch.float64, torch.float32
pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN:UserWarning")

MODULES = {
    "lstm": lambda size, hidden, **kw: nn.LSTM(size, hidden, **kw),
    "gru": lambda size, hidden, **kw: nn.GRU(size, hidden, **kw),
    "rnn_tanh": lambda size, hidden, **kw: nn.RNN(size, hidden, nonlinearity="tanh", **kw),
    "rnn_relu": lambda size, hidden, **kw: nn.RNN(size, hidden, nonlinearity="relu", **kw),
}
FUSED = {"lstm": "torch.lstm", "gru": "torch.gru", "rnn_tanh": "torch.rnn_tanh", "rnn_relu": "torch.rnn_relu"}


class Case(NamedTuple):
    kind: str
    layers: int = 3
    options: dict = {}  # nn.LSTM/GRU/RNN keywords: bidirectional, proj_size, bias, dropout
    batch_first: bool = False
    packed: bool = False  # a PackedSequence of lengths LENGTHS
    state: bool = False  # h0 (and c0) computed from z, so they carry tangents too
    train: bool = False


CASES = {
    "lstm": Case("lstm"),
    "gru": Case("gru"),
    "rnn_tanh": Case("rnn_tanh"),
    "rnn_relu": Case("rnn_relu", layers=2),
    "lstm_bidirectional": Case("lstm", options={"bidirectional": True}),
    "gru_bidirectional": Case("gru", options={"bidirectional": True}),
    "lstm_batch_first": Case("lstm", batch_first=True),
    "lstm_proj_size": Case("lstm", options={"proj_size": 2}),
    "lstm_proj_size_bidirectional": Case("lstm", options={"proj_size": 2, "bidirectional": True}),
    "lstm_no_bias": Case("lstm", options={"bias": False}),
    "gru_no_bias": Case("gru", options={"bias": False}),
    "lstm_given_state": Case("lstm", state=True),
    "gru_given_state": Case("gru", options={"bidirectional": True}, state=True),
    "lstm_packed": Case("lstm", packed=True),
    "gru_packed_bidirectional_batch_first": Case("gru", options={"bidirectional": True}, packed=True,
                                                 batch_first=True),
    "rnn_tanh_packed": Case("rnn_tanh", packed=True, state=True),
    "lstm_train_dropout": Case("lstm", options={"dropout": 0.4}, train=True),
    "lstm_train_dropout_bidirectional": Case("lstm", options={"dropout": 0.3, "bidirectional": True}, train=True),
    "lstm_train_dropout_batch_first": Case("lstm", options={"dropout": 0.3}, batch_first=True, train=True),
    "gru_train_dropout_packed": Case("gru", options={"dropout": 0.5}, packed=True, train=True),
    "rnn_relu_train_dropout": Case("rnn_relu", options={"dropout": 0.3}, state=True, train=True),
    "lstm_everything_train": Case("lstm", options={"proj_size": 2, "bidirectional": True, "bias": False,
                                                   "dropout": 0.3}, batch_first=True, state=True, train=True),
    "lstm_eval_with_dropout": Case("lstm", options={"dropout": 0.5}),
}
DROPOUT = [name for name, c in CASES.items() if c.train]
FLOAT32 = ["lstm", "lstm_bidirectional", "lstm_batch_first", "gru", "rnn_relu", "lstm_proj_size",
           "lstm_packed", "lstm_train_dropout_batch_first", "lstm_everything_train"]
LATENT, STEPS, SIZE, HIDDEN, LENGTHS = 4, 5, 3, 4, (5, 4, 2)


class RNNGenerator(nn.Module):
    """z -> a sequence -> a fused multi-layer RNN; returns (output, h_n[, c_n]) as a flat tuple."""

    def __init__(self, case, *, hidden=HIDDEN, steps=STEPS):
        super().__init__()
        self.case, self.steps = case, steps
        self.rnn = MODULES[case.kind](SIZE, hidden, num_layers=case.layers, batch_first=case.batch_first,
                                      **case.options)
        self.embed = nn.Linear(LATENT, steps * SIZE)
        rows = case.layers * (2 if self.rnn.bidirectional else 1)
        self.h0 = nn.Linear(LATENT, rows * (self.rnn.proj_size or hidden)) if case.state else None
        self.c0 = nn.Linear(LATENT, rows * hidden) if case.state and case.kind == "lstm" else None

    def forward(self, z):
        x = self.embed(z).reshape(z.shape[0], self.steps, SIZE)
        if not self.case.batch_first:
            x = x.transpose(0, 1)
        if self.case.packed:
            x = pack_padded_sequence(x, LENGTHS, batch_first=self.case.batch_first)
        state = None
        if self.h0 is not None:  # (layers x directions, batch, features), not contiguous
            h0 = self.h0(z).tanh().reshape(z.shape[0], -1, self.rnn.proj_size or self.rnn.hidden_size).transpose(0, 1)
            state = h0 if self.c0 is None else (h0, self.c0(z).reshape(h0.shape[1], h0.shape[0], -1).transpose(0, 1))
        out, final = self.rnn(x, state)
        if self.case.packed:
            out = pad_packed_sequence(out, batch_first=self.case.batch_first)[0]
        return (out, *final) if isinstance(final, tuple) else (out, final)


def cubic(y, g):
    return sum(((a + b) ** 3).sum() for a, b in zip(y, g))


def build(case, dtype, **sizes):
    """``(G, z, y, v)``: random weights, G in train or eval mode as the case says."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        G = RNNGenerator(case, **sizes).to(dtype).train(case.train)
    gen = torch.Generator().manual_seed(1)
    batch = len(LENGTHS) if case.packed else 2
    z = torch.randn(batch, LATENT, generator=gen, dtype=dtype)
    v = torch.randn(batch, LATENT, generator=gen, dtype=dtype)
    with torch.no_grad():
        y = tuple(torch.randn(g.shape, generator=gen, dtype=dtype) for g in G(z))
    return G, z, y, v


def seeded(fn, *args, **kwargs):
    """``fn`` after ``torch.manual_seed(7)``: mixed_grad and the reference draw the same dropout masks."""
    torch.manual_seed(7)
    return fn(*args, **kwargs)


@pytest.fixture(autouse=True)
def fresh_failures():
    mixedad.op_rules.forget_failures()
    yield
    mixedad.op_rules.forget_failures()


@pytest.mark.parametrize("name", CASES)
def test_exact_against_double_backward_in_float64(name):
    G, z, y, v = build(CASES[name], F64)
    ours = seeded(mixedad.mixed_grad, cubic, G, z, y, v, strategy="forward")
    assert_close(ours, seeded(double_backward_mixed_grad, cubic, G, z, y, v), rtol=1e-9)


@pytest.mark.parametrize("name", FLOAT32)
def test_float32_close_to_double_backward(name):
    """float32 LSTMs run oneDNN's kernel (no forward-AD formula): each layer takes the local rule."""
    G, z, y, v = build(CASES[name], F32)
    ours = seeded(mixedad.mixed_grad, cubic, G, z, y, v, strategy="forward")
    assert_close(ours, seeded(double_backward_mixed_grad, cubic, G, z, y, v), rtol=1e-4)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("name", DROPOUT)
def test_primal_is_the_fused_call_bit_for_bit(name, dtype):
    """Same seed: the split draws the dropout masks that the fused call draws, on the same numbers."""
    G, z, _, v = build(CASES[name], dtype)
    g, _, _ = seeded(push_tangent, "mixed_grad(f, G, z, y)", G, [z], [v], strategy="forward")
    plain = seeded(G, z)
    assert len(g) == len(plain)
    for ours, theirs in zip(g, plain):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    with torch.no_grad():
        assert not torch.equal(seeded(G, z)[0], G(z)[0])  # dropout is really drawn


@pytest.mark.parametrize("dtype, local", [(F64, False), (F32, True)])
@pytest.mark.parametrize("kind", MODULES)
def test_report_shows_the_split_and_flat(kind, dtype, local):
    """One split per fused call, then one call per layer on its own path (float32 LSTM: the local rule)."""
    case = Case(kind, options={"bidirectional": True})
    G, z, _, v = build(case, dtype)
    report = mixedad.tangent_report(G, z, v, strategy="forward")
    rows = {(op, path): (reason, n) for op, path, reason, n in report.rows}
    assert rows[(FUSED[kind], "written formula")] == ("multi-layer RNN split per layer", 1), str(report)
    per_layer = "local double-VJP" if local and kind == "lstm" else "forward AD"
    assert rows[(FUSED[kind], per_layer)][1] == case.layers, str(report)
    assert report.flat and "memory: flat in G's depth" in str(report)


def test_single_layer_is_not_split():
    G, z, _, v = build(Case("lstm", layers=1), F64)
    report = mixedad.tangent_report(G, z, v, strategy="forward")
    assert "torch.lstm" not in report.ops("written formula") and "torch.lstm" in report.ops("forward AD")


def test_one_layer_declines_and_calls_without_tangent_never_reach_the_rule(monkeypatch):
    """NotImplemented for one layer; without a tangent the dispatcher makes the plain call itself."""
    from mixedad.op_rules import TABLE, OpCall, OpRules

    rnn = nn.LSTM(SIZE, HIDDEN, num_layers=2).double()
    x, h = torch.randn(STEPS, 2, SIZE, dtype=F64), torch.zeros(2, 2, HIDDEN, dtype=F64)
    one_layer = (x, (h[:1], h[:1]), rnn._flat_weights[:4], True, 1, 0.0, False, False, False)
    assert rnn_split_rule(OpCall(torch.lstm, "torch.lstm", "call", one_layer, {})) is NotImplemented
    calls = []
    monkeypatch.setitem(TABLE, torch.lstm, TABLE[torch.lstm]._replace(apply=lambda op: calls.append(op)))
    args = (x, (h, h), rnn._flat_weights, True, 2, 0.0, False, False, False)
    with OpRules("call"):
        out = torch.lstm(*args)
    assert calls == []
    assert_close(out[0], torch.lstm(*args)[0])


def test_no_formula_failure_is_remembered_per_dtype():
    """A float32 LSTM's failed formula (oneDNN) does not send a later float64 LSTM to the local rule."""
    case = Case("lstm", layers=1)
    G32, z32, _, v32 = build(case, F32)
    assert "torch.lstm" in mixedad.tangent_report(G32, z32, v32, strategy="forward").ops("local double-VJP")
    G64, z64, _, v64 = build(case, F64)
    report = mixedad.tangent_report(G64, z64, v64, strategy="forward")
    assert "torch.lstm" in report.ops("forward AD") and "torch.lstm" not in report.ops("local double-VJP")
    again = mixedad.tangent_report(G32, z32, v32, strategy="forward")  # still remembered for float32
    assert "torch.lstm" in again.ops("local double-VJP") and "torch.lstm" not in again.ops("forward AD")


MEMORY = {"lstm": Case("lstm"), "bilstm": Case("lstm", options={"bidirectional": True}), "gru": Case("gru")}


def _peak(case, layers, dtype):
    G, z, y, v = build(case._replace(layers=layers), dtype, hidden=16, steps=12)
    return cpu_peak_memory(mixedad.mixed_grad, cubic, G, z, y, v, strategy="forward")[1]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name", MEMORY)
def test_peak_flat_in_num_layers(name, dtype):
    """Exact byte counts: 8 layers within 1.3x of 2 (the fused op on the local rule grew 3.4x)."""
    peak_2, peak_8 = _peak(MEMORY[name], 2, dtype), _peak(MEMORY[name], 8, dtype)
    assert peak_8 <= 1.3 * peak_2, (peak_2, peak_8)


@pytest.mark.parametrize("name", ["lstm", "bilstm"])
def test_float64_after_float32_still_flat(name):
    """The float32 LSTM's failed formula is remembered for float32 only (it had grown 3.1x here)."""
    _peak(MEMORY[name], 2, F32)
    peak_2, peak_8 = _peak(MEMORY[name], 2, F64), _peak(MEMORY[name], 8, F64)
    assert peak_8 <= 1.3 * peak_2, (peak_2, peak_8)
