"""Our daemon threads ended before the interpreter finalizes (the torch 2.13 abort at exit, issue 34).

A daemon thread still running at finalization is killed by ``pthread_exit`` the moment it takes the GIL back.
When that happens on the way out of a C++ call that released the GIL (the control group's heartbeat sits in
``TCPStore.set`` about every 0.5 s), the forced unwind through the store's C++ frames ends in
``std::terminate``: "terminate called without an active exception", exit status -6 (SIGABRT), after all work
had succeeded -- the quickstart aborted at exit in about 1 run of 8. An ``atexit`` handler runs before
finalization, while such threads can still finish their call and return: it stops and joins them.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Protocol

__all__ = ["StoppableThread", "stop_at_exit"]


class StoppableThread(Protocol):
    """What :func:`stop_at_exit` needs of an owner of a daemon thread."""

    def stop(self) -> None: ...

    @property
    def thread(self) -> threading.Thread | None: ...


_OWNERS: weakref.WeakSet[StoppableThread] = weakref.WeakSet()
JOIN_S = 2.0
"""How long the exit waits for each thread (a store call that hangs must not hang the exit)."""


def stop_at_exit(owner: StoppableThread) -> None:
    """Stop ``owner`` (``owner.stop()``) and join its thread when the interpreter exits, if it still runs."""
    _OWNERS.add(owner)


@atexit.register
def _stop_all() -> None:
    owners = list(_OWNERS)
    for o in owners:
        o.stop()
    for o in owners:
        t = o.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=JOIN_S)
