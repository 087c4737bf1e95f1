"""ucp_dcp on an S3-compatible store against DCP's FsspecWriter/FsspecReader, same server, state and run.

    python recipes/bench_s3.py [--mib 128] [--save-ranks 2] [--load-ranks 4] [--repeats 3] [--load-dim 0]
                               [--store-ranges exact|few] [--server moto|s3rver]

An S3 server runs in its own process on 127.0.0.1: moto's (``ucp_dev.testing.s3_server``, the tests'
server), or with ``--server s3rver`` the file-backed S3 server of npm's ``s3rver`` package (``make
bench-s3-s3rver`` installs it under ``runs/``), which answers a ranged GET by reading just that range of
the object's file, as S3 charges by the bytes sent, where moto builds the whole object for every range. A state of
``--mib`` MiB (one fp32 matrix sharded by rows, plus a replicated vector and a counter) is saved by
``--save-ranks`` gloo ranks to ``s3://bench/<system>`` and loaded by ``--load-ranks`` ranks sharded by rows
(a resharding load; ``--load-dim 1``: by columns, a tensor-parallel dim change), by each system in turn,
``--repeats`` times; a phase's time is the slowest rank's, and the median over the repeats is reported
(with the spread); each rank's S3 client is made before the clock starts. The server runs in Python on the same cores as the ranks, so it is often the
bottleneck: its CPU seconds per phase are reported too (from ``/proc``), with the requests it served by
kind and the object bytes it sent (its counters, :func:`~ucp_dev.testing.s3_server.server_stats`). ucp_dcp: ``UCPFileSystemWriter`` (multipart uploads, parts in flight, checksums,
commit by one PUT) and ``UCPFileSystemReader`` (ranged GETs of the bytes each rank needs, several in
flight, verified); DCP: ``FsspecWriter`` / ``FsspecReader`` with its default planners. Both loads are
checked bitwise. Prints a table and the ratios of the medians (DCP's time / ours: > 1 means ucp_dcp is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch


def _state(rank: int, world: int, rows: int, target: bool, dim: int = 0) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(world))
    full = torch.zeros(rows, 1024) if target else _full(rows)
    return {
        "w": distribute_tensor(full, mesh, [Shard(dim)], src_data_rank=None),
        "b": torch.zeros(1024) if target else torch.arange(1024.0),
        "step": -1 if target else 100,
    }


def _full(rows: int) -> torch.Tensor:
    return torch.randn(rows, 1024, generator=torch.Generator().manual_seed(0))


def _phase(
    rank: int, world: int, env: dict, system: str, phase: str, url: str, rows: int, used: int, dim: int, ranges: str
) -> dict:
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
        sd = _state(rank, used, rows, target=phase == "load", dim=dim if phase == "load" else 0)
        FsspecWriter, FsspecReader = fsspec_storage()
        # the client (s3fs and its botocore session, the same cached instance both systems use) is made and
        # its connection opened before the clock starts: about a second per fresh process here, for either
        from fsspec.core import url_to_fs

        url_to_fs(url)[0].exists(url.split("://", 1)[1].split("/", 1)[0])
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
            reader = ucp_dcp.UCPFileSystemReader(url, store_ranges=ranges)
            dcp.load(sd, storage_reader=reader, planner=ucp_dcp.UCPLoadPlanner(), process_group=group)
            out["bytes_read"] = reader.stats.bytes_read
        else:
            dcp.load(sd, storage_reader=FsspecReader(url), process_group=group)
        out["seconds"] = time.perf_counter() - t0
        if phase == "load":
            from torch.distributed.tensor import Shard, distribute_tensor

            expect = distribute_tensor(_full(rows), sd["w"].device_mesh, [Shard(dim)], src_data_rank=None)
            out["bitwise"] = bool(torch.equal(sd["w"].to_local(), expect.to_local())) and sd["step"] == 100
            out["needed"] = sd["w"].to_local().numel() * 4
    dist.barrier()
    return out


def spawn_s3rver(binary: str, bucket: str, folder: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """npm's ``s3rver`` on a free port of 127.0.0.1, keeping objects under ``folder``, with ``bucket``
    made: the process and the AWS environment that reaches it (s3rver accepts the key ``S3RVER``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "-d", folder, "-a", "127.0.0.1", "-p", str(port), "-s", "--configure-bucket", bucket],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "S3RVER",
        "AWS_SECRET_ACCESS_KEY": "S3RVER",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, env
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"s3rver ({binary}) did not start")


def _server_stats(endpoint: str, counted: bool) -> dict:
    """The server's request and byte counters, reset (moto's); s3rver keeps none."""
    from ucp_dev.testing.s3_server import server_stats

    return server_stats(endpoint, reset=True) if counted else {"requests": {}, "bytes_out": {}}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--save-ranks", type=int, default=2)
    ap.add_argument("--load-ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load-dim", type=int, choices=(0, 1), default=0, help="the load's shard dim (1: by columns)")
    ap.add_argument("--store-ranges", choices=("few", "exact"), default="few", help="ucp_dcp reader's store_ranges")
    ap.add_argument("--server", choices=("moto", "s3rver"), default="moto", help="the S3 server (see above)")
    ap.add_argument("--s3rver", default="runs/s3rver/node_modules/.bin/s3rver", help="s3rver's executable")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from ucp_dev.testing.processes import run_ranks
    from ucp_dev.testing.s3_server import spawn_server

    rows = a.mib * 1024 // 4
    world = max(a.save_ranks, a.load_ranks)
    counted = a.server == "moto"
    scratch = tempfile.TemporaryDirectory(prefix="s3rver-", dir="runs" if os.path.isdir("runs") else None)
    proc, env = spawn_server("bench") if counted else spawn_s3rver(a.s3rver, "bench", scratch.name)
    endpoint = env["AWS_ENDPOINT_URL"]
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    served: dict[tuple[str, str], dict] = {}
    extra: dict[str, dict] = {}
    try:
        for rep in range(a.repeats):
            for system in ("dcp", "ucp"):
                url = f"s3://bench/{system}-{rep}"
                for phase, used in (("save", a.save_ranks), ("load", a.load_ranks)):
                    _server_stats(endpoint, counted)
                    c0 = _cpu_seconds(proc.pid)
                    res = [
                        r
                        for r in run_ranks(
                            _phase, world, env, system, phase, url, rows, used, a.load_dim, a.store_ranges
                        )
                        if r
                    ]
                    cpu.setdefault((system, phase), []).append(_cpu_seconds(proc.pid) - c0)
                    served[(system, phase)] = _server_stats(endpoint, counted)
                    t = max(r["seconds"] for r in res)
                    times.setdefault((system, phase), []).append(t)
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
        scratch.cleanup()
    med = {k: statistics.median(v) for k, v in times.items()}
    save_ratio = med[("dcp", "save")] / med[("ucp", "save")]
    load_ratio = med[("dcp", "load")] / med[("ucp", "load")]
    mb = a.mib * 2**20 / 1e6
    how = ("by rows" if a.load_dim == 0 else "by columns") + f", store_ranges={a.store_ranges}"
    print(
        f"\nS3 ({a.server} on 127.0.0.1), {a.mib} MiB, save on {a.save_ranks} ranks, load on {a.load_ranks} ranks ({how}); "
        f"medians of {a.repeats} repeats [min-max]"
    )
    print(f"{'':>6} {'DCP Fsspec':>20} {'ucp_dcp':>20} {'ratio':>7}  server CPU s (DCP / ucp_dcp)")
    for phase, ratio in (("save", save_ratio), ("load", load_ratio)):
        d, u = times[("dcp", phase)], times[("ucp", phase)]
        cd, cu = statistics.median(cpu[("dcp", phase)]), statistics.median(cpu[("ucp", phase)])
        print(
            f"{phase:>6} {med[('dcp', phase)]:>6.2f} s [{min(d):.2f}-{max(d):.2f}] "
            f"{med[('ucp', phase)]:>6.2f} s [{min(u):.2f}-{max(u):.2f}] {ratio:>6.2f}x  {cd:.2f} / {cu:.2f}"
            f"   ({mb / med[('dcp', phase)]:.0f} vs {mb / med[('ucp', phase)]:.0f} MB/s)"
        )
    for phase in ("save", "load") if counted else ():
        for system in ("dcp", "ucp"):
            st = served[(system, phase)]
            reqs = ", ".join(f"{k} {v}" for k, v in sorted(st["requests"].items()))
            print(
                f"  {system} {phase}: requests {reqs}; object bytes sent {st['bytes_out'].get('GET', 0) / 2**20:.1f} MiB"
            )
    ux = extra["ucp"]
    print(f"ucp_dcp bytes requested / needed on the load: {ux['bytes_read'] / ux['needed']:.3f}")
    print(f"S3 BENCH: save {save_ratio:.2f}x, resharding load {load_ratio:.2f}x (DCP's median time / ucp_dcp's)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "seconds": {f"{s} {p}": v for (s, p), v in times.items()},
                    "server_cpu_s": {f"{s} {p}": v for (s, p), v in cpu.items()},
                    "served": {f"{s} {p}": v for (s, p), v in served.items()},
                    "mib": a.mib,
                    "server": a.server,
                    "load_dim": a.load_dim,
                    **extra,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
