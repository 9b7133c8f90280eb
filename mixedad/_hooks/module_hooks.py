"""Module backward hooks, which forward mode never runs.

What this relies on in torch (pinned by ``tests/_hooks/test_module_hooks.py``):

- a module's backward hooks live in ``module._backward_hooks`` and ``_backward_pre_hooks``, the
  global ones in ``torch.nn.modules.module._global_backward_hooks`` and
  ``_global_backward_pre_hooks``;
- full backward hooks run through the custom Function
  ``torch.nn.modules._functions.BackwardHookFunction``.
"""
from torch import nn
from torch.nn.modules import module as _module_globals
from torch.nn.modules._functions import BackwardHookFunction

__all__ = ["BackwardHookFunction", "HOOK_KINDS", "MODULE_INTERNALS", "backward_hooks", "hook_handles", "global_hook_handles"]

#: The attributes every ``nn.Module`` has in its ``__dict__`` (its tensors, submodules, hooks, mode): what is left
#: of a module's dict is its own.
MODULE_INTERNALS = frozenset(vars(nn.Module()))

#: The attributes of a module that hold its hooks, by kind, each a dict keyed by the handles' ids.
HOOK_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def backward_hooks(modules):
    """Whether any of ``modules``, or every module (global hooks), has backward hooks."""
    if _module_globals._global_backward_hooks or _module_globals._global_backward_pre_hooks:
        return True
    return any(m._backward_hooks or m._backward_pre_hooks for m in modules)


def hook_handles(module, attributes=None):
    """The ids of ``module``'s forward, forward pre-, backward and backward pre-hooks, by kind (a handle's id is
    never reused: a hook removed and another added give other ids); from ``attributes``, its dict as recorded,
    where given."""
    hooks = vars(module) if attributes is None else attributes
    return tuple(tuple(hooks.get(kind) or ()) for kind in HOOK_KINDS)


def global_hook_handles():
    """The ids of the process's global module hooks, as :func:`hook_handles`."""
    return tuple(tuple(getattr(_module_globals, f"_global{kind}")) for kind in HOOK_KINDS)
