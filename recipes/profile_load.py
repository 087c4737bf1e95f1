"""Where a warm load on 4 gloo ranks spends its time, against each rank's raw read of its bytes.

    python recipes/profile_load.py [--mib 1024] [--reps 9] [--threads N] [--verify] [--tp-dim]

Four ranks save ``mib`` MiB (16 fp32 tensors, ``Shard(0)``) with ucp_dcp, then load them back warm (page
cache) ``reps`` times, at the same layout or (``--tp-dim``) as ``Shard(1)``, interleaved with a raw read of the same number of bytes per rank (each rank its own
file, read into a touched buffer: the data path with no protocol). Every step of DCP's load is timed on
every rank by wrapping it (DCP's ``_DistWrapper`` collectives, the planner's and reader's hooks, the
reader's file reads, the checkpoint group's gates), and the table prints the median per load of the slowest rank
for each step. ``plan collectives`` is DCP's ``reduce_scatter`` (local plans, gather, global plan,
scatter); ``final gather`` is DCP's ``all_gather`` after ``read_data`` (the wait for the slowest rank and
the result exchange). The loaded state is checked bitwise. The last line is ``LOAD PHASES: ...``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

STEPS: list[tuple[str, str, str]] = [
    # (label, owner, attribute): owner "dist" is DCP's _DistWrapper, "planner" UCPLoadPlanner,
    # "reader" UCPFileSystemReader, "watch" the checkpoint group's gates (ucp_dcp.planning.checkpoint_group)
    ("plan collectives", "dist", "reduce_scatter"),
    ("  read_metadata", "reader", "read_metadata"),
    ("  set_up_planner", "planner", "set_up_planner"),
    ("  create_local_plan", "planner", "create_local_plan"),
    ("read_data", "reader", "read_data"),
    ("  file reads", "reader", "_read_local"),
    ("  gates (all of the load's)", "watch", "gate"),
    ("read_data + final gather", "dist", "all_gather"),
]


def _wrap(owner: Any, name: str, label: str, times: dict[str, list[float]]) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(label, []).append(time.perf_counter() - t0)

    setattr(owner, name, timed)


def _worker(rank: int, port: int, cfg: dict, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import utils as dcp_utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ucp_dcp
    from ucp_dcp.planning.checkpoint_group import Watch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (4,))
    rows = cfg["mib"] * (1 << 20) // (4 * 512 * 16) // 4
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(rows, 512, generator=g) for _ in range(16)]
    state = {f"w{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(local)}
    if cfg["tp_dim"]:  # loaded as Shard(1): every rank needs a quarter of every saved row
        gens = [torch.Generator().manual_seed(r) for r in range(4)]
        parts = [[torch.randn(rows, 512, generator=gens[r]) for _ in range(16)] for r in range(4)]
        full = [torch.cat([parts[r][i] for r in range(4)]) for i in range(16)]
        expect = [f[:, rank * 128 : (rank + 1) * 128].contiguous() for f in full]
        del parts, full
        target = {
            k: DTensor.from_local(torch.zeros_like(e), mesh, [Shard(1)], run_check=False) for k, e in zip(state, expect)
        }
    else:
        expect = local
        target = {
            k: DTensor.from_local(torch.zeros_like(t), mesh, [Shard(0)], run_check=False) for k, t in zip(state, local)
        }
    root = cfg["out"]
    dcp.save(state, storage_writer=ucp_dcp.UCPFileSystemWriter(f"{root}/ucp"), planner=ucp_dcp.UCPSavePlanner())
    flat = torch.cat([t.reshape(-1) for t in local]).view(torch.uint8).numpy()
    raw_path = f"{root}/raw_{rank}.bin"
    with open(raw_path, "wb") as f:
        f.write(memoryview(flat))
    dest = memoryview(torch.ones(flat.nbytes, dtype=torch.uint8).numpy())
    del flat

    def raw() -> None:
        with open(raw_path, "rb", buffering=0) as f:
            pos = 0
            while pos < len(dest):
                pos += f.readinto(dest[pos : pos + (64 << 20)])

    times: dict[str, list[float]] = {}
    owners = {
        "dist": dcp_utils._DistWrapper,
        "planner": ucp_dcp.UCPLoadPlanner,
        "reader": ucp_dcp.UCPFileSystemReader,
        "watch": Watch,
    }
    for label, owner, name in STEPS:
        _wrap(owners[owner], name, label, times)
    loads: list[float] = []
    raws: list[float] = []
    for rep in range(cfg["reps"] + 1):  # the first round warms up
        for case in ("ucp", "raw") if rep % 2 else ("raw", "ucp"):
            dist.barrier()
            t0 = time.perf_counter()
            if case == "ucp":
                # ucp_dcp.load: DCP's collectives on the checkpoint group, behind the watch's gates
                ucp_dcp.load(target, f"{root}/ucp", verify_checksums=cfg["verify"], thread_count=cfg["threads"])
            else:
                raw()
            took = time.perf_counter() - t0
            if rep:
                (loads if case == "ucp" else raws).append(took)
        if rep == 0:
            times.clear()
    for k, t in zip(target, expect):
        assert torch.equal(target[k].to_local(), t), k
    q.put((rank, {"steps": times, "load": loads, "raw": raws, "bytes": len(dest)}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="reading threads per rank (default: the reader's)")
    ap.add_argument("--verify", action="store_true", help="verify checksums (the reader's default; off here)")
    ap.add_argument("--tp-dim", action="store_true", help="load as Shard(1) (the benchmark's tp-dim case)")
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="ucp-profile-load-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"mib": a.mib, "reps": a.reps, "out": out, "threads": a.threads, "verify": a.verify, "tp_dim": a.tp_dim}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, cfg, q)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        res = dict(q.get(timeout=1800) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
        shutil.rmtree(out, ignore_errors=True)
    reps = a.reps
    total = sum(r["bytes"] for r in res.values())

    def per_load(label: str) -> float:
        """Median per load of the slowest rank (a step called several times per load is summed)."""
        worst = []
        for r in res.values():
            xs = r["steps"].get(label, [])
            calls = max(1, len(xs) // reps)
            worst.append(statistics.median([sum(xs[i * calls : (i + 1) * calls]) for i in range(reps)]) if xs else 0.0)
        return max(worst)

    load = max(statistics.median(r["load"]) for r in res.values())  # from the barrier, slowest rank
    raw_rank = max(statistics.median(r["raw"]) for r in res.values())
    layout = "Shard(0) -> Shard(1) (tp-dim)" if a.tp_dim else "same layout"
    print(
        f"{a.mib} MiB on 4 gloo ranks, {layout}, warm, checksums {'on' if a.verify else 'off'}; medians of {reps} loads"
    )
    print(f"{'step':<28} {'ms':>8}")
    print(f"{'load, from the barrier':<28} {load * 1e3:8.1f}")
    for label, _, _ in STEPS:
        print(f"{label:<28} {per_load(label) * 1e3:8.1f}")
    print(f"{'raw read, slowest rank':<28} {raw_rank * 1e3:8.1f}")
    fixed = load - per_load("read_data")
    print(
        f"LOAD PHASES: load {load * 1e3:.0f} ms = {total / load / 1e9:.2f} GB/s, {raw_rank / load:.2f} of raw; "
        f"file reads {per_load('  file reads') * 1e3:.0f} ms vs raw {raw_rank * 1e3:.0f} ms per rank; "
        f"outside read_data {fixed * 1e3:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
