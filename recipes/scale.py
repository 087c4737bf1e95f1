"""Where the checkpoint protocol's cost grows with the number of ranks: store traffic, gathered bytes, time per call.

    python recipes/scale.py [--ranks 2,4,8,16] [--mib-per-rank 6] [--reps 3] [--idle-s 2] [--json runs/scale.json]
    python recipes/scale.py --direct [...]     (ranks connect to the store itself: times without the meter, no counts)

Per N (a fresh job each: N gloo ranks on this machine), the parent process hosts the job's TCPStore (libuv server,
``world_size=None``, as torchrun's agent does) with :class:`store_meter.StoreMeter` in front of it (a counting proxy,
in a thread of the parent); the ranks connect their store to the meter and ``init_process_group("gloo", store=...)``
on it. Each rank holds ``--mib-per-rank`` MiB (default 6): 32 parameters and two optimizer moments each, DTensors
``Shard(0)`` over a 1-D mesh of N (so the state grows with N, the per-rank share does not), plus replicated scalars
(a step counter, an lr and a loss scale).

Per N, interleaved (``ucp`` first on even reps, ``dcp`` first on odd), after one warm-up round that is not counted
(the first ``ucp_dcp`` call creates its control group): ``ucp_dcp.save(sd, path)`` + ``ucp_dcp.load`` against stock
``dcp.save(sd, checkpoint_id=...)`` + ``dcp.load`` (DCP's default planners, ``FileSystemWriter``/``Reader``), each
into a fresh folder, loads warm (the page cache holds what the save wrote) and checked bitwise against the saved
state. Around each call all ranks meet in a gloo barrier (no store traffic) and the parent snapshots the meter, so a
call's window holds its own store traffic and whatever background traffic (heartbeats) ran beside it. Per call:

* store requests in total and on the busiest rank (per-rank figures: all the connections of that rank's process,
  found by the meter through ``/proc``; a connection it could not place counts in the total only);
* store bytes, both directions, in total and on the busiest rank; store connections opened during the call;
* of the requests, those on key families (keys with their numbers masked) that also turn up in the idle window
  below: a heartbeat running beside the call, e.g. ucp_dcp's control group beating during a stock DCP call;
* gathered bytes: what rank 0 deserializes in ``gather_object`` / ``all_gather_object`` / ``scatter_object_list`` /
  ``broadcast_object_list`` (wrapped on every rank before the calls: the sizes torch passes to
  ``_tensor_to_object``, its own contribution included) -- the objects DCP's coordinator receives;
* the slowest rank's wall time.

Medians over ``--reps``, then ucp/dcp time ratios, and the growth exponent over the N run (log-log least-squares
slope) of requests, bytes, gathered bytes and per-rank requests per call. After the calls every rank sleeps
``--idle-s``: the store traffic per second with no call running. Keys left in the store: ``num_keys()`` at the end
minus at the start of the calls (init and gloo rendezvous keys are there before). Goals (the "after" design, DCP's
collectives on gloo, a few keys per rank per collective): requests exponent <= 1.1, per-rank requests O(1)
(exponent <= 0.1), no store traffic between calls, ucp save and load at the largest N within 1.1x DCP's time;
each printed met / not met. The time goal is judged on a second job of the largest N run without the meter
(``--direct``'s way): the meter is a Python proxy sharing this machine's cores, and it delays every store round
trip -- which only ucp_dcp's gates make, so it would charge ucp_dcp alone. The last line is ``SCALE: ...``.

Exit status 0 whether or not goals are met (a benchmark); 1 when a load was not bitwise or a job failed. The meter
adds a few tens of microseconds per store round trip: with store-heavy protocols ``--direct`` gives the times
without it. Progress goes to stderr. The ranks import the ``ucp_dcp`` the parent's interpreter would (its
``sys.path``): to measure another checkout, run a Python that finds that one first. :func:`call_counts` is what a
call's counts are (exact counts, no times), for a check of them.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from store_meter import StoreMeter, by_owner, diff, key_family  # noqa: E402

HOST = "127.0.0.1"
CALLS = ("ucp_save", "ucp_load", "dcp_save", "dcp_load")
LABELS = {"ucp_save": "ucp save", "ucp_load": "ucp load", "dcp_save": "dcp save", "dcp_load": "dcp load"}
N_PARAMS = 32
MOMENTS = ("exp_avg", "exp_avg_sq")
COLS = 128
OBJECT_COLLECTIVES = ("gather_object", "all_gather_object", "scatter_object_list", "broadcast_object_list")
GOALS = {"requests_exponent": 1.1, "per_rank_exponent": 0.1, "time_ratio": 1.1}
# what the forkserver imports once, so that N ranks start in a second, not N imports of torch on 2 cores. Not
# ucp_dcp (0.4 s a rank): the forkserver's sys.path is its own (its cwd first), a rank's is the parent's, so the
# ranks import the ucp_dcp the parent would (each reports which it ran; a mismatch fails the job)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- rank side ----------------------------------------------------------------------------------------------


class ObjectBytes:
    """Counts, per object collective, the calls and the pickled bytes this rank deserializes in them.

    Installed on ``torch.distributed`` and ``distributed_c10d`` (DCP calls ``dist.gather_object`` etc.); the bytes
    are the sizes torch hands ``_tensor_to_object`` (no pickling of our own inside the timed call). Where a torch
    lacks ``_tensor_to_object`` the received objects are pickled after the call instead.
    """

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self._inside: list[str] = []

    def install(self) -> ObjectBytes:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        to_object = getattr(c10d, "_tensor_to_object", None)
        self.exact = to_object is not None
        if to_object is not None:

            def counted_to_object(tensor: Any, tensor_size: Any, group: Any) -> Any:
                if self._inside:
                    self._add(self._inside[-1], 0, int(tensor_size))
                return to_object(tensor, tensor_size, group)

            c10d._tensor_to_object = counted_to_object
        for name in OBJECT_COLLECTIVES:
            fn = getattr(c10d, name)
            wrapped = self._wrap(name, fn)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)
        return self

    def _wrap(self, name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._add(name, 1, 0)
            self._inside.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.pop()
                if not self.exact:
                    self._add(name, 0, _pickled_size(name, args, kwargs))

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def _add(self, name: str, calls: int, nbytes: int) -> None:
        c = self.counts.setdefault(name, {"calls": 0, "bytes": 0})
        c["calls"] += calls
        c["bytes"] += nbytes

    def reset(self) -> None:
        self.counts = {}

    def snapshot(self) -> dict:
        out = {k: dict(v) for k, v in self.counts.items()}
        out["total_bytes"] = sum(v["bytes"] for v in self.counts.values())  # type: ignore[assignment]
        return out


def _pickled_size(name: str, args: tuple, kwargs: dict) -> int:
    """The fallback: the received objects' pickled size (the output list of each collective, positional first)."""
    import pickle

    out = args[0] if args else next(iter(kwargs.values()), None)
    if name == "gather_object":
        out = args[1] if len(args) > 1 else kwargs.get("object_gather_list")
    if not isinstance(out, list):
        return 0
    return sum(len(pickle.dumps(o)) for o in out)


def _state(rank: int, n: int, mesh: Any, mib: float, zero: bool) -> dict:
    """This rank's share: 32 parameters and their two moments as ``Shard(0)`` DTensors of ``rows x 128`` fp32 per
    rank, plus replicated scalars. Values depend on (tensor, rank) only, so a load's result is known."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    rows = max(1, int(mib * (1 << 20)) // (N_PARAMS * (1 + len(MOMENTS)) * 4 * COLS))

    def shard(i: int) -> Any:
        g = torch.Generator().manual_seed(1_000_003 * i + rank)
        local = torch.zeros(rows, COLS) if zero else torch.randn(rows, COLS, generator=g)
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size([rows * n, COLS]), stride=(COLS, 1)
        )

    names = [f"layers.{i}.weight" for i in range(N_PARAMS)]
    model = {k: shard(i) for i, k in enumerate(names)}
    optim = {k: {m: shard(1000 * (j + 1) + i) for j, m in enumerate(MOMENTS)} for i, k in enumerate(names)}
    scalars = (0.0, 0.0) if zero else (1e-3, 65536.0)
    return {
        "model": model,
        "optim": {"state": optim, "lr": torch.tensor(scalars[0]), "loss_scale": torch.tensor(scalars[1])},
        "step": 0 if zero else 1234,
    }


def _leaves(sd: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in sd.items():
        if isinstance(v, dict):
            out += _leaves(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _bitwise_equal(a: dict, b: dict) -> list[str]:
    """The leaves of ``b`` that differ from ``a`` bit for bit (tensors compared as int32 words)."""
    import torch
    from torch.distributed.tensor import DTensor

    bad = []
    got = dict(_leaves(b))
    for k, v in _leaves(a):
        w = got.get(k)
        if isinstance(v, DTensor):
            v, w = v.to_local(), w.to_local() if isinstance(w, DTensor) else None
        if isinstance(v, torch.Tensor):
            ok = (
                isinstance(w, torch.Tensor)
                and v.shape == w.shape
                and torch.equal(v.view(torch.int32), w.view(torch.int32))
            )
        else:
            ok = v == w
        if not ok:
            bad.append(k)
    return bad


def _clear(sd: dict) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    for k, v in sd.items():
        if isinstance(v, dict):
            _clear(v)
        elif isinstance(v, DTensor):
            v.to_local().zero_()
        elif isinstance(v, torch.Tensor):
            v.zero_()
        else:
            sd[k] = 0


def _rank(rank: int, n: int, port: int, cfg: dict, q: Any, acks: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.filterwarnings("ignore")
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh

        import ucp_dcp

        torch.set_num_threads(1)
        timeout = timedelta(seconds=cfg["timeout"])
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)
        mesh = init_device_mesh("cpu", (n,))
        objects = ObjectBytes().install()
        src = _state(rank, n, mesh, cfg["mib"], zero=False)
        tgt = _state(rank, n, mesh, cfg["mib"], zero=True)
        root = Path(cfg["out"])

        def mark(label: str, info: Any = None) -> None:
            """All ranks between two gloo barriers while the parent snapshots the meter (rank 0 asks, waits)."""
            dist.barrier()
            if rank == 0:
                q.put(("mark", label, info))
                acks.get()
            dist.barrier()

        calls = {
            "ucp_save": lambda p: ucp_dcp.save(src, p),
            "ucp_load": lambda p: ucp_dcp.load(tgt, p),
            "dcp_save": lambda p: dcp.save(src, checkpoint_id=p),
            "dcp_load": lambda p: dcp.load(tgt, checkpoint_id=p),
        }
        records = []
        mark("baseline")
        for rep in range(-1, cfg["reps"]):  # rep -1: the warm-up round, not counted
            systems = ("ucp", "dcp") if rep % 2 == 0 else ("dcp", "ucp")
            for system in systems:
                path = str(root / f"{system}_{'warmup' if rep < 0 else rep}")
                for op in ("save", "load"):
                    kind = f"{system}_{op}"
                    idx = len(records)
                    if op == "load":
                        _clear(tgt)
                    objects.reset()
                    mark(f"{idx}:before")
                    t0 = time.perf_counter()
                    calls[kind](path)
                    dt = time.perf_counter() - t0
                    mark(f"{idx}:after", {"kind": kind, "rep": rep, "seconds": dt})
                    rec: dict[str, Any] = {"idx": idx, "kind": kind, "rep": rep, "seconds": dt}
                    if rank == 0:
                        rec["gathered"] = objects.snapshot()
                    if op == "load":
                        rec["mismatch"] = _bitwise_equal(src, tgt)
                    records.append(rec)
            dist.barrier()
            if rank == 0:  # not in any window: the next rep writes fresh folders
                for system in systems:
                    shutil.rmtree(root / f"{system}_{'warmup' if rep < 0 else rep}", ignore_errors=True)
        mark("idle:before")
        time.sleep(cfg["idle_s"])
        mark("idle:after")
        q.put(("records", rank, records, str(Path(ucp_dcp.__file__).resolve().parent)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))
        raise


# -- parent side ----------------------------------------------------------------------------------------------


def call_counts(window: dict | None) -> dict | None:
    """A call's store counts from a meter window (:func:`store_meter.diff`): the figures this benchmark reports,
    exact counts only (no times), so a CI check can compare them."""
    if window is None:
        return None
    owners = by_owner(window)
    ranks = {k: v for k, v in owners.items() if k.startswith("rank")}
    return {
        "requests": window["requests_total"],
        "bytes": window["bytes_up"] + window["bytes_down"],
        "bytes_up": window["bytes_up"],
        "bytes_down": window["bytes_down"],
        "requests_per_rank_max": max((v["requests_total"] for v in ranks.values()), default=0),
        "bytes_per_rank_max": max((v["bytes"] for v in ranks.values()), default=0),
        "requests_unattributed": sum(v["requests_total"] for k, v in owners.items() if k not in ranks),
        "connections_opened": window["connections_opened"],
        "by_command": dict(sorted(window["requests"].items(), key=lambda kv: -kv[1])),
        "unparsed_bytes": window["unparsed_bytes"],
        "unparsed_connections": window["unparsed_connections"],
    }


def _key_names(store: Any) -> list[str] | None:
    try:
        return list(store.list_keys())
    except Exception:  # a torch without list_keys
        return None


def run_job(n: int, cfg: dict, direct: bool) -> dict:
    """One job of ``n`` ranks: every call's counts and times, the idle window, the keys left."""
    import torch.distributed as dist

    store = dist.TCPStore(
        HOST,
        0,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        use_libuv=True,
        timeout=timedelta(seconds=cfg["timeout"]),
    )
    meter = None if direct else StoreMeter(HOST, store.port).start()
    port = store.port if meter is None else meter.port
    ctx = mp.get_context("forkserver")
    q, acks = ctx.Queue(), ctx.Queue()
    procs = []
    for r in range(n):
        p = ctx.Process(target=_rank, args=(r, n, port, cfg, q, acks if r == 0 else None), daemon=True)
        p.start()
        if meter is not None:
            meter.set_owner(p.pid, f"rank{r}")
        procs.append(p)
    snaps: dict[str, dict] = {}
    keys: dict[str, dict] = {}
    records: dict[int, list] = {}
    errors: list[str] = []
    deadline = time.monotonic() + cfg["job_timeout"]
    t_start = time.monotonic()
    try:
        while len(records) < n and not errors:
            try:
                msg = q.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"ranks exited: {dead}")
                elif time.monotonic() > deadline:
                    errors.append(f"job of {n} ranks past {cfg['job_timeout']} s")
                continue
            if msg[0] == "mark":
                _, label, info = msg
                snaps[label] = meter.snapshot() if meter is not None else {"time": time.monotonic()}
                if label in ("baseline", "idle:before", "idle:after"):
                    keys[label] = {"num_keys": store.num_keys(), "names": _key_names(store)}
                acks.put(True)
                if info is not None:
                    before = snaps.get(label.replace(":after", ":before"))
                    reqs = ""
                    if meter is not None and before is not None:
                        reqs = f", {diff(before, snaps[label])['requests_total']} store requests"
                    rep = "warm-up" if info["rep"] < 0 else f"rep {info['rep']}"
                    log(f"  N={n} {rep} {LABELS[info['kind']]}: {info['seconds']:.2f} s (rank 0){reqs}")
            elif msg[0] == "records":
                records[msg[1]] = msg[2]
                if msg[3] != cfg["ucp_dcp"]:  # measured code other than the parent's: the figures would mislead
                    errors.append(f"rank {msg[1]} ran ucp_dcp from {msg[3]}, the parent imports {cfg['ucp_dcp']}")
            elif msg[0] == "error":
                errors.append(f"rank {msg[1]}:\n{msg[2]}")
    finally:
        if errors:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        if meter is not None:
            meter.close()
        del store
    if errors:
        return {"n": n, "error": "\n".join(errors)}
    return _summarize(n, records, snaps, keys, meter is not None, time.monotonic() - t_start)


def _summarize(n: int, records: dict[int, list], snaps: dict, keys: dict, metered: bool, seconds: float) -> dict:
    calls = []
    for rec0 in records[0]:
        idx = rec0["idx"]
        per_rank = [records[r][idx] for r in range(n)]
        window = diff(snaps[f"{idx}:before"], snaps[f"{idx}:after"]) if metered else None
        calls.append(
            {
                "kind": rec0["kind"],
                "rep": rec0["rep"],
                "seconds": max(r["seconds"] for r in per_rank),  # the slowest rank's
                "seconds_per_rank": [round(r["seconds"], 4) for r in per_rank],
                "mismatch": sorted({k for r in per_rank for k in r.get("mismatch", [])}),
                "gathered": rec0["gathered"],
                "store": call_counts(window),
                "families": window["families"] if window else None,
            }
        )
    idle = diff(snaps["idle:before"], snaps["idle:after"]) if metered else None
    # a call's background: its requests on key families that also turn up with no call running (heartbeats)
    idle_families = set(idle["families"]) if idle else set()
    for c in calls:
        if c["store"] is not None:
            c["store"]["requests_background"] = sum(v for f, v in c["families"].items() if f in idle_families)
    summary = {}
    for kind in CALLS:
        runs = [c for c in calls if c["kind"] == kind and c["rep"] >= 0]
        med = statistics.median
        s: dict[str, Any] = {
            "seconds": med(c["seconds"] for c in runs),
            "seconds_range": [min(c["seconds"] for c in runs), max(c["seconds"] for c in runs)],
            "gathered_bytes": med(c["gathered"]["total_bytes"] for c in runs),
        }
        if metered:
            for k in (
                "requests",
                "bytes",
                "requests_per_rank_max",
                "bytes_per_rank_max",
                "connections_opened",
                "requests_background",
            ):
                s[k] = med(c["store"][k] for c in runs)
            s["unparsed_bytes"] = sum(c["store"]["unparsed_bytes"] for c in runs)
            s["by_command"] = runs[0]["store"]["by_command"]
            s["families"] = dict(sorted(runs[0]["families"].items(), key=lambda kv: -kv[1]))
            first = next(c for c in calls if c["kind"] == kind and c["rep"] < 0)
            s["warmup"] = {
                "requests": first["store"]["requests"],
                "connections_opened": first["store"]["connections_opened"],
            }
        summary[kind] = s
    for op in ("save", "load"):
        summary[f"ucp_{op}"]["ratio_to_dcp"] = summary[f"ucp_{op}"]["seconds"] / summary[f"dcp_{op}"]["seconds"]
    out: dict[str, Any] = {"n": n, "job_seconds": seconds, "summary": summary, "calls": calls}
    out["bitwise"] = all(not c["mismatch"] for c in calls if c["kind"].endswith("load"))
    if idle is not None:
        out["idle"] = {
            "seconds": idle["seconds"],
            "requests_per_s": idle["requests_total"] / idle["seconds"],
            "bytes_per_s": (idle["bytes_up"] + idle["bytes_down"]) / idle["seconds"],
            "by_command": idle["requests"],
            "families": idle["families"],
        }
        # every connection the job's ranks opened, with what the meter knows of it (for attribution checks)
        t0 = snaps["baseline"]["time"]
        out["connections"] = [
            {
                "id": cid,
                "label": c["label"],
                "pid": c["pid"],
                "first_key": c["first_key"],
                "requests": sum(c["requests"].values()),
                "bytes": c["bytes_up"] + c["bytes_down"],
                "opened_s": round(c["opened_at"] - t0, 3),
                "closed_s": None if c["closed_at"] is None else round(c["closed_at"] - t0, 3),
                "parse_error": c["parse_error"],
                "owner_lookup": c.get("owner_lookup"),
            }
            for cid, c in snaps["idle:after"]["connections"].items()
        ]
    base, end = keys["baseline"], keys["idle:after"]
    out["keys"] = {
        "before_calls": base["num_keys"],
        "after_calls": keys["idle:before"]["num_keys"],
        "after_idle": end["num_keys"],
        "left": end["num_keys"] - base["num_keys"],
    }
    if base["names"] is not None and end["names"] is not None:
        new = sorted(set(end["names"]) - set(base["names"]))
        fams: dict[str, int] = {}
        for k in new:
            f = key_family(k.encode())
            fams[f] = fams.get(f, 0) + 1
        out["keys"]["left_families"] = fams
        out["keys"]["left_sample"] = new[:20]
    return out


def _watch_families(families: dict[str, int]) -> dict[str, int]:
    """``families`` with the watch's name masked whatever its form (a group's name is a hash and a making
    number: ``ucp_dcp/<name>/<call>/...``), other families as they are."""
    out: dict[str, int] = {}
    for k, v in families.items():
        op, _, key = k.partition(" ")
        parts = key.split("/")
        if len(parts) > 3 and parts[1] == "ucp_dcp":
            parts[2] = "#"
        name = f"{op} {'/'.join(parts)}"
        out[name] = out.get(name, 0) + v
    return out


def check_counts(jobs: list[dict]) -> list[str]:
    """What is wrong with the exact counts of ``ucp_dcp.save``/``load`` (CI's plan tier runs this): per call the
    same number of gates G at every N, and per gate one add, one blocking get (WAIT then GET on the wire) per
    rank and one verdict; one ``left`` add per rank; no store connection opened, no key family outside
    ucp_dcp's, nothing between calls, none of ucp_dcp's keys left after the calls. Beats and the watchers'
    scans are per second of a call, not per rank pair, and are not counted here (their rate is)."""
    from ucp_dcp.planning.checkpoint_group import GATES, call_requests

    problems: list[str] = []
    gates: dict[str, set[int]] = {}
    for job in jobs:
        n = job["n"]
        if "error" in job:
            problems.append(f"N={n}: the job failed: {job['error'][:300]}")
            continue
        for c in job["calls"]:
            if not c["kind"].startswith("ucp") or c["rep"] < 0:
                continue
            where = f"N={n} {c['kind']} rep {c['rep']}"
            f = _watch_families(c["families"])
            g, rest = divmod(f.get("ADD /ucp_dcp/#/#/a/#", 0), n)
            gates.setdefault(c["kind"], set()).add(g)
            # the model `ucp_dcp plan` prints (checkpoint_group.call_requests, GATES), against the wire
            model = call_requests(n, GATES[c["kind"].split("_", 1)[1]])
            got = {
                "arrivals (add)": f.get("ADD /ucp_dcp/#/#/a/#", 0),
                "waits (wait + get)": f.get("WAIT /ucp_dcp/#/#/g/#", 0) + f.get("GET /ucp_dcp/#/#/g/#", 0),
                "verdicts (compare_set)": f.get("COMPARE_SET /ucp_dcp/#/#/g/#", 0),
                "leaving (add)": f.get("ADD /ucp_dcp/#/#/left", 0),
            }
            bad = {k: (got[k], v) for k, v in model.items() if got[k] != v}
            if f.get("WAIT /ucp_dcp/#/#/g/#", 0) != f.get("GET /ucp_dcp/#/#/g/#", 0):
                bad["a wait without its get"] = (f.get("WAIT /ucp_dcp/#/#/g/#", 0), f.get("GET /ucp_dcp/#/#/g/#", 0))
            if rest or g == 0 or bad:
                problems.append(f"{where}: {g} gates (+{rest} adds); counts (got, model): {bad}")
            other = sorted(k for k in f if not k.split(" ", 1)[-1].startswith("/ucp_dcp/"))
            if other:
                problems.append(f"{where}: store requests outside ucp_dcp's keys: {other}")
            if c["store"]["connections_opened"]:
                problems.append(f"{where}: {c['store']['connections_opened']} store connections opened")
        idle = job.get("idle", {})
        if idle.get("requests_per_s", 0):
            problems.append(f"N={n}: {idle['requests_per_s']:.1f} store requests/s with no call running")
        ours = {k: v for k, v in job["keys"].get("left_families", {}).items() if "ucp_dcp" in k}
        if ours:
            problems.append(f"N={n}: ucp_dcp keys left in the store after the calls: {ours}")
    for kind, gs in gates.items():
        if len(gs) != 1:
            problems.append(f"{kind}: the number of gates per call depends on N: {sorted(gs)}")
    return problems


def slope(ns: list[int], ys: list[float]) -> float | None:
    """Least-squares slope of log y over log N, over the N where y > 0; 0.0 where y is 0 at every N (nothing
    grows); None where fewer than two N have a value."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(ns, ys) if y and y > 0]
    if not pts and ys:
        return 0.0
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for div, pre in ((1 << 30, "Gi"), (1 << 20, "Mi"), (1 << 10, "Ki")):
        if unit == "B" and abs(x) >= div:
            return f"{x / div:.1f} {pre}B"
    if unit == "B":
        return f"{x:.0f} B"
    return f"{x:,.0f}"


def _exp(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def report(jobs: list[dict], metered: bool, timed: dict | None = None) -> dict:
    """Print the table, the exponents and the goals. ``timed``: a job of the largest N run without the meter,
    whose times the time goal is judged on (the meter is a Python proxy on this machine's 2 cores: it delays
    every store round trip, which only ucp_dcp's gates make)."""
    ok = [j for j in jobs if "error" not in j]
    ns = [j["n"] for j in ok]
    print(
        f"\n{'N':>3}  {'call':<9} {'time s':>7} {'ucp/dcp':>7} {'req/call':>9} {'req/rank':>8} {'bytes/call':>11}"
        f" {'bytes/rank':>11} {'conns':>5} {'bg req':>6} {'gathered':>10}"
    )
    for j in ok:
        for kind in CALLS:
            s = j["summary"][kind]
            ratio = f"{s['ratio_to_dcp']:.2f}x" if "ratio_to_dcp" in s else ""
            print(
                f"{j['n']:>3}  {LABELS[kind]:<9} {s['seconds']:7.3f} {ratio:>7} {_si(s.get('requests')):>9} "
                f"{_si(s.get('requests_per_rank_max')):>8} {_si(s.get('bytes'), 'B'):>11} "
                f"{_si(s.get('bytes_per_rank_max'), 'B'):>11} {_si(s.get('connections_opened')):>5} "
                f"{_si(s.get('requests_background')):>6} "
                f"{_si(s['gathered_bytes'], 'B'):>10}"
            )
    print(
        "(medians over the reps; time: the slowest rank; req/rank, bytes/rank: the busiest rank; conns: store "
        "connections opened in the call; bg req: of req/call, those on key families also seen with no call running "
        "(heartbeats beside the call); gathered: bytes rank 0 deserializes in DCP's object collectives)"
    )
    exps: dict[str, dict] = {}
    if len(ns) >= 2:
        print(
            f"\ngrowth exponent over N={ns[0]}..{ns[-1]} (log-log least squares over the N with a nonzero value; "
            "0.00: zero at every N; '-': not measured)"
        )
        print(f"{'call':<9} {'requests':>9} {'bytes':>7} {'gathered':>9} {'req/rank':>9}")
        for kind in CALLS:
            col = {  # None where not measured (--direct)
                k: slope(ns, vals) if None not in (vals := [j["summary"][kind].get(k) for j in ok]) else None
                for k in ("requests", "bytes", "gathered_bytes", "requests_per_rank_max")
            }
            exps[kind] = col
            print(
                f"{LABELS[kind]:<9} {_exp(col['requests']):>9} {_exp(col['bytes']):>7} "
                f"{_exp(col['gathered_bytes']):>9} {_exp(col['requests_per_rank_max']):>9}"
            )
    if metered:
        print("\nstore traffic with no call running, and keys left in the store after the calls")
        for j in ok:
            i, k = j["idle"], j["keys"]
            fams = ", ".join(
                f"{f} x{c}" for f, c in sorted(k.get("left_families", {}).items(), key=lambda x: -x[1])[:4]
            )
            print(
                f"N={j['n']:>2}: idle {i['requests_per_s']:.1f} req/s, {_si(i['bytes_per_s'], 'B')}/s; keys "
                f"{k['before_calls']} before the calls, {k['after_idle']} after: {k['left']:+d}"
                + (f" ({fams})" if fams else "")
            )
        big = ok[-1] if ok else None
        if big:
            print(f"\nrequests by command at N={big['n']} (one rep)")
            for kind in CALLS:
                cmds = big["summary"][kind]["by_command"]
                print(f"  {LABELS[kind]:<9} " + (", ".join(f"{c} {v}" for c, v in cmds.items()) or "none"))
                fams = big["summary"][kind]["families"]
                if fams:  # whose keys: a call's own, or a heartbeat running beside it
                    print(f"  {'':<9}   keys: " + ", ".join(f"{f} {v}" for f, v in list(fams.items())[:4]))
        unparsed = sum(j["summary"][kind].get("unparsed_bytes", 0) for j in ok for kind in CALLS)
        if unparsed:
            print(f"\nNOTE: {unparsed} store bytes the meter could not parse (counted as bytes only; see the JSON)")
    goals: dict[str, Any] = {}
    if ok:
        big = ok[-1]
        if metered and exps:
            for op in ("save", "load"):
                e = exps[f"ucp_{op}"]
                goals[f"ucp {op}: store requests per call exponent <= {GOALS['requests_exponent']}"] = (
                    e["requests"] is not None and e["requests"] <= GOALS["requests_exponent"],
                    _exp(e["requests"]),
                )
                goals[f"ucp {op}: per-rank store requests O(1) (exponent <= {GOALS['per_rank_exponent']})"] = (
                    e["requests_per_rank_max"] is not None and e["requests_per_rank_max"] <= GOALS["per_rank_exponent"],
                    _exp(e["requests_per_rank_max"]),
                )
        if metered:
            worst = max(ok, key=lambda j: j["idle"]["requests_per_s"])
            goals["zero store traffic between calls"] = (
                all(j["idle"]["requests_per_s"] == 0 for j in ok),
                f"{worst['idle']['requests_per_s']:.1f} req/s at N={worst['n']}",
            )
        timing = timed if timed is not None and "error" not in timed else big
        if timing is not big:
            print(f"\ntimes at N={timing['n']} without the meter (ranks straight to the store; medians of the reps)")
            for kind in CALLS:
                s = timing["summary"][kind]
                ratio = f"  ucp/dcp {s['ratio_to_dcp']:.2f}x" if "ratio_to_dcp" in s else ""
                print(f"  {LABELS[kind]:<9} {s['seconds']:7.3f} s{ratio}")
        for op in ("save", "load"):
            r = timing["summary"][f"ucp_{op}"]["ratio_to_dcp"]
            where = "" if timing is big or not metered else ", without the meter"
            goals[f"ucp {op} at N={timing['n']} within {GOALS['time_ratio']}x DCP's time{where}"] = (
                r <= GOALS["time_ratio"],
                f"{r:.2f}x",
            )
        print("\ngoals (the 'after' design)")
        for name, (met, value) in goals.items():
            print(f"  {'met    ' if met else 'NOT met'}  {name}: {value}")
    return {"exponents": exps, "goals": {k: {"met": m, "value": v} for k, (m, v) in goals.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4,8,16", help="comma list of job sizes (32 works, slowly, on 2 cores)")
    ap.add_argument("--mib-per-rank", type=float, default=6.0, help="state per rank, MiB (default 6)")
    ap.add_argument("--reps", type=int, default=3, help="counted repetitions per call (default 3; median)")
    ap.add_argument("--idle-s", type=float, default=2.0, help="seconds of no calls, every rank asleep (default 2)")
    ap.add_argument("--json", default="runs/scale.json", help="write the figures here (default runs/scale.json)")
    ap.add_argument("--out", default="runs/scale_ckpt", help="scratch folder for the checkpoints (removed after)")
    ap.add_argument("--direct", action="store_true", help="no meter: ranks use the store itself (times only)")
    ap.add_argument("--timeout", type=float, default=600.0, help="process group / store timeout, s")
    ap.add_argument(
        "--check-counts",
        action="store_true",
        help="CI: assert the exact store counts per call (check_counts); exit 1 on a problem (defaults: 2,4 ranks, 1 rep)",
    )
    a = ap.parse_args(argv)
    if a.check_counts:  # the counts are exact at any size: the smallest jobs, one rep, a short idle window
        argv = list(argv if argv is not None else sys.argv[1:])
        a.ranks = a.ranks if "--ranks" in argv else "2,4"
        a.reps = a.reps if "--reps" in argv else 1
        a.idle_s = a.idle_s if "--idle-s" in argv else 1.0
    ns = sorted({int(x) for x in a.ranks.split(",") if x.strip()})
    if not ns or min(ns) < 2:
        ap.error("--ranks: job sizes of 2 or more")
    # inherited by the forkserver and every rank: one compute thread per rank (N ranks share 2 cores), quiet c10d
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    mp.set_forkserver_preload(PRELOAD)
    out = Path(a.out).resolve()
    cfg = {"mib": a.mib_per_rank, "reps": a.reps, "idle_s": a.idle_s, "timeout": a.timeout}
    cfg["job_timeout"] = 4 * a.timeout
    print(
        f"state per rank: {N_PARAMS} params + {len(MOMENTS)} moments, Shard(0) DTensors, {a.mib_per_rank:g} MiB; "
        f"{a.reps} interleaved reps after a warm-up; gloo ranks {ns}; "
        f"{'direct to the store (no counts)' if a.direct else 'store traffic through the meter'}"
    )
    import ucp_dcp  # which checkout is measured (the forkserver and the ranks import the same)

    where = str(Path(ucp_dcp.__file__).resolve().parent)
    print(f"ucp_dcp: {where}")
    t0 = time.monotonic()
    jobs = []
    for n in ns:
        log(f"N={n}: starting {n} ranks")
        job_dir = out / f"N{n}"
        shutil.rmtree(job_dir, ignore_errors=True)
        job_dir.mkdir(parents=True)
        try:
            job = run_job(n, {**cfg, "out": str(job_dir), "ucp_dcp": where}, a.direct)
        except Exception:
            job = {"n": n, "error": traceback.format_exc()}
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)
        jobs.append(job)
        if "error" in job:
            log(f"N={n}: FAILED\n{job['error']}")
        else:
            log(f"N={n}: done in {job['job_seconds']:.0f} s")
    timed = None
    if not a.direct and not a.check_counts and jobs and "error" not in jobs[-1]:
        # the time goal's own run: the largest N again, straight to the store (the counts came from the meter)
        n = ns[-1]
        log(f"N={n}: again without the meter, for the times ({a.reps} reps)")
        job_dir = out / f"N{n}-direct"
        shutil.rmtree(job_dir, ignore_errors=True)
        job_dir.mkdir(parents=True)
        try:
            timed = run_job(n, {**cfg, "out": str(job_dir), "ucp_dcp": where}, True)
        except Exception:
            timed = {"n": n, "error": traceback.format_exc()}
            log(f"N={n} without the meter: FAILED\n{timed['error']}")
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    res = report(jobs, not a.direct, timed)
    failed = [j["n"] for j in jobs if "error" in j]
    not_bitwise = [j["n"] for j in jobs if "error" not in j and not j["bitwise"]]
    if timed is not None and "error" not in timed and not timed["bitwise"]:
        not_bitwise.append(timed["n"])
    ok = [j for j in jobs if "error" not in j]
    doc = {
        "config": {
            **cfg,
            "ranks": ns,
            "ucp_dcp": where,
            "direct": a.direct,
            "cols": COLS,
            "params": N_PARAMS,
            "moments": list(MOMENTS),
        },
        "jobs": jobs,
        "timed": timed,
        **res,
        "failed": failed,
        "not_bitwise": not_bitwise,
        "seconds": time.monotonic() - t0,
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str))
        print(f"\nJSON: {a.json}")
    parts = []
    for kind in ("ucp_save", "ucp_load"):
        e = res["exponents"].get(kind)
        if e:
            parts.append(
                f"{LABELS[kind]} exponents requests {_exp(e['requests'])} bytes {_exp(e['bytes'])} gathered "
                f"{_exp(e['gathered_bytes'])} per-rank {_exp(e['requests_per_rank_max'])}"
            )
    if ok:
        big = ok[-1]
        parts.append(
            f"N={big['n']} ucp/dcp time save {big['summary']['ucp_save']['ratio_to_dcp']:.2f}x load "
            f"{big['summary']['ucp_load']['ratio_to_dcp']:.2f}x"
        )
        if "idle" in big:
            parts.append(f"idle {big['idle']['requests_per_s']:.1f} req/s")
    met = sum(g["met"] for g in res["goals"].values())
    parts.append(f"goals {met}/{len(res['goals'])} met")
    if failed or not_bitwise:
        parts.append(f"FAILED: jobs {failed}, not bitwise at N={not_bitwise}")
    print("SCALE: " + "; ".join(parts))
    log(f"total {time.monotonic() - t0:.0f} s")
    if a.check_counts:
        problems = check_counts(jobs)
        gates = {
            c["kind"]: _watch_families(c["families"]).get("ADD /ucp_dcp/#/#/a/#", 0) // j["n"]
            for j in ok
            for c in j["calls"]
            if c["kind"].startswith("ucp") and c["rep"] == 0
        }
        for p in problems:
            print(f"  {p}")
        verdict = "OK" if not problems and not failed and not not_bitwise else "FAILED"
        print(f"SCALE COUNTS {verdict}: N={ns}, gates per call {gates}, {len(problems)} problem(s)")
        return 0 if verdict == "OK" else 1
    return 1 if failed or not_bitwise else 0


if __name__ == "__main__":
    sys.exit(main())
