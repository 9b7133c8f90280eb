"""Leaving G as it was: RNG replay and buffer snapshots.

Policy, for every mixedad call:

- **Random state (dropout).** Every pass through G within one call sees the random state the
  call's own forward pass saw, so all passes use the same dropout masks. After the call the
  global RNG (CPU, and every initialised CUDA device) is where one plain forward of G on z
  would have left it: forward passes advance it exactly as the naive code does, and replays
  (input_grad's backward, a fallback after a failed attempt) are undone.
- **Buffers (BatchNorm running statistics, num_batches_tracked).** They are updated exactly as
  one plain train-mode forward of G on z (per chunk, as the chunked naive code would) updates
  them, never twice: replays restore the buffers they touched. They never hold a dual tensor.

Snapshots copy the buffers of modules in training mode (those are the ones that update their
buffers, like BatchNorm); buffers of eval-mode modules are watched through their version
counters, and if one of those changes in a pass that must be undone, restoring raises instead
of leaving G silently changed. When G is an ``nn.Module`` its modules are known up front; when
it is any other callable (a lambda or function around modules), the modules are recorded as
they first run inside :meth:`Snapshot.watching`, through a global forward pre-hook that exists
only for that block.
"""
import contextlib

import torch
from torch import nn


class RngState:
    """The global random state: the CPU generator and every initialised CUDA generator."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


class Snapshot:
    """The random state and G's mutable buffers, to undo passes through G.

    Run the passes to undo inside ``with snapshot.watching():`` (needed when G is not an
    ``nn.Module``, harmless otherwise), then call :meth:`restore`. ``modules`` records modules
    of a non-Module G up front (those another snapshot has seen run); :attr:`modules` lists the
    modules recorded so far.
    """

    def __init__(self, G, *, modules=()):
        self.rng = RngState()
        self.saved, self.watched, self._seen, self.modules = [], [], set(), []
        self._upfront = isinstance(G, nn.Module)
        for module in (G.modules() if self._upfront else modules):
            self._record(module)

    def _record(self, module, *_):
        if id(module) in self._seen:
            return
        self._seen.add(id(module))
        self.modules.append(module)
        for name, buf in module.named_buffers(recurse=False):
            if buf is None:
                continue
            if module.training:
                self.saved.append((buf, buf.detach().clone()))
            else:
                self.watched.append((f"{type(module).__name__}.{name}", buf, buf._version))

    @contextlib.contextmanager
    def watching(self):
        """Record, before they first run, the modules a non-Module G calls inside the block."""
        if self._upfront:
            yield self
            return
        handle = nn.modules.module.register_module_forward_pre_hook(self._record)
        try:
            yield self
        finally:
            handle.remove()

    def restore(self):
        self.rng.restore()
        with torch.no_grad():
            for buf, copy in self.saved:
                buf.copy_(copy)
        for name, buf, version in self.watched:
            if buf._version != version:
                raise RuntimeError(
                    f"mixedad: G changed the buffer {name} of a module in eval mode in place during a "
                    f"pass that had to be undone, and mixedad could not restore it. Put that module "
                    f"in train mode (its buffers are then snapshotted) or stop it mutating buffers."
                )
