"""What the control group costs: ``ucp_dcp.save`` + ``ucp_dcp.load`` with DCP's collectives on the control
group (the default) against the same calls on the gloo default group (``control_group=False``), one run.

    python recipes/bench_control.py [--mib 16] [--reps 7] [--world 4]

``world`` gloo ranks save and load ``mib`` MiB of fp32 state (a small model: 8 tensors sharded
``Shard(0)``, 8 small replicated ones, a step counter) into a fresh folder each time. Runs interleave
(gloo, control, control, gloo, ...). Reported per mode: median seconds of the save, of the load and of
the collectives' share measured on the coordinator (the time not spent planning, writing or reading
is what the group changes). The last line is ``CONTROL COST: save x, load y`` (control / gloo).
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
from datetime import timedelta


def _worker(rank: int, world: int, port: int, cfg: dict, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ucp_dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, cfg["mib"] * (1 << 20) // (4 * 256 * 8)) // world * world
    g = torch.Generator().manual_seed(0)
    state = {
        f"layers.{i}.w": distribute_tensor(torch.randn(rows, 256, generator=g), mesh, [Shard(0)]) for i in range(8)
    }
    state |= {f"layers.{i}.norm": torch.randn(256, generator=g) for i in range(8)}
    state["step"] = 7
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in ("gloo", "control")}
    for rep in range(cfg["reps"] + 1):  # the first round warms up (the control group is created), not counted
        for mode in ("gloo", "control") if rep % 2 else ("control", "gloo"):
            path = f"{cfg['out']}/{mode}_{rep}"
            on = mode == "control"
            dist.barrier()
            t0 = time.perf_counter()
            ucp_dcp.save(state, path, control_group=on, sync_files=False)
            t1 = time.perf_counter()
            ucp_dcp.load(target, path, control_group=on)
            t2 = time.perf_counter()
            dist.barrier()
            if rep:
                times[mode]["save"].append(t1 - t0)
                times[mode]["load"].append(t2 - t1)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    q.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--world", type=int, default=4)
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="ucp-bench-control-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cfg = {"mib": a.mib, "reps": a.reps, "out": out}
    procs = [ctx.Process(target=_worker, args=(r, a.world, port, cfg, q)) for r in range(a.world)]
    for p in procs:
        p.start()
    per_rank = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    shutil.rmtree(out, ignore_errors=True)
    # a call's time is its slowest rank's
    med = {
        m: {
            c: statistics.median(max(per_rank[r][m][c][i] for r in per_rank) for i in range(a.reps))
            for c in ("save", "load")
        }
        for m in ("gloo", "control")
    }
    print(f"{'mode':<8} {'save s':>8} {'load s':>8}   ({a.mib} MiB, {a.world} gloo ranks, median of {a.reps})")
    for m in ("gloo", "control"):
        print(f"{m:<8} {med[m]['save']:8.4f} {med[m]['load']:8.4f}")
    ratio = {c: med["control"][c] / med["gloo"][c] for c in ("save", "load")}
    print(f"CONTROL COST: save {ratio['save']:.3f}, load {ratio['load']:.3f} (control group / gloo)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
