"""The ranks of a plan, planned in several processes: this machine's cores, each planning a share of the ranks.

Planning one simulated rank is independent of every other (its own state dict, planner and reads); only the
coordinator's steps (the global checks, read-once assignment) need all of them. :class:`Split` forks
workers (Linux: the plan's state, the checkpoint's metadata and the class representatives the parent built,
are theirs without a copy) and runs two steps per rank:

1. ``plan(rank)`` over each worker's ranks (every ``workers``-th: ranks of one pipeline stage cost alike, the
   stages do not); the parent plans the first share (rank 0, the coordinator, stays in this process) and
   gathers the others' results in rank order (:meth:`Split.planned`);
2. ``finish(rank, arg)``, after the parent worked out each rank's ``arg`` from all results (its read-once
   transport): each worker finishes its own ranks, whose reads it kept (:meth:`Split.finish`).

What a worker returns is pickled through a pipe; an error in one is raised here with its traceback. With one
worker (one core, a small plan, or ``UCP_DCP_PLAN_WORKERS=1``) both steps run in this process, in the same
order."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ... import settings

__all__ = ["Split", "plan_workers", "WORKERS_ENV", "RANKS_PER_WORKER"]

WORKERS_ENV = settings.ENV["plan_workers"]
"""Environment variable: the number of processes a plan uses (1: this process only)."""
RANKS_PER_WORKER = 256
"""A plan forks a worker per this many simulated ranks, up to the cores it may use: below, forking costs more
than it saves."""
FREEZE_EVERY = 16
"""Ranks between two collections of the garbage collector (automatic ones are off while ranks are planned),
each followed by ``gc.freeze()``: the results kept for every rank are moved out of the collector's sight,
which would otherwise walk them all again on every full collection (a 4,096-rank plan: -14 % CPU; with the
automatic collections off too, -6 % more at 1,024 ranks, the same peak memory)."""


def plan_workers(n: int, requested: int | None = None) -> int:
    """How many processes plan ``n`` ranks: ``requested``, else ``UCP_DCP_PLAN_WORKERS``, else one per
    :data:`RANKS_PER_WORKER` ranks up to the cores this process may use; 1 without ``fork`` (not Linux)."""
    if requested is None:
        requested = settings.plan_workers()
    if requested is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        requested = min(cores, n // RANKS_PER_WORKER)
    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(requested, n))


class Split:
    """Two steps per rank over ``n`` ranks, in ``workers`` processes (see the module docstring)."""

    def __init__(
        self,
        n: int,
        workers: int,
        plan: Callable[[int], Any],
        finish: Callable[[int, Any], Any],
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.n, self.plan, self._finish, self.progress = n, plan, finish, progress
        self.runs = [range(i, n, workers) for i in range(min(workers, n))]
        self._children: list[tuple[range, Any, Any, Any]] = []
        self._delivered = False
        """Every worker answered step 1 (then each exits on being let go; before, it is stopped)."""
        self._gc = False
        """This object turned the garbage collector's automatic collections off (until :meth:`close`)."""

    # -- the parent ------------------------------------------------------------------------------------

    def planned(self) -> list[Any]:
        """Step 1 for every rank, in rank order. The garbage collector's automatic collections stay off until
        :meth:`close` (it collects every :data:`FREEZE_EVERY` ranks and freezes what is kept): every full
        collection would walk all the ranks' results again, while they are made and when the workers' arrive."""
        self._gc = gc.isenabled()  # a caller that turned the collector off keeps it off
        if self._gc:
            gc.disable()
        mp = multiprocessing.get_context("fork") if len(self.runs) > 1 else None
        for run in self.runs[1:]:
            assert mp is not None
            parent, child = mp.Pipe()
            done = mp.Value("q", 0, lock=False)
            proc = mp.Process(target=self._child, args=(run, child, done), daemon=True)
            proc.start()
            child.close()
            self._children.append((run, proc, parent, done))
        out: list[Any] = [None] * self.n
        out[self.runs[0].start :: self.runs[0].step] = _planned(self.runs[0], self.plan, self._report, self._gc)
        own = len(self.runs[0])
        for run, proc, conn, _ in self._children:
            while not conn.poll(0.5):
                self._report(own)
                if not proc.is_alive() and not conn.poll(0):
                    raise RuntimeError(f"a plan worker ({_name(run)}) died: exit {proc.exitcode}")
            out[run.start :: run.step] = self._answer(conn, run)
        self._delivered = True
        return out

    def finish(self, args: Sequence[Any]) -> list[Any]:
        """Step 2 for every rank (``args[rank]`` its argument), in rank order; the workers exit after it."""
        for run, _, conn, _ in self._children:
            conn.send([args[r] for r in run])
        out: list[Any] = [None] * self.n
        out[self.runs[0].start :: self.runs[0].step] = [self._finish(r, args[r]) for r in self.runs[0]]
        for run, _, conn, _ in self._children:
            out[run.start :: run.step] = self._answer(conn, run)
        self.close()
        return out

    def close(self) -> None:
        """Let the workers go (no step 2) and wait for them."""
        for _, proc, conn, _ in self._children:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            conn.close()
            if self._delivered:  # it has answered: it exits on the None
                proc.join(5)
            if proc.is_alive():  # still planning (an error in this process, or in another worker): stopped
                proc.terminate()
                proc.join()
        self._children = []
        if self._gc:
            self._gc = False
            gc.unfreeze()
            gc.enable()

    def _report(self, own: int) -> None:
        if self.progress is not None:
            self.progress(own + sum(int(done.value) for _, _, _, done in self._children), self.n)

    def _answer(self, conn: Any, run: range) -> list[Any]:
        try:
            kind, value = conn.recv()
        except EOFError:
            raise RuntimeError(f"a plan worker ({_name(run)}) stopped without an answer") from None
        if kind == "error":
            raise RuntimeError(f"a plan worker ({_name(run)}) failed:\n{value}")
        return value

    # -- a worker ----------------------------------------------------------------------------------------

    def _child(self, run: range, conn: Any, done: Any) -> None:
        self._children = []  # the parent's, inherited: not this process's to answer
        self.progress = None

        def count(k: int) -> None:
            done.value = k

        try:
            conn.send(("ok", _planned(run, self.plan, count, self._gc)))
            args = conn.recv()
            if args is not None:
                conn.send(("ok", [self._finish(r, a) for r, a in zip(run, args)]))
        except BaseException:  # sent to the parent, which raises it with this worker's traceback
            try:
                conn.send(("error", traceback.format_exc()))
            except (BrokenPipeError, OSError):
                pass
        finally:
            conn.close()


def _name(run: range) -> str:
    return f"ranks {run.start}, {run.start + run.step}, ... of every {run.step}"


def _planned(run: range, plan: Callable[[int], Any], count: Callable[[int], None], collect: bool) -> list[Any]:
    """``plan`` over ``run``; with ``collect``, a collection every :data:`FREEZE_EVERY` ranks, then what it kept
    is frozen (out of the collector's walks)."""
    out = []
    for k, r in enumerate(run, 1):
        out.append(plan(r))
        count(k)
        if collect and k % FREEZE_EVERY == 0:
            gc.collect()
            gc.freeze()
    return out
