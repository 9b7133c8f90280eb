r"""Saved passes against changed state: the versions of what a later pass reads again without a copy.

Four objects keep a pass and run it again later: ``input_grad``'s backward, a ``z_curvature``
operator's products, ``implicit_argmin``'s backward and ``cached_backward``'s second pass. Each
replays from a :class:`~mixedad._ground.state.Snapshot` what the snapshot holds: the random
state, the buffers it copied (those of train-mode modules, and the small ones of eval-mode
modules), the buffer objects and the plain attributes (the train/eval mode too). What the pass
reads again is checked here, as autograd checks the tensors a graph saves, through
``tensor._version``:

- **the parameters** of G's modules, under their names in G's ``named_parameters()``: the same
  tensor object, at the same version (an in-place write under ``torch.no_grad()``, an optimizer
  step and ``load_state_dict`` all bump it; a replaced parameter is another object);
- **the buffers the snapshot does not copy** (large buffers of eval-mode modules), and **the
  eval-mode buffers it copied that the saved pass read** (double backward saves those, as eval
  batch norm's running statistics, and refuses a change): the same version (a replaced one is
  fine: the replay puts the recorded object back). Train-mode buffers, and copied ones the pass did
  not read (a step counter), are replayed from their copies. A G made of torch.nn's own layers is
  not watched as it runs (it reads nothing but its parameters, buffers and inputs): what their
  forwards read in eval mode among the buffers a snapshot copied counts as read
  (:func:`mixedad._hooks.batch_norm.read_in_eval`);
- **the inputs the object keeps** (z, y's leaves, z_star): the same version;
- **every other tensor the saved pass read** that it did not make (a tensor G closes over, seen
  by :mod:`mixedad._ground.watch` while the pass ran): the same version.

.. math::

    \text{check} = \bigwedge_{(t,\, v) \in \text{saved}} \big(\mathrm{version}(t) = v\big)

A change raises :class:`StateChangedError` before anything is computed, so a result never mixes
the state saved with the new one. A check holds a list of (tensor, version) pairs, no copies.
As for autograd, a write through ``.data`` bypasses the version counter and is not seen.
mixedad's own restores write only what a snapshot copied, which is not checked, so a replay
never trips a check; where such a restore writes a watched buffer (its module was switched to train
mode since, so the caller's snapshot copied it), :meth:`Versions.refresh` takes its version again.
This module reads a snapshot's ``modules`` and, for each entry of its ``watched`` list, ``tensor``,
``module``, ``name`` and ``version``.
"""
import contextlib
import operator

import torch
from torch import nn

from mixedad._hooks.batch_norm import read_in_eval
from mixedad._hooks.pytree import keystr, tree_flatten_with_path
from mixedad._hooks.tensor_kinds import storage_id
from mixedad._ground.structure import ClassStructure, Structure

__all__ = ["StateChangedError", "Versions", "input_labels"]


class StateChangedError(RuntimeError):
    r"""G's state, or an input that a saved pass keeps, changed between the call that saved the pass and its use.

    Raised by ``input_grad``'s backward, a ``z_curvature`` operator's methods, ``implicit_argmin``'s
    backward and ``cached_backward``'s second pass when a tensor :math:`t` they read again moved
    from the version :math:`v` it had when the pass was saved (or was replaced by another tensor):

    .. math::

        \mathrm{version}(t) \ne v

    Computing then would mix the saved state with the new one; call again after the change.

    Example:
        >>> import torch, mixedad
        >>> G = torch.nn.Linear(3, 3).double()
        >>> op = mixedad.z_curvature(lambda y, g: ((g - y) ** 2).sum(), G, torch.ones(3).double(), torch.ones(3).double())
        >>> with torch.no_grad():
        ...     _ = G.weight.mul_(2.0)
        >>> try:
        ...     op @ torch.ones(3).double()
        ... except mixedad.StateChangedError as error:
        ...     print(str(error)[:72])
        z_curvature(f, G, z, y): the parameter weight of G was modified in place
    """


def _version(tensor):
    """The version counter; None for an inference tensor, which has none."""
    return None if tensor.is_inference() else tensor._version


def input_labels(name, tree):
    """How messages name the tensors of an argument, in the order of its leaves.

    A tensor is ``name``; a tuple of tensors gives ``name[i]``; any other tree gives
    ``name's leaf i (name['key'])``.
    """
    if isinstance(tree, torch.Tensor):
        return [name]
    pairs = tree_flatten_with_path(tree)[0]
    if isinstance(tree, (tuple, list)) and all(len(path) == 1 for path, _ in pairs):
        return [name + keystr(path) for path, _ in pairs]
    return [f"{name}'s leaf {i} ({name}{keystr(path)})" for i, (path, _) in enumerate(pairs)]


def _roots(G, modules):
    """G itself when it is a module; else the recorded modules that are not inside another recorded one."""
    if isinstance(G, nn.Module):
        return [G]
    roots, covered = [], set()
    for module in modules:
        if id(module) not in covered:
            roots.append(module)
            covered.update(id(m) for m in module.modules())
    return roots


def _owner_of(G, root, owner):
    """How messages name a root: G itself, or a module G calls."""
    return owner if root is G else f"the {type(root).__name__} that {owner} calls"


class Versions:
    """What a saved pass reads again without a copy, with its version when the pass was saved.

    Args:
        call: the public call, to open messages with.
        G: the module or callable whose state is recorded.
        snapshots: the snapshots the pass replays from (their modules, for a G that is not a
            module, the buffers they copied or watch, and the tensors the pass read: watch it with
            ``snapshot.watching(reads=True)``).
        inputs: ``(label, tensor)`` pairs the object keeps (z, y's leaves, z_star).
        owner: how messages name G ("G", or "f" for ``cached_backward``).
        after: what the change came after, for messages ("the call that saved this backward pass").
        fix: what to do, for messages.
    """

    def __init__(self, call, G, snapshots, inputs, *, owner="G", after, fix):
        self.call, self.after, self.fix, self.snapshots, self.owner = call, after, fix, snapshots, owner
        modules = []
        for snapshot in snapshots:
            modules += snapshot.modules
        # The buffers snapshots watch without a copy, and the eval-mode ones they copied that the saved pass read
        # (double backward saves those, as eval batch norm's running statistics, and refuses a change). Train-mode
        # buffers, and copied ones the pass did not read, are replayed from their copies.
        read = {id(t) for snapshot in snapshots for t in snapshot.reads.tensors}
        # A G of torch.nn's own layers is not watched as it runs (it reads only its parameters, buffers and inputs):
        # what its layers' eval-mode forwards read among the buffers a snapshot copied counts as read.
        read |= {id(e.tensor) for snapshot in snapshots if snapshot.torch_only for e in snapshot.saved
                 if read_in_eval(e.module, e.name)}
        watched = {id(entry.tensor): entry for snapshot in snapshots
                   for entry in [*snapshot.watched, *(e for e in snapshot.saved if not e.always and id(e.tensor) in read)]}
        replayed = {id(e.tensor) for snapshot in snapshots for e in snapshot.saved if e.always}
        self.params, self.buffers, seen, every_buffer, every_module = [], [], set(), set(), {}
        for root in _roots(G, modules):
            of = _owner_of(G, root, owner)
            found = []
            for prefix, module in root.named_modules():  # named_parameters()'s and named_buffers()' names and order
                every_module.setdefault(id(module), module)
                for local, p in module._parameters.items():
                    if p is not None and id(p) not in seen:
                        seen.add(id(p))
                        found.append((prefix + "." + local if prefix else local, p, module, local))
                for local, b in module._buffers.items():
                    if b is not None and id(b) not in every_buffer:
                        every_buffer.add(id(b))
                        entry = watched.pop(id(b), None)
                        if entry is not None:
                            self.buffers.append([f"the buffer {prefix + '.' + local if prefix else local} of {of}", b,
                                                 _version(b)])
            params = [p for _, p, _, _ in found]
            names = [(name, p, version, stamp, module, local) for (name, p, module, local), version, stamp
                     in zip(found, _versions(params), _stamps(params))]
            self.params.append((root, of, names, _Quick(names)))
        for entry in watched.values():  # a plain tensor attribute, or a buffer outside the roots
            label = f"the tensor {entry.name} of a {type(entry.module).__name__} that {owner} calls"
            self.buffers.append([label, entry.tensor, _version(entry.tensor)])
        self.inputs = [(label, t, _version(t)) for label, t in inputs if isinstance(t, torch.Tensor)]
        self._modules, self._held = list(every_module.values()), []
        self.structure = [Structure(m, self._held) for m in self._modules]
        self.classes = [ClassStructure(cls, self._held) for cls in {type(m): None for m in self._modules}]
        known = seen | replayed | every_buffer | {id(t) for _, t, _ in self.inputs}
        reads = {id(t): t for snapshot in snapshots for t in snapshot.reads.tensors if id(t) not in known}
        self.reads = [(_read_label(t, owner), t, _version(t)) for t in reads.values()]

    def check(self):
        """Raise :class:`StateChangedError` if anything recorded changed since."""
        changed = [record for record in self.structure if not record.holds()]
        for root, of, names, quick in self.params:
            # Where every module holds the children it held, a parameter is found in its module, by its own name.
            if not changed and quick.holds():
                continue
            now = dict(root.named_parameters())
            for name, p, version, stamp, _, _ in names:
                if now.get(name) is not p:
                    self._raise(f"the parameter {name} of {of}", "replaced by another tensor" if name in now
                                else "removed")
                if _version(p) != version:
                    self._raise(f"the parameter {name} of {of}", "modified in place", version, _version(p))
                if _stamp(p) != stamp:
                    self._raise(f"the parameter {name} of {of}", "given other data (its dtype, device or storage: "
                                                                 "G.to(), .float(), .half(), or .data = ...)")
        for label, t, version in [*self.buffers, *self.inputs, *self.reads]:
            if _version(t) != version:
                self._raise(label, "modified in place", version, _version(t))
        for record in changed:
            module = record.module
            self._raise(f"the {type(module).__name__} {_name_of(module, self._modules[0])}",
                        "changed (a module added, removed or replaced, a hook, or an attribute that is not a "
                        "number, string or tensor: a configuration, a generator, a method)")
        for record in self.classes:
            if not record.holds():
                self._raise(f"the class {record.cls.__qualname__} of {self.owner}'s modules", "changed (a class "
                            "attribute, or a global its forward names)")

    @contextlib.contextmanager
    def replaying(self, snapshot, *, every_op=True):
        """The saved pass replayed inside the block, from ``snapshot`` (or snapshots of this record, which the
        block restores): :meth:`check` first; after the block, G as the caller had it before (through
        ``snapshot.undoing()``), and :meth:`refresh`. ``every_op``: watch every op for a generator G draws from
        first; without it, only the ops mixedad's dispatch sees (a pass that replays one watched before draws from
        the sources it saw)."""
        self.check()
        undo = snapshot.undoing()
        try:
            with undo.watching(mode=every_op):
                yield
        finally:
            undo.restore()
            self.refresh()

    def refresh(self):
        """Take the watched buffers' versions again after a pass and mixedad's own restore of the caller's state.

        Call it once :meth:`check` passed before the pass and the restore after it succeeded: a
        snapshot taken while a module was in train mode copies its buffers and always writes them
        back, which bumps their versions, so a module switched to train mode after the pass was
        saved (the pass replays its eval mode) has its watched buffers written by that restore,
        from a copy of the values :meth:`check` found unchanged. The snapshots' own records of
        those buffers (which refuse a change in place during a pass) move with them.
        """
        for entry in self.buffers:
            entry[2] = _version(entry[1])
        for snapshot in self.snapshots:
            for watched in snapshot.watched:
                watched.version = _version(watched.tensor)

    def _raise(self, what, how, before=None, now=None):
        counts = f" (version {before}, now {now})" if before is not None else ""
        raise StateChangedError(
            f"{self.call}: {what} was {how} after {self.after}{counts}. Computing with it would mix the state "
            f"saved then with the new one. {self.fix}"
        )


class _Quick:
    """A quick test that every parameter recorded is where, at the version and with the data it was recorded (in
    C, over all of them at once): the common case of :meth:`Versions.check` before each use."""

    def __init__(self, names):
        self.params = [p for _, p, _, _, _, _ in names]
        self.dicts, self.locals = [m._parameters for *_, m, _ in names], [local for *_, local in names]
        self.versions, self.stamps = [v for _, _, v, _, _, _ in names], [s for _, _, _, s, _, _ in names]

    def holds(self):
        try:
            return (all(map(operator.is_, map(dict.get, self.dicts, self.locals), self.params))
                    and list(map(_VERSION, self.params)) == self.versions
                    and list(zip(map(_SHAPE, self.params), map(_DATA_PTR, self.params))) == self.stamps)
        except (RuntimeError, TypeError):  # an inference tensor (no version), a scripted module (no dict of
            return False  # parameters): the test one at a time tells


_VERSION, _SHAPE, _DATA_PTR = operator.attrgetter("_version"), operator.attrgetter("shape"), operator.methodcaller("data_ptr")


def _versions(tensors):
    """:func:`_version` of each tensor, in C where none is an inference tensor (the common case)."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        return list(map(_version, tensors))


def _stamps(tensors):
    """:func:`_stamp` of each tensor, in C where each has one address (the common case)."""
    try:
        return list(zip(map(_SHAPE, tensors), map(_DATA_PTR, tensors)))
    except RuntimeError:
        return list(map(_stamp, tensors))


def _stamp(t):
    """What a parameter's data is, beyond its version: ``.data = ...`` and ``module.to()`` replace it unversioned
    (data of another dtype or device is new memory, allocated while the old was alive: another address)."""
    return t.shape, _address(t)


def _address(t):
    try:
        return t.data_ptr()
    except RuntimeError:  # a layout without one address (sparse): its storage's identity
        return storage_id(t)


def _name_of(module, root):
    """``module``'s name in G (``'3'``, ``'net.1'``), quoted, or '' where it has none under ``root``."""
    for name, m in root.named_modules():
        if m is module:
            return f"'{name}' of G" if name else "G"
    return "that G calls"


def _read_label(t, owner):
    closes = owner if owner == "f" else f"{owner} or f"
    return (f"a tensor of shape {tuple(t.shape)} and dtype {str(t.dtype).replace('torch.', '')} that the saved pass "
            f"reads (neither a parameter nor a buffer of {owner}: a tensor {closes} closes over?)")
