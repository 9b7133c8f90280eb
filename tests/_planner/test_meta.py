"""Meta copies for plans: sizes kept, nothing allocated, the user's module untouched."""
import torch
from torch import nn

from mixedad._planner.meta import PlanError, meta_generator, meta_tree


def test_meta_tree_keeps_sizes_dtypes_and_requires_grad():
    tree = {"a": torch.ones(2, 3, dtype=torch.float64, requires_grad=True), "b": [torch.zeros(4, dtype=torch.int64), 3]}
    out = meta_tree(tree)
    assert out["a"].is_meta and out["a"].shape == (2, 3) and out["a"].dtype == torch.float64 and out["a"].requires_grad
    assert out["b"][0].is_meta and out["b"][0].dtype == torch.int64 and out["b"][1] == 3
    already = torch.empty(2, device="meta")
    assert meta_tree(already) is already


def test_meta_generator_runs_on_meta_and_leaves_the_module_alone():
    G = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    state = {k: (v, v.clone()) for k, v in G.state_dict(keep_vars=True).items()}
    out = meta_generator("test", G)(torch.empty(5, 3, device="meta"))
    assert out.is_meta and out.shape == (5, 4)
    for name, (obj, values) in state.items():
        now = G.state_dict(keep_vars=True)[name]
        assert now is obj and not now.is_meta and torch.equal(now, values), name
    assert G.training and G[0].weight.requires_grad


def test_a_module_already_on_meta_runs_as_it_is():
    with torch.device("meta"):
        G = nn.Linear(3, 4)
    assert meta_generator("test", G) is G


def test_plan_error_is_not_a_runtime_error():
    """mixedad's passes catch RuntimeError from ops (a formula that raised); a plan's error must go through."""
    assert not issubclass(PlanError, RuntimeError)
