"""Run a function on the ranks of a fresh gloo process group: :func:`run_ranks`, what a recipe uses where the
tests use their pool of workers (tests/support/dist.py, which keeps processes between tests).

Each call starts ``world`` processes from a forkserver that has imported torch and ucp_dcp once (so a second
call starts quickly), initializes a gloo default group on every rank, runs ``fn(rank, world, *args)``, and
returns the results of ranks 0..world-1. A rank that raises or dies, or a run past ``timeout``, kills the
others and raises :class:`RanksFailed` with every rank's report.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

PG_TIMEOUT = timedelta(seconds=600)
"""Collective timeout of the ranks' gloo group (a rank that waits longer fails)."""
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "ucp_dcp"]
_CTX = None


class RanksFailed(RuntimeError):
    """A rank raised or died, or the run timed out; the message holds every report."""


def _ctx():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick): the checkout's one helper for it; the shipped
    quickstart and the device-machine benchmark keep their own, since neither may import ``ucp_dev``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, results, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
        out = fn(rank, world, *args)
        dist.barrier()  # every rank is done with the run's collectives before the group goes away
        dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    for f in (sys.stdout, sys.stderr):
        f.flush()
    results.close()
    results.join_thread()  # the report is in the pipe before the process ends
    # No interpreter teardown: with torch 2.13, about 1 in 6 pp=3 runs aborted there ("terminate called
    # without an active exception") after all work had succeeded.
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` fresh processes with a gloo default group; the results, rank 0
    first. ``fn`` and ``args`` must pickle (a module-level function: a recipe's ``__main__`` works too)."""
    ctx = _ctx()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, results, args)) for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(done) < world and not failures:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                for r in dead:
                    failures[r] = f"died with exit code {procs[r].exitcode}"
                if deadline is not None and time.monotonic() > deadline:
                    failures[-1] = f"timed out after {timeout:.0f}s; ranks done: {sorted(done)}"
                continue
            if ok:
                done[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
    finally:
        for p in procs:
            if failures:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{report}" for r, report in sorted(failures.items()))
        raise RanksFailed(f"{world}-rank run of {getattr(fn, '__name__', fn)} failed:\n{text}")
    return [done[r] for r in range(world)]
