"""ucp_dcp on an S3-compatible store against DCP's FsspecWriter/FsspecReader, same server, state and run.

    python recipes/bench_s3.py [--mib 128] [--save-ranks 2] [--load-ranks 4] [--repeats 2]

An S3 server (moto's, ``ucp_dcp.testing.s3_server``) runs in its own process on 127.0.0.1. A state of
``--mib`` MiB (one fp32 matrix sharded by rows, plus a replicated vector and a counter) is saved by
``--save-ranks`` gloo ranks to ``s3://bench/<system>`` and loaded by ``--load-ranks`` ranks sharded by rows
(a resharding load), by each system in turn, ``--repeats`` times; a phase's time is the slowest rank's,
the best repeat is kept. ucp_dcp: ``UCPFileSystemWriter`` (multipart uploads, parts in flight, checksums,
commit by one PUT) and ``UCPFileSystemReader`` (ranged GETs of the bytes each rank needs, several in
flight, verified); DCP: ``FsspecWriter`` / ``FsspecReader`` with its default planners. Both loads are
checked bitwise. Prints a table and the ratios (DCP's time / ours: > 1 means ucp_dcp is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch


def _state(rank: int, world: int, rows: int, target: bool) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(world))
    full = torch.zeros(rows, 1024) if target else _full(rows)
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
        "b": torch.zeros(1024) if target else torch.arange(1024.0),
        "step": -1 if target else 100,
    }


def _full(rows: int) -> torch.Tensor:
    return torch.randn(rows, 1024, generator=torch.Generator().manual_seed(0))


def _phase(rank: int, world: int, env: dict, system: str, phase: str, url: str, rows: int, used: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ucp_dcp
    from ucp_dcp._compat import fsspec_storage

    os.environ.update(env)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    group = dist.new_group(list(range(used)))
    out: dict = {}
    if rank < used:
        sd = _state(rank, used, rows, target=phase == "load")
        FsspecWriter, FsspecReader = fsspec_storage()
        dist.barrier(group)
        t0 = time.perf_counter()
        if phase == "save" and system == "ucp":
            dcp.save(
                sd,
                storage_writer=ucp_dcp.UCPFileSystemWriter(url),
                planner=ucp_dcp.UCPSavePlanner(),
                process_group=group,
            )
        elif phase == "save":
            dcp.save(sd, storage_writer=FsspecWriter(url), process_group=group)
        elif system == "ucp":
            reader = ucp_dcp.UCPFileSystemReader(url)
            dcp.load(sd, storage_reader=reader, planner=ucp_dcp.UCPLoadPlanner(), process_group=group)
            out["bytes_read"] = reader.stats.bytes_read
        else:
            dcp.load(sd, storage_reader=FsspecReader(url), process_group=group)
        out["seconds"] = time.perf_counter() - t0
        if phase == "load":
            from torch.distributed.tensor import Shard, distribute_tensor

            expect = distribute_tensor(_full(rows), sd["w"].device_mesh, [Shard(0)], src_data_rank=None)
            out["bitwise"] = bool(torch.equal(sd["w"].to_local(), expect.to_local())) and sd["step"] == 100
            out["needed"] = sd["w"].to_local().numel() * 4
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--save-ranks", type=int, default=2)
    ap.add_argument("--load-ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from ucp_dcp.testing.processes import run_ranks
    from ucp_dcp.testing.s3_server import spawn_server

    rows = a.mib * 1024 // 4
    world = max(a.save_ranks, a.load_ranks)
    proc, env = spawn_server("bench")
    best: dict[tuple[str, str], float] = {}
    extra: dict[str, dict] = {}
    try:
        for rep in range(a.repeats):
            for system in ("dcp", "ucp"):
                url = f"s3://bench/{system}-{rep}"
                for phase, used in (("save", a.save_ranks), ("load", a.load_ranks)):
                    res = [r for r in run_ranks(_phase, world, env, system, phase, url, rows, used) if r]
                    t = max(r["seconds"] for r in res)
                    best[(system, phase)] = min(best.get((system, phase), t), t)
                    if phase == "load":
                        if not all(r["bitwise"] for r in res):
                            print(f"BENCH FAILED: {system} load not bitwise")
                            return 1
                        extra[system] = {
                            "needed": sum(r["needed"] for r in res),
                            "bytes_read": sum(r.get("bytes_read", 0) for r in res),
                        }
                    print(f"  {system} {phase} (repeat {rep + 1}): {t:.2f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    save_ratio = best[("dcp", "save")] / best[("ucp", "save")]
    load_ratio = best[("dcp", "load")] / best[("ucp", "load")]
    mb = a.mib * 2**20 / 1e6
    print(
        f"\nS3 (moto on 127.0.0.1), {a.mib} MiB, save on {a.save_ranks} ranks, load on {a.load_ranks} ranks (by rows)"
    )
    print(f"{'':>6} {'DCP Fsspec':>12} {'ucp_dcp':>10} {'ratio':>7}")
    for phase, ratio in (("save", save_ratio), ("load", load_ratio)):
        d, u = best[("dcp", phase)], best[("ucp", phase)]
        print(f"{phase:>6} {d:>10.2f} s {u:>8.2f} s {ratio:>6.2f}x   ({mb / d:.0f} vs {mb / u:.0f} MB/s)")
    ux = extra["ucp"]
    print(f"ucp_dcp bytes requested / needed on the load: {ux['bytes_read'] / ux['needed']:.3f}")
    print(f"S3 BENCH: save {save_ratio:.2f}x, resharding load {load_ratio:.2f}x (DCP's time / ucp_dcp's)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"best_s": {f"{s} {p}": t for (s, p), t in best.items()}, "mib": a.mib, **extra}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
