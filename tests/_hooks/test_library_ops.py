"""Pins for mixedad._hooks.library_ops: library ops reach a mode as OpOverload(Packet)s with a namespace and schema."""
import torch

from mixedad._hooks import library_ops as hook

from tests._hooks.recording import Seen


@torch.library.custom_op("mixedad_pin::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x



def test_a_custom_op_is_a_library_op_with_its_schemas_argument_names():
    mode = Seen()
    with mode:
        torch.ops.mixedad_pin.twice(torch.ones(2))
    assert any(hook.is_library_op(f) for f in mode.funcs)
    assert not hook.is_library_op(torch.ops.aten.sin.default) and not hook.is_library_op(torch.sin)
    assert hook.schema_argument_names(torch.ops.mixedad_pin.twice) == ("x",)
    assert torch.ops.mixedad_pin.twice.default in hook.registry_keys(torch.ops.mixedad_pin.twice)
