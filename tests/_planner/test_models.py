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


def _tiny_gpt2(dtype=torch.float64, positions=128):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=positions, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.GPT2Model(config).to(dtype).eval().requires_grad_(False)


class _SdpaCalls(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls.append((kwargs.get("attn_mask", args[3] if len(args) > 3 else None), kwargs.get("is_causal")))
        return func(*args, **kwargs)


def test_the_cli_s_gpt2_is_causal_as_transformers_runs_it():
    """Found by a review: the CLI passed an all-zero additive mask, so every token saw every other. Now the blocks
    run as GPT2Model runs them without a mask: SDPA's own causal mask, no mask tensor, the same numbers."""
    from mixedad._planner.models import gpt2_call

    model = _tiny_gpt2()
    z = torch.randn(2, 16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with _SdpaCalls() as ours:
        out = gpt2_call(model)(z)
    with _SdpaCalls() as theirs:
        expected = model(inputs_embeds=z, use_cache=False).last_hidden_state
    assert torch.equal(out, expected)
    assert ours.calls == theirs.calls == [(None, True)] * 2
    later = z.clone()
    later[:, -1] += 1.0  # the last token moves: no earlier one sees it
    assert torch.equal(gpt2_call(model)(later)[:, :-1], out[:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cli_s_gpt2_is_planned_at_its_cpu_peak(dtype):
    from mixedad._planner.models import gpt2_call
    from mixedad.profiling import PLAN_METHODS, peak_memory

    G = gpt2_call(_tiny_gpt2(dtype))
    z, y = (torch.randn(2, 128, 64, dtype=dtype, generator=torch.Generator().manual_seed(i)) for i in range(2))
    f = lambda y_, g: ((g - y_) ** 2).sum()  # noqa: E731
    predicted = plan(f, G, z, y, device="cpu", methods=tuple(PLAN_METHODS))
    for method, planned in predicted.peaks.items():
        _, measured = peak_memory(PLAN_METHODS[method], f, G, (z,), y)
        assert abs(planned - measured) <= 0.02 * measured, (method, planned, measured)


def test_a_cuda_plan_of_the_cli_s_gpt2_takes_the_fused_causal_kernel():
    """What GPT-2 runs on a GPU: SDPA with is_causal and no mask takes the flash kernel in float16, which holds no
    T x T scores (the all-zero mask the CLI passed before took another kernel, and held the mask)."""
    from mixedad._planner.models import gpt2_call

    with torch.device("meta"):
        G = gpt2_call(_tiny_gpt2(torch.float16, positions=1024))
    z = torch.empty(1, 1024, 64, dtype=torch.float16, device="meta")
    peak = plan(lambda y, g: ((g - y) ** 2).sum(), G, z, z, device="cuda", methods=("forward",)).peaks["forward"]
    assert peak < 4 * 1024 * 1024 * 2  # one layer's scores: 4 heads x T x T in float16
