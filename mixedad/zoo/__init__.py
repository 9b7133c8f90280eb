"""Random-weight generators for tests, the demo, benchmarks and notebooks.

Nothing is downloaded: every member is built from a seed with random weights (and, for
BatchNorm, random running statistics so eval mode is not the identity). Construction forks the
global RNG, so building a generator leaves the caller's random state as it was. Members are
returned in eval mode with parameters that require grad, as a freshly loaded pretrained model
would be; mixedad treats them as frozen either way.

Random deep networks at PyTorch's default initialisation have vanishing Jacobians: through 64
tanh layers J_G v shrinks to about 1e-16, and every derivative a test compares would be
numerically zero. So each member is calibrated once after construction, like a trained
generator's well-conditioned Jacobian: walking the layers in order with a random input and
tangent, each Linear or convolution weight is rescaled so that the tangent leaves it with unit
standard deviation (a data-independent form of LSUV initialisation, applied to J_G v).
"""
from typing import Callable, Dict, Tuple

from torch import nn

from mixedad.zoo._classic import dcgan, mlp, resnet
from mixedad.zoo._stylegan import stylegan
from mixedad.zoo._stylegan2_ada import stylegan2_ada
from mixedad.zoo._transformer import attention_stack, transformer
from mixedad.zoo._vq import vq_decoder

__all__ = ["mlp", "dcgan", "resnet", "stylegan", "stylegan2_ada", "transformer", "attention_stack", "vq_decoder",
           "latent_shape", "MEMBERS"]


#: Every member with small default sizes, by name: ``MEMBERS[name](dtype=..., seed=...)``.
MEMBERS: Dict[str, Callable[..., nn.Module]] = {
    "mlp": lambda **kw: mlp(4, 16, **kw),
    "dcgan": lambda **kw: dcgan(latent_dim=8, channels=4, image_size=8, extra_blocks=1, **kw),
    "resnet_batchnorm": lambda **kw: resnet(latent_dim=8, channels=8, image_size=8, **kw),
    "resnet_instancenorm": lambda **kw: resnet(latent_dim=8, channels=8, image_size=8, norm="instance", **kw),
    "stylegan": lambda **kw: stylegan(latent_dim=8, w_dim=8, channels=4, image_size=8, **kw),
    "transformer_layer": lambda **kw: transformer(latent_dim=8, d_model=8, tokens=4, **kw),
    "transformer_sdpa": lambda **kw: transformer(latent_dim=8, d_model=8, tokens=4, attention="sdpa", **kw),
    "stylegan2_ada": lambda **kw: stylegan2_ada(latent_dim=8, w_dim=8, channels=4, image_size=8, **kw),
    "vq_decoder": lambda **kw: vq_decoder(latent_dim=8, **kw),
}


def latent_shape(G: nn.Module, batch: int) -> Tuple[int, int]:
    r"""The shape of a batch of inputs for a zoo member: (batch, in_features or latent_dim).

    .. math::

        \mathrm{latent\_shape}(G, B) = (B, d_z)

    Example:
        >>> from mixedad import zoo
        >>> zoo.latent_shape(zoo.dcgan(latent_dim=12), 5)
        (5, 12)
    """
    latent = getattr(G, "latent_dim", None)
    if latent is not None:
        return (batch, latent)
    first = next(m for m in G.modules() if isinstance(m, (nn.Linear, nn.Unflatten)))  # a DCGAN's latent-to-map layer
    return (batch, first.in_features if isinstance(first, nn.Linear) else first.unflattened_size[0])
