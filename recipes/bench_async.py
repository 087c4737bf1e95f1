"""How long ``dcp.async_save`` blocks training with ucp_dcp, against DCP's default in the same run.

    python recipes/bench_async.py [--world 4] [--mib 1024] [--reps 5] [--device cpu|cuda]
                                  [--stager writer|default] [--checkpointer thread|process]
                                  [--order pairs|alternate] [--json PATH]

On ``world`` gloo ranks, a state of ``mib`` MiB in total (16 fp32 tensors of ``rows x 512``,
``Shard(0)`` over the ranks, as DTensors, plus a step counter and a learning rate) is saved with
``dcp.async_save`` by

* **dcp**: DCP's default planner and ``FileSystemWriter``;
* **ucp**: ``UCPSavePlanner`` and ``UCPFileSystemWriter`` (block checksums, sidecar, atomic commit),

alternating in the same process group, the order flipped every repetition, each save into a fresh
folder after ``sync``, on a gloo group of its own (as a trainer does). Per save and rank:
**blocked** = from the call to its return (what the training loop waits for: staging the state
into CPU memory and handing it to the checkpointer) and **total** = from the call until the
future completes (the checkpoint committed). A save counts its slowest rank (the next training
collective waits for it); reported is the median over ``reps`` repetitions, after one warm-up
save per system that is not counted.

Order (``--order``). Both systems stage through the same DCP code (``FileSystemWriter.stage``,
which ``UCPFileSystemWriter`` inherits) into freshly allocated CPU memory, so the blocked time is
copying plus page faults, and how many pages fault depends on what the process's allocator kept
from the save before (from none to a whole fresh copy on this machine), i.e. on which system saved
last. A training job saves with one system only, so by default (``pairs``) each repetition saves
twice in a row with each system and counts the second save: every counted save follows a save of
its own system. ``alternate`` counts one save per system and repetition, half of them right after
the other system's save.

Noise: on a small machine shared with other work the blocked time of single saves varies by 2x
and the medians of two runs by up to ~15 %, more than the two systems differ; hence 9 counted
repetitions by default.

Staging: with ``--stager writer`` (default on CPU) ``async_save`` stages through the writer, which
for both systems is DCP's ``BlockingAsyncStager`` (``FileSystemWriter.stage``): a new CPU copy
per save. ``--stager default`` hands both the same ``DefaultStager`` (synchronous staging into
buffers it keeps and reuses from one save to the next, pinned and copied non-blocking when the
state is on CUDA; default with ``--device cuda``). ``--device cuda`` puts every rank's shard on GPU ``rank % device_count`` (one
GPU shared by all ranks works: the process group stays gloo, DCP's collectives are CPU object
collectives). ``--checkpointer process`` uses ``AsyncCheckpointerType.PROCESS`` (DCP's checkpoint
daemon; its start-up falls into the warm-up save).

Import ``measure_async(world, nbytes, device, repeats)`` to get the figures as a dict.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

SYSTEMS = ("dcp", "ucp")
GOAL = 1.0  # blocked time ucp / dcp
COLS = 512
TENSORS = 16


def _layout(world: int, nbytes: int) -> tuple[int, int]:
    """(rows, cols) of each of the 16 fp32 tensors: ``nbytes`` in all, rows divisible by ``world``."""
    rows = max(world, nbytes // (4 * COLS * TENSORS) // world * world)
    return rows, COLS


def _schedule(reps: int, order: str) -> list[tuple[int, str, bool]]:
    """The saves of a run, in order: ``(repetition, system, counted)``; repetition -1 is the warm-up.

    ``pairs``: each repetition saves with one system twice in a row, then with the other, the
    order flipped every repetition; only the second of each pair is counted, so every counted save
    follows a save of its own system, as in a training job. ``alternate``: one save per system and
    repetition, each counted, so half of them follow a save of the other system.
    """
    out = [(-1, s, False) for s in SYSTEMS]
    for rep in range(reps):
        for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
            if order == "pairs":
                out.append((rep, system, False))
            out.append((rep, system, True))
    return out


def _minor_faults() -> int:
    """Minor page faults of the calling thread so far (Linux; 0 elsewhere)."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_minflt if who is not None else 0


def _worker(rank: int, world: int, port: int, cfg: dict, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if cfg["device"] == "cuda":
            # select (and initialize) the device before any mesh exists: DeviceMesh then leaves it be
            torch.cuda.set_device(rank % torch.cuda.device_count())
            torch.zeros(1, device="cuda")
        dist.init_process_group(cfg["backend"], rank=rank, world_size=world, timeout=timedelta(seconds=1800))
        out = _bench(rank, world, cfg)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        results.close()
        results.join_thread()  # flush before the process exits


def _bench(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    import ucp_dcp
    from ucp_dcp._compat import default_stager_reusable

    device = (
        torch.device(cfg["device"], torch.cuda.current_device()) if cfg["device"] == "cuda" else torch.device("cpu")
    )
    mesh = DeviceMesh(device.type, torch.arange(world))
    rows, cols = cfg["rows"], cfg["cols"]
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    sd: dict = {"model": {}, "train": {"step": 7, "lr": 1e-3}}
    for i in range(TENSORS):
        local = torch.randn(rows // world, cols, generator=g, device=device)
        sd["model"][f"w{i}"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, cols)), stride=(cols, 1)
        )
    local_bytes = sum(t.to_local().nbytes for t in sd["model"].values())
    # checkpointing on a gloo group of its own, as trainers do (training collectives stay on theirs)
    ckpt_pg = dist.new_group(backend="gloo")
    kind = AsyncCheckpointerType.PROCESS if cfg["checkpointer"] == "process" else AsyncCheckpointerType.THREAD
    stager = None

    def new_stager():
        cuda = device.type == "cuda"
        # synchronous, so async_save returns once the copy is done (the blocked time is all of it);
        # shared memory when a checkpoint process receives the staged state (no copy to pickle it)
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=cfg["checkpointer"] == "process",
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )

    # torch 2.11's DefaultStager cannot stage twice (it closes itself after each stage): one per save there
    reuse = default_stager_reusable()
    if cfg["stager"] == "default" and reuse:
        stager = new_stager()

    def writer(system: str, path: str):
        return ucp_dcp.UCPFileSystemWriter(path) if system == "ucp" else dcp.FileSystemWriter(path)

    def planner(system: str):
        return ucp_dcp.UCPSavePlanner() if system == "ucp" else None  # None: DCP's DefaultSavePlanner

    times: list[dict] = []  # one entry per save of _schedule(), this rank's figures
    for _rep, system, _counted in _schedule(cfg["reps"], cfg["order"]):
        path = f"{cfg['out']}/{system}"
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.sync()  # no writeback of an earlier save lands in this one
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        f0 = _minor_faults()
        t0 = time.perf_counter()
        this = stager if reuse or cfg["stager"] != "default" else new_stager()
        fut = dcp.async_save(
            sd,
            checkpoint_id=path,
            storage_writer=writer(system, path),
            planner=planner(system),
            process_group=ckpt_pg,
            async_checkpointer_type=kind,
            async_stager=this,
        )
        t1 = time.perf_counter()
        f1 = _minor_faults()
        fut.result()
        t2 = time.perf_counter()
        if this is not stager:
            this.close()
        times.append({"blocked": t1 - t0, "total": t2 - t0, "faults": f1 - f0})
        dist.barrier()
    if stager is not None:
        stager.close()
    if rank == 0:  # the last checkpoints are complete: check ours once
        from ucp_dcp.tools.verify import verify

        status = verify(f"{cfg['out']}/ucp").status
    else:
        status = None
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"times": times, "local_bytes": local_bytes, "verify": status})
    return {"ranks": gathered}


def _run(world: int, cfg: dict) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, q)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        while len(results) < world and not any("error" in r for r in results.values()):
            try:
                rank, out = q.get(timeout=5)
                results[rank] = out
            except queue.Empty:  # a rank that died without reporting (killed, out of memory)
                dead = [
                    f"rank {r} exited with {p.exitcode}"
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results
                ]
                if dead:
                    results[-1] = {"error": "; ".join(dead)}
    finally:
        failed = any("error" in r for r in results.values())
        for p in procs:
            if failed:
                p.kill()
            p.join(timeout=60)
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError("benchmark worker failed:\n" + "\n".join(errors))
    return results[0]["ranks"]


def measure_async(
    world: int = 4,
    nbytes: int = 1 << 30,
    device: str = "cpu",
    repeats: int = 9,
    *,
    stager: str | None = None,
    checkpointer: str = "thread",
    order: str = "pairs",
    out: str | None = None,
    backend: str = "gloo",
) -> dict:
    """Blocked and total time of ``dcp.async_save``, DCP's default against ucp_dcp, in one run.

    ``nbytes``: the whole state, split over ``world`` ranks. Returns ``{"config", "per_rep":
    {system: {"blocked": [...], "total": [...], "faults": [...]}}`` (counted saves, slowest rank),
    ``"median"`` and ``"spread"`` ([min, max]) of those, ``"ratio": {"blocked", "total"}`` (ucp / dcp
    of the medians), ``"goal"``, ``"met"`` (blocked ratio <= goal), ``"verify"`` (status of the last
    ucp checkpoint), ``"saves"`` (every save with its per-rank figures) and ``"summary"`` (one line)}``.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    stager = stager or ("default" if device == "cuda" else "writer")
    rows, cols = _layout(world, nbytes)
    scratch = Path(out) if out else Path(tempfile.mkdtemp(prefix="ucp-bench-async-"))
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    if order not in ("pairs", "alternate"):
        raise ValueError(f"order must be pairs or alternate, got {order}")
    cfg = {
        "out": str(scratch.resolve()),
        "rows": rows,
        "cols": cols,
        "reps": repeats,
        "device": device,
        "stager": stager,
        "checkpointer": checkpointer,
        "order": order,
        "backend": backend,
    }
    try:
        ranks = _run(world, cfg)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    saves = []  # every save, the slowest rank's figures (the next training collective waits for it)
    for i, (rep, system, counted) in enumerate(_schedule(repeats, order)):
        saves.append(
            {
                "rep": rep,
                "system": system,
                "counted": counted,
                **{m: max(r["times"][i][m] for r in ranks) for m in ("blocked", "total", "faults")},
                "per_rank": {m: [r["times"][i][m] for r in ranks] for m in ("blocked", "total", "faults")},
            }
        )
    per_rep = {
        s: {m: [x[m] for x in saves if x["system"] == s and x["counted"]] for m in ("blocked", "total", "faults")}
        for s in SYSTEMS
    }
    median = {s: {m: statistics.median(v) for m, v in per_rep[s].items()} for s in SYSTEMS}
    spread = {s: {m: [min(v), max(v)] for m, v in per_rep[s].items()} for s in SYSTEMS}
    ratio = {m: median["ucp"][m] / median["dcp"][m] for m in ("blocked", "total")}
    total_bytes = sum(r["local_bytes"] for r in ranks)
    config = {
        "world": world,
        "nbytes": total_bytes,
        "tensors": TENSORS,
        "shape": [rows, cols],
        "dtype": "float32",
        "device": device,
        "stager": stager,
        "checkpointer": checkpointer,
        "order": order,
        "repeats": repeats,
        "backend": backend,
    }
    met = ratio["blocked"] <= GOAL
    summary = (
        f"ASYNC blocked ucp/dcp = {ratio['blocked']:.2f}x (goal <= {GOAL}) {'met' if met else 'NOT met'}; "
        f"blocked ucp {median['ucp']['blocked']:.3f} s dcp {median['dcp']['blocked']:.3f} s; "
        f"total ucp/dcp = {ratio['total']:.2f}x (ucp {median['ucp']['total']:.3f} s dcp "
        f"{median['dcp']['total']:.3f} s); {world} ranks, {total_bytes / (1 << 20):.0f} MiB, {device}, "
        f"{stager} stager, {checkpointer}, {order}, {backend}, median of {repeats}"
    )
    return {
        "config": config,
        "per_rep": per_rep,
        "saves": saves,
        "median": median,
        "spread": spread,
        "ratio": ratio,
        "goal": GOAL,
        "met": met,
        "verify": ranks[0]["verify"],
        "summary": summary,
    }


def format_table(res: dict) -> str:
    med, spr, ratio = res["median"], res["spread"], res["ratio"]
    lines = [f"{'figure':<24} {'ucp':>9} {'dcp':>9} {'ucp/dcp':>8}  {'ucp min..max':<14} dcp min..max"]
    for m, name in (("blocked", "blocked (s)"), ("total", "until committed (s)")):
        u, d = med["ucp"][m], med["dcp"][m]
        lines.append(
            f"{name:<24} {u:>9.3f} {d:>9.3f} {ratio[m]:>7.2f}x  "
            f"{spr['ucp'][m][0]:.3f}..{spr['ucp'][m][1]:.3f}  {spr['dcp'][m][0]:.3f}..{spr['dcp'][m][1]:.3f}"
        )
    lines.append(
        f"{'page faults while blocked':<24} {med['ucp']['faults']:>9.0f} {med['dcp']['faults']:>9.0f}"
        f" {'':>8}  (calling thread, max over ranks: staging into fresh memory faults)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="gloo ranks (default 4)")
    ap.add_argument("--mib", type=int, default=1024, help="total state size in MiB (default 1024)")
    ap.add_argument("--reps", type=int, default=9, help="counted repetitions per system (default 9)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--stager",
        choices=("writer", "default"),
        default=None,
        help="writer: the writer's BlockingAsyncStager (default on cpu); default: one DefaultStager, "
        "pinned on cuda (default on cuda)",
    )
    ap.add_argument("--checkpointer", choices=("thread", "process"), default="thread")
    ap.add_argument(
        "--order",
        choices=("pairs", "alternate"),
        default="pairs",
        help="pairs: count the second of two saves in a row per system (default); alternate: "
        "one save per system and repetition",
    )
    ap.add_argument(
        "--backend",
        default="gloo",
        help="the default group's backend, as users init it (gloo; cpu:gloo,cuda:nccl on a GPU); the saves run on "
        "a gloo group of their own either way",
    )
    ap.add_argument("--out", default="runs/bench_async", help="scratch folder (removed after)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows, cols = _layout(a.world, a.mib << 20)
    print(
        f"state: {TENSORS} fp32 tensors of {rows}x{cols} Shard(0) on {a.world} gloo ranks ({a.device}), "
        f"{a.reps} reps ({a.order}) + 1 warm-up save per system",
        flush=True,
    )
    res = measure_async(
        a.world,
        a.mib << 20,
        a.device,
        a.reps,
        stager=a.stager,
        checkpointer=a.checkpointer,
        order=a.order,
        out=a.out,
        backend=a.backend,
    )
    print(format_table(res))
    if res["verify"] != "ok":
        print(f"WARNING: verify of the last ucp checkpoint: {res['verify']}")
    print(f"wall time {time.perf_counter() - t0:.0f}s")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"results: {a.json}")
    print(res["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
