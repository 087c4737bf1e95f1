"""Restart at a new layout from the memory tier vs from the local disk vs DCP's default from disk, same run.

    python recipes/bench_memory.py [--mib 512] [--reps 3] [--staging buffered|direct] [--json PATH]

Save job: 4 gloo ranks on 2 simulated hosts (``node0``: ranks 0-1, ``node1``: ranks 2-3), a state of
``mib`` MiB (16 fp32 tensors of ``rows x 512``, ``Shard(0)`` over the 4 ranks, as DTensors, plus a step
counter). It saves the same state three ways:

* **memory**: ``MemoryTier.save`` (k = 1), then waits for the background replication;
* **ucp disk**: ``ucp_dcp.save`` into a folder on the local disk;
* **dcp disk**: ``dcp.save`` with DCP's default planner and ``FileSystemWriter``.

and measures the **host copy alone** (every rank cloning its local shards into fresh memory: the least
any save into host memory must block for) and the tier's **blocked** time (``MemoryTier.blocked_s``:
with ``--staging buffered``, the default, the copy into the tier's staging buffers; with ``direct``, the
``dcp.save`` into host memory, planning included), medians over ``reps`` saves after a first one (the
first save of a tier is always direct). Then ``reps`` saves follow each other as often as the background
takes (a pause of its median time between them, as a training step would be): what training waits for
per save, the wait for earlier saves' background work included (``waited_s + blocked_s``). Memory per host counts the tier's files in ``/dev/shm`` and the
staging buffers its ranks keep between saves.

Host ``node1`` is then lost (its memory folder removed) and a 2-rank job loads the state at ``Shard(0)``
over 2 ranks (a new layout) from each tier: the memory tier (node0's own pieces and node1's replica),
the ucp disk folder, the dcp disk folder. Two restarts: on ``node0`` and a fresh, empty ``node2``
(node2's rank gets every fragment from node0 over gloo), and with both ranks on ``node0``. Disk loads start from a cold page cache for the checkpoint's files
(``posix_fadvise(DONTNEED)`` after an fsync; the memory tier's tmpfs cannot be evicted: it *is* memory).
The memory tier loads two ways: as ``ucp_dcp.memory.load`` does by default (the source chosen from the
completion markers and file sizes, every byte verified by the block checksums as it is read) and with
``verify=True`` (every held file hashed against its marker before the choice). A load counts its
slowest rank; reported are medians over ``reps`` and the ratios to ucp_dcp's and DCP's disk loads.
Loaded state is checked bitwise against the saved one each time. By default one job makes every load of
a scenario (warm: its groups, pools and memory reused from the second load on); ``--fresh`` starts a new
job for each load, as a restart is (its first and only load pays those once). Last, the ceiling: 2
ranks on ``node0`` read the data files' bytes with plain ``preadv`` from the evicted disk folder and
from node0's memory folder, the ratio a load with no cost but its bytes would reach on this machine.
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
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ucp_dcp
from ucp_dcp.memory import MemoryTier
from ucp_dcp.memory import load as memory_load
from ucp_dcp.memory.store import host_dir

SYSTEMS = ("memory", "memory, files hashed first", "ucp disk", "dcp disk")
COLS = 512
N_TENSORS = 16


def _state(world: int, mib: int, fill: bool) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, (mib << 20) // (N_TENSORS * COLS * 4) // world * world)
    g = torch.Generator().manual_seed(0)
    sd: dict = {"step": torch.tensor(7)}
    for i in range(N_TENSORS):
        full = torch.randn(rows, COLS, generator=g) if fill else torch.zeros(rows, COLS)
        sd[f"t{i}"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    if fill:  # every rank built the same full tensors: its shard is the right one without communication
        return sd
    return sd


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _evict(folder: str) -> None:
    for n in os.listdir(folder):
        p = os.path.join(folder, n)
        if os.path.isfile(p):
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _save_phase(rank: int, a: dict) -> dict:
    os.environ["UCP_DCP_HOST"] = f"node{rank // 2}"
    sd = _state(4, a["mib"], fill=True)
    out: dict = {"copy": [], "blocked": [], "background": []}
    tier = MemoryTier(a["root"], replicas=1, staging=a["staging"])
    for _ in range(a["reps"] + 1):  # the first save of each kind warms up (not counted)
        local = [v.to_local() for v in sd.values() if hasattr(v, "to_local")]
        out["copy"].append(_timed(lambda: [t.clone() for t in local]))
        tier.save(sd)
        b = torch.tensor([tier.blocked_s])
        dist.all_reduce(b, op=dist.ReduceOp.MAX)
        out["blocked"].append(float(b))
        st = tier.wait()
        assert st is not None and st.complete, st
        out["background"].append(st.seconds)
    for k in ("copy", "blocked", "background"):
        out[k] = out[k][1:]
    # saves as often as the background takes: a training step of the median background time between them
    # (every rank sleeps the same, so no rank waits on another), what training waits for per save
    step_s = statistics.median(out["background"])
    out["step_s"] = step_s
    out["paced"] = []
    for _ in range(a["reps"]):
        time.sleep(step_s)
        tier.save(sd)
        w = torch.tensor([tier.waited_s + tier.blocked_s])
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        out["paced"].append(float(w))
    tier.wait()
    held: list = [None] * dist.get_world_size()
    dist.all_gather_object(held, (os.environ["UCP_DCP_HOST"], tier.staged_bytes))
    out["staged_per_host"] = {f"host-{h}": sum(n for hh, n in held if hh == h) for h in sorted({h for h, _ in held})}
    tier.close()
    ucp_dcp.save(sd, a["ucp"])
    dcp.save(sd, checkpoint_id=a["dcp"])
    if rank == 0:
        out["per_host"] = {h: _du(os.path.join(a["root"], h)) for h in sorted(os.listdir(a["root"]))}
        out["state"] = sum(v.numel() * v.element_size() for v in sd.values())
    return out


def _du(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def _raw_phase(rank: int, a: dict) -> dict:
    """The ceiling: each of 2 ranks on ``node0`` reads half the data files' bytes with plain ``preadv``
    into memory it already holds (no DCP, no checksums), from the ucp disk folder (evicted first) and
    from node0's memory folder (its own files and node1's replicas): what the bytes alone cost each
    tier, the ratio a load with no other cost would reach."""
    gen = max(os.listdir(host_dir(a["root"], "node0")))
    folders = {"raw disk read": a["ucp"], "raw memory read": os.path.join(host_dir(a["root"], "node0"), gen)}
    out: dict = {k: [] for k in folders}
    for _ in range(a["reps"]):
        for kind, folder in folders.items():
            names = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[rank::2]
            paths = [os.path.join(folder, n) for n in names]
            bufs = [torch.ones(os.path.getsize(p), dtype=torch.uint8) for p in paths]  # pages faulted in
            if kind == "raw disk read":
                _evict(folder)

            def read() -> None:
                for p, b in zip(paths, bufs):
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        assert os.preadv(fd, [memoryview(b.numpy())], 0) == b.numel()
                    finally:
                        os.close(fd)

            out[kind].append(_timed(read))
    return out


def _load_phase(rank: int, a: dict) -> dict:
    os.environ["UCP_DCP_HOST"] = a["hosts"][rank]
    want = _state(2, a["mib"], fill=True)
    out: dict = {s: [] for s in SYSTEMS}
    out["received"] = 0
    for _ in range(a["reps"]):
        for system in a.get("systems", SYSTEMS):
            sd = _state(2, a["mib"], fill=False)
            if system.endswith("disk") and rank == 0:
                _evict(a["ucp"] if system == "ucp disk" else a["dcp"])
            if system.startswith("memory"):
                src: list = []
                verify = system != "memory"
                out[system].append(_timed(lambda: src.append(memory_load(sd, a["root"], verify=verify))))
                assert src[0].tier == "memory"
                out["received"] = src[0].stats.bytes_received
            elif system == "ucp disk":
                out[system].append(_timed(lambda: ucp_dcp.load(sd, a["ucp"])))
            else:
                out[system].append(_timed(lambda: dcp.load(sd, checkpoint_id=a["dcp"])))
            for k, v in want.items():
                got = sd[k].to_local() if hasattr(sd[k], "to_local") else sd[k]
                exp = v.to_local() if hasattr(v, "to_local") else v
                assert torch.equal(got, exp), (system, k)
    return out


def _run(rank: int, world: int, port: int, fn, a: dict, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q.put((rank, fn(rank, a)))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, fn, a: dict) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps = [ctx.Process(target=_run, args=(r, world, port, fn, a, q)) for r in range(world)]
    for p in ps:
        p.start()
    got = dict(q.get(timeout=1800) for _ in ps)
    for p in ps:
        p.join()
        if p.exitcode:
            sys.exit(f"a rank failed (exit {p.exitcode})")
    return [got[r] for r in range(world)]


def _fresh_loads(a: dict, hosts: list[str]) -> list[dict]:
    """Every (rep, system) load in a job of its own, like a restart; results merged per rank."""
    merged: list[dict] = [{s: [] for s in SYSTEMS} for _ in hosts]
    for _ in range(a["reps"]):
        for system in SYSTEMS:
            got = _spawn(len(hosts), _load_phase, {**a, "hosts": hosts, "reps": 1, "systems": [system]})
            for m, g in zip(merged, got):
                m[system] += g[system]
                m["received"] = max(m.get("received", 0), g["received"])
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--staging", choices=("buffered", "direct"), default="buffered", help="MemoryTier(staging=)")
    ap.add_argument("--fresh", action="store_true", help="each load in a new job (a restart's first and only load)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-memory-", dir=os.environ.get("UCP_BENCH_DISK") or None)
    shm = tempfile.mkdtemp(prefix="bench-memory-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    a = {
        "mib": args.mib,
        "reps": args.reps,
        "staging": args.staging,
        "root": shm,
        "ucp": f"{tmp}/ucp",
        "dcp": f"{tmp}/dcp",
    }
    try:
        saved = _spawn(4, _save_phase, a)[0]
        shutil.rmtree(host_dir(shm, "node1"))  # node1 is lost
        places = {"node0 + a fresh node2": ["node0", "node2"], "2 ranks on node0": ["node0", "node0"]}
        if args.fresh:  # a restarted job loads once, in new processes: one job per load
            scenarios = {name: _fresh_loads(a, hosts) for name, hosts in places.items()}
        else:
            scenarios = {name: _spawn(2, _load_phase, {**a, "hosts": hosts}) for name, hosts in places.items()}
        raw = _spawn(2, _raw_phase, {**a, "hosts": ["node0", "node0"]})[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    med = statistics.median
    load = {name: {s: med(got[0][s]) for s in SYSTEMS} for name, got in scenarios.items()}
    slowest = {name: {s: max(got[0][s]) for s in SYSTEMS} for name, got in scenarios.items()}
    fig = {
        "torch": torch.__version__,
        "mib": args.mib,
        "reps": args.reps,
        "host_copy_s": med(saved["copy"]),
        "blocked_s": med(saved["blocked"]),
        "blocked_over_copy": med(saved["blocked"]) / med(saved["copy"]),
        "background_s": med(saved["background"]),
        "paced_step_s": saved["step_s"],
        "paced_waited_and_blocked_s": med(saved["paced"]),
        "staging": args.staging,
        "fresh_process_loads": args.fresh,
        "memory_per_host_bytes": saved["per_host"],
        "staged_per_host_bytes": saved["staged_per_host"],
        "state_bytes": saved["state"],
        "load_s": load,
        "slowest_load_s": slowest,
        "dcp_over": {n: {s: d["dcp disk"] / v for s, v in d.items()} for n, d in load.items()},
        "ucp_over": {n: {s: d["ucp disk"] / v for s, v in d.items()} for n, d in load.items()},
        "received_from_peers": {n: [r["received"] for r in got] for n, got in scenarios.items()},
        "raw_read_s": {k: med(v) for k, v in raw.items()},
    }
    print(
        f"state {fig['state_bytes'] / 2**20:.0f} MiB on 4 ranks / 2 hosts, torch {fig['torch']}, medians of {args.reps}"
    )
    print(
        f"save: host copy alone {fig['host_copy_s']:.3f} s, memory tier blocked {fig['blocked_s']:.3f} s "
        f"({fig['blocked_over_copy']:.2f}x the copy), replication in the background {fig['background_s']:.3f} s"
    )
    print(
        f"saves {fig['paced_step_s']:.3f} s apart (the background's time): training waits "
        f"{fig['paced_waited_and_blocked_s']:.3f} s per save ({fig['paced_waited_and_blocked_s'] / fig['host_copy_s']:.2f}x "
        "the copy), waiting for earlier saves included"
    )
    for h, n in fig["memory_per_host_bytes"].items():
        b = fig["staged_per_host_bytes"].get(h, 0)
        print(
            f"memory on {h}: {n / 2**20:.0f} MiB in /dev/shm ({n / fig['state_bytes']:.2f}x the state) + "
            f"{b / 2**20:.0f} MiB of staging buffers ({args.staging}) = {(n + b) / fig['state_bytes']:.2f}x the state"
        )
    for name, d in load.items():
        how = "each load a new job" if args.fresh else f"{args.reps} loads in one job"
        print(f"restart at 2 ranks ({name}) after node1 is lost, slowest rank, {how}:")
        for s, v in d.items():
            print(
                f"  {s:26s} {v:.3f} s  ({fig['ucp_over'][name][s]:.2f}x faster than ucp disk, "
                f"{fig['dcp_over'][name][s]:.2f}x faster than dcp disk; slowest {slowest[name][s]:.3f} s)"
            )
    rd, rm = fig["raw_read_s"]["raw disk read"], fig["raw_read_s"]["raw memory read"]
    print(
        f"ceiling (2 ranks on node0, plain preadv of the data files' bytes): cold disk {rd:.3f} s, memory "
        f"{rm:.3f} s: reading the bytes alone is {rd / rm:.2f}x faster from memory than from this disk"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)


if __name__ == "__main__":
    main()
