"""Elastic resume: train at one parallel layout, save with ucp_dcp, resume at another.

    python recipes/elastic_resume.py --save-topology dp=4 --load-topology dp=2 [--steps K] [--out DIR]

Topologies take ``pp=,dp=,ep=,tp=`` (and ``vpp=`` model chunks per pipeline rank for interleaved
schedules); missing keys default to 1 and the world size is their product. The save job (its own
processes) trains K steps, saves with ``UCPSavePlanner``, writes an oracle of every *logical*
parameter and optimizer entry (unfused, unpadded, global names) with plain ``torch.save`` (no
ucp_dcp code), and continues to step 2K as the uninterrupted reference. The load job (fresh
processes, another world size) loads with ``UCPLoadPlanner``, checks the loaded state bitwise
against the oracle, trains to step 2K and compares losses. The last line is ``RESUME OK: ...``
(exit 0) or ``RESUME MISMATCH: ...`` (exit 1).

Under torchrun (which cannot change the world size) run one phase per launch:
``torchrun --nproc-per-node 4 recipes/elastic_resume.py --phase save ...`` then ``--phase load``. The phases
and the verdict are ``ucp_dev.testing.elastic``'s, the ones the multi-process tests run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ucp_dev.testing.checks import loss_note, state_diffs
from ucp_dev.testing.elastic import load_phase, resume_problems, resume_rels, save_phase
from ucp_dev.testing.processes import RanksFailed, run_ranks
from ucp_dev.toy import Topology, build_job


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--save-topology",
        default="dp=4",
        help="e.g. dp=4 or dp=2,tp=2,pp=2 (keys pp, dpr (HSDP replicas), dp, ep, tp, vpp)",
    )
    ap.add_argument("--load-topology", default="dp=2")
    ap.add_argument("--steps", type=int, default=4, help="K: steps before the save, and after the resume")
    ap.add_argument("--out", default=None, help="output folder (default runs/elastic_resume/<save>_to_<load>)")
    ap.add_argument(
        "--storage",
        choices=["ucp", "dcp"],
        default="ucp",
        help="storage: ucp_dcp's ranged, checksummed, read-once writer/reader, or DCP's stock ones",
    )
    ap.add_argument(
        "--phase",
        choices=["save", "load", "all"],
        default="all",
        help="run one phase in the current process group (torchrun), or both in spawned processes",
    )
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="where the checkpoint goes: a folder or an object-store URL (s3://bucket/run; default OUT/ckpt)",
    )
    ap.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)  # test hook: flip one loaded element
    a = ap.parse_args(argv)
    a.save_topo, a.load_topo = Topology.parse(a.save_topology), Topology.parse(a.load_topology)
    if a.out is None:
        tag = f"{a.save_topo}_to_{a.load_topo}".replace(",", "_").replace("=", "")
        a.out = str(Path("runs") / "elastic_resume" / tag)
    return a


def _phase(a: argparse.Namespace, phase: str) -> None:
    """One phase on this process group (every rank); the job's first rank writes its figures to ``--out``."""
    torch.set_num_threads(1)
    # the oracle's full_tensor() of FSDP x TP weights logs a performance warning per call
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    topo = a.save_topo if phase == "save" else a.load_topo
    if dist.get_world_size() != topo.world:
        raise SystemExit(f"--phase {phase} needs {topo.world} processes for {topo}, got {dist.get_world_size()}")
    job = build_job(topo)
    out, lead = Path(a.out), dist.get_rank(job.group) == 0
    if phase == "save":
        oracle, losses = save_phase(job, a.out, a.steps, a.storage, checkpoint=a.checkpoint)
        if lead:
            torch.save(oracle, out / "oracle.pt")
            (out / "save.json").write_text(json.dumps({"topology": str(job.topo), "losses": losses}))
        return
    r = load_phase(job, a.out, a.steps, a.storage, corrupt=a.corrupt, checkpoint=a.checkpoint)
    if lead:
        diffs = state_diffs(torch.load(out / "oracle.pt", weights_only=False), r["loaded"])
        figures = {"losses": r["resumed"], "state_diffs": diffs, "entries": len(r["loaded"]), "io": r["io"]}
        (out / "load.json").write_text(json.dumps({"topology": str(job.topo), **figures}))


def _phase_on_ranks(rank: int, world: int, a: argparse.Namespace, phase: str) -> None:
    _phase(a, phase)


def report(a: argparse.Namespace) -> int:
    """The loss table, the plot and the verdict line from the two phases' files."""
    out = Path(a.out)
    saved = json.loads((out / "save.json").read_text())
    loaded = json.loads((out / "load.json").read_text())
    k = a.steps
    r = {
        "save": saved["topology"],
        "load": loaded["topology"],
        "reference": saved["losses"],
        "resumed": loaded["losses"],
        "state_diffs": loaded["state_diffs"],
        "entries": loaded["entries"],
    }
    rels = resume_rels(r, k)
    print(f"\nelastic resume: save {r['save']} -> load {r['load']}, K={k} ({out})")
    print(f"{'step':>5} {'reference':>14} {'resumed':>14} {'rel diff':>10}")
    for i, ref in enumerate(r["reference"], start=1):
        if i <= k:
            print(f"{i:>5} {ref:>14.8f} {'':>14} {'':>10}")
        else:
            print(f"{i:>5} {ref:>14.8f} {r['resumed'][i - k - 1]:>14.8f} {rels[i - k - 1]:>10.2e}")
    _plot(out, saved, loaded, k)
    problems = resume_problems(r, k)
    if problems:
        print(f"RESUME MISMATCH: {r['save']} -> {r['load']}: " + "; ".join(problems))
        return 1
    io_stats = loaded.get("io")
    if io_stats:
        print(
            f"I/O: {io_stats['bytes_read'] / 1e6:.2f} MB read from storage, {io_stats['bytes_received'] / 1e6:.2f} MB "
            f"received from the rank that read them; {io_stats['items']} saved items, "
            f"{io_stats['items_read_by_several_ranks']} read (in parts) by several ranks, "
            f"{io_stats['items_read_on_several_hosts']} on several of {io_stats['hosts']} host(s)"
        )
    same = "losses bitwise equal" if r["save"] == r["load"] else loss_note(rels, k + 1, 2 * k)
    print(f"RESUME OK: {r['save']} -> {r['load']}: {r['entries']} state entries bitwise equal, {same}")
    return 0


def _plot(out: Path, saved: dict, loaded: dict, k: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a convenience; the verdict does not depend on it
        print("(matplotlib not installed: no plot)")
        return
    ref = saved["losses"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(ref) + 1), ref, "o-", label=f"uninterrupted ({saved['topology']})")
    ax.plot(range(k + 1, 2 * k + 1), loaded["losses"], "x--", label=f"resumed ({loaded['topology']})")
    ax.axvline(k + 0.5, color="gray", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    print(f"plot: {out / 'loss.png'}")


def main(argv: list[str] | None = None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    phases = ["save", "load"] if a.phase == "all" else [a.phase]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun: one phase, this group
        if a.phase == "all":
            raise SystemExit("under torchrun pass --phase save or --phase load (the world size cannot change)")
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        _phase(a, a.phase)
        dist.barrier()
        dist.destroy_process_group()
        if a.phase == "save" or int(os.environ["RANK"]) != 0:
            return 0
    else:
        for phase in phases:
            try:
                run_ranks(_phase_on_ranks, (a.save_topo if phase == "save" else a.load_topo).world, a, phase)
            except RanksFailed as e:
                raise SystemExit(f"{phase} phase failed: {e}") from None
        if "load" not in phases:
            return 0
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
