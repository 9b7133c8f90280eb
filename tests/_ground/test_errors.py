"""mixedad's errors: refusals are RuntimeErrors of its own; the signals are not."""
from mixedad.op_rules import FunctionUnderTransformError, OpRuleError, UnderTransformError
from mixedad._ground.errors import NeedsWholeG, RestartPass


def test_hierarchy():
    assert issubclass(OpRuleError, RuntimeError)
    assert issubclass(FunctionUnderTransformError, UnderTransformError) and issubclass(UnderTransformError, OpRuleError)
    assert not issubclass(NeedsWholeG, RuntimeError) and not issubclass(RestartPass, RuntimeError)
    assert NeedsWholeG("why", at_cotangent=True).at_cotangent and not NeedsWholeG("why").at_cotangent
    restart = RestartPass("torch.sin", ValueError("x"))
    assert restart.op == "torch.sin" and "torch.sin: x" in str(restart)
