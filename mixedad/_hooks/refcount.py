"""A patch that is in place only while someone needs it: one reference count under a lock.

The two patches mixedad still makes (the ``Function.apply`` trampoline and the thread-start
watch) are process-wide, while the passes that need them run per thread. Each patch is a
:class:`SharedPatch`: the first user installs it, the last one out removes it, and passes in
other threads in between keep it. ``install`` and ``uninstall`` run under the lock, so a patch
is never half installed.
"""
import contextlib
import threading


class SharedPatch:
    """``install()`` when the first user enters :meth:`use`, ``uninstall()`` when the last one leaves."""

    def __init__(self, install, uninstall):
        self._install, self._uninstall = install, uninstall
        self._lock = threading.Lock()
        self.users = 0

    @contextlib.contextmanager
    def use(self):
        with self._lock:
            if self.users == 0:
                self._install()
            self.users += 1
        try:
            yield
        finally:
            with self._lock:
                self.users -= 1
                if self.users == 0:
                    self._uninstall()
