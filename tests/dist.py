"""Run a function on N gloo ranks (CPU) from a test.

Workers are forked from a forkserver that has already imported torch, so a spawn costs a fork, not
N `import torch` on two cores. A failing rank's traceback is reported and the others are killed at
once (no waiting for a collective timeout).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

_CTX = None


def _ctx():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(
            ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp", "ucp_dcp"]
        )
    return _CTX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, queue, args, backend="gloo"):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if "nccl" in backend:  # NCCL needs the rank's device before the first collective
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=180))
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes (process group ``backend``);
    return their results."""
    ctx = _ctx()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, backend)) for r in range(world_size)]
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
                results[rank] = payload
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


_TMPDIRS: list[str] = []


def tmpdir() -> str:
    """A scratch folder for one spawn's checkpoints, removed when the test process exits."""
    d = tempfile.mkdtemp(prefix="ucp-test-")
    _TMPDIRS.append(d)
    return d


@atexit.register
def _remove_tmpdirs() -> None:
    for d in _TMPDIRS:
        shutil.rmtree(d, ignore_errors=True)
