"""What the save-time checks cost: ``ucp_dcp.save`` with the default replica checks against the same
save with them off (``check_replicas="off"``), in one run, per layout.

    python recipes/bench_checks.py [--mib 512] [--reps 5] [--json runs/bench_checks.json]

4 gloo ranks save ``mib`` MiB of fp32 state (8 tensors) laid out as

* ``fsdp``: ``Shard(0)`` over 4 ranks: no piece is held twice, nothing to compare;
* ``hsdp``: ``[Replicate, Shard(0)]`` on a 2 x 2 mesh: every piece is held by 2 ranks, all compared;
* ``ddp_tp``: each data-parallel rank's own TP mesh of 2 (slices of a (dp, tp) mesh): every piece
  is a replica on the other data-parallel rank, all compared.

Runs interleave (on, off, on, ...), each save into a fresh folder after ``sync``. Reported: median
seconds of each and the ratio on / off (the issue's goal: <= 1.03). The last line is
``CHECKS COST: ...`` with the three ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

LAYOUTS = ("fsdp", "hsdp", "ddp_tp")


def _worker(rank: int, world: int, port: int, cfg: dict, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ucp_dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    n_tensors = 8
    rows = cfg["mib"] * (1 << 20) // (4 * 1024 * n_tensors)
    torch.manual_seed(0)
    full = [torch.randn(rows, 1024) for _ in range(n_tensors)]
    flat = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    states = {
        "fsdp": {f"w{i}": distribute_tensor(t, flat, [Shard(0)]) for i, t in enumerate(full)},
        "hsdp": {f"w{i}": distribute_tensor(t, grid, [Replicate(), Shard(0)]) for i, t in enumerate(full)},
        "ddp_tp": {f"w{i}": distribute_tensor(t, grid["tp"], [Shard(0)]) for i, t in enumerate(full)},
    }
    del full
    times: dict[str, dict[str, list[float]]] = {lay: {"on": [], "off": []} for lay in LAYOUTS}
    for rep in range(cfg["reps"] + 1):  # the first round warms up, not counted
        for lay in LAYOUTS:
            for mode in ("on", "off") if rep % 2 else ("off", "on"):
                path = f"{cfg['out']}/{lay}_{mode}_{rep}"
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                    os.sync()
                dist.barrier()
                t0 = time.perf_counter()
                ucp_dcp.save(states[lay], path, **({} if mode == "on" else {"check_replicas": "off"}))
                dist.barrier()
                if rep:
                    times[lay][mode].append(time.perf_counter() - t0)
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        q.put(times)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="runs/bench_checks")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cfg = {"mib": a.mib, "reps": a.reps, "out": a.out}
    procs = [ctx.Process(target=_worker, args=(r, 4, port, cfg, q)) for r in range(4)]
    for p in procs:
        p.start()
    times = q.get()
    for p in procs:
        p.join()
    rows = {}
    print(
        f"{'layout':<8} {'checks on s':>12} {'checks off s':>13} {'on/off':>7}   ({a.mib} MiB, 4 ranks, median of {a.reps})"
    )
    for lay in LAYOUTS:
        on, off = statistics.median(times[lay]["on"]), statistics.median(times[lay]["off"])
        rows[lay] = {
            "on_s": on,
            "off_s": off,
            "ratio": on / off,
            "on_all": times[lay]["on"],
            "off_all": times[lay]["off"],
        }
        print(f"{lay:<8} {on:12.3f} {off:13.3f} {on / off:7.3f}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"mib": a.mib, "reps": a.reps, "layouts": rows}, indent=1))
    print(
        "CHECKS COST: save time with the default checks / without, "
        + ", ".join(f"{lay} {rows[lay]['ratio']:.3f}" for lay in LAYOUTS)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
