"""``torch.compile``: the eager G behind a compiled one, and whether dynamo is tracing now.

What this relies on in torch (pinned by ``tests/_hooks/test_torch_compile.py``): a compiled module
keeps its original as ``_orig_mod``, and a compiled function as ``_torchdynamo_orig_callable``;
``torch.compiler.is_compiling()`` is True while dynamo traces.
"""
import torch
from torch import nn


def original_of(G):
    """The eager module or function behind a ``torch.compile`` wrapper, or None if G is not one."""
    if isinstance(G, nn.Module):
        return getattr(G, "_orig_mod", None)
    return getattr(G, "_torchdynamo_orig_callable", None)


def compiling():
    """Whether torch.compile is tracing the caller now."""
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()
