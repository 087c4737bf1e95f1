"""torch_checkpointing side by side with ucp_dcp and stock DCP (issue 34): the reconfiguration set's transitions,
each saved by every system from one trained toy job and loaded by it at the new layout. The fourth system,
``tc+ucp_dcp``, is torch_checkpointing's ``CheckpointManager`` with ucp_dcp's ``UCPResharder`` on every item
(``ucp_dcp.peers.torch_checkpointing``, docs/torch_checkpointing.md).

    python recipes/bench_torch_checkpointing.py [--only SUBSTRING] [--steps K] [--json FILE]

torch_checkpointing (PyPI ``torch_checkpointing``, Meta's, what torchtitan 0.3.0 moves to) runs as its docs
show: ``CheckpointManager`` with a synchronous saver and ``ItemSpec(resharder=DefaultResharder())`` for the
model and optimizer (two settings needed to run at all here: on a machine without CUDA its metadata exchange is patched to
gloo and its O_DIRECT default is turned off: ``ucp_dev.testing.peer_tc.tc_manager``); stock DCP as ``dcp.save``/``dcp.load`` with its default planners; ucp_dcp as
``ucp_dcp.save``/``load`` with the toy's declarations (``ucp_dev.toy.layouts.ucp_options``: stage/expert maps,
Fused, Padded, Reduce). Each load is judged against the oracle taken at the save (every logical entry, full,
bitwise): ``bitwise``, ``WRONG k/N`` (loaded without an error, k entries differ) or ``refused`` (an error, its
class named). Save and load seconds are the slowest rank's. ``--async`` adds the blocked time of each async
save (the time ``save`` holds the training loop) of a 4-rank FSDP2 state of ``--mib`` MiB.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ucp_dcp.progress import StepProgress
from ucp_dev.testing.checks import state_diffs
from ucp_dev.testing.elastic import RECONFIG_SET
from ucp_dev.testing.peer_tc import tc_manager
from ucp_dev.testing.processes import run_ranks
from ucp_dev.toy import ModelConfig, Topology, build_job
from ucp_dev.toy.layouts import trainer_options
from ucp_dev.toy.parallel import build_trainer, logical_state, train_step

SYSTEMS = ("ucp_dcp", "dcp", "torch_checkpointing", "tc+ucp_dcp")
UCP_ITEMS = ("model", "optim", "train_state")
"""tc+ucp_dcp: torch_checkpointing's CheckpointManager with ucp_dcp's UCPResharder on every item."""


def _tc_manager(sync: bool = True, keys: tuple[str, ...] = ("model", "optim"), resharder=None):
    return tc_manager(resharder, sync=sync, keys=keys)


def _ucp_resharder(cfg, tr):
    from ucp_dcp.peers.torch_checkpointing import UCPResharder

    return UCPResharder(**trainer_options(cfg, tr))


def _slowest(dt: float, group) -> float:
    t = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _any(flag: bool, group) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t)


def _first_line(e: BaseException) -> str:
    from ucp_dcp.errors import first_ucp_error

    inner = first_ucp_error(e) or e
    failures = getattr(e, "failures", None)
    if inner is e and isinstance(failures, dict) and failures:
        f = next(iter(failures.values()))
        inner = f[0] if isinstance(f, tuple) else f
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0][:160] if text else ''}"


def _save_rank(rank: int, world: int, topo: str, root: str, steps: int) -> dict:
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    job = build_job(Topology.parse(topo))
    cfg = ModelConfig()
    tr = build_trainer(cfg, job, seed=0)
    for _ in range(steps):
        train_step(tr)
    out: dict = {}
    for system in SYSTEMS:
        path = f"{root}/{system}"
        err, t0 = None, time.perf_counter()
        try:
            if system == "ucp_dcp":
                import ucp_dcp

                ucp_dcp.save(tr.state_dict(), path, process_group=job.group, **trainer_options(cfg, tr))
            elif system == "dcp":
                dcp.save(tr.state_dict(), checkpoint_id=path, process_group=job.group)
            else:
                mgr = (
                    _tc_manager()
                    if system == "torch_checkpointing"
                    else _tc_manager(keys=UCP_ITEMS, resharder=_ucp_resharder(cfg, tr))
                )
                mgr.save(path, tr.state_dict())
                mgr.close()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            err = _first_line(e)
        dt = _slowest(time.perf_counter() - t0, job.group)
        out[system] = {"save_s": dt, "save_error": err if _any(err is not None, job.group) else None}
    oracle = logical_state(tr)
    if dist.get_rank(job.group) == 0:
        torch.save(oracle, f"{root}/oracle.pt")
    return out


def _load_rank(rank: int, world: int, topo: str, root: str, saved: dict) -> dict:
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    job = build_job(Topology.parse(topo))
    cfg = ModelConfig()
    oracle = torch.load(f"{root}/oracle.pt", weights_only=False)
    out: dict = {}
    for system in SYSTEMS:
        if saved[system]["save_error"]:
            out[system] = {"verdict": "save refused", "load_s": None}
            continue
        tr = build_trainer(cfg, job, seed=1)  # another init: every value must come from the checkpoint
        sd = tr.state_dict()
        path = f"{root}/{system}"
        err, t0 = None, time.perf_counter()
        try:
            if system == "ucp_dcp":
                import ucp_dcp

                ucp_dcp.load(sd, path, process_group=job.group, **trainer_options(cfg, tr))
            elif system == "dcp":
                dcp.load(sd, checkpoint_id=path, process_group=job.group)
            else:
                mgr = (
                    _tc_manager()
                    if system == "torch_checkpointing"
                    else _tc_manager(keys=UCP_ITEMS, resharder=_ucp_resharder(cfg, tr))
                )
                sd = dict(mgr.load(path, into=sd))
                mgr.close()
            tr.load_state_dict(sd)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            err = _first_line(e)
        dt = _slowest(time.perf_counter() - t0, job.group)
        errs = [None] * dist.get_world_size(job.group)
        dist.all_gather_object(errs, err, group=job.group)
        first = next((e for e in errs if e), None)
        if first:
            out[system] = {"verdict": f"refused ({first})", "load_s": dt}
            continue
        diffs = state_diffs(oracle, logical_state(tr))
        verdict = "bitwise" if not diffs else f"WRONG {len(diffs)}/{len(oracle)}"
        out[system] = {"verdict": verdict, "load_s": dt, "wrong": diffs[:6]}
    return out


def _transitions(only: str) -> list[tuple[str, str]]:
    return [(s, lo) for s, lo in RECONFIG_SET if only in f"{s} -> {lo}"]


def matrix(a: argparse.Namespace) -> list[dict]:
    rows = []
    print(f"{'save -> load':<34}" + "".join(f"{s:>30}" for s in SYSTEMS), flush=True)
    todo = _transitions(a.only)
    progress = StepProgress("bench_torch_checkpointing", len(todo), "transitions")  # stderr, on a terminal
    for save, load in todo:
        with tempfile.TemporaryDirectory(prefix="ucp-tc-") as root:
            st, lt = Topology.parse(save), Topology.parse(load)
            saved = run_ranks(_save_rank, st.world, save, root, a.steps)[0]
            loaded = run_ranks(_load_rank, lt.world, load, root, saved)[0]
        row = {"save": save, "load": load, "systems": {s: {**saved[s], **loaded[s]} for s in SYSTEMS}}
        rows.append(row)
        cells = []
        for s in SYSTEMS:
            r = row["systems"][s]
            verdict = r["verdict"].split(" (")[0]
            t = f"{r['save_s']:.2f}/{r['load_s']:.2f}s" if r["load_s"] is not None else ""
            cells.append(f"{verdict} {t}".strip())
        print(f"{save + ' -> ' + load:<34}" + "".join(f"{c:>30}" for c in cells), flush=True)
        progress(f"{save} -> {load}")
    for row in rows:
        for s in SYSTEMS:
            r = row["systems"][s]
            if r["verdict"] != "bitwise":
                extra = f"; e.g. {', '.join(r.get('wrong') or [])}" if r.get("wrong") else ""
                print(f"  {row['save']} -> {row['load']} {s}: {r['verdict']}{r.get('save_error') or ''}{extra}")
    return rows


# -- async: how long each save holds the training loop ----------------------------------------------------------


def _async_rank(rank: int, world: int, root: str, mib: int) -> dict:
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ucp_dcp

    mesh = init_device_mesh("cpu", (world,))
    rows = mib * 2**20 // 4 // 1024
    sd = {"model": {f"w{i}": distribute_tensor(torch.randn(rows // 8, 1024), mesh, [Shard(0)]) for i in range(8)}}
    group = dist.new_group(backend="gloo")
    out = {}
    for system in SYSTEMS:
        mgr = None  # torch_checkpointing's writer process starts here
        if system == "torch_checkpointing":
            mgr = _tc_manager(sync=False, keys=("model",))
        elif system == "tc+ucp_dcp":
            from ucp_dcp.peers.torch_checkpointing import UCPResharder

            mgr = _tc_manager(sync=False, keys=("model",), resharder=UCPResharder())
        for rep in range(2):  # the second save is reported: the first starts pools, processes and caches
            path = f"{root}/async-{system}-{rep}"
            dist.barrier()
            t0 = time.perf_counter()
            if system == "ucp_dcp":
                fut = ucp_dcp.async_save(sd, path, process_group=group)
            elif system == "dcp":
                fut = dcp.async_save(sd, checkpoint_id=path, process_group=group)
            else:
                assert mgr is not None
                fut = mgr.save(path, sd)
            blocked = time.perf_counter() - t0
            try:
                fut.result()
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                out[system] = {"error": _first_line(e)}
                break
            total = time.perf_counter() - t0
            out[system] = {"blocked_s": _slowest(blocked, None), "total_s": _slowest(total, None)}
        if mgr is not None:
            mgr.close()
    return out


def async_figures(a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="ucp-tc-async-") as root:
        res = run_ranks(_async_rank, 4, root, a.mib)[0]
    print(f"\nasync save, {a.mib} MiB FSDP2 state on 4 ranks: blocked (save call) / total (until durable)")
    for s, r in res.items():
        if "error" in r:
            print(f"  {s:<22} failed: {r['error']}")
        else:
            print(f"  {s:<22} blocked {r['blocked_s']:.3f} s   total {r['total_s']:.3f} s")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="transitions whose 'save -> load' text contains this")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--async", dest="async_", action="store_true", help="also the async save's blocked time")
    ap.add_argument("--no-matrix", action="store_true", help="only the async figures")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch_checkpointing

    print(f"torch {torch.__version__}, torch_checkpointing {torch_checkpointing.__version__}, {os.cpu_count()} CPUs")
    out: dict = {"torch": torch.__version__, "torch_checkpointing": str(torch_checkpointing.__version__)}
    if not a.no_matrix:
        out["matrix"] = matrix(a)
    if a.async_ or a.no_matrix:
        out["async"] = async_figures(a)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
