"""Progress of long work on the coordinating rank (issue 34): ``plan``'s ranks planned, a save's bytes written
and a load's bytes read, with the rate.

Shown on stderr by rank 0 only, once the work has run ``MIN_SECONDS`` (short saves and loads print nothing);
on by default when stderr is a terminal (one line rewritten in place), off otherwise. ``UCP_DCP_PROGRESS=1``
turns it on also into a log (a line every ``LOG_EVERY_S``), ``UCP_DCP_PROGRESS=0`` off; ``plan --no-progress``
and :func:`set_enabled` do the same from code. No dependency: a small printer of its own.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["ENV", "MIN_SECONDS", "enabled", "set_enabled", "RankProgress", "BytesProgress", "StepProgress"]

ENV = "UCP_DCP_PROGRESS"
"""``1``: show progress, also when stderr is not a terminal; ``0``: never."""
MIN_SECONDS = 2.0
"""Work that ends sooner prints nothing."""
TTY_EVERY_S = 0.5
LOG_EVERY_S = 10.0

_FORCED: list[bool] = []


def set_enabled(on: bool | None) -> None:
    """Turn progress on or off for this process (None: back to ``UCP_DCP_PROGRESS`` / the terminal test)."""
    _FORCED[:] = [] if on is None else [on]


def enabled(stream: TextIO | None = None) -> bool:
    """Whether progress is shown: :func:`set_enabled`, else ``UCP_DCP_PROGRESS``, else whether stderr is a terminal."""
    if _FORCED:
        return _FORCED[0]
    env = os.environ.get(ENV, "").strip().lower()
    if env:
        return env not in ("0", "off", "false", "no")
    s = stream or sys.stderr
    return bool(getattr(s, "isatty", lambda: False)())


def _coordinator() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class _Printer:
    """Writes status lines: rewritten in place on a terminal, one per ``LOG_EVERY_S`` into a log."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = TTY_EVERY_S if self.tty else LOG_EVERY_S
        self.printed = False
        self.last = 0.0

    def show(self, text: str, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.every:
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


class BytesProgress:
    """A save's or load's bytes on this rank, shown while the work runs (``with BytesProgress(...):``) by a
    daemon thread that reads ``value()``: ``ucp_dcp load (rank 0): 3.2 GiB, 812.4 MiB/s, 4.0 s``."""

    def __init__(
        self,
        what: str,
        value: Callable[[], int],
        stream: TextIO | None = None,
        min_seconds: float = MIN_SECONDS,
    ) -> None:
        self.what, self.value, self.min_seconds = what, value, min_seconds
        self.on = enabled(stream) and _coordinator()
        self.printer = _Printer(stream)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.t0 = 0.0

    def _line(self) -> str:
        dt = time.monotonic() - self.t0
        n = self.value()
        return f"ucp_dcp {self.what} (rank 0): {_size(n)}, {_size(n / max(dt, 1e-9))}/s, {dt:.1f} s"

    def _run(self) -> None:
        if self.stop.wait(self.min_seconds):
            return
        while not self.stop.is_set():
            self.printer.show(self._line())
            self.stop.wait(min(self.printer.every, 0.5))

    def __enter__(self) -> BytesProgress:
        self.t0 = time.monotonic()
        if self.on:
            self.thread = threading.Thread(target=self._run, name="ucp_dcp-progress", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.thread is None:
            return
        self.stop.set()
        self.thread.join()
        if self.printer.printed:
            self.printer.show(self._line() + (" (failed)" if exc[0] is not None else ""), final=True)
