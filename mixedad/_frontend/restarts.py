"""The one restart driver of mixedad's forward passes, with one tangent or a batch of them.

A pass runs G once. Where an op's formula raises, the dispatch remembers the op and raises
:class:`~mixedad._ground.errors.RestartPass`; where G is about to write into the caller's z or v,
:class:`~mixedad._ground.errors.InputsWritten`. Either way G's state is put back
(:class:`~mixedad._ground.state.Snapshot`) and the pass runs again, that op on the local rule or G on
mixedad's own copies of its inputs, up to :data:`MAX_RESTARTS` times. A pass that cannot go on at all
(:class:`~mixedad._ground.errors.NeedsWholeG`, an op no dispatch sees that has no formula, G using
forward-mode AD itself) is refused with a reason, which the caller turns into the whole-G fallback (one
tangent) or a pass per tangent (a batch). Every other error leaves the pass with G's state put back as
the call found it: buffers, attributes and every random source.
"""
from typing import Any, Callable, Optional

from mixedad._ground.errors import NeedsWholeG, RestartPass
from mixedad._hooks.dual_level import raised_entering_a_dual_level
from mixedad._hooks.functorch import NotLowerable

__all__ = ["MAX_RESTARTS", "run_restarting"]

#: How often one call may restart its forward pass to put a newly failed op on the local rule.
MAX_RESTARTS = 16


def run_restarting(attempt: Callable[[], Any], snapshot: Any, refuse: Callable[..., Any], *,
                   recorder: Optional[Any] = None, inputs: Optional[Any] = None) -> Any:
    """``attempt()``, one pass of G, run until it completes; restarted where it asks to be.

    Args:
        attempt: runs one pass and returns its result.
        snapshot: G's state before the pass (``.watching()`` the pass, ``.restore()`` after it).
        refuse: ``refuse(reason, at_cotangent=False)``, called with G's state put back where the pass cannot go
            on; it returns the call's result another way (the whole-G fallback) or raises.
        recorder: None, or the pass's :class:`~mixedad.op_rules.PathRecorder`: an aborted pass's counts are
            dropped, and whether G wrote its inputs is noted.
        inputs: the pass's :class:`~mixedad._ground.inputs.PassInputs`, for ``recorder``.
    """
    for _ in range(MAX_RESTARTS + 1):
        try:
            with snapshot.watching(mode=False):
                result = attempt()
        except RestartPass:
            snapshot.restore()  # the op that failed is now on the local rule, or G gets copies of its inputs
            if recorder is not None:
                recorder.counts.clear()  # the aborted pass's ops are counted again by the next one
            continue
        except NeedsWholeG as error:
            snapshot.restore()
            return refuse(str(error), at_cotangent=error.at_cotangent)
        except NotLowerable as error:  # a value a batch of tangents cannot take apart
            snapshot.restore()
            return refuse(str(error))
        except RuntimeError as error:  # NotImplementedError among them
            snapshot.restore()
            if raised_entering_a_dual_level(error):
                return refuse("G uses forward-mode AD inside itself, and PyTorch cannot nest forward-mode AD")
            if isinstance(error, NotImplementedError):  # torch's type for "no forward-AD formula": an op the
                # dispatch did not see (the dispatch restarts the pass for those it sees)
                return refuse("an op of G that mixedad's dispatch does not see has no forward-mode AD formula here")
            raise
        except BaseException:
            snapshot.restore()  # G's error, or mixedad's: G's state as the call found it
            raise
        if recorder is not None and inputs is not None:
            recorder.inputs_written = inputs.private
        return result
    snapshot.restore()
    return refuse(f"more than {MAX_RESTARTS} ops of G needed the local rule in one call")
