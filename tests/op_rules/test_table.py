"""The rule table: paths as an Enum, one rule signature over OpCall, and the dispatcher's common work."""
import pytest
import torch
import torch.nn.functional as F

import mixedad
from mixedad.op_rules import PATHS, TABLE, OpCall, OpRules, Path
from mixedad.op_rules._table import arguments_of, pack

F64 = torch.float64


def test_paths_are_an_enum_of_strings_in_report_order_each_described():
    assert PATHS == tuple(Path) and Path.FROZEN == "frozen layer" and f"{Path.LOCAL}" == "local double-VJP"
    assert [str(p) for p in PATHS][-2:] == ["forward AD", "whole-G fallback"]
    assert all(p.description.endswith(".") for p in Path)


def test_every_table_entry_is_a_rule_of_one_signature_on_a_path():
    assert TABLE
    for func, rule in TABLE.items():
        assert isinstance(rule.path, Path) and rule.path not in (Path.FORWARD, Path.WHOLE_G), func
        assert callable(rule.apply) and rule.reason and rule.owner == "mixedad"


def test_opcall_binds_by_name_splits_duals_and_replays_with_replacements():
    x, t, w = torch.randn(2, 3, dtype=F64), torch.randn(2, 3, dtype=F64), torch.randn(4, 3, dtype=F64)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, t)
        op = OpCall(F.linear, "linear", "call", (dual, w), {"bias": None}, ("input", "weight", "bias"))
        assert op.primals["input"] is not dual and torch.equal(op.primals["input"], x)
        assert torch.equal(op.tangents["input"], t) and op.tangents["weight"] is None and op.tangents["bias"] is None
        assert torch.allclose(op.primal(), x @ w.T)
        assert torch.allclose(op.primal(input=t), t @ w.T)
        packed = pack(op.primal(), op.primal(input=t))
        assert torch.allclose(torch.autograd.forward_ad.unpack_dual(packed).tangent, t @ w.T)


def test_arguments_are_read_from_signatures_and_schemas():
    assert arguments_of(torch.ops.aten.sin.default) == ("self",)
    assert arguments_of(torch.cdist)[:2] == ("x1", "x2")
    assert arguments_of(torch.sin) == ()  # a builtin without a signature: give arguments=


def test_the_dispatcher_makes_the_plain_call_when_no_argument_has_a_tangent(monkeypatch):
    calls = []
    monkeypatch.setitem(TABLE, F.linear, TABLE[F.linear]._replace(apply=lambda op: calls.append(op)))
    with OpRules("call"):
        F.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert calls == []


def test_skipping_a_path_by_enum_or_string():
    G, z = mixedad.zoo.mlp(2, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    with mixedad.op_rules.skipping("frozen layer"):
        report = mixedad.tangent_report(G, z)
    assert report.ops(Path.FROZEN) == [] and "torch.nn.functional.linear" in report.ops(Path.FORWARD)
    with pytest.raises(ValueError, match="expected paths from"):
        with mixedad.op_rules.skipping(Path.FORWARD):
            pass


def test_a_missing_argument_name_says_which_names_there_are():
    op = OpCall(torch.sin, "torch.sin", "call", (torch.ones(2),), {})
    with pytest.raises(KeyError, match=r"torch.sin has no argument 'input' in this call; its arguments here are "
                                       r"named \['arg0'\].*arguments=\(\.\.\.\)"):
        op.primals["input"]
    assert op.primals.get("input") is None
