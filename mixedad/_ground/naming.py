"""How mixedad's messages and reports name an op of G."""
import functools
from typing import Any

from torch.overrides import resolve_name

__all__ = ["op_name"]


@functools.lru_cache(maxsize=None)
def op_name(func: Any) -> str:
    """A readable name for a torch function: ``torch.nn.functional.linear``, ``torch.Tensor.add``."""
    if isinstance(func, type):
        return f"{func.__qualname__} (custom Function)"
    return resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
