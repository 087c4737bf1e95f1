"""ucp_dcp against DCP's default planners and filesystem storage, in one run, same state, same disk.

    python recipes/benchmark.py [--quick] [--json PATH] [--out DIR]
    python recipes/benchmark.py --device cuda [...]     (GPU: recipes/bench_device.py)

Prints a table and writes JSON records ``{"case", "metric", "ucp", "dcp", "ratio", "target", "met"}``.
Measured (4 gloo processes on CPU; state = tensors sharded ``Shard(0)``, fp32):

* save time (4 ranks), UCP / DCP;
* load time for N->M resharding (1->4, 4->3, 2->4, 4->4, a TP dim change Shard(0)->Shard(1), and
  an HSDP load ``[Replicate(), Shard(0)]`` on 2x2, on one host and with the replicas on two
  simulated hosts, where UCP reads each replica once and sends it) against DCP's same-layout
  (4->4) load and DCP's load of the same case;
* bytes read / bytes needed (bytes read = byte ranges requested from storage, all ranks; needed =
  sum of the target local tensors), UCP without and with checksum verification, DCP;
* the offline path: ``dcp_to_torch_save`` + every rank loading the full file and taking its shard;
* peak RSS added by the load (VmHWM reset before loading) against the target state;
* throughput against a raw sequential write / read of the same bytes on the same disk, warm and
  cold cache (``posix_fadvise(DONTNEED)``): the faster of one process and 4 processes writing /
  reading a quarter each (the VM's disk takes parallel streams faster); reads land in a buffer of
  the size read, as a load must;
* planning: rank-0 CPU time and gathered plan bytes at simulated 256/1024/4096 ranks
  (``recipes/bench_planning.py``); DCP at 4096 is extrapolated linearly from 1024.

Timings are the median of ``--reps`` interleaved warm-cache runs (with min..max), plus one cold run;
saves get ``3 * reps`` runs, each starting after ``sync`` with its old files removed. The 4->4 load is also reported as its
data phase alone (``UCPFileSystemReader.stats.seconds``, slowest rank), which excludes the fixed
cost of DCP's load collectives. On 2 cores run-to-run noise is a few percent, more below 0.1 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# (name, save ranks, save placement, load ranks, load placement)
CASES = [
    ("1->4", 1, "S0", 4, "S0"),
    ("4->3", 4, "S0", 3, "S0"),
    ("2->4", 2, "S0", 4, "S0"),
    ("4->4", 4, "S0", 4, "S0"),
    ("tp-dim", 4, "S0", 4, "S1"),
    ("hsdp 4->2x2", 4, "S0", 4, "RS0"),  # [Replicate(), Shard(0)] on 2x2, one host: each rank reads
    ("hsdp 2 hosts", 4, "S0", 4, "RS0"),  # the same, replicas on 2 simulated hosts: read once, sent
]
SIMULATED_HOSTS = {"hsdp 2 hosts"}  # UCP_DCP_HOST = node<rank // 2> during these loads
TARGETS = {
    "bytes_ratio": 1.05,
    "load_vs_dcp_same_layout": 1.0,
    "save_ratio": 1.03,
    "save_nosync_ratio": 1.0,  # issue 33: without fsync no slower than DCP's, checksums on
    "offline_speedup": 3.0,
    "planning_speedup": 5.0,
    "throughput_vs_raw": 0.9,
}


# -- worker side ----------------------------------------------------------------------------------


def _hwm_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    try:
        out = _io_bench(rank, cfg)
        queue.put((rank, out))
    except BaseException:
        import traceback

        queue.put((rank, {"error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def _io_bench(rank: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ucp_dcp
    from ucp_dev.testing.pagecache import evict

    root, n_tensors, rows, cols, reps = cfg["out"], cfg["tensors"], cfg["rows"], cfg["cols"], cfg["reps"]
    groups = {n: (dist.group.WORLD if n == 4 else dist.new_group(list(range(n)))) for n in (1, 2, 3, 4)}
    meshes = {n: DeviceMesh("cpu", torch.arange(n)) for n in (1, 2, 3, 4)}
    torch.manual_seed(0)
    full = [torch.randn(rows, cols) for _ in range(n_tensors)]

    mesh22 = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))

    def state(n: int, pl: str, fill: bool):
        if rank >= n:
            return None
        mesh, p = {
            "S0": (meshes[n], [Shard(0)]),
            "S1": (meshes[n], [Shard(1)]),
            "RS0": (mesh22, [Replicate(), Shard(0)]),
        }[pl]
        return {
            f"w{i}": distribute_tensor(t if fill else torch.zeros_like(t), mesh, p, src_data_rank=None)
            for i, t in enumerate(full)
        }

    class CountingReader(dcp.FileSystemReader):
        """DCP's reader, counting the bytes it reads: every read item loads its whole saved item."""

        def read_data(self, plan, planner):
            self.bytes_read = sum(self.storage_data[it.storage_index].length for it in plan.items)
            return super().read_data(plan, planner)

    def timed(fn, n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if rank < n:
            fn()
        dist.barrier()
        return time.perf_counter() - t0

    def sum_all(x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    res: dict = {"save": {"ucp": [], "dcp": []}, "save_nosync": {"ucp": [], "dcp": []}}
    res |= {"load": {}, "bytes": {}, "rss": {}, "raw": {}}
    sources = sorted({(c[1], c[2]) for c in CASES})
    # saves (the 4-rank one is the timed save), interleaved; disk writeback makes single saves vary
    # by up to 3x, so the timed save gets 3x the reps
    for rep in range(3 * reps):
        for system in ("ucp", "dcp") if rep % 2 == 0 else ("dcp", "ucp"):
            for n, pl in sources if rep < reps else [(4, "S0")]:
                sd = state(n, pl, True)
                path = f"{root}/{system}_{n}{pl}"
                if rank == 0:  # each save starts on a clean disk: no old files, no dirty pages in flight
                    shutil.rmtree(path, ignore_errors=True)
                    os.sync()
                if system == "ucp":
                    fn = lambda: dcp.save(
                        sd,
                        storage_writer=ucp_dcp.UCPFileSystemWriter(path),  # noqa: E731
                        planner=ucp_dcp.UCPSavePlanner(),
                        process_group=groups[n],
                    )
                else:
                    fn = lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), process_group=groups[n])  # noqa: E731
                dt = timed(fn, n)
                if n == 4:
                    res["save"][system].append(dt)
    # the 4-rank save without fsync (both writers' sync_files=False; ours still hashes every block):
    # what the library itself costs once the disk's flush is out of the way
    whole = state(4, "S0", True)
    for rep in range(3 * reps):
        for system in ("ucp", "dcp") if rep % 2 == 0 else ("dcp", "ucp"):
            path = f"{root}/{system}_nosync"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
            if system == "ucp":
                fn = lambda: dcp.save(  # noqa: E731
                    whole,
                    storage_writer=ucp_dcp.UCPFileSystemWriter(path, sync_files=False),
                    planner=ucp_dcp.UCPSavePlanner(),
                )
            else:
                fn = lambda: dcp.save(whole, storage_writer=dcp.FileSystemWriter(path, sync_files=False))  # noqa: E731
            res["save_nosync"][system].append(timed(fn, 4))
    if rank == 0:  # their dirty pages are not left to be written back during the loads below
        for system in ("ucp", "dcp"):
            shutil.rmtree(f"{root}/{system}_nosync", ignore_errors=True)
        os.sync()
    dist.barrier()
    # loads, interleaved; targets are allocated (and touched) once per case
    for name, ns, ps, nl, pl in CASES:
        os.environ.pop("UCP_DCP_HOST", None)
        if name in SIMULATED_HOSTS:
            os.environ["UCP_DCP_HOST"] = f"node{rank // 2}"
        tgt = state(nl, pl, False)
        needed = sum_all(sum(v.to_local().nbytes for v in tgt.values()) if tgt else 0)
        runs: dict[str, list[float]] = {"ucp": [], "dcp": [], "ucp_verify": [], "ucp_data_phase": []}
        readers: dict = {}

        def load(system: str) -> None:
            path = f"{root}/{'dcp' if system == 'dcp' else 'ucp'}_{ns}{ps}"
            if system == "dcp":
                r = readers["dcp"] = CountingReader(path)
                dcp.load(tgt, storage_reader=r, process_group=groups[nl])
            else:
                r = readers[system] = ucp_dcp.UCPFileSystemReader(path, verify_checksums=system == "ucp_verify")
                dcp.load(tgt, storage_reader=r, planner=ucp_dcp.UCPLoadPlanner(), process_group=groups[nl])

        for rep in range(reps):
            order = ["ucp", "dcp", "ucp_verify"] if rep % 2 == 0 else ["dcp", "ucp_verify", "ucp"]
            for system in order:
                runs[system].append(timed(lambda: load(system), nl))
                if system == "ucp":  # the slowest rank's read_data, without DCP's planning collectives
                    phase = torch.tensor([readers["ucp"].stats.seconds if rank < nl else 0.0])
                    dist.all_reduce(phase, op=dist.ReduceOp.MAX)
                    runs["ucp_data_phase"].append(float(phase))
        for system in ("ucp", "dcp", "ucp_verify"):
            if rank < nl:
                read = readers[system].bytes_read if system == "dcp" else readers[system].stats.bytes_read
            else:
                read = 0
            res["bytes"].setdefault(name, {})[system] = sum_all(read) / needed
            # cold cache: drop the checkpoint's pages, then one load
            if rank == 0:
                evict(f"{root}/{'dcp' if system == 'dcp' else 'ucp'}_{ns}{ps}")
            runs[system + "_cold"] = [timed(lambda: load(system), nl)]
        # peak RSS added by one load beyond the target state (per rank, max over ranks)
        for system in ("ucp", "dcp"):
            _reset_hwm()
            base = _hwm_kib()
            timed(lambda: load(system), nl)
            extra = torch.tensor([float(_hwm_kib() - base) if rank < nl else 0.0])
            dist.all_reduce(extra, op=dist.ReduceOp.MAX)
            res["rss"].setdefault(name, {})[system] = float(extra) * 1024
        res["rss"][name]["target_per_rank"] = needed / nl
        res["load"][name] = runs
    os.environ.pop("UCP_DCP_HOST", None)
    # offline path for 4->3: consolidate, then every rank loads the full file and takes its shard
    tgt = state(3, "S0", False)

    def offline() -> None:
        if rank == 0:
            dcp_to_torch_save(f"{root}/dcp_4S0", f"{root}/full.pt")
        dist.barrier(group=groups[3])
        full_sd = torch.load(f"{root}/full.pt", weights_only=True)
        for k, v in tgt.items():
            c = v.to_local()
            per = -(-rows // 3)
            c.copy_(full_sd[k][rank * per : rank * per + c.shape[0]])

    res["offline"] = [timed(offline, 3) for _ in range(max(1, reps // 2))]
    # the physical limit: the same number of bytes written / read sequentially, by one process
    # ("1") and by the 4 ranks in parallel, each its own quarter ("4"); reads land in a touched
    # buffer of the size read, as a load's must, 64 MiB per call
    total = sum(t.nbytes for t in full)
    flat = torch.cat([t.reshape(-1) for t in full]).view(torch.uint8).numpy()
    dest = torch.ones(total, dtype=torch.uint8).numpy()

    def raw_write(path: str, lo: int, hi: int) -> None:
        with open(path, "wb") as f:
            for pos in range(lo, hi, 64 << 20):
                f.write(memoryview(flat[pos : min(hi, pos + (64 << 20))]))
            f.flush()
            os.fsync(f.fileno())

    def raw_read(path: str, lo: int, hi: int) -> None:
        out = memoryview(dest)
        with open(path, "rb", buffering=0) as f:
            pos = lo
            while pos < hi:
                pos += f.readinto(out[pos : min(hi, pos + (64 << 20))])

    for rep in range(reps):
        for streams in (1, 4):
            q = total // streams
            lo, hi = rank * q, (rank + 1) * q if rank < streams - 1 else total
            path = f"{root}/raw{streams}_{rank}.bin"
            if rank < streams and os.path.exists(path):
                os.remove(path)
            if rank == 0:
                os.sync()
            res["raw"].setdefault(f"write{streams}", []).append(timed(lambda: raw_write(path, lo, hi), streams))
            for mode in ("read", "read_cold") if rep == 0 else ("read",):
                if mode == "read_cold" and rank < streams:
                    evict(path)
                res["raw"].setdefault(f"{mode}{streams}", []).append(timed(lambda: raw_read(path, lo, hi), streams))
    res["total_bytes"] = total
    return res


# -- orchestration ----------------------------------------------------------------------------------


def _run_io(cfg: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 4, port, cfg, q)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    if any("error" in r for r in results.values()):
        raise SystemExit("benchmark worker failed:\n" + "\n".join(r.get("error", "") for r in results.values()))
    return results[0]


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}..{max(xs):.3f}"


def _record(
    records: list,
    case: str,
    metric: str,
    ucp: float,
    dcp: float | None,
    target: float | None,
    lower_is_better: bool = True,
    ratio: float | None = None,
) -> None:
    if ratio is None and dcp:
        ratio = ucp / dcp
    met = None if target is None or ratio is None else (ratio <= target if lower_is_better else ratio >= target)
    records.append(
        {"case": case, "metric": metric, "ucp": ucp, "dcp": dcp, "ratio": ratio, "target": target, "met": met}
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    known, rest = pre.parse_known_args(argv)
    if known.device == "cuda":  # loads into CUDA targets: recipes/bench_device.py (same run, vs DCP's default)
        import bench_device

        return bench_device.main(["--device", "cuda", *rest])
    argv = rest
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: resharding loads into CUDA targets (recipes/bench_device.py)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="64 MiB of state, 3 reps, planning at 64 ranks x 500 tensors (< 1 min)"
    )
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--out", default="runs/benchmark", help="scratch folder (checkpoints)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--mib", type=int, default=None, help="state size (default 1024; quick: 64)")
    ap.add_argument("--plan-ranks", default=None, help="comma list of simulated ranks (default 256,1024,4096)")
    ap.add_argument("--plan-tensors", type=int, default=None, help="default 1000 (quick: 500)")
    ap.add_argument(
        "--dcp-plan-limit",
        type=int,
        default=1024,
        help="largest rank count DCP's planning is measured at; larger ones are extrapolated",
    )
    a = ap.parse_args(argv)
    quick = a.quick
    reps = a.reps or (3 if quick else 5)
    mib = a.mib or (64 if quick else 1024)
    cols = 512
    n_tensors = 16
    rows = mib * (1 << 20) // (4 * cols * n_tensors)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"out": str(out.resolve()), "tensors": n_tensors, "rows": rows, "cols": cols, "reps": reps}
    t_start = time.perf_counter()
    print(f"state: {n_tensors} tensors of {rows}x{cols} fp32 = {mib} MiB; {reps} interleaved reps; 4 gloo ranks")
    io = _run_io(cfg)
    records: list = []
    rows_out = []
    save_u, save_d = _med(io["save"]["ucp"]), _med(io["save"]["dcp"])
    _record(records, "save 4 ranks", "time_s", save_u, save_d, TARGETS["save_ratio"])
    rows_out.append(
        ("save 4 ranks", "time (s)", save_u, save_d, _spread(io["save"]["ucp"]), _spread(io["save"]["dcp"]))
    )
    nos_u, nos_d = _med(io["save_nosync"]["ucp"]), _med(io["save_nosync"]["dcp"])
    _record(records, "save 4 ranks no fsync", "time_s", nos_u, nos_d, TARGETS["save_nosync_ratio"])
    rows_out.append(
        (
            "save 4 ranks no fsync",
            "time (s)",
            nos_u,
            nos_d,
            _spread(io["save_nosync"]["ucp"]),
            _spread(io["save_nosync"]["dcp"]),
        )
    )
    same = _med(io["load"]["4->4"]["dcp"])
    for name, *_ in CASES:
        L = io["load"][name]
        u, d, v = _med(L["ucp"]), _med(L["dcp"]), _med(L["ucp_verify"])
        _record(records, f"load {name}", "time_s", u, d, None)
        # the time target is the resharding set; HSDP read-once trades storage reads for
        # network transfers, which on one machine (page cache vs loopback TCP) only costs: reported
        target = None if name.startswith("hsdp") else TARGETS["load_vs_dcp_same_layout"]
        _record(records, f"load {name}", "time_vs_dcp_same_layout", u, same, target)
        _record(records, f"load {name}", "time_with_checksums_s", v, d, None)
        _record(records, f"load {name}", "cold_time_s", L["ucp_cold"][0], L["dcp_cold"][0], None)
        _record(records, f"load {name}", "cold_time_with_checksums_s", L["ucp_verify_cold"][0], L["dcp_cold"][0], None)
        b = io["bytes"][name]
        _record(
            records,
            f"load {name}",
            "bytes_read_over_needed",
            b["ucp"],
            b["dcp"],
            TARGETS["bytes_ratio"],
            ratio=b["ucp"],
        )
        _record(
            records,
            f"load {name}",
            "bytes_read_over_needed_checksums",
            b["ucp_verify"],
            b["dcp"],
            None,
            ratio=b["ucp_verify"],
        )
        rss = io["rss"][name]
        _record(
            records,
            f"load {name}",
            "peak_rss_added_over_target",
            rss["ucp"] / rss["target_per_rank"],
            rss["dcp"] / rss["target_per_rank"],
            None,
        )
        rows_out.append((f"load {name}", "time (s)", u, d, _spread(L["ucp"]), _spread(L["dcp"])))
        rows_out.append(
            (
                f"load {name}",
                "  checksums on / cold (s)",
                v,
                None,
                f"cold {L['ucp_cold'][0]:.3f}, checksums {L['ucp_verify_cold'][0]:.3f}",
                f"cold {L['dcp_cold'][0]:.3f}",
            )
        )
        rows_out.append(
            (f"load {name}", "  bytes read / needed", b["ucp"], b["dcp"], f"checksums {b['ucp_verify']:.3f}", "")
        )
        rows_out.append(
            (
                f"load {name}",
                "  peak RSS added / target",
                rss["ucp"] / rss["target_per_rank"],
                rss["dcp"] / rss["target_per_rank"],
                "",
                "",
            )
        )
    off = _med(io["offline"])
    u43 = _med(io["load"]["4->3"]["ucp"])
    _record(
        records,
        "load 4->3 vs offline",
        "speedup",
        off / u43,
        None,
        TARGETS["offline_speedup"],
        lower_is_better=False,
        ratio=off / u43,
    )
    rows_out.append(("offline 4->3", "time (s)", u43, off, "ucp direct", "dcp_to_torch_save + load"))
    total = io["total_bytes"]
    # the raw limit is the faster of one stream and four parallel streams
    raw = {k: min(_med(io["raw"][f"{k}1"]), _med(io["raw"][f"{k}4"])) for k in ("write", "read")}
    raw["read_cold"] = min(io["raw"]["read_cold1"][0], io["raw"]["read_cold4"][0])
    streams = {
        k: f"1 stream {total / _med(io['raw'][k + '1']) / 1e9:.2f}, 4 streams {total / _med(io['raw'][k + '4']) / 1e9:.2f} GB/s"
        for k in ("write", "read")
    }
    streams["read_cold"] = (
        f"1 stream {total / io['raw']['read_cold1'][0] / 1e9:.2f}, "
        f"4 streams {total / io['raw']['read_cold4'][0] / 1e9:.2f} GB/s"
    )
    for kind, ucp_t, k in (
        ("save", save_u, "write"),
        ("load 4->4 warm", _med(io["load"]["4->4"]["ucp"]), "read"),
        ("load 4->4 cold", io["load"]["4->4"]["ucp_cold"][0], "read_cold"),
    ):
        frac = raw[k] / ucp_t
        _record(
            records,
            f"throughput {kind}",
            "fraction_of_raw",
            frac,
            None,
            TARGETS["throughput_vs_raw"],
            lower_is_better=False,
            ratio=frac,
        )
        rows_out.append(
            (
                f"throughput {kind}",
                "GB/s ucp / raw",
                total / ucp_t / 1e9,
                total / raw[k] / 1e9,
                f"{frac:.2f} of raw",
                f"(raw {streams[k]})",
            )
        )
    # what the fixed cost of DCP's load protocol (plan gather/scatter, result all-gather) hides
    data_s = _med(io["load"]["4->4"]["ucp_data_phase"])
    frac = raw["read"] / data_s
    _record(
        records,
        "throughput load 4->4 warm data phase",
        "fraction_of_raw",
        frac,
        None,
        None,
        lower_is_better=False,
        ratio=frac,
    )
    rows_out.append(
        (
            "throughput load 4->4 warm",
            "  data phase GB/s / raw",
            total / data_s / 1e9,
            total / raw["read"] / 1e9,
            f"{frac:.2f} of raw",
            f"(read_data {data_s:.3f} s of {_med(io['load']['4->4']['ucp']):.3f} s)",
        )
    )
    # planning
    from bench_planning import simulate

    ranks_list = [int(x) for x in (a.plan_ranks or ("64" if quick else "256,1024,4096")).split(",")]
    a.plan_tensors = a.plan_tensors or (500 if quick else 1000)
    dcp_fit: dict[str, tuple[int, dict]] = {}
    for phase in ("save", "load"):
        for R in ranks_list:
            u = simulate(R, a.plan_tensors, "ucp", phase)
            if R <= a.dcp_plan_limit:
                d = simulate(R, a.plan_tensors, "dcp", phase)
                dcp_fit[phase] = (R, d)
                note = ""
            else:  # DCP at this scale exceeds the time budget: extrapolate linearly in ranks
                R0, d0 = dcp_fit[phase]
                d = {k: v * R / R0 for k, v in d0.items()}
                note = f"dcp extrapolated from {R0}"
            target = TARGETS["planning_speedup"] if R == 1024 else None
            _record(records, f"plan {phase} {R} ranks", "rank0_cpu_s", u["seconds"], d["seconds"], None)
            _record(
                records,
                f"plan {phase} {R} ranks",
                "speedup",
                d["seconds"] / u["seconds"],
                None,
                target,
                lower_is_better=False,
                ratio=d["seconds"] / u["seconds"],
            )
            _record(records, f"plan {phase} {R} ranks", "plan_bytes", u["plan_bytes"], d["plan_bytes"], None)
            if "metadata_bytes" in u:
                _record(
                    records, f"plan {phase} {R} ranks", "metadata_bytes", u["metadata_bytes"], d["metadata_bytes"], None
                )
            rows_out.append(
                (
                    f"plan {phase} {R} ranks",
                    "rank-0 CPU s",
                    u["seconds"],
                    d["seconds"],
                    f"plans {u['plan_bytes'] / 1e6:.1f} MB",
                    f"{d['plan_bytes'] / 1e6:.1f} MB {note}",
                )
            )
        if phase == "save":
            R = min(ranks_list[-1], a.dcp_plan_limit)
            uc = simulate(R, a.plan_tensors, "ucp", phase, caching=True)
            dc = simulate(R, a.plan_tensors, "dcp", phase, caching=True)
            _record(records, f"plan save {R} ranks cached", "rank0_cpu_s", uc["seconds"], dc["seconds"], None)
            rows_out.append(
                (
                    f"plan save {R} ranks cached",
                    "rank-0 CPU s",
                    uc["seconds"],
                    dc["seconds"],
                    f"plans {uc['plan_bytes'] / 1e6:.2f} MB",
                    f"{dc['plan_bytes'] / 1e6:.2f} MB",
                )
            )
    print(f"\n{'case':<26} {'figure':<28} {'ucp':>10} {'dcp':>10}  notes")
    for case, fig, u, d, nu, nd in rows_out:
        dtxt = f"{d:>10.3f}" if isinstance(d, (int, float)) else f"{'':>10}"
        print(f"{case:<26} {fig:<28} {u:>10.3f} {dtxt}  {nu} {nd}".rstrip())
    unmet = [r for r in records if r["met"] is False]
    print(
        f"\n{sum(1 for r in records if r['met'])} targets met, {len(unmet)} not met"
        + (
            ": " + "; ".join(f"{r['case']} {r['metric']} {r['ratio']:.3f} (target {r['target']})" for r in unmet)
            if unmet
            else ""
        )
    )
    print(f"benchmark wall time {time.perf_counter() - t_start:.0f}s")
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
        print(f"records: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
