"""Is every other rank of this load still alive? Asked through the job's store, not a collective.

A collective with a dead or stuck rank waits until the process group's timeout (minutes); a rank
that merely reads slowly must not be mistaken for one. So each rank of a load beats a counter in
the default group's store (``UCP_DCP_BEAT_S``, 0.5 s) from a thread while it reads, and announces
each step it reaches (``ready``: its own reads are over, so it now sends; ``done``: its exchange is
over). A rank waits for a peer's step as long as the peer's counter moves; a peer whose counter
stands still for :func:`peer_timeout` seconds (or that never started) is *lost*, and the waiting
rank raises :class:`~ucp_dcp.errors.PeerLostError` naming it.

After a rank is lost, DCP's next collective (its final gather) would wait for it: on the control
group (:mod:`ucp_dcp.planning.control_group`, what ``ucp_dcp.load`` gives DCP) the loss is published
so that gather raises at once; on a gloo group its timeout is cut to a few seconds first so it fails fast, and :func:`ucp_dcp.errors.ucp_errors` raises the lost rank's error instead of the
backend's (the job cannot go on without that rank anyway).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._compat import default_store, set_default_timeout
from ..errors import PeerLostError, peer_lost, record_lost
from ..planning.collectives import PEER_TIMEOUT_ENV, peer_timeout
from ..planning.control_group import beat_s, publish_lost

__all__ = ["PEER_TIMEOUT_ENV", "peer_timeout", "Liveness"]

FAIL_FAST_S = 5.0
"""The default group's timeout after a rank is lost (DCP's next collective then fails, not hangs)."""


def _clients(store: Any) -> tuple[Any, Any]:
    """The job's store for this thread, and a connection of its own for the heartbeat thread (one
    TCPStore client is not used from two threads at once). Keys carry our own prefix."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return base, dist.TCPStore(base.host, base.port, is_master=False, timeout=timedelta(seconds=60))
    return store, store  # FileStore, HashStore: one lock per operation


class Liveness:
    """One load's heartbeat and step announcements (inactive outside a process group, or without a
    token from the coordinator). Use as a context manager: the heartbeat stops on exit."""

    def __init__(self, token: str, members: list[int] | None, timeout: float | None = None) -> None:
        self.timeout = peer_timeout() if timeout is None else timeout
        self.active = bool(token) and dist.is_initialized() and bool(members) and len(members or ()) > 1
        self.members = list(members or [])
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.prefix = f"ucp_dcp/{token}/"
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = time.monotonic()
        if self.active:
            self.store, self._beat_store = _clients(default_store())

    def __enter__(self) -> Liveness:
        if self.active:
            self._beat(0)
            self._thread = threading.Thread(target=self._run, name="ucp-dcp-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _beat(self, n: int) -> None:
        self._beat_store.set(f"{self.prefix}beat/{self.rank}", str(n))

    def _run(self) -> None:
        n = 1
        while not self._stop.wait(beat_s()):
            try:
                self._beat(n)
            except Exception:  # the store is gone (job torn down): nothing left to tell
                return
            n += 1

    # -- steps -------------------------------------------------------------------------------------

    def announce(self, step: str) -> None:
        if self.active:
            self.store.set(f"{self.prefix}{step}/{self.rank}", "1")

    def check(self, r: int) -> None:
        """Raise :class:`PeerLostError` if rank ``r``'s heartbeat stood still for the timeout."""
        now = time.monotonic()
        key = f"{self.prefix}beat/{r}"
        value = self.store.get(key) if self.store.check([key]) else b""
        last = self._seen.get(r)
        if last is None or last[0] != value:
            self._seen[r] = (value, now)
            return
        if now - last[1] > self.timeout:
            why = "it never started reading" if not value else f"no heartbeat for {now - last[1]:.0f} s"
            raise self.lost(r, why)

    def lost(self, r: int, why: str) -> PeerLostError:
        """The error for a lost rank; DCP's next collective is made to fail fast (see the module doc)."""
        err = peer_lost(r, why)
        record_lost(err)
        publish_lost(err)  # DCP's collectives on the control group end at once, not after another timeout
        try:
            set_default_timeout(timedelta(seconds=min(FAIL_FAST_S, self.timeout)))
        except Exception:  # a backend without a settable timeout: DCP's collective waits its own
            pass
        return err

    def wait_for(self, step: str, ranks: list[int]) -> None:
        """Wait until every rank of ``ranks`` announced ``step``; raise for the first lost one.
        One store call per poll while all are there or nearly; which ranks are missing (one call
        each) is looked at once a second, so a job of many ranks does not flood the store."""
        if not self.active:
            return
        missing = [r for r in ranks if r != self.rank]
        pause, looked = 0.005, time.monotonic()
        while missing:
            try:
                if self.store.check([f"{self.prefix}{step}/{r}" for r in missing]):  # all there
                    return
                if time.monotonic() - looked >= 1.0 or len(missing) == 1:
                    missing = [r for r in missing if not self.store.check([f"{self.prefix}{step}/{r}"])]
                    for r in missing:
                        self.check(r)
                    looked = time.monotonic()
            except (RuntimeError, OSError) as e:  # the store's host exited (it raised for the same rank first)
                r = min(missing, key=lambda m: self._seen.get(m, (b"", time.monotonic()))[1])
                raise self.lost(r, f"it had not finished when the job's store stopped answering ({e})") from e
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def done(self) -> None:
        """Announce this rank's exchange is over and wait for every member's (a rank that died
        anywhere in the read is named here, not left to DCP's gather)."""
        self.announce("done")
        self.wait_for("done", self.members)
