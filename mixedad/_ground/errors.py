r"""What the op rules raise: mixedad's errors, and the signals that change a pass's course."""

__all__ = ["OpRuleError", "UnderTransformError", "FunctionUnderTransformError", "NeedsWholeG", "RestartPass",
           "InputsWritten"]


class OpRuleError(RuntimeError):
    """An op whose tangent mixedad can compute neither by forward AD nor by reverse mode."""


class UnderTransformError(OpRuleError):
    """Something in G that mixedad cannot do inside a torch.func transform or in a batch of
    tangents (vmap over mixed_grad, mixed_jacobian); ``mixed_jacobian`` then pushes one tangent per pass."""


class FunctionUnderTransformError(UnderTransformError):
    """A custom Function that torch.func cannot run inside mixedad's batched pass."""


class NeedsWholeG(Exception):
    r"""Only the whole-G fallback can push the tangent through G: an op's outputs cannot carry
    forward-mode tangents at all (sparse layouts), or G's derivative depends on its reverse pass
    (G differentiates inside itself, changes gradients with hooks, or holds a custom Function
    whose backward is not linear in its incoming gradient).

    ``at_cotangent``: the fallback must evaluate G's backward at double backward's own cotangent
    :math:`u^* = \nabla_g f(y, g)`, because the backward may not be linear in it.
    """

    def __init__(self, reason, *, at_cotangent=False):
        super().__init__(reason)
        self.at_cotangent = at_cotangent


class RestartPass(Exception):
    """An op's forward-AD formula raised; the pass restarts with that op on the local rule."""

    def __init__(self, op, error):
        super().__init__(f"{op}: {error}")
        self.op, self.error = op, error


class InputsWritten(RestartPass):
    """An op of G is about to write in place into the caller's z or v; the pass restarts on mixedad's copies."""

    def __init__(self, op):
        super().__init__(op, "writes in place into G's input")
