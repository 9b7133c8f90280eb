"""What a replay of G's modules takes from them that no snapshot restores: their structure, recorded and checked.

A saved pass (``input_grad``'s backward, a ``z_curvature`` operator, ``implicit_argmin``'s backward) runs
G's modules again later. :mod:`mixedad._ground.state` replays their plain attributes (numbers,
strings, tensors, the train/eval mode) and buffers, and :mod:`mixedad._ground.versions` checks
their parameters' versions; what is left is each module's **structure**: its identity, hooks and
children, its other attributes (configurations, generators, methods), and its class's attributes
and the globals its ``forward`` names. :func:`structure_of` and :func:`class_structure` key those
as :mod:`mixedad._programs.key` keys a program.

:class:`Structure` and :class:`ClassStructure` record them and answer, before each use, whether they
still hold. The common case, nothing changed, is answered by one comparison of each namespace with a
copy taken when recorded (in C); a key is computed again only where that comparison fails, and only
where the copy cannot stand for the namespace as it was (an object compared by its contents in
depth, which a shallow copy does not keep) is it computed when recorded.
"""
from typing import Any, List

import torch
from torch import nn

from mixedad._hooks.module_hooks import HOOK_KINDS, MODULE_INTERNALS, hook_handles
from mixedad._ground.fingerprints import SIMPLE_TYPES, class_key, fingerprint, forward_globals, own_classes

__all__ = ["ClassStructure", "Structure", "class_structure", "structure_of"]

#: Attribute types a snapshot of G restores itself (:func:`mixedad._ground.state.plain_attributes`).
_REPLAYED = (bool, int, float, str, type(None), torch.Tensor)


def structure_of(module, held, attributes=None):
    """What a replay of ``module`` takes from it that no snapshot restores: its identity, hooks and children, and its
    attributes but numbers, strings and tensors (a snapshot replays those; parameters and buffers are versioned
    apart), read from ``attributes`` (its dict as recorded) where given. With :func:`class_structure` of its class,
    equal where the module runs the same code on the same configuration."""
    if isinstance(module, torch.jit.ScriptModule):  # compiled code and attributes: its identity says what runs
        return (id(module),)
    attributes = module.__dict__ if attributes is None else attributes
    children = attributes["_modules"]
    key: List[Any] = [id(module), hook_handles(module, attributes), tuple(children), tuple(map(id, children.values()))]
    for name, value in attributes.items():
        if name not in MODULE_INTERNALS and not isinstance(value, _REPLAYED):
            key += (name, type(value), fingerprint(value, held))
    return tuple(key)


def class_structure(cls, held):
    """What a module's code takes from its class: the class's attributes and the globals its forward names (one
    per class, however many modules share it)."""
    return class_key(cls, held)


class _Copy:
    """A namespace (a module's or a class's dict) as recorded, for a quick test that a key computed from it still
    holds: one comparison of the namespace with a copy (:meth:`same`), which is equal where it holds the same
    names in the same order, bound to the same objects (or, where one was replaced, to an equal one).

    The mutable objects a key reads by their contents are copied too, so that a change in place shows: the dicts
    named in ``also``, and lists, dicts and sets of values fixed by their identity among the names ``read`` (all
    but ``skip``) says the key reads. Where the key reads an object's contents in depth (a container of other
    objects, a configuration object), ``deep`` is True: the copy does not stand for the namespace as it was. The
    objects are held, so that identity means what it says.
    """

    __slots__ = ("copy", "deep")

    def __init__(self, namespace, read, *, also=(), skip=frozenset()):
        copy, self.deep = dict(namespace), False
        for name in also:
            held = copy.get(name)
            if held is not None:  # an empty one (most hook dicts) as the one empty dict: equal until written
                copy[name] = type(held)(held) if held else _EMPTY
        for name in copy.keys() - skip:
            value = copy[name]
            kind = type(value)
            if kind in SIMPLE_TYPES or (kind is tuple and all(map(SIMPLE_TYPES.__contains__, map(type, value)))):
                continue
            if not read(name, value) or _by_identity(value):
                continue
            if type(value) in (list, dict, set) and all(map(_by_identity, value.values() if type(value) is dict
                                                                      else value)):
                copy[name] = type(value)(value)
            else:
                self.deep = True
        self.copy = copy

    def same(self, namespace):
        """Whether ``namespace`` compares equal to the copy (an object's ``==`` that raises, as a tensor's, says
        no)."""
        try:
            return not self.deep and bool(namespace == self.copy)
        except Exception:  # noqa: BLE001 - a value replaced by one whose == is not a truth value
            return False


_EMPTY: dict = {}  # never written: stands for every empty dict a copy holds


def _by_identity(value):
    """Whether :func:`~mixedad._ground.fingerprints.fingerprint` of ``value`` is fixed by the object itself: a simple
    value, a tuple of them, a module, class, Python module or function (by identity), an inference tensor (which
    has no version)."""
    kind = type(value)
    if kind in SIMPLE_TYPES:
        return True
    if kind is tuple:
        return all(map(_by_identity, value))
    if isinstance(value, torch.Tensor):
        return value.is_inference()
    if isinstance(value, (nn.Module, type, type(torch))):
        return True
    return callable(value) and not isinstance(value, (list, dict, set))


def _read_by_structure(name, value):
    return not isinstance(value, _REPLAYED)


def _not_dunder(name, value):
    return not name.startswith("__")


def _any(name, value):
    return True


class Structure:
    """:func:`structure_of` a module when recorded, and whether it still holds (:meth:`holds`): its dict compared
    with a copy (:class:`_Copy`, children and hooks included); where that fails, :func:`structure_of` the module
    now against the copy's (or, for a copy that cannot stand for the dict, against the key taken when recorded).
    """

    __slots__ = ("module", "namespace", "key")

    def __init__(self, module, held):
        self.module, self.namespace, self.key = module, None, None
        if isinstance(module, torch.jit.ScriptModule):  # keyed by its identity alone
            self.key = structure_of(module, held)
            return
        self.namespace = _Copy(vars(module), _read_by_structure, also=("_modules", *HOOK_KINDS), skip=MODULE_INTERNALS)
        if self.namespace.deep:
            self.key = structure_of(module, held)

    def holds(self):
        """Whether :func:`structure_of` the module is what it was."""
        if self.namespace is not None and self.namespace.same(vars(self.module)):
            return True
        before = self.key if self.namespace is None or self.key is not None else structure_of(
            self.module, [], self.namespace.copy)
        return structure_of(self.module, []) == before


class ClassStructure:
    """:func:`class_structure` of a module class when recorded, and whether it still holds (:meth:`holds`): the
    dict of each class of its MRO up to ``nn.Module``, and the globals its forward names, compared with copies
    (:class:`_Copy`); where that fails, the key now against the copies' (or the key taken when recorded)."""

    __slots__ = ("cls", "classes", "globals", "key")

    def __init__(self, cls, held):
        self.cls = cls
        if issubclass(cls, torch.jit.ScriptModule):  # compiled code: a scripted module is keyed by its identity
            self.classes, self.globals, self.key = [], _Copy({}, _any), None
            return
        self.classes = [(c, _Copy(vars(c), _not_dunder)) for c in own_classes(cls)]
        self.globals = _Copy(self._globals(), _any)
        deep = self.globals.deep or any(namespace.deep for _, namespace in self.classes)
        self.key = class_structure(cls, held) if deep else None

    def _globals(self):
        if not self.classes:
            return {}
        glob, used = forward_globals(self.cls)
        return {n: glob.get(n) for n in used}

    def holds(self):
        """Whether :func:`class_structure` of the class is what it was."""
        if all(namespace.same(vars(c)) for c, namespace in self.classes) and self.globals.same(self._globals()):
            return True
        before = self.key if self.key is not None else class_key(
            self.cls, [], [namespace.copy for _, namespace in self.classes], list(self.globals.copy.values()))
        return class_structure(self.cls, []) == before
