"""Progress of long work on the coordinating rank (issues 34, 47): ``plan``'s ranks planned; a save's or load's
phases (planning, writing or reading the job's bytes with the time left, the commit) and their times.

Shown on stderr by rank 0 only, once the work has run ``MIN_SECONDS`` (short saves and loads print nothing);
on by default when stderr is a terminal (one line rewritten in place), off otherwise. ``UCP_DCP_PROGRESS=1``
turns it on also into a log (a line every ``LOG_EVERY_S``), ``UCP_DCP_PROGRESS=0`` off; ``plan --no-progress``
and :func:`set_enabled` do the same from code. No dependency: a small printer of its own.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from . import settings

__all__ = ["ENV", "MIN_SECONDS", "enabled", "set_enabled", "size_text", "RankProgress", "StepProgress", "CallProgress"]

ENV = settings.ENV["progress"]
"""``1``: show progress, also when stderr is not a terminal; ``0``: never."""
MIN_SECONDS = 2.0
"""Work that ends sooner prints nothing."""
TTY_EVERY_S = 0.5
LOG_EVERY_S = 10.0
UNKNOWN_S = 5.0
"""A writing / reading phase's first line waits this long for its time left to be known (in a log)."""

_FORCED: list[bool] = []


def set_enabled(on: bool | None) -> None:
    """Turn progress on or off for this process (None: back to ``UCP_DCP_PROGRESS`` / the terminal test)."""
    _FORCED[:] = [] if on is None else [on]


def enabled(stream: TextIO | None = None) -> bool:
    """Whether progress is shown: :func:`set_enabled`, else ``UCP_DCP_PROGRESS``, else whether stderr is a terminal."""
    if _FORCED:
        return _FORCED[0]
    if (env := settings.progress()) is not None:
        return env
    s = stream or sys.stderr
    return bool(getattr(s, "isatty", lambda: False)())


def _coordinator() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def size_text(n: float) -> str:
    """``n`` bytes for a person: ``512 B``, ``3.2 MiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _seconds(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def _absent() -> None:
    """What a :class:`CallProgress` unpickles to (its thread and stream stay in the process that made it)."""
    return None


class _Printer:
    """Writes status lines: rewritten in place on a terminal, one per ``LOG_EVERY_S`` into a log (``force``: now)."""

    def __init__(self, stream: TextIO | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = TTY_EVERY_S if self.tty else LOG_EVERY_S
        self.clock = clock
        self.printed = False
        self.last = -float("inf")
        self.lock = threading.Lock()  # the call's thread (a new phase) and the printing thread both write

    def show(self, text: str, final: bool = False, force: bool = False) -> None:
        with self.lock:
            now = self.clock()
            if not (final or force) and now - self.last < self.every:
                return
            self.last = now
            end = "\n" if final or not self.tty else ""
            self.stream.write(("\r\x1b[K" if self.tty else "") + text + end)
            self.stream.flush()
            self.printed = True


class RankProgress:
    """``plan``'s callback ``(done, total)``: ``plan: 1024/4096 ranks planned, 312 ranks/s, 3.3 s``."""

    def __init__(self, what: str = "plan", stream: TextIO | None = None, min_seconds: float = MIN_SECONDS) -> None:
        self.what, self.min_seconds = what, min_seconds
        self.on = enabled(stream)
        self.printer = _Printer(stream)
        self.t0 = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not self.on:
            return
        dt = time.monotonic() - self.t0
        if dt < self.min_seconds:
            return
        text = f"{self.what}: {done}/{total} ranks planned, {done / max(dt, 1e-9):.0f} ranks/s, {dt:.1f} s"
        self.printer.show(text, final=done == total)


class StepProgress:
    """A long recipe's steps (transitions, fault cases, runs): call it after each step, and once it has run
    ``min_seconds`` it prints ``chaos: 12/60 cases, 38.1 s, ~2.6 min left (exit@read)`` -- a line per step,
    so the recipe's own output lines stay whole. On by default when stderr is a terminal (see :func:`enabled`)."""

    def __init__(
        self, what: str, total: int, unit: str = "steps", stream: TextIO | None = None, min_seconds: float = MIN_SECONDS
    ) -> None:
        self.what, self.total, self.unit, self.min_seconds = what, total, unit, min_seconds
        self.stream = stream or sys.stderr
        self.on = enabled(stream)
        self.done = 0
        self.t0 = time.monotonic()

    def __call__(self, label: str = "") -> None:
        self.done += 1
        dt = time.monotonic() - self.t0
        if not self.on or dt < self.min_seconds:
            return
        left = dt / self.done * (self.total - self.done)
        eta = f", ~{left / 60:.1f} min left" if left >= 60 else f", ~{left:.0f} s left" if left > 0 else ""
        tail = f" ({label})" if label else ""
        self.stream.write(f"{self.what}: {self.done}/{self.total} {self.unit}, {dt:.1f} s{eta}{tail}\n")
        self.stream.flush()


class CallProgress:
    """One ``ucp_dcp.save`` / ``async_save`` / ``load`` on the coordinating rank, planning to the end.

    Phases: ``staging`` (an async save's copy, in the caller), ``planning``, then ``writing`` / ``reading`` with the
    job's bytes, its rate and the time left, then ``commit`` (a save) / ``finishing`` (a load: DCP's last
    collective), and a closing line with each phase's time. The storage writer and reader name the phases
    (:meth:`phase`, :meth:`counting`); the coordinator's writer / reader gives the job's total from the global plan
    (:meth:`job`), which lists every rank's items with their sizes.

    Only rank 0's own bytes are counted live (no collective, no store request per update): the job's bytes done are
    rank 0's fraction of its own bytes times the job's total, which assumes the ranks move at about the same pace
    (the line says "est. from rank 0" when the job has more than one rank); the time left is rank 0's, at its rate.
    A background thread prints once the call has run ``min_seconds``: rewritten in place on a terminal, in a log a
    line per phase and every ``LOG_EVERY_S``. Picklable as nothing (:meth:`__reduce__`): a writer sent to DCP's
    checkpoint process arrives without it and shows its own writing phase there.
    """

    COUNTING = {"writing", "reading"}

    def __init__(
        self,
        what: str,
        first: str = "planning",
        *,
        stream: TextIO | None = None,
        min_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        thread: bool = True,
    ) -> None:
        self.what = what
        self.min_seconds = MIN_SECONDS if min_seconds is None else min_seconds
        self.clock = clock
        self.on = enabled(stream) and _coordinator()
        self.printer = _Printer(stream, clock)
        self.threaded = thread
        self.t0 = self.since = clock()
        self.name = first
        self.times: dict[str, float] = {}
        """Seconds spent in each phase that ended (a phase entered twice adds up: a load planned again)."""
        self.job_bytes: int | None = None
        self.ranks = 1
        self.own_bytes = 0
        self.done: Callable[[], int] = lambda: 0
        self.moved: tuple[str, int, float] | None = None
        """The counting phase that ended: its name, rank 0's bytes and its seconds (for the closing line)."""
        self.first: tuple[float, int] | None = None
        """When the counting phase's counter first read above 0, and its value: the rate is taken from there (the
        phase's set-up, before its first byte, would make the time left too long)."""
        self.pending = True  # a line for the current phase is still due (a log gets one per phase)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_absent, ())

    # -- what the writer and reader say -------------------------------------------------------------

    def job(self, nbytes: int | None, ranks: int) -> None:
        """The job's bytes to write or read (every rank's items in the global plan; None: not known) over ``ranks``."""
        self.job_bytes, self.ranks = nbytes, max(1, ranks)

    def phase(self, name: str) -> None:
        """The call reached phase ``name``."""
        if name == self.name:
            return
        self.tick(ending=True)  # a phase whose line is still due prints its last figures before it ends
        now = self.clock()
        self.times[self.name] = self.times.get(self.name, 0.0) + now - self.since
        if self.name in self.COUNTING:
            n = self.done()
            self.moved = (self.name, n, now - self.since)
            self.done = lambda: n  # what the counter reads (the writer's files) need not outlive the phase
        self.name, self.since, self.pending, self.first = name, now, True, None
        self.tick()

    def counting(self, name: str, own_bytes: int, done: Callable[[], int]) -> None:
        """Phase ``name`` (``writing``/``reading``) of ``own_bytes`` on this rank; ``done()``: how many so far."""
        self.own_bytes, self.done = own_bytes, done
        self.phase(name)

    # -- what is printed ----------------------------------------------------------------------------

    def line(self) -> str:
        now = self.clock()
        total, at = now - self.t0, now - self.since
        head = f"ucp_dcp {self.what}: {self.name}"
        if self.name not in self.COUNTING:
            wait = " (after every rank's writes)" if self.name == "commit" and self.ranks > 1 else ""
            return f"{head}{wait}, {total:.1f} s"
        done, own = self.done(), self.own_bytes
        frac = min(1.0, done / own) if own else 1.0
        job = self.job_bytes
        mine = f"{size_text(done)}/{size_text(own)}"
        if job is None or self.ranks == 1:
            what = f" {mine}" + (" (rank 0's; the job's total is not known)" if job is None and _world() > 1 else "")
            rate = done / at if at > 0 else 0.0
        else:  # the job's bytes done: rank 0's fraction of its own, applied to the job's total
            what = f" ~{size_text(frac * job)}/{size_text(job)} ({self.ranks} ranks; est. from rank 0's {mine})"
            rate = frac * job / at if at > 0 else 0.0
        left = self._left(now, done)
        eta = "time left unknown yet" if left is None else "<1 s left" if 0 < left < 1 else f"~{_seconds(left)} left"
        return f"{head}{what}, {size_text(rate)}/s, {eta}, {total:.1f} s"

    def _left(self, now: float, done: int) -> float | None:
        """Seconds rank 0 needs for the rest of its bytes, at its rate since its first bytes (None: not known yet)."""
        if self.first is None and done > 0:
            self.first = (now, done)
        if done >= self.own_bytes:
            return 0.0
        if self.first is None or done <= self.first[1] or now <= self.first[0]:
            return None
        return (self.own_bytes - done) * (now - self.first[0]) / (done - self.first[1])

    def summary(self, failed: bool) -> str:
        now = self.clock()
        total = now - self.t0
        if failed:
            return f"ucp_dcp {self.what}: failed after {total:.1f} s, while {self.name}"
        times = dict(self.times)
        times[self.name] = times.get(self.name, 0.0) + now - self.since
        parts = []
        for name, s in times.items():
            text = f"{name} {s:.1f} s"
            if self.moved is not None and self.moved[0] == name:
                _, n, t = self.moved
                where = " on rank 0" if self.ranks > 1 or _world() > 1 else ""
                text += f" ({size_text(n)}{where}, {size_text(n / t if t > 0 else 0)}/s)"
            parts.append(text)
        return f"ucp_dcp {self.what}: done in {total:.1f} s ({', '.join(parts)})"

    def tick(self, ending: bool = False) -> None:
        """Print the current line if it is due (the printing thread calls it; tests call it with a fake clock).
        A phase's first line is printed at once, in a log too; a counting phase's once its time left is known
        (or it has run ``UNKNOWN_S`` without, or is ``ending``)."""
        if not self.on:
            return
        now = self.clock()
        known = self.name not in self.COUNTING or self._left(now, self.done()) is not None  # samples the counter
        if now - self.t0 < self.min_seconds:
            return
        if self.pending and (known or ending or now - self.since >= UNKNOWN_S):
            self.pending = False
            self.printer.show(self.line(), force=True)
        else:
            self.printer.show(self.line())

    def _run(self) -> None:
        while not self._stop.wait(TTY_EVERY_S / 2):
            self.tick()

    def __enter__(self) -> CallProgress:
        self.t0 = self.since = self.clock()
        if self.on and self.threaded:
            self._thread = threading.Thread(target=self._run, name="ucp_dcp-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(exc[0] is not None)

    def close(self, failed: bool = False) -> None:
        """The call ended (its thread stops; a closing line if anything was printed)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        if self.on and self.printer.printed:
            self.printer.show(self.summary(failed), final=True)
            self.on = False
