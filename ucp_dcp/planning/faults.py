"""Fault points: named steps of a save or load where a test can make one rank fail.

The library only names the steps; what happens there is the test's. A test (``make chaos``, the failure
tests) installs one hook per process with :func:`install`; every :func:`fault_point` then calls it with the
step's name, and the hook raises :class:`FaultInjected`, kills or stops its process, or returns. With no
hook installed (every real job) a fault point is one comparison with None: no environment lookup, nothing
on the I/O path. The steps: :data:`CALL_STEPS` around a save or load, and ``read_data``'s
(:data:`ucp_dcp.storage.reader.READ_STEPS`). The hook the chaos tier installs is
``ucp_dev.testing.faults.inject`` (``RANK:STEP[:ACTION]``, outside the installed package).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import PeerFailedError, UCPError, peer_class

__all__ = ["CALL_STEPS", "FaultInjected", "Hook", "fault_point", "install", "installed"]

CALL_STEPS = ("save-plan", "write", "written", "load-plan")
"""Steps of a save or load outside ``read_data``: a save's local planning (``UCPSavePlanner``), the
start and the end of its writes (``UCPFileSystemWriter.write_data``: ``written`` is after this rank's
files are on disk, before DCP gathers the write results for the commit), a load's local planning
(``UCPFileSystemReader.set_up_storage_reader``)."""

Hook = Callable[[str], None]
"""Called with the step's name at every fault point while installed."""

_HOOK: list[Hook] = []
"""The installed hook (at most one), for this process: every thread's fault points call it."""


class FaultInjected(UCPError):
    """The failure a test's hook raised at a fault point (testing only)."""


@peer_class  # beside its cause: ucp_dcp.errors, the lowest layer, cannot import this module
class PeerFaultInjected(PeerFailedError, FaultInjected):
    """Another rank's :class:`FaultInjected`."""


def install(hook: Hook | None) -> None:
    """Install ``hook`` for this process (None: remove it)."""
    _HOOK[:] = [] if hook is None else [hook]


def installed() -> bool:
    """Whether a hook is installed (read-once then wraps its incoming messages in fault points too)."""
    return bool(_HOOK)


def fault_point(step: str) -> None:
    """Step ``step`` is reached: the installed hook's turn (nothing without one)."""
    if _HOOK:
        _HOOK[0](step)
