"""Our daemon threads ended before the interpreter finalizes.

A thread that takes the GIL back while Python finalizes is ended by ``pthread_exit``; when that happens on the
way out of a C++ call, the forced unwind through C++ frames ends in ``std::terminate`` ("terminate called
without an active exception", SIGABRT) after all work had succeeded. The quickstart's abort at exit was gloo's
worker thread doing exactly that (its fix: a barrier as the last collective, ``docs/examples/quickstart.py``);
the control group's heartbeat thread sits in ``TCPStore.set``, a C++ call that releases the GIL, twice a second,
so it could do the same. An ``atexit`` handler runs before finalization, while such threads can still finish
their call: it stops and joins them.
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
