"""Pins for mixedad._hooks.library_ops: library ops reach a mode as OpOverload(Packet)s with a namespace and schema."""
import torch
from torch.overrides import TorchFunctionMode

from mixedad._hooks import library_ops as hook


@torch.library.custom_op("mixedad_pin::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


class Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_a_custom_op_is_a_library_op_with_its_schemas_argument_names():
    mode = Seen()
    with mode:
        torch.ops.mixedad_pin.twice(torch.ones(2))
    assert any(hook.is_library_op(f) for f in mode.funcs)
    assert not hook.is_library_op(torch.ops.aten.sin.default) and not hook.is_library_op(torch.sin)
    assert hook.schema_argument_names(torch.ops.mixedad_pin.twice) == ("x",)
    assert torch.ops.mixedad_pin.twice.default in hook.registry_keys(torch.ops.mixedad_pin.twice)
