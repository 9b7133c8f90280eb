r"""Building zoo members: seeded construction and Jacobian calibration.

Construction forks the global RNG, so building a generator leaves the caller's random state as
it was. Random deep networks at PyTorch's default initialisation have vanishing Jacobians, so
each member is calibrated once after construction (see :func:`_calibrate`).
"""
import torch
from torch import nn
from torch.autograd import forward_ad

from mixedad._ground.forward_pass import forward_pass
from mixedad._hooks.function_apply import routing
from mixedad.op_rules._dispatch import ATTENTION, FROZEN, OpRules

WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
             nn.ConvTranspose3d)


def seeded(build, seed, input_shape):
    """``build()`` under a forked RNG seeded with ``seed``, with random BatchNorm statistics, calibrated.

    Built under ``torch.device("meta")`` (for memory plans at full size), the module holds no
    values: it is neither initialised nor calibrated, and nothing runs.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build()
        if any(p.is_meta for p in module.parameters()):
            return module.eval()
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
        module.eval()
        _calibrate(module, input_shape)
    return module


@torch.no_grad()
def _calibrate(module, input_shape):
    """Rescale each weighted layer so a random tangent leaves it with unit standard deviation.

    One forward-mode pass in execution order: a forward hook on each Linear or convolution
    measures the tangent of its output, divides the weight by that standard deviation (the bias
    does not enter the tangent, so one rescale is exact) and recomputes the output, so later
    layers are calibrated on what they will really see.
    """
    done = set()

    def hook(layer, args, output):
        if layer in done:
            return None
        done.add(layer)
        tangent = forward_ad.unpack_dual(output).tangent
        scale = None if tangent is None else tangent.std()
        if scale is None or not torch.isfinite(scale) or scale <= 0:
            return None
        layer.weight.div_(scale)
        return layer(*args)

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, WEIGHTED)]
    try:
        # PyTorch's own formulas where they exist, so calibration does not depend on the fast
        # layer kernels; the local rule and written formulas where they do not (custom ops, cdist).
        # Grad enabled, as in mixedad's own pass: the rules read grad mode at each op (forward_pass).
        rules = OpRules("zoo calibration", skip=(FROZEN, ATTENTION))
        with forward_pass(rules), forward_ad.dual_level(), rules, routing(rules):  # as every pass is set up
            module(forward_ad.make_dual(torch.randn(input_shape), torch.randn(input_shape)))
    finally:
        for handle in handles:
            handle.remove()


def finish(module, dtype, device):
    """The module in ``dtype`` on ``device``; a module built on meta stays there (it has no values to move)."""
    if any(p.is_meta for p in module.parameters()):
        return module.to(dtype=dtype)
    return module.to(dtype=dtype, device=device)
