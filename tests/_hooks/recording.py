"""A torch-function mode that records the functions it sees, for the hook pins."""
from torch.overrides import TorchFunctionMode


class Seen(TorchFunctionMode):
    """Records every torch function called while it is active, in order."""

    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))
