"""Leaving G as it was: RNG replay and buffer snapshots.

Policy, for every mixedad call:

- **Random state (dropout, noise).** Every pass through G within one call sees the random state
  the call's own forward pass saw, so all passes draw the same numbers. After the call every
  random source (torch's global CPU and CUDA generators, each ``torch.Generator`` G's ops
  receive, Python's ``random``, NumPy's global generator: :mod:`mixedad._ground.random_state`)
  is where one plain forward of G on z would have left it: forward passes advance them exactly as
  the naive code does, and replays (input_grad's backward, a fallback after a failed attempt) are
  undone.
- **Buffers (BatchNorm running statistics, num_batches_tracked).** They are updated exactly as
  one plain train-mode forward of G on z (per chunk, as the chunked naive code would) updates
  them, never twice: replays restore the buffers they touched. They never hold a dual tensor.

What a snapshot keeps, per buffer (keyed by module and attribute name):

- **Buffers of train-mode modules** (BatchNorm's statistics, spectral norm's ``u``/``v``):
  copied by value, and always copied back on restore (BatchNorm's kernel updates its running
  statistics without bumping their version counters, so a change cannot be detected cheaply).
- **Small buffers of eval-mode modules**, at most :data:`SMALL_BUFFER_BYTES` each (step
  counters, EMAs such as StyleGAN's ``w_avg``): copied by value too, and copied back when their
  version counter shows an in-place change. Unchanged ones are not written, so a graph of the
  caller's that saved them (eval BatchNorm saves its running statistics) stays valid.
- **Larger buffers of eval-mode modules** (attention masks, rotary caches): not copied, which
  would cost memory per snapshot; watched through their version counters instead. If one
  changes in place in a pass that must be undone, restoring raises instead of leaving G
  silently changed.
- **Reassigned buffers** (``self.n = self.n + 1`` replaces the buffer object): restoring puts
  the original object back under its name, then restores its values as above.
- **Plain attributes** of G's modules (a Python ``int`` step count, a flag, a tensor cached in
  ``self.cache``): kept by reference, so a reassignment is undone and an attribute that an undone
  pass created is removed. A plain tensor attribute written in place is not undone.

When G is an ``nn.Module`` its modules are known up front; when
it is any other callable (a lambda or function around modules), the modules are recorded as
they first run inside :meth:`Snapshot.watching`, through a global forward pre-hook that exists
only for that block.
"""
import contextlib
import operator
import threading
from itertools import repeat

import torch
from torch import nn

from mixedad._ground import random_state, watch
from mixedad._ground.random_state import RandomState, is_source, source_types
from mixedad._ground.reach import reached
from mixedad._hooks.module_hooks import MODULE_INTERNALS
from mixedad._hooks.sequential import forward_hooks
from mixedad._hooks.torch_function_stack import unseen

#: The largest buffer (in bytes) of an eval-mode module that every snapshot copies by value;
#: larger ones are only watched, and changing one in place in a pass that must be undone raises.
#: 4 KiB holds counters, scalars and EMAs up to 512 float64 values, at a memory cost per
#: snapshot (input_grad and cached_backward keep one per chunk) of at most 4 KiB per buffer.
SMALL_BUFFER_BYTES = 4096


class Snapshot:
    """The random state and G's mutable buffers, to undo passes through G.

    Run the passes to undo inside ``with snapshot.watching():`` (which records the generators G's
    ops receive, and the modules of a G that is not an ``nn.Module``), then call :meth:`restore`. ``modules`` records modules
    of a non-Module G up front (those another snapshot has seen run); :attr:`modules` lists the
    modules recorded so far.
    """

    def __init__(self, G, *, modules=(), call="mixedad"):
        with unseen():  # bookkeeping, never G's ops to a pass's modes
            self._capture(G, modules, call)

    def _capture(self, G, modules, call):
        self.call, self._G = call, G  # the public call, for the message of a buffer that cannot be restored
        self._upfront = isinstance(G, nn.Module)
        modules = list(G.modules()) if self._upfront else modules
        #: Whether G is a module of torch.nn's own layers with no hooks: it draws from no generator it is given and
        #: no host random state, and reads no tensor but its parameters, its buffers and its inputs.
        self.torch_only = self._upfront and _torch_layers_only(modules)
        self.rng = RandomState(G, host=not self.torch_only)
        self.saved, self.watched, self._seen, self.modules = [], [], set(), []
        self.attributes = []  # each module's plain attributes (_Attributes)
        self._untouched = None  # the quick test of what is recorded, built on first use after a module is recorded
        self._positions = self._entries = None  # by id of each module recorded: its position in modules, its
        # buffer records; built on first use
        #: The tensors the passes watched with ``reads=True`` read that they did not make.
        self.reads = watch.Reads()
        if not self._upfront:  # the random sources a function G closes over (a module's are its attributes)
            for source in reached(G):
                if is_source(source):
                    self.rng.hold(source)
        for module in modules:
            self._record(module)

    def _record(self, module, *_):
        if id(module) in self._seen:
            return
        with unseen():
            self._record_new(module)

    def _record_new(self, module):
        self._untouched = self._positions = self._entries = None
        self._seen.add(id(module))
        self.modules.append(module)
        torch_layer = type(module).__module__.startswith("torch.nn.")
        if not torch_layer:  # torch.nn's own layers keep no random source
            kinds, d = source_types(), vars(module)
            for name in d.keys() - MODULE_INTERNALS:  # a generator the module keeps: its state before it draws
                if isinstance(d[name], kinds) and is_source(d[name]):
                    self.rng.hold(d[name])
        attributes = _Attributes(module)
        self.attributes.append(attributes)
        tensors = [(name, value, _TensorAttribute) for name, value in attributes.values.items()
                   if isinstance(value, torch.Tensor)] if attributes.tensors else ()
        for name, buf, kind in [*((n, b, _Buffer) for n, b in module._buffers.items()), *tensors]:
            if buf is None:
                continue
            entry = kind(module, name, buf)
            if module.training or entry.nbytes <= SMALL_BUFFER_BYTES:
                entry.copy, entry.always = buf.detach().clone(), module.training
                self.saved.append(entry)
            else:
                self.watched.append(entry)

    @contextlib.contextmanager
    def private_buffers(self):
        """G runs on copies of the recorded buffers inside the block; the recorded tensors are put back after.

        For a graph kept beyond the block (``z_curvature(keep_graph=True)``): the tensors it saves
        (BatchNorm saves its running statistics) are the copies, so restoring the user's buffers in
        place later does not invalidate it, and the user's tensors are never written by G.
        """
        swapped = []
        for entry in self.saved:
            current = entry.current()
            if current is entry.tensor:
                copy = entry.tensor.detach().clone()
                entry.place(copy)
                swapped.append((entry, copy))
        try:
            yield self
        finally:
            for entry, _ in swapped:
                entry.place(entry.tensor)

    @contextlib.contextmanager
    def watching(self, *, reads=False, mode=True):
        """Record, before they first run, the generators G's ops receive and the modules a non-Module G calls
        inside the block; with ``reads``, also every tensor its ops read that the block did not make
        (:attr:`reads`, for a saved pass's :class:`~mixedad._ground.versions.Versions`). Without ``mode``, the
        block starts the watch itself where G or f runs (:func:`mixedad._ground.watch.ops`), or runs them through
        mixedad's per-op pass, whose dispatch notes the generators: mixedad's own bookkeeping is not watched."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(random_state.watching(self.rng, mode=mode))
            if reads:
                stack.enter_context(watch.observing("reads", self.reads, mode=mode))
            if not self._upfront:  # the hook is the process's: only this thread's modules are G's
                thread = threading.get_ident()
                record = lambda module, *_: self._record(module) if threading.get_ident() == thread else None  # noqa: E731
                stack.callback(nn.modules.module.register_module_forward_pre_hook(record).remove)
            yield self

    def restore(self):
        """Put back the random state and every recorded buffer (object and values).

        Raises:
            RuntimeError: a watched eval-mode buffer (larger than :data:`SMALL_BUFFER_BYTES`)
                was changed in place; everything else is restored first.
        """
        with unseen():
            self.rng.restore()
            self._restore_modules()

    def current(self):
        """Whether G's modules hold now what this snapshot recorded (or last restored): every plain attribute, and
        every buffer by object and version, checked without writing. Never where a buffer is copied back
        unconditionally (of a module in train mode: BatchNorm writes its statistics without a version bump)."""
        untouched = self._quick()
        return not untouched.always and untouched.holds()

    def _quick(self):
        if self._untouched is None:
            self._untouched = _Untouched(self.attributes, [*self.saved, *self.watched])
        return self._untouched

    def undoing(self):
        """What puts G back as the caller has it now after passes that replay this snapshot (``.watching()`` the
        passes, ``.restore()`` after): where G's modules hold now what this snapshot recorded (:meth:`current`),
        this snapshot's modules and the random state taken now; else a snapshot of its own."""
        if self._upfront and self.current():
            return _Undo(self)
        return Snapshot(self._G, modules=self.modules, call=self.call)

    def part(self, part):
        """A snapshot of ``part`` of G (a segment of it), taken now, before ``part`` runs.

        Where ``part`` is a module whose modules this snapshot recorded (a slice of an ``nn.Sequential`` G, whose
        own container holds nothing), none of them in train mode with buffers, and they hold now what this
        snapshot recorded, restoring this snapshot's modules puts ``part``'s back as they are now: the result
        takes the random state now and shares this snapshot's records, with no second copy of their buffers.
        Else a snapshot of its own.
        """
        if isinstance(part, nn.Module):
            modules = self._within(part)
            untouched = None if modules is None else self._quick_of(modules)
            if untouched is not None and not untouched.always and untouched.holds():
                return _Part(self, untouched, modules)
        return Snapshot(part, call=self.call)

    def _within(self, part):
        """``part``'s modules, where this snapshot recorded them all (but ``part`` itself where it is a plain
        ``nn.Sequential`` slice, which holds nothing); else None."""
        positions, _ = self._index()
        if id(part) not in positions and not (type(part) is nn.Sequential and not forward_hooks(part)
                                              and not part._buffers):
            return None
        modules = [m for m in part.modules() if m is not part or id(m) in positions]
        return modules if all(id(m) in positions for m in modules) else None

    def _quick_of(self, modules):
        """The quick test (:class:`_Untouched`) of some of the modules recorded."""
        positions, entries = self._index()
        return _Untouched([self.attributes[positions[id(m)]] for m in modules],
                          [entry for m in modules for entry in entries.get(id(m), ())])

    def _index(self):
        """By id of each module recorded: its position in :attr:`modules`, and its buffers' records."""
        if self._positions is None:
            self._positions = {id(m): i for i, m in enumerate(self.modules)}
            self._entries = {}
            for entry in [*self.saved, *self.watched]:
                self._entries.setdefault(id(entry.module), []).append(entry)
        return self._positions, self._entries

    def _restore_modules(self):
        untouched = self._quick()
        if not untouched.always and untouched.holds():
            return  # nothing to write
        for attributes in self.attributes:
            attributes.restore()
        with torch.no_grad():
            for entry in self.saved:
                entry.put_back()
                # Train-mode buffers always: BatchNorm updates its statistics without a version bump.
                if entry.always or entry.changed():
                    entry.tensor.copy_(entry.copy)
                    entry.version = _version(entry.tensor)
        for entry in self.watched:
            entry.put_back()
        for entry in self.watched:
            if entry.changed():
                raise RuntimeError(
                    f"{self.call}: G changed the buffer {entry.label} of a module in eval mode in place during a "
                    f"pass that had to be undone, and mixedad could not restore it: snapshots copy "
                    f"eval-mode buffers of at most {SMALL_BUFFER_BYTES} bytes, and this one holds "
                    f"{entry.nbytes}. Put that module in train mode (its buffers are then copied), "
                    f"replace the buffer instead of writing into it (self.{entry.name} = new_value), or "
                    f"stop it mutating buffers."
                )


class _Untouched:
    """A quick test, over all a snapshot's modules at once (in C), that nothing it recorded changed since it recorded
    or last restored: each module's dict holds as many names as it held and its plain attributes the very objects
    they were, and every buffer is the same tensor at the same version (:meth:`holds`): the common case of a restore,
    which then writes nothing. ``always`` says whether the snapshot copies buffers back whatever their version
    (train mode). Built from the modules' records (:class:`_Attributes`) and their buffers' (a snapshot's, or a part
    of them: :meth:`Snapshot._within`).
    """

    def __init__(self, attributes, entries):
        self.dicts, self.sizes = [vars(a.module) for a in attributes], [len(a.recorded) for a in attributes]
        self.owners = [vars(a.module) for a in attributes for _ in a.values]
        self.names = [name for a in attributes for name in a.values]
        self.values = [value for a in attributes for value in a.values.values()]
        self.entries = entries
        self.places = [entry.namespace() for entry in self.entries]
        self.buffers = [entry.name for entry in self.entries]
        self.tensors = [entry.tensor for entry in self.entries]
        self.always = any(entry.always for entry in self.entries)

    def holds(self):
        try:
            return (list(map(len, self.dicts)) == self.sizes
                    and all(map(operator.is_, map(dict.get, self.owners, self.names, repeat(_ABSENT)), self.values))
                    and all(map(operator.is_, map(dict.get, self.places, self.buffers), self.tensors))
                    and list(map(_VERSION, self.tensors)) == [entry.version for entry in self.entries])
        except RuntimeError:  # an inference tensor has no version: the test one at a time tells
            return False


_VERSION = operator.attrgetter("_version")


class _Attributes:
    """A module's dict when recorded (a shallow copy: its objects by reference), of which a snapshot restores the
    plain attributes (:attr:`values`)."""

    __slots__ = ("module", "recorded", "tensors", "_values")

    def __init__(self, module):
        self.module, self.recorded, self._values = module, dict(vars(module)), None
        #: Whether a tensor is among its attributes (then perhaps a plain one, which the snapshot copies or watches).
        self.tensors = any(map(isinstance, self.recorded.values(), repeat(torch.Tensor)))

    @property
    def values(self):
        """The plain attributes recorded (:func:`plain_attributes`), found on first use."""
        if self._values is None:
            self._values = _plain(self.recorded)
        return self._values

    def unchanged(self):
        """Whether the module's dict holds the names and the very objects it held (in C: the common case)."""
        d = self.module.__dict__
        return (len(d) == len(self.recorded)
                and all(map(operator.is_, map(d.get, self.recorded, repeat(_ABSENT)), self.recorded.values())))

    def restore(self):
        """Put back every recorded plain attribute that was reassigned, and remove the plain ones made since."""
        if self.unchanged():
            return
        d, values = self.module.__dict__, self.values
        for name in plain_attributes(self.module).keys() - values.keys():
            del d[name]  # made by a pass that is undone (a cache, a step count)
        # Against the module's own dict: an attribute set to something no snapshot records (a trace's proxy) is
        # put back too.
        d.update((name, value) for name, value in values.items() if d.get(name, _ABSENT) is not value)


class _Part:
    """A snapshot of a part of G taken while the part's modules held what ``whole`` recorded (:meth:`Snapshot.part`):
    the random state then, and ``whole``'s records of the modules, which its restore puts back where the part's
    modules no longer hold them (``untouched``: the quick test of the part's modules)."""

    saved = watched = ()  # the records are whole's

    def __init__(self, whole, untouched, modules):
        self.whole, self.call, self.torch_only, self._untouched = whole, whole.call, whole.torch_only, untouched
        self.modules = modules  #: the part's modules (recorded by whole)
        self.rng = whole.rng.again()
        self.reads = watch.Reads()  # reads are watched by whole's snapshot

    def watching(self, *, mode=True):
        """Inside the block, generators first seen are recorded before they draw (as :meth:`Snapshot.watching`)."""
        return random_state.watching(self.rng, mode=mode)

    def restore(self):
        with unseen():
            self.rng.restore()
            if not self._untouched.holds():  # modules outside the part are not what it computes with
                self.whole._restore_modules()


class _Undo:
    """Puts G back as the caller has it now, where its modules hold what ``snapshot`` recorded: that snapshot's
    modules, and the random state as it is now (:meth:`Snapshot.undoing`)."""

    def __init__(self, snapshot):
        self.snapshot, self.rng = snapshot, snapshot.rng.again()

    def watching(self, *, mode=True):
        """Inside the block, generators first seen are recorded before they draw (as :meth:`Snapshot.watching`)."""
        return random_state.watching(self.rng, mode=mode)

    def restore(self):
        with unseen():
            self.snapshot._restore_modules()
            self.rng.restore()


class _Buffer:
    """One buffer, by module and attribute name: the tensor object there when recorded.

    ``copy`` holds its values when the snapshot copies it, else None; ``always`` says whether
    restoring writes them back unconditionally (train mode) or only after an in-place change.
    """

    __slots__ = ("module", "name", "tensor", "copy", "always", "version", "nbytes")

    def __init__(self, module, name, tensor):
        self.module, self.name, self.tensor, self.copy, self.always = module, name, tensor, None, False
        self.version = _version(tensor)
        self.nbytes = tensor.nbytes

    @property
    def label(self):
        """How messages name it."""
        return f"{type(self.module).__name__}.{self.name}"

    def namespace(self):
        """The dict the module holds this tensor in, under its name."""
        return self.module._buffers

    def current(self):
        """The tensor the module holds under this name now."""
        return self.namespace().get(self.name)

    def place(self, tensor):
        """Make ``tensor`` the module's buffer under this name."""
        self.namespace()[self.name] = tensor

    def put_back(self):
        """Make the recorded tensor object the module's buffer again, if G reassigned the attribute."""
        if self.current() is not self.tensor:
            self.place(self.tensor)

    def changed(self):
        """Whether the recorded tensor was written in place since it was recorded (or last restored)."""
        return _version(self.tensor) != self.version


class _TensorAttribute(_Buffer):
    """A tensor kept as a plain module attribute (``self.ema = torch.zeros(...)``), not registered as a buffer."""

    __slots__ = ()

    def namespace(self):
        return self.module.__dict__


#: Plain module attributes a forward may set (step counts, flags, cached tensors): snapshots keep
#: them by reference, so reassigning one (``self.step += 1``, ``self.cache = h``) is undone.
_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


_ABSENT = object()


def torch_layers_only(G):
    """Whether G is a module of ``torch.nn``'s own layers with no hooks: it runs no Python code of the user's, so it
    draws nothing from Python's or NumPy's random state (:class:`~mixedad._ground.random_state.RandomState`'s
    ``host``)."""
    return isinstance(G, nn.Module) and _torch_layers_only(list(G.modules()))


def _torch_layers_only(modules):
    """Whether G's ``modules`` are all ``torch.nn``'s own layers with no hooks: no Python code of the user's runs in
    them, so they draw nothing from Python's or NumPy's random state."""
    return all(type(m).__module__.startswith("torch.nn.") for m in modules) and not forward_hooks(*modules)


def plain_attributes(module):
    """A module's public attributes of plain types, its mode among them (parameters, buffers and submodules live
    elsewhere)."""
    return _plain(vars(module))


def _plain(attributes):
    found = {"training": attributes["training"]} if "training" in attributes else {}
    found.update((name, attributes[name]) for name in attributes.keys() - MODULE_INTERNALS
                 if not name.startswith("_") and isinstance(attributes[name], _PLAIN))
    return found


def _version(tensor):
    """The version counter; None for an inference tensor, which has none (and which code outside
    inference mode, where mixedad's passes run, cannot write in place)."""
    return None if tensor.is_inference() else tensor._version
