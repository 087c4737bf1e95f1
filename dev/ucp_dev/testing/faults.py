"""The chaos tier's fault hook (:mod:`ucp_dcp.planning.faults`): ``RANK:STEP[:ACTION]`` makes global rank
``RANK`` fail when it reaches fault point ``STEP``. ``ACTION`` is ``raise`` (default: a
:class:`~ucp_dcp.planning.faults.FaultInjected`), ``exit`` (the process is SIGKILLed: no cleanup, no goodbye)
or ``hang`` (the process is SIGSTOPped: every thread of it stops, its beats included, as on a frozen node)."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from ucp_dcp.planning import faults
from ucp_dcp.planning.faults import FaultInjected

__all__ = ["inject"]


def inject(spec: str | None) -> None:
    """Install the hook for ``spec`` in this process (None or empty: remove it)."""
    if not spec:
        faults.install(None)
        return
    rank, _, rest = spec.partition(":")
    at, _, action = rest.partition(":")
    if action not in ("", "raise", "exit", "hang"):
        raise ValueError(f"fault {spec!r}: the action is raise, exit or hang")

    def hook(step: str) -> None:
        if step != at or not dist.is_initialized() or int(rank) != dist.get_rank():
            return
        if action == "exit":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen until someone kills it
        raise FaultInjected(f"fault injected at step '{step}' ({spec})")

    faults.install(hook)
