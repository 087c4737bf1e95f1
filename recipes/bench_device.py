"""Resharding loads into device (CUDA) tensors: ucp_dcp against DCP's default, same run, same files.

    python recipes/bench_device.py --device cuda [--mib 1024] [--ranks 4] [--json PATH]
    python recipes/benchmark.py --device cuda ...          (the same)

Ranks share the machine's GPU (gloo carries the planning and read-once bytes). The state is
``--tensors`` fp32 tensors, saved ``Shard(0)`` twice, by ucp_dcp (``ucp_dcp.save``) and by DCP's
default planner and ``FileSystemWriter``, on all ranks and on rank 0 alone. The cases (``CASES``):
same layout, a TP dim change (``Shard(1)``), HSDP (``[Replicate(), Shard(0)]`` on 2 x N/2; also
loaded with read-once off and with ``read_once="ranks"``), 1->N and N->1. Each loads into device
targets with ucp_dcp's defaults (``UCPLoadPlanner()``, ``UCPFileSystemReader`` verifying checksums)
and with DCP's, warm page cache, median of ``--reps`` interleaved runs:

* **GB/s**: bytes the targets need (all ranks) / wall time of the load (slowest rank);
* **fraction of raw**: that rate over a raw host-to-device rate of the same bytes from the page
  cache: every rank reads its share of the checkpoint files' bytes into pinned buffers (16 MiB,
  double-buffered) and copies them to the device with non-blocking copies (goal >= 0.8);
* **bytes read / needed** (all ranks; DCP reads every saved item it touches whole);
* **peak host memory** added by the load (VmHWM, reset before) and **peak device memory** added
  (``torch.cuda.max_memory_allocated`` over what the targets hold), per rank, max over ranks;
* **async-save blocked time** (``recipes/bench_async.py``), when that script is present.

``--device cpu`` runs the same cases with CPU targets (the staging path forced with
``--staging always``): it checks the script on a machine without a GPU; its figures are not GPU
figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

# (name, saving ranks, load placement, loading ranks): "all" ranks or rank 0 alone ("one")
CASES = [
    ("same layout S0->S0", "all", "S0", "all"),
    ("tp-dim S0->S1", "all", "S1", "all"),
    ("hsdp RS0 2xN/2", "all", "RS0", "all"),
    ("1->N S0", "one", "S0", "all"),
    ("N->1 S0", "all", "S0", "one"),
]
# the HSDP case also loads with read-once off (every replica read from storage by its own rank) and with
# read_once="ranks" (each saved byte read by one rank, sent to the other replica): the default must not be
# slower than reading the replicas independently
HSDP_EXTRA = {"ucp_off": "off", "ucp_ranks": "ranks"}
STAGE = 16 << 20


def _hwm_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE=str(world),  # as torchrun sets it: the reader shares the host's cores among the ranks
        OMP_NUM_THREADS="1",
    )
    if cfg["staging"]:
        os.environ["UCP_DCP_STAGING"] = cfg["staging"]
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    if cfg["device"] == "cuda":
        torch.cuda.set_device(0)  # the ranks share the GPU
    dist.init_process_group(cfg["backend"], timeout=timedelta(seconds=1800))
    try:
        queue.put((rank, _bench(rank, world, cfg)))
    except BaseException:
        import traceback

        queue.put((rank, {"error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def _bench(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    import ucp_dcp

    dev = torch.device(cfg["device"])
    cuda = dev.type == "cuda"
    root, reps = cfg["out"], cfg["reps"]
    shape = (cfg["rows"], cfg["cols"])
    ranks = {"all": world, "one": 1}
    groups = {"all": dist.group.WORLD, "one": dist.new_group([0])}
    meshes = {
        ("S0", "all"): DeviceMesh(dev.type, torch.arange(world)),
        ("S0", "one"): DeviceMesh(dev.type, torch.arange(1)),
        ("S1", "all"): DeviceMesh(dev.type, torch.arange(world)),
        ("RS0", "all"): DeviceMesh(dev.type, torch.arange(world).reshape(2, world // 2), mesh_dim_names=("r", "s")),
    }
    places = {"S0": [Shard(0)], "S1": [Shard(1)], "RS0": [Replicate(), Shard(0)]}

    def state(pl: str, who: str, fill: bool) -> dict | None:
        if rank >= ranks[who]:
            return None
        mesh = meshes[(pl, who)]
        out = {}
        for i in range(cfg["tensors"]):
            lshape, off = compute_local_shape_and_global_offset(shape, mesh, places[pl])
            if fill:
                g = torch.Generator().manual_seed(i)
                full = torch.randn(shape, generator=g)
                local = full[tuple(slice(o, o + n) for o, n in zip(off, lshape))].contiguous()
            else:
                local = torch.zeros(lshape)
            out[f"w{i}"] = DTensor.from_local(
                local.to(dev), mesh, places[pl], run_check=False, shape=shape, stride=(shape[1], 1)
            )
        return out

    def slowest(fn, who: str = "all") -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank < ranks[who]:
            fn()
        if cuda:
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def total(x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    def peak(x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for who in sorted({c[1] for c in CASES}):
        src = state("S0", who, True)
        if src is not None:
            ucp_dcp.save(src, f"{root}/ucp_{who}", process_group=groups[who])
            dcp.save(src, storage_writer=dcp.FileSystemWriter(f"{root}/dcp_{who}"), process_group=groups[who])
        del src
        dist.barrier()
    res: dict = {}
    for name, saved, pl, loads in CASES:
        tgt = state(pl, loads, False)
        target_bytes = sum(v.to_local().nbytes for v in tgt.values()) if tgt is not None else 0
        needed = total(target_bytes)
        stats: dict = {}
        systems = ["ucp", "dcp", *(HSDP_EXTRA if pl == "RS0" else ())]

        def load(system: str) -> None:
            group = groups[loads]
            if system.startswith("ucp"):
                # the default planner (its read_once choice) and reader: what a user gets
                kw = {"read_once": HSDP_EXTRA[system]} if system in HSDP_EXTRA else {}
                r = stats[system] = ucp_dcp.UCPFileSystemReader(f"{root}/ucp_{saved}")
                dcp.load(tgt, storage_reader=r, planner=ucp_dcp.UCPLoadPlanner(**kw), process_group=group)
            else:
                r = stats["dcp"] = dcp.FileSystemReader(f"{root}/dcp_{saved}")
                stats["dcp_read"] = 0
                orig = r.read_data

                def counted(plan, planner):
                    stats["dcp_read"] = sum(r.storage_data[it.storage_index].length for it in plan.items)
                    return orig(plan, planner)

                r.read_data = counted
                dcp.load(tgt, storage_reader=r, process_group=group)

        times: dict[str, list[float]] = {s: [] for s in systems}
        for system in systems:  # warm the page cache
            slowest(lambda: load(system), loads)
        mem: dict[str, tuple[float, float]] = {}
        for rep in range(reps):
            for system in systems if rep % 2 == 0 else systems[::-1]:
                _reset_hwm()
                base_host = _hwm_kib()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                base_dev = torch.cuda.memory_allocated() if cuda else 0
                times[system].append(slowest(lambda: load(system), loads))
                extra_dev = (torch.cuda.max_memory_allocated() - base_dev) if cuda else 0
                mem[system] = (peak((_hwm_kib() - base_host) * 1024), peak(extra_dev))
        loading = rank < ranks[loads]
        over = {
            s: total(stats[s].stats.bytes_read + stats[s].stats.bytes_received if loading else 0) / needed
            for s in systems
            if s != "dcp"
        }
        over["dcp"] = total(stats["dcp_read"] if loading else 0) / needed
        raw = _raw_rate(rank, world, f"{root}/ucp_{saved}", target_bytes, dev, slowest, reps)
        med = {s: statistics.median(v) for s, v in times.items()}
        res[name] = {
            "needed_bytes": needed,
            "time_s": med,
            "runs": times,
            "gbps": {s: needed / med[s] / 1e9 for s in med},
            "raw_gbps": needed / raw / 1e9,
            "bytes_over_needed": over,
            "peak_host_added_bytes": {s: m[0] for s, m in mem.items()},
            "peak_device_added_bytes": {s: m[1] for s, m in mem.items()},
            "target_bytes_per_rank": target_bytes,
            "staging_buffers": peak(stats["ucp"].stats.staging_buffers if loading else 0),
            "staged_bytes": total(stats["ucp"].stats.staged_bytes if loading else 0),
        }
        tgt = None  # the next case's target replaces it; its memory goes now
    return res


def _raw_rate(rank: int, world: int, ckpt: str, nbytes: int, dev, slowest, reps: int) -> float:
    """Seconds for every rank to read ``nbytes`` of checkpoint file bytes (warm) into pinned
    buffers and copy them to ``dev``, double-buffered: the rate a load could reach at best."""
    import torch

    files = sorted(str(p) for p in Path(ckpt).glob("*.distcp"))
    cuda = dev.type == "cuda"
    bufs = [torch.empty(STAGE, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    events = [None, None]

    sizes = [os.path.getsize(p) for p in files]

    def run() -> None:
        done, k, fi, off = 0, 0, rank % len(files), 0
        fds = {p: os.open(p, os.O_RDONLY) for p in files}
        try:
            while done < nbytes:
                n = min(STAGE, nbytes - done, sizes[fi] - off)
                if n <= 0:  # this file is done: the next one (round robin)
                    fi, off = (fi + 1) % len(files), 0
                    continue
                if events[k] is not None:
                    events[k].synchronize()
                got = os.preadv(fds[files[fi]], [memoryview(bufs[k].numpy())[:n]], off)
                assert got == n, (files[fi], off, n, got)
                off += n
                dst[done : done + n].copy_(bufs[k][:n], non_blocking=cuda)
                if cuda:
                    events[k] = torch.cuda.Event()
                    events[k].record()
                done += n
                k ^= 1
        finally:
            for fd in fds.values():
                os.close(fd)

    run()  # warm
    return statistics.median(slowest(run) for _ in range(reps))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bench(cfg: dict, world: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    errors = [v["error"] for v in out.values() if isinstance(v, dict) and "error" in v]
    if errors:
        raise SystemExit(errors[0])
    return out[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ranks", type=int, default=4, help="processes sharing the device (even)")
    ap.add_argument("--backend", default="gloo", help="default process group backend (ranks share one GPU)")
    ap.add_argument("--mib", type=int, default=1024, help="state size")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--staging", default=None, choices=[None, "auto", "always"], help="UCP_DCP_STAGING for the ranks")
    ap.add_argument(
        "--async-save",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure async_save blocked time (recipes/bench_async.py)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default="runs/bench_device")
    a = ap.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_device: no CUDA GPU on this machine; nothing measured (use --device cpu to check the script)")
        return 2
    cols = 1024
    rows = a.mib * (1 << 20) // (4 * cols * a.tensors)
    rows -= rows % a.ranks
    Path(a.out).mkdir(parents=True, exist_ok=True)
    cfg = {
        "out": str(Path(a.out).resolve()),
        "tensors": a.tensors,
        "rows": rows,
        "cols": cols,
        "reps": a.reps,
        "device": a.device,
        "backend": a.backend,
        "staging": a.staging,
    }
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    print(
        f"device: {name}; {a.ranks} ranks ({a.backend}); state {a.tensors} x {rows}x{cols} fp32 = {a.mib} MiB; "
        f"{a.reps} interleaved warm reps"
    )
    res = run_bench(cfg, a.ranks)
    print(
        f"{'case':22} {'UCP GB/s':>9} {'DCP GB/s':>9} {'raw GB/s':>9} {'UCP/raw':>8} {'UCP/DCP t':>9} "
        f"{'read/need U':>11} {'D':>6} {'host+ U MiB':>11} {'D':>7} {'dev+ U MiB':>10} {'D':>7}"
    )
    for case, r in res.items():
        g = r["gbps"]
        print(
            f"{case:22} {g['ucp']:9.2f} {g['dcp']:9.2f} {r['raw_gbps']:9.2f} {g['ucp'] / r['raw_gbps']:8.2f} "
            f"{r['time_s']['ucp'] / r['time_s']['dcp']:9.2f} {r['bytes_over_needed']['ucp']:11.3f} "
            f"{r['bytes_over_needed']['dcp']:6.2f} {r['peak_host_added_bytes']['ucp'] / 2**20:11.0f} "
            f"{r['peak_host_added_bytes']['dcp'] / 2**20:7.0f} {r['peak_device_added_bytes']['ucp'] / 2**20:10.0f} "
            f"{r['peak_device_added_bytes']['dcp'] / 2**20:7.0f}"
        )
        for extra, mode in HSDP_EXTRA.items():
            if extra in r["time_s"]:
                print(
                    f"{'':22} read_once={mode}: {g[extra]:.2f} GB/s, default/this time "
                    f"{r['time_s']['ucp'] / r['time_s'][extra]:.2f}, read/need {r['bytes_over_needed'][extra]:.3f}"
                )
    out = {"device": name, "ranks": a.ranks, "backend": a.backend, "mib": a.mib, "loads": res}
    if a.async_save:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        try:
            import bench_async
        except ImportError:
            bench_async = None
        if bench_async is not None:
            out["async_save"] = bench_async.measure_async(
                world=a.ranks, nbytes=a.mib << 20, device=a.device, repeats=a.reps
            )
            print("async_save:", json.dumps(out["async_save"]))
    worst = min(r["gbps"]["ucp"] / r["raw_gbps"] for c, r in res.items())
    print(f"DEVICE LOAD {name}: UCP at >= {worst:.2f} of the raw host-to-device rate in every case (goal >= 0.8)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
