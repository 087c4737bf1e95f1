"""What the trust guarantees cost: save time with atomic commit and full checksums against DCP's
default save in the same run, and ``verify``'s rate against a raw read of the same files.

    python recipes/bench_trust.py [--mib 1024] [--reps 5] [--json runs/bench_trust.json]

* **save** (4 gloo ranks, one fp32 tensor of ``mib`` MiB sharded by rows): ``ucp_dcp.save``
  (UCPSavePlanner + UCPFileSystemWriter: block checksums of every byte, sidecar, fsync of files and
  folder, atomic rename, removal of the replaced files) against ``dcp.save`` with DCP's default
  planner and ``FileSystemWriter`` (fsync of files). Both save *over the previous checkpoint of the
  same folder* (the case atomic commit is for) and into a fresh folder; runs interleave, each after
  ``sync``. Reported: median seconds and the ratio UCP / DCP (goal <= 1.03). Alongside, the disk
  pattern of each without either library: every rank writes its bytes to a new file and removes
  the previous one (atomic commit's pattern) or truncates and rewrites one file (DCP's overwrite).
* **verify**: ``python -m ucp_dcp verify`` on that checkpoint against reading every byte of the same
  files with the same number of threads (no hashing), warm (page cache) and cold (pages dropped
  with ``posix_fadvise(DONTNEED)`` before each run). Ratio = verify rate / raw rate (goal >= 0.9).
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
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path


def _save_worker(rank: int, world: int, port: int, cfg: dict, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ucp_dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    rows = cfg["mib"] * (1 << 20) // (4 * 1024 * world)
    g = torch.Generator().manual_seed(rank)
    sd = {
        "w": DTensor.from_local(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)], run_check=False),
        "step": 7,
        "lr": 1e-3,
    }
    out: dict = {}
    raw = sd["w"].to_local().numpy().tobytes()

    def raw_write(where: str, rep: int) -> None:
        """The disk pattern of each system without either: a new file then the old one removed
        (atomic commit's), or the same file truncated and rewritten (DCP's overwrite)."""
        name = f"{cfg['out']}/raw_{where}/r{rank}" + (f"_{rep}" if where == "new" else "")
        with open(name, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        if where == "new" and rep:
            os.remove(f"{cfg['out']}/raw_new/r{rank}_{rep - 1}")

    os.makedirs(f"{cfg['out']}/raw_new", exist_ok=True)
    os.makedirs(f"{cfg['out']}/raw_trunc", exist_ok=True)
    raw_write("trunc", 0)
    raw_write("new", 0)
    modes = [("ucp", "over"), ("dcp", "over"), ("ucp", "fresh"), ("dcp", "fresh"), ("raw", "new"), ("raw", "trunc")]
    for system, where in modes:  # the "over" folders start with a checkpoint in them
        if where == "over":
            path = f"{cfg['out']}/{system}_over"
            (ucp_dcp.save(sd, path) if system == "ucp" else dcp.save(sd, storage_writer=dcp.FileSystemWriter(path)))
    for rep in range(cfg["reps"]):
        for system, where in modes if rep % 2 == 0 else modes[::-1]:
            path = f"{cfg['out']}/{system}_{where}"
            if rank == 0:
                if where == "fresh" and system != "raw":
                    shutil.rmtree(path, ignore_errors=True)
                os.sync()  # no dirty pages of an earlier save in flight
            dist.barrier()
            t0 = time.perf_counter()
            if system == "ucp":
                ucp_dcp.save(sd, path)
            elif system == "dcp":
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))
            else:
                raw_write(where, rep + 1)
            dist.barrier()
            out.setdefault(f"{system} {where}", []).append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 0:
        q.put(out)
    q.close()
    q.join_thread()  # the queue's feeder thread must flush before os._exit
    os._exit(0)


def bench_save(cfg: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_save_worker, args=(r, 4, port, cfg, q)) for r in range(4)]
    for p in procs:
        p.start()
    res = q.get(timeout=3600)
    for p in procs:
        p.join()
    return res


def _raw_read(files: list[str], threads: int) -> float:
    def one(f: str) -> int:
        buf = bytearray(8 << 20)
        mv = memoryview(buf)
        n = 0
        with open(f, "rb", buffering=0) as fh:
            while True:
                k = fh.readinto(mv)
                if not k:
                    return n
                n += k

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))
    return time.perf_counter() - t0


def bench_verify(path: str, reps: int) -> dict:
    from ucp_dcp.tools.verify import verify
    from ucp_dev.testing.pagecache import evict

    files = [str(p) for p in Path(path).iterdir() if p.is_file()]
    total = sum(os.path.getsize(f) for f in files)
    threads = min(8, os.cpu_count() or 1)
    out: dict = {"bytes": total, "files": len(files), "threads": threads}
    for temp in ("warm", "cold"):
        raw, ver = [], []
        for rep in range(reps):
            for kind in ("raw", "verify") if rep % 2 == 0 else ("verify", "raw"):
                if temp == "cold":
                    evict(files)
                else:
                    _raw_read(files, threads)  # make sure every page is cached
                if kind == "raw":
                    raw.append(_raw_read(files, threads))
                else:
                    t0 = time.perf_counter()
                    r = verify(path, threads=threads)
                    ver.append(time.perf_counter() - t0)
                    assert r.status == "ok", r
        out[temp] = {
            "raw_s": statistics.median(raw),
            "verify_s": statistics.median(ver),
            "raw_gbs": total / statistics.median(raw) / 1e9,
            "verify_gbs": total / statistics.median(ver) / 1e9,
            "ratio": statistics.median(raw) / statistics.median(ver),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="runs/bench_trust")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"state: {a.mib} MiB fp32 on 4 gloo ranks, {a.reps} interleaved reps per mode", flush=True)
    save = bench_save({"out": str(out), "mib": a.mib, "reps": a.reps})
    med = {k: statistics.median(v) for k, v in save.items()}
    rows = []
    for where in ("over", "fresh"):
        u, d = med[f"ucp {where}"], med[f"dcp {where}"]
        rows.append((f"save {'over a checkpoint' if where == 'over' else 'into a new folder'}", u, d, u / d))
    rows.append(("disk: new file + rm / rewrite", med["raw new"], med["raw trunc"], med["raw new"] / med["raw trunc"]))
    ver = bench_verify(str(out / "ucp_over"), a.reps)
    print(f"{'case':<32} {'ucp_dcp':>9} {'DCP':>9} {'ratio':>7}")
    for name, u, d, r in rows:
        print(
            f"{name:<32} {u:8.3f}s {d:8.3f}s {r:7.3f}   "
            + ("(goal <= 1.03)" if name.startswith("save") else "(the same bytes without either library)")
        )
    for temp in ("warm", "cold"):
        v = ver[temp]
        print(
            f"{'verify ' + temp + ' vs raw read':<32} {v['verify_gbs']:6.2f}GB/s {v['raw_gbs']:6.2f}GB/s "
            f"{v['ratio']:7.3f}   (goal >= 0.9; {ver['files']} files, {ver['threads']} threads)"
        )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps({"mib": a.mib, "reps": a.reps, "save": save, "save_median": med, "verify": ver}, indent=1)
        )
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
