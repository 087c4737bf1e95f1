"""Run a function on N ranks of a process group from a test: ``run(fn, world_size, *args)``.

gloo runs (the CPU tests) go to a **session-scoped pool**: per world size, ``world_size`` persistent
worker processes, forked from a forkserver that has already imported torch, each with its gloo
default group initialized once. A test submits a picklable ``fn`` (a module-level function of a
test module) and its arguments; every rank runs ``fn(rank, world_size, *args)`` and ``run`` returns
the results of ranks 0..N-1. Splitting a test into many pytest items therefore costs no process
start-ups: a task costs a pickle, a barrier and the cleanup below.

Isolation between tasks on the same workers (everything a fresh process would have had):

* ``os.environ``, the working directory, ``sys.path``, warning filters, logger levels, torch's
  default dtype, grad mode and its global RNG state are restored after each task (the RNG is reset
  *before* each task to the state a fresh worker starts with);
* module state: the globals of every ``ucp_dcp``, ``ucp_dev`` and test module, and of a few torch modules that
  keep state (DCP's plan caches, which are class attributes of ``SavePlanner`` keyed by planner
  class; DCP's checkpoint daemon process; DTensor's RNG tracker; the state-dict patch set), are
  snapshotted before a task and restored after it: rebound names get their old objects back and
  dicts, lists and sets their old contents (so ucp_dcp's ``_CACHE`` plan cache and its side-group
  cache start empty, as in a fresh process). Class attributes of classes defined there likewise.
  :func:`patch` and :func:`setenv` make a task-scoped change explicit (also for objects outside
  those modules); the change is undone when the task ends;
* process groups (and so device meshes) a task created are destroyed after it, and DCP's
  checkpoint daemon (``async_save`` with ``AsyncCheckpointerType.PROCESS``) is stopped; hashed
  group names get a per-task salt so a group of the same ranks in a later task is a new group;
  memo caches (``lru_cache``) of torch.distributed, ucp_dcp, ucp_dev and the test modules are emptied:
  DTensor's sharding caches would otherwise hand a later task an equal-comparing mesh of an earlier
  one, with destroyed groups;
* task output (stdout/stderr of every rank, fd level) goes to a log per worker; the part a task
  wrote is printed in the test's captured output, and is part of the error when the task fails.

Failures: a rank that raises reports its traceback; a rank that dies (its exit code) or a task that
does not finish within ``timeout`` (the stacks of the ranks still running, dumped by faulthandler)
make ``run`` raise ``AssertionError`` with every rank's report, and the pool is torn down (its
process groups killed, children included) and started afresh for the next test, so one failure
does not cascade.

Other backends (the GPU tier's ``nccl``, ``cpu:gloo,cuda:nccl``) run in fresh processes per call, as
does everything when ``UCP_TEST_POOL=0``.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as _wait
from typing import Any

from worker import PG_TIMEOUT, _pool_worker, _worker, patch, setenv  # noqa: F401  (patch, setenv: dist.patch)

from ucp_dev.testing.processes import free_port

MAX_POOLED_PROCESSES = 12
"""Pools of other world sizes are closed (least recently used first) beyond this many workers."""
START_TIMEOUT = 180.0
GRACE_S = 1.0
"""After a rank fails, how long to wait for the other ranks' reports before the pool is killed."""

STARTS: list[tuple[int, float, str]] = []
"""Every pool started this session: (world size, seconds to start, why): printed at the end of the run, since
a pool restarted often (evicted by another world size, or torn down by a failure) is time ``make test`` loses."""

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "ucp_dcp",
    # imported by most tasks: once in the forkserver, not once per worker (seven workers importing the toy,
    # torchtitan and transformers side by side on two cores cost make test ~15 s); a missing extra is skipped
    "ucp_dev.toy",
    "ucp_dcp.torchtitan",
    "transformers",
]
_CTX = None


def _ctx():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


# == the driver: pools ===================================================================================


class _Pool:
    """``world_size`` workers with a gloo group; :meth:`run` runs one task on all of them."""

    def __init__(self, world_size: int, why: str = "first use") -> None:
        import torch.distributed as dist

        t0 = time.monotonic()
        self.world_size = world_size
        self.task = 0
        self.dir = tempfile.mkdtemp(prefix=f"ucp-pool{world_size}-")
        # the rendezvous store lives here: its port is taken atomically (no free-port race)
        self.store = dist.TCPStore(
            host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False, timeout=PG_TIMEOUT
        )
        ctx = _ctx()
        self.logs = [os.path.join(self.dir, f"rank{r}.log") for r in range(world_size)]
        self.procs, self.conns = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_pool_worker,
                args=(r, world_size, self.store.port, child, self.logs[r]),
                name=f"ucp-pool{world_size}-rank{r}",
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        ok, results, failures = self._collect(0, START_TIMEOUT, [0] * world_size)
        if not ok:
            self.close()
            raise AssertionError(f"the {world_size}-process pool did not start:\n{failures}")
        STARTS.append((world_size, time.monotonic() - t0, why))

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)  # (closed: no processes)

    def _tail(self, r: int, offset: int, limit: int = 6000) -> str:
        try:
            with open(self.logs[r], "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return text if len(text) <= limit else "[...]\n" + text[-limit:]

    def _collect(self, task_id: int, timeout: float, offsets: list[int]) -> tuple[bool, list[Any], str]:
        pending = dict(enumerate(self.conns))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace = None
        while pending:
            end = deadline if grace is None else min(deadline, grace)
            left = end - time.monotonic()
            if left <= 0:
                break
            waiting = list(pending.values()) + [self.procs[r].sentinel for r in pending]
            for obj in _wait(waiting, timeout=left):
                r = next((r for r, c in pending.items() if c is obj or self.procs[r].sentinel == obj), None)
                if r is None:
                    continue
                conn = pending.pop(r)
                try:
                    got_id, ok, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # the pipe closed: the process is gone
                    self.procs[r].join(timeout=5)
                    failures[r] = f"the process died (exit code {self.procs[r].exitcode})"
                    continue
                if got_id != task_id:
                    failures[r] = f"answered task {got_id}, expected {task_id}"
                elif not ok:
                    failures[r] = payload
                else:
                    try:
                        results[r] = None if payload is None else pickle.loads(payload)
                    except BaseException:
                        failures[r] = "its result could not be unpickled here:\n" + traceback.format_exc()
            if failures and grace is None:
                grace = time.monotonic() + GRACE_S
        if not failures and not pending:
            return True, [results[r] for r in range(self.world_size)], ""
        if pending and not failures:  # a hang: what every rank still running is doing
            for r in pending:
                try:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(1.0)
            for r in pending:
                failures[r] = f"no result after {timeout:.0f}s: hung; its stacks are in its output below"
        parts = []
        for r in range(self.world_size):
            if r in failures:
                status = failures[r]
            elif r in pending:
                status = "still running when another rank failed (killed)"
            else:
                status = "finished"
            out = self._tail(r, offsets[r])
            parts.append(f"--- rank {r}: {status}" + (f"\n--- rank {r} output:\n{out}" if out.strip() else ""))
        return False, [], "\n".join(parts)

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        blob = pickle.dumps((fn, args))  # a task that cannot be pickled fails here, the pool untouched
        self.task += 1
        offsets = []
        for log in self.logs:
            try:
                offsets.append(os.path.getsize(log))
            except OSError:
                offsets.append(0)
        msg = pickle.dumps((self.task, blob))
        try:
            for conn in self.conns:
                conn.send_bytes(msg)
        except (OSError, EOFError) as e:
            self.close()
            raise AssertionError(f"distributed run failed: the {self.world_size}-process pool is gone ({e})") from None
        ok, results, report = self._collect(self.task, timeout, offsets)
        if not ok:
            self.close()
            name = getattr(fn, "__qualname__", repr(fn))
            raise AssertionError(f"distributed run of {name} on {self.world_size} ranks failed:\n{report}")
        for r in range(self.world_size):  # into the test's captured output (shown when it fails)
            out = self._tail(r, offsets[r])
            if out.strip():
                print(f"--- rank {r} output:\n{out}", file=sys.stderr)
        return results

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the worker leads its own process group
                except OSError:
                    pass
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        self.store = None
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}  # least recently used first


def pool(world_size: int) -> _Pool:
    """The pool of ``world_size`` workers, started (or restarted after a failure) when needed."""
    p = _POOLS.pop(world_size, None)
    why = "first use" if not any(w == world_size for w, _, _ in STARTS) else "evicted"
    if p is not None and not p.alive():
        p.close()
        p = None
        why = "after a failure"
    if p is None:
        while _POOLS and sum(x.world_size for x in _POOLS.values()) + world_size > MAX_POOLED_PROCESSES:
            _POOLS.pop(next(iter(_POOLS))).close()
        p = _Pool(world_size, why)
    _POOLS[world_size] = p
    return p


@atexit.register
def shutdown() -> None:
    """Stop every pool (the session fixture calls this at the end of the run)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def use_pool(backend: str) -> bool:
    return backend == "gloo" and os.environ.get("UCP_TEST_POOL", "1") != "0"


# == fresh processes (other backends, or UCP_TEST_POOL=0) ================================================


def _run_fresh(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, backend: str) -> list[Any]:
    ctx = _ctx()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, backend)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    import queue as q

    try:
        while len(results) + len(failures) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except q.Empty:
                failures[-1] = f"timed out after {timeout}s waiting for ranks"
                break
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                break
    finally:
        for p in procs:
            if failures:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
        raise AssertionError(f"distributed run failed:\n{text}")
    return [results[r] for r in range(world_size)]


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (process group ``backend``);
    return their results, rank 0 first. gloo runs go to the session's pool of workers (see the
    module docstring); ``fn`` and ``args`` must pickle (a module-level function)."""
    if use_pool(backend):
        return pool(world_size).run(fn, args, timeout)
    return _run_fresh(fn, world_size, args, timeout, backend)


_TMPDIRS: list[str] = []


def tmpdir() -> str:
    """A scratch folder for one run's checkpoints, removed when the test process exits."""
    d = tempfile.mkdtemp(prefix="ucp-test-")
    _TMPDIRS.append(d)
    return d


@atexit.register
def _remove_tmpdirs() -> None:
    for d in _TMPDIRS:
        shutil.rmtree(d, ignore_errors=True)
