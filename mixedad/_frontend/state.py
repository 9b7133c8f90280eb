"""Leaving G as it was: RNG replay and buffer snapshots.

Policy, for every mixedad call:

- **Random state (dropout, noise).** Every pass through G within one call sees the random state
  the call's own forward pass saw, so all passes draw the same numbers. After the call every
  random source (torch's global CPU and CUDA generators, each ``torch.Generator`` G's ops
  receive, Python's ``random``, NumPy's global generator: :mod:`mixedad._frontend.random_state`)
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
import threading

import torch
from torch import nn

from mixedad._frontend import random_state, watch
from mixedad._frontend.random_state import RandomState, is_source, source_types
from mixedad._frontend.reach import reached
from mixedad._hooks.sequential import forward_hooks

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
        self.call = call  # the public call, for the message of a buffer that cannot be restored
        self.rng = RandomState(G, host=not _torch_layers_only(G))
        self.saved, self.watched, self._seen, self.modules = [], [], set(), []
        self.attributes = []  # (module, {name: value}) of plain attributes
        #: The tensors the passes watched with ``reads=True`` read that they did not make.
        self.reads = watch.Reads()
        self._upfront = isinstance(G, nn.Module)
        if not self._upfront:  # the random sources a function G closes over (a module's are its attributes)
            for source in reached(G):
                if is_source(source):
                    self.rng.hold(source)
        for module in (G.modules() if self._upfront else modules):
            self._record(module)

    def _record(self, module, *_):
        if id(module) in self._seen:
            return
        self._seen.add(id(module))
        self.modules.append(module)
        if not type(module).__module__.startswith("torch.nn."):  # torch.nn's own layers keep no random source
            kinds = source_types()
            for value in vars(module).values():  # a generator the module keeps: its state before the module draws
                if isinstance(value, kinds) and is_source(value):
                    self.rng.hold(value)
        attributes = plain_attributes(module)
        self.attributes.append((module, attributes))
        tensors = [(name, value, _TensorAttribute) for name, value in attributes.items() if isinstance(value, torch.Tensor)]
        for name, buf, kind in [*((n, b, _Buffer) for n, b in module.named_buffers(recurse=False)), *tensors]:
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
    def watching(self, *, reads=False, by_dispatch=False):
        """Record, before they first run, the generators G's ops receive and the modules a non-Module G calls
        inside the block; with ``reads``, also every tensor its ops read that the block did not make
        (:attr:`reads`, for a saved pass's :class:`~mixedad._frontend.versions.Versions`). ``by_dispatch``: the
        block is mixedad's per-op pass, whose dispatch notes the generators itself (no watch mode started)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(random_state.watching(self.rng, mode=not by_dispatch))
            if reads:
                stack.enter_context(watch.observing("reads", self.reads))
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
        self.rng.restore()
        for module, attributes in self.attributes:
            now = plain_attributes(module)
            for name in now.keys() - attributes.keys():
                del module.__dict__[name]  # made by a pass that is undone (a cache, a step count)
            # Against the module's own dict: an attribute set to something no snapshot records (a trace's proxy)
            # is put back too.
            module.__dict__.update((name, value) for name, value in attributes.items()
                                   if module.__dict__.get(name, _ABSENT) is not value)
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


class _Buffer:
    """One buffer, by module and attribute name: the tensor object there when recorded.

    ``copy`` holds its values when the snapshot copies it, else None; ``always`` says whether
    restoring writes them back unconditionally (train mode) or only after an in-place change.
    """

    def __init__(self, module, name, tensor):
        self.module, self.name, self.tensor, self.copy, self.always = module, name, tensor, None, False
        self.version = _version(tensor)
        self.nbytes = tensor.numel() * tensor.element_size()
        self.label = f"{type(module).__name__}.{name}"

    def current(self):
        """The tensor the module holds under this name now."""
        return self.module._buffers.get(self.name)

    def place(self, tensor):
        """Make ``tensor`` the module's buffer under this name."""
        self.module._buffers[self.name] = tensor

    def put_back(self):
        """Make the recorded tensor object the module's buffer again, if G reassigned the attribute."""
        if self.current() is not self.tensor:
            self.place(self.tensor)

    def changed(self):
        """Whether the recorded tensor was written in place since it was recorded (or last restored)."""
        return _version(self.tensor) != self.version


class _TensorAttribute(_Buffer):
    """A tensor kept as a plain module attribute (``self.ema = torch.zeros(...)``), not registered as a buffer."""

    def current(self):
        return self.module.__dict__.get(self.name)

    def place(self, tensor):
        self.module.__dict__[self.name] = tensor


#: Plain module attributes a forward may set (step counts, flags, cached tensors): snapshots keep
#: them by reference, so reassigning one (``self.step += 1``, ``self.cache = h``) is undone.
_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


_ABSENT = object()


def _torch_layers_only(G):
    """Whether G is a module made of ``torch.nn``'s own layers with no hooks: no Python code of the user's runs in
    it, so it draws nothing from Python's or NumPy's random state."""
    if not isinstance(G, nn.Module):
        return False
    modules = list(G.modules())
    return all(type(m).__module__.startswith("torch.nn.") for m in modules) and not forward_hooks(*modules)


def plain_attributes(module):
    """A module's public attributes of plain types (parameters, buffers and submodules live elsewhere)."""
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and isinstance(value, _PLAIN)}


def _version(tensor):
    """The version counter; None for an inference tensor, which has none (and which code outside
    inference mode, where mixedad's passes run, cannot write in place)."""
    return None if tensor.is_inference() else tensor._version
