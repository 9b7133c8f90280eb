"""The CLI's generators at real sizes: built on meta in a moment, nothing allocated, plannable."""
import importlib.util
import time

import pytest
import torch

from mixedad._planner.models import PLAN_MODELS, build
from mixedad.profiling import plan


@pytest.mark.parametrize("name", sorted(PLAN_MODELS))
def test_every_model_builds_on_meta_at_its_size(name):
    needs = {"gpt2-medium": "transformers", "sd-vae": "diffusers"}.get(name)
    if needs is not None and importlib.util.find_spec(needs) is None:
        with pytest.raises(ModuleNotFoundError, match=needs):
            build(name, 1, 64, torch.float16)
        return
    start = time.perf_counter()
    G, z, y, what = build(name, 2, 256, torch.float16)
    assert time.perf_counter() - start < 30
    assert all(p.is_meta for p in G.parameters()) and z.is_meta and y.is_meta and what
    assert G(z).shape == y.shape


def test_a_real_size_plan_shows_double_backward_far_above_mixed_grad():
    G, z, y, _ = build("stylegan2", 2, 256, torch.float16)
    result = plan(lambda y_, g: ((g - y_) ** 2).sum(), G, z, y)
    assert result.peaks["double_backward"] > 1.3 * result.peaks["mixed_grad"] > result.peaks["forward"] > 0
