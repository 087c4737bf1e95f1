"""One-rank failures on purpose, for the failure-injection tier (``make chaos``) and its tests.

``UCP_DCP_FAULT=RANK:STEP[:ACTION]`` makes global rank ``RANK`` fail when it reaches ``STEP``:
``ACTION`` is ``raise`` (default: a :class:`FaultInjected`), ``exit`` (the process is SIGKILLed: no
cleanup, no goodbye) or ``hang`` (the process is SIGSTOPped: every thread of it stops, its heartbeat
included, as on a frozen node). The steps are named where they are reached: ``read_data``'s (see
:data:`ucp_dcp.storage.read_protocol.STEPS`) and :data:`CALL_STEPS` of a save or load around it.
Cheap when unset: one environment lookup.
"""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from ..errors import UCPError

__all__ = ["FAULT_ENV", "CALL_STEPS", "FaultInjected", "fault_point"]

FAULT_ENV = "UCP_DCP_FAULT"
CALL_STEPS = ("save-plan", "write", "written", "load-plan")
"""Steps of a save or load outside ``read_data``: a save's local planning (``UCPSavePlanner``), the
start and the end of its writes (``UCPFileSystemWriter.write_data``: ``written`` is after this rank's
files are on disk, before DCP gathers the write results for the commit), a load's local planning
(``UCPFileSystemReader.set_up_storage_reader``)."""


class FaultInjected(UCPError):
    """The failure ``UCP_DCP_FAULT`` asked for (testing only)."""


def fault_point(step: str) -> None:
    """Fail here if ``$UCP_DCP_FAULT`` names this rank and ``step``."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    rank, _, rest = spec.partition(":")
    at, _, action = rest.partition(":")
    if at != step or not dist.is_initialized() or int(rank) != dist.get_rank():
        return
    if action == "exit":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen until someone kills it
    raise FaultInjected(f"fault injected at step '{step}' ({FAULT_ENV}={spec})")
