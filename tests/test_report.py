"""tangent_report: which op took which path, with the whole-G fallback named; the user's state untouched."""

import pytest
import torch
from torch import nn

import mixedad


F64 = torch.float64


def test_report_lists_each_path_and_prints_a_table():
    from mixedad.zoo._custom_ops import bias_act

    G = nn.Sequential(nn.Conv1d(3, 3, 1), nn.GroupNorm(1, 3)).to(F64)
    b = torch.zeros(3, dtype=F64)
    H = lambda z: bias_act(G(z), b).logcumsumexp(-1) + z  # noqa: E731
    report = mixedad.tangent_report(H, torch.randn(2, 3, 4, dtype=F64))
    assert report.ops("frozen layer") == ["torch.nn.functional.conv1d"]
    assert report.ops("written formula") == ["torch.nn.functional.group_norm"]
    assert report.ops("local double-VJP") == ["_BiasAct (custom Function)", "torch.Tensor.logcumsumexp"]
    assert report.ops("forward AD") == ["torch.Tensor.add"]
    text = str(report)
    assert "known-wrong formula (pytorch#196705)" in text and "memory: flat in G's depth" in text


def test_report_shows_the_whole_g_fallback_and_warns():
    from torch.autograd import forward_ad

    G = lambda z: forward_ad.unpack_dual(torch.tanh(z)).primal * 2  # noqa: E731  (drops its tangent)
    with pytest.warns(RuntimeWarning, match="lost its forward-mode tangent"):
        report = mixedad.tangent_report(G, torch.randn(3, dtype=F64))
    assert not report.flat and "GROWS" in str(report)


def test_report_leaves_rng_and_buffers_as_they_were():
    G = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).to(F64).train()
    z = torch.randn(3, 4, dtype=F64)
    before = G[1].running_mean.clone(), torch.get_rng_state()
    mixedad.tangent_report(G, z)
    assert torch.equal(G[1].running_mean, before[0]) and torch.equal(torch.get_rng_state(), before[1])
    assert G.training
