"""One setting of a ``threading.local`` for the length of a ``with`` block, in this thread alone."""
import contextlib
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def setting(local: threading.local, name: str, value: Any) -> Iterator[None]:
    """``local.<name> = value`` inside the block; the value it had before (None where it had none) after, also
    where the block raises."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)
