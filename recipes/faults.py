"""Fault injection: does a checkpoint survive bit flips, truncations, crashes mid-save and crafted pickles?

    python recipes/faults.py [--flips 100] [--truncations 20] [--crashes 20] [--only KIND] [--seed 0]
    python recipes/faults.py --store s3 [--crashes N]

* **flips**: a random bit of a random byte, spread round-robin over every file of a 2-rank
  checkpoint (data files, ``.metadata``, the sidecar). Caught when ``verify`` reports it *and* a
  load either raises a ``UCPError`` or loads exactly the saved state (the flip was in bytes no load
  uses, e.g. a zip header). A load that returns different values without an error is *silent*.
* **truncations**: a random file cut at a random length; caught as above.
* **crashes**: 4 ranks save over the folder's checkpoint; one random rank is SIGKILLed at a random
  moment of the save (uniform over 1.3x a measured save time), then the whole job. *Lost* when the
  folder then loads neither the previous nor the new state bitwise.
* **code-exec**: crafted ``.metadata`` pickles (``inspect``, ``verify``, load), a crafted object
  value written by a hostile writer with valid checksums, and a crafted tensor record in a stock
  checkpoint. Each payload would create a marker file; counted when it does.

With ``--store s3`` the crashes run against an S3-compatible server started on 127.0.0.1 (moto's, its own
process): 4 ranks save over the checkpoint on ``s3://``, and one rank SIGKILLs itself just before each store
request of the save in turn (every request of the coordinator and of one other rank, or ``--crashes`` of
them spread over the walk): *lost* as above, and every object an uncommitted save left must be reported by
``inspect`` as a stray (:mod:`ucp_dev.testing.store_crashes`).

The last line is the summary, e.g. ``FAULTS OK: flips 100/100 caught, truncations 20/20, crashes 0/20
lost, code-exec 0/5``; ``FAULTS FAILED: ...`` (exit 1) otherwise.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException  # noqa: E402

ROWS, COLS = 96, 1024  # per rank: 384 KiB of the sharded parameter (flips and truncations)
CRASH_ROWS = 8192  # per rank for crash runs: 32 MiB, so a save lasts long enough to be hit


# -- the state: DTensor shards, a replicated tensor, objects (some holding tensors) -------------------


def full_state(gen: int, world: int, rows: int = ROWS) -> dict[str, Any]:
    """The logical state of generation ``gen`` (what any load must return)."""
    g = torch.Generator().manual_seed(1000 + gen)
    return {
        "model": {
            "w": torch.randn(world * rows, COLS, generator=g),
            "norm": torch.randn(COLS, generator=g),
            "emb": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        },
        "optim": {"lr": 0.001 * (gen + 1), "betas": (0.9, 0.95), "step": torch.tensor(10 * gen)},
        "train": {"step": gen, "run": f"run-{gen}", "rng": (torch.arange(4) + gen,), "milestones": [1, 2, gen]},
    }


def local_state(rank: int, world: int, gen: int, rows: int) -> dict[str, Any]:
    """This rank's view: ``w`` sharded by rows over a 1-D mesh, everything else replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    sd = full_state(gen, world, rows)
    mesh = init_device_mesh("cpu", (world,))
    w = sd["model"]["w"]
    sd["model"]["w"] = DTensor.from_local(w[rank * rows : (rank + 1) * rows].clone(), mesh, [Shard(0)], run_check=False)
    return sd


def empty_like_state(world: int, rows: int) -> dict[str, Any]:
    s = full_state(0, world, rows)
    return {
        "model": {k: torch.full_like(v, 7) for k, v in s["model"].items()},
        "optim": {"lr": None, "betas": None, "step": torch.tensor(-1)},
        "train": {"step": None, "run": None, "rng": None, "milestones": None},
    }


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def load_single(path: str, world: int, rows: int, system: str = "ucp") -> dict[str, Any]:
    """Load a checkpoint into one process at full size (a resharding load); ``system="dcp"``: with
    DCP's default planner and storage."""
    import torch.distributed.checkpoint as dcp

    import ucp_dcp

    sd = empty_like_state(world, rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ucp_dcp.load(sd, path) if system == "ucp" else dcp.load(sd, checkpoint_id=path)
    return sd


# -- ranks ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, folder: str, gen: int, rows: int, q: Any, system: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    warnings.simplefilter("ignore")
    log = os.open(os.path.join(os.path.dirname(folder), f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)  # a killed peer makes the others print gloo's "connection closed" tracebacks
    import torch.distributed as dist

    import ucp_dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    sd = local_state(rank, world, gen, rows)
    dist.barrier()
    q.put(("start", rank, time.time()))
    if system == "ucp":
        ucp_dcp.save(sd, folder)
    else:  # DCP's default planner and FileSystemWriter, for comparison
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, checkpoint_id=folder)
    q.put(("done", rank, time.time()))
    dist.barrier()
    dist.destroy_process_group()
    q.close()
    q.join_thread()  # the queue's feeder thread must flush before os._exit
    os._exit(0)


def _ctx() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "ucp_dcp"])
    return ctx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JobDidNotStart(RuntimeError):
    """The ranks did not all reach the save (a start-up failure, not a result)."""


def save_job(
    folder: str,
    gen: int,
    world: int,
    rows: int,
    kill_after: float | None = None,
    rng: random.Random | None = None,
    system: str = "ucp",
) -> dict[str, Any]:
    """Run a ``world``-rank save of generation ``gen``; with ``kill_after``, SIGKILL a random rank that
    many seconds after all ranks started saving, then the rest of the job. Start-up failures are
    retried (they say nothing about the checkpoint)."""
    for _attempt in range(3):
        try:
            return _save_job(folder, gen, world, rows, kill_after, rng, system)
        except JobDidNotStart as e:
            print(f"  (job did not start, retrying: {e})", flush=True)
    raise JobDidNotStart("three attempts")


def _save_job(
    folder: str, gen: int, world: int, rows: int, kill_after: float | None, rng: random.Random | None, system: str
) -> dict[str, Any]:
    import queue as queue_mod

    ctx = _ctx()
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, folder, gen, rows, q, system)) for r in range(world)]
    for p in procs:
        p.start()
    starts, dones = [], []
    try:
        try:
            while len(starts) < world:
                kind, _, t = q.get(timeout=60)
                (starts if kind == "start" else dones).append(t)
        except queue_mod.Empty:
            raise JobDidNotStart(f"{len(starts)}/{world} ranks reached the save") from None
        t0 = max(starts)
        if kill_after is None:
            while len(dones) < world:
                kind, _, t = q.get(timeout=300)
                if kind == "done":
                    dones.append(t)
            for p in procs:
                p.join(timeout=30)
            return {"seconds": max(dones) - t0, "killed": None}
        time.sleep(max(0.0, t0 + kill_after - time.time()))
        victim = (rng or random).randrange(world)
        try:
            os.kill(procs[victim].pid, signal.SIGKILL)
        except ProcessLookupError:  # it had already finished: a kill after the save
            pass
        time.sleep(0.3)  # the job notices (or not) and is torn down
        return {"seconds": None, "killed": victim}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)


# -- fault kinds ---------------------------------------------------------------------------------------


def _files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))


def _judge(path: str, want: dict[str, Any], world: int, rows: int) -> tuple[str, bool]:
    """(load outcome, verify flagged it): outcome is 'raised', 'harmless', 'silent' or 'foreign:<type>'."""
    import ucp_dcp
    from ucp_dcp.tools.verify import verify

    try:
        got = load_single(path, world, rows)
        outcome = "harmless" if equal(got, want) else "silent"
    except ucp_dcp.UCPError:
        outcome = "raised"
    except (Exception, _CheckpointException) as e:  # anything but our errors is a failure of its own
        outcome = f"foreign:{type(e).__name__}:{e}"[:160]
    return outcome, verify(path).exit_code != 0


def damage_trials(
    kind: str, n: int, base: str, work: str, world: int, rng: random.Random
) -> tuple[int, list[str], dict]:
    want = full_state(1, world)
    files = _files(base)
    caught, notes, tally = 0, [], {}
    for i in range(n):
        trial = os.path.join(work, f"{kind}{i}")
        shutil.copytree(base, trial)
        name = files[i % len(files)]
        p = os.path.join(trial, name)
        size = os.path.getsize(p)
        if kind == "flip":
            off, bit = rng.randrange(size), rng.randrange(8)
            with open(p, "r+b") as f:
                f.seek(off)
                b = f.read(1)[0]
                f.seek(off)
                f.write(bytes([b ^ (1 << bit)]))
            what = f"{name} byte {off} bit {bit}"
        else:
            cut = rng.randrange(size)
            os.truncate(p, cut)
            what = f"{name} cut to {cut}/{size}"
        outcome, flagged = _judge(trial, want, world, ROWS)
        key = (
            f"{'data' if name.endswith('.distcp') else name.split('.')[1] or 'metadata'}: load {outcome.split(':')[0]}"
        )
        tally[key] = tally.get(key, 0) + 1
        ok = outcome in ("raised", "harmless") and flagged
        caught += ok
        if not ok:
            notes.append(f"{kind} {what}: load {outcome}, verify {'flagged' if flagged else 'passed'}")
        shutil.rmtree(trial)
    return caught, notes, tally


def crash_trials(n: int, work: str, rng: random.Random, system: str = "ucp") -> tuple[int, list[str], float]:
    world = 4
    folder = os.path.join(work, "crash")
    states = {g: full_state(g, world, CRASH_ROWS) for g in range(n + 2)}
    current = 0
    save_job(folder, current, world, CRASH_ROWS, system=system)  # the good checkpoint every trial starts from
    calib = os.path.join(work, "calibrate")
    save_job(calib, 0, world, CRASH_ROWS, system=system)
    t_save = save_job(calib, 1, world, CRASH_ROWS, system=system)["seconds"]  # over a checkpoint, as in the trials
    lost, notes, kept = 0, [], {"previous": 0, "new": 0}
    for i in range(n):
        gen = i + 1
        delay = rng.uniform(0.0, 1.3 * t_save)
        info = save_job(folder, gen, world, CRASH_ROWS, kill_after=delay, rng=rng, system=system)
        try:
            got = load_single(folder, world, CRASH_ROWS, system)
            which = next((g for g in (current, gen) if equal(got, states[g])), None)
        except (Exception, _CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            got, which = None, None
            notes.append(f"crash {i}: rank {info['killed']} killed {delay:.3f}s into the save: load raised {e!r}"[:300])
        if which is None:
            lost += 1
            if got is not None:
                notes.append(f"crash {i}: folder loads a state that is neither generation {current} nor {gen}")
        else:
            kept["previous" if which == current else "new"] += 1
            current = which
    notes.append(
        f"after the kills the folder held the previous checkpoint {kept['previous']}x, the new one {kept['new']}x"
    )
    # the next save removes what the interrupted ones left
    save_job(folder, n + 1, world, CRASH_ROWS, system=system)
    try:
        back_ok = equal(load_single(folder, world, CRASH_ROWS, system), states[n + 1])
    except (Exception, _CheckpointException) as e:
        back_ok = False
        notes.append(f"loading the save after the crashes raised {e!r}"[:300])
    if not back_ok:
        lost += 1
        notes.append("the save after the crashes did not load back")
    import ucp_dcp.storage.opening as ins

    _, integ = ins.open_path(folder)
    if integ.strays and system == "ucp":
        notes.append(f"stray files left after a clean save: {integ.strays}")
        lost += 1
    return lost, notes, t_save


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def code_exec_cases(work: str, base: str) -> tuple[int, int, list[str]]:
    import torch.distributed.checkpoint as dcp

    import ucp_dcp
    from ucp_dcp import UCPFileSystemWriter, UCPSavePlanner
    from ucp_dcp.tools.verify import verify

    ran, notes = 0, []
    cases = 0

    def check(name: str, marker: str, fn) -> None:
        nonlocal ran, cases
        cases += 1
        try:
            fn()
        except ucp_dcp.UCPError:
            pass
        except Exception as e:
            notes.append(f"{name}: raised {type(e).__name__} (not a UCPError): {e}"[:200])
        if os.path.exists(marker):
            ran += 1
            notes.append(f"{name}: the payload ran")

    # 1-3: a crafted .metadata, opened by inspect (a separate process), verify and a load
    evil_md = os.path.join(work, "evil_md")
    shutil.copytree(base, evil_md)
    for n in os.listdir(evil_md):
        if n.startswith(".ucp."):
            os.remove(os.path.join(evil_md, n))
    marker = os.path.join(work, "pwned_md")
    Path(evil_md, ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    check(
        "inspect of a crafted .metadata",
        marker,
        lambda: subprocess.run([sys.executable, "-m", "ucp_dcp", "inspect", evil_md], capture_output=True, timeout=120),
    )
    check("verify of a crafted .metadata", marker, lambda: verify(evil_md))
    check("load of a crafted .metadata", marker, lambda: load_single(evil_md, 2, ROWS))

    # 4: a hostile writer stores a crafted object under a valid checksum
    marker_v = os.path.join(work, "pwned_value")

    class Hostile(UCPSavePlanner):
        def resolve_data(self, item):
            if item.index.fqn == "optim.lr":
                buf = io.BytesIO()
                torch.save(_Payload(marker_v), buf)
                return buf
            return super().resolve_data(item)

    evil_v = os.path.join(work, "evil_value")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(full_state(1, 2), storage_writer=UCPFileSystemWriter(evil_v), planner=Hostile())
    check("load of a crafted object value", marker_v, lambda: load_single(evil_v, 2, ROWS))

    # 5: a stock checkpoint whose tensor record is a crafted pickle
    marker_t = os.path.join(work, "pwned_tensor")
    evil_t = os.path.join(work, "evil_tensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=evil_t)
    md = pickle.loads(Path(evil_t, ".metadata").read_bytes())  # our own fixture: trusted
    buf = io.BytesIO()
    torch.save(_Payload(marker_t), buf)
    ((index, info),) = [(k, v) for k, v in md.storage_data.items()]
    Path(evil_t, info.relative_path).write_bytes(buf.getvalue())
    info.offset, info.length = 0, len(buf.getvalue())
    Path(evil_t, ".metadata").write_bytes(pickle.dumps(md))

    def load_tensor() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ucp_dcp.load({"w": torch.zeros(4)}, evil_t)

    check("load of a crafted tensor record", marker_t, load_tensor)
    return ran, cases, notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flips", type=int, default=100)
    ap.add_argument("--truncations", type=int, default=20)
    ap.add_argument("--crashes", type=int, default=None, help="crash trials (default 20; --store s3: every request)")
    ap.add_argument("--only", choices=["flips", "truncations", "crashes", "code-exec"], default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--system",
        choices=["ucp", "dcp"],
        default="ucp",
        help="crashes only: 'dcp' runs the same kills against DCP's default planner and storage",
    )
    ap.add_argument(
        "--store",
        choices=["local", "s3"],
        default="local",
        help="crashes only: 's3' kills a rank at each store request of a save on a local S3 server",
    )
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    if a.store == "s3":
        return store_main(a.crashes)
    a.crashes = 20 if a.crashes is None else a.crashes
    rng = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="ucp-faults-")
    run = lambda k: a.only in (None, k)
    parts, notes, bad = [], [], False
    try:
        base = os.path.join(work, "base")
        if run("flips") or run("truncations") or run("code-exec"):
            save_job(base, 1, 2, ROWS)
            print(f"base checkpoint: {len(_files(base))} files: {', '.join(_files(base))}", flush=True)
        for kind, label, n in (("flip", "flips", a.flips), ("truncate", "truncations", a.truncations)):
            if not run(label):
                continue
            t = time.perf_counter()
            c, nn, tally = damage_trials(kind, n, base, work, 2, rng)
            parts.append(f"{label} {c}/{n}" + (" caught" if kind == "flip" else ""))
            bad |= c < n
            notes += nn
            print(
                f"{label}: {c}/{n} caught by verify and load ({time.perf_counter() - t:.1f} s); "
                f"{dict(sorted(tally.items()))}",
                flush=True,
            )
        if run("crashes") and a.crashes:
            t = time.perf_counter()
            lost, nn, t_save = crash_trials(a.crashes, work, rng, a.system)
            parts.append(f"crashes {lost}/{a.crashes} lost" + (" (DCP default)" if a.system == "dcp" else ""))
            bad |= lost > 0
            notes += nn
            print(
                f"crashes: {lost}/{a.crashes} lost (4 ranks, {4 * CRASH_ROWS * COLS * 4 >> 20} MiB, save {t_save:.2f} s; "
                f"{time.perf_counter() - t:.1f} s)",
                flush=True,
            )
        if run("code-exec"):
            ran, cases, nn = code_exec_cases(work, base)
            parts.append(f"code-exec {ran}/{cases}")
            bad |= ran > 0 or bool(nn)
            notes += nn
            print(f"code-exec: payload ran in {ran}/{cases} cases", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for n in notes:
        print(f"  - {n}")
    print(f"FAULTS {'FAILED' if bad else 'OK'}: {', '.join(parts)}")
    return 1 if bad else 0


def store_main(crashes: int | None) -> int:
    """``--store s3``: the kill walk of :mod:`ucp_dev.testing.store_crashes` on a local S3 server."""
    from ucp_dev.testing.s3_server import spawn_server
    from ucp_dev.testing.store_crashes import store_crash_trials

    proc, env = spawn_server("faults")
    t = time.perf_counter()
    try:
        out = store_crash_trials(env, "s3://faults/crash", limit=crashes)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for n in out.notes:
        print(f"  - {n}")
    bad = out.lost > 0 or out.undetected > 0
    print(f"store crashes: {out.trials} kills in {time.perf_counter() - t:.1f} s", flush=True)
    print(
        f"FAULTS {'FAILED' if bad else 'OK'}: store crashes {out.lost}/{out.trials} lost, "
        f"{out.undetected}/{out.trials} undetected"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
