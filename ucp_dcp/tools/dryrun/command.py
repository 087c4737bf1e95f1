"""``python -m ucp_dcp plan CKPT --target ...`` (also ``ucp-dcp plan``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ...errors import UCPError
from ...progress import RankProgress, set_enabled

__all__ = ["add_parser", "run"]

_TARGETS = """targets:
  titan             a torchtitan job: --module, --config and the Trainer's own parallelism flags
                    after the known options (e.g. --parallelism.data_parallel_shard_degree 64)
  pkg.mod:fn        your job: fn(rank, world_size) returns the state dict that rank loads
                    (or (state_dict, UCPLoadPlanner options)); needs --world-size"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="will CKPT load at a target layout, and what will the load cost? (no GPUs, no ranks)",
        description="Plan the load of a checkpoint into every rank of a target job, in this process: "
        "every problem a real load would raise, and per rank the bytes, reads and files.",
        epilog=_TARGETS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "checkpoint",
        help="checkpoint folder, an fsspec URL (s3://bucket/run: AWS_* configuration), or a memory-tier root "
        "(host-*/gen-* folders): then the generation a restart would load is planned and each rank's serving tier "
        "reported",
    )
    p.add_argument(
        "--hosts",
        help="memory root: the target's host of each node, comma-separated (a name with no folder under the root is "
        "a fresh, empty host); default: the root's hosts in name order",
    )
    p.add_argument("--durable", help="memory root: the tier's durable folder (drained generations)")
    p.add_argument("--target", required=True, help="titan | package.module:function (see below)")
    p.add_argument("--world-size", type=int, help="function target: ranks of the job")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks per host (default 8)")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="where the job's state lives (cuda: reads cut to 16 MiB staging buffers); default: the target's "
        "plan_device, else where the tensors it builds are, else cuda (built on the meta device)",
    )
    p.add_argument(
        "--read-once",
        choices=("hosts", "ranks", "off"),
        default="hosts",
        help="the load's read_once setting (default hosts)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="the reader's thread_count (default: its own choice from the cores)"
    )
    p.add_argument("--bandwidth", help="storage read bandwidth per node, e.g. 2GB/s: gives a load-time estimate")
    p.add_argument(
        "--aggregate-bandwidth", help="storage bandwidth of all nodes together (default: nodes x --bandwidth)"
    )
    p.add_argument("--network", help="per-node network bandwidth for read-once transfers (default: not counted)")
    p.add_argument(
        "--request-rate",
        type=float,
        help="object stores: ranged GETs per second one node gets answered, e.g. 5500 (S3's documented GET rate per "
        "prefix): a node's reads then take at least its requests / this rate (default: bytes only)",
    )
    p.add_argument(
        "--store-ranges",
        choices=("few", "exact"),
        default="few",
        help="object stores: the reader's store_ranges (few, its default: gaps under 1 MiB fetched too; exact: "
        "the bytes needed, a request per saved row of a column slice)",
    )
    p.add_argument("--allow-partial-load", action="store_true", help="as UCPLoadPlanner(allow_partial_load=True)")
    p.add_argument("--allow-lossy-dtype", action="store_true", help="as UCPLoadPlanner(allow_lossy_dtype=True)")
    p.add_argument("--trust", action="store_true", help="open the checkpoint's metadata without the allow-list")
    p.add_argument(
        "--no-check-symmetry",
        action="store_true",
        help="do not build one extra rank per class of ranks to check the rebinding",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ranks planned so far on stderr, after 2 s (default: when stderr is a terminal; UCP_DCP_PROGRESS=0/1)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes planning ranks side by side (default: one per 256 ranks up to this machine's cores, or "
        "UCP_DCP_PLAN_WORKERS; 1: this process only); the answer does not depend on it",
    )
    p.add_argument("--json", metavar="OUT", help="also write the full report (every rank) as JSON to OUT ('-': stdout)")
    return p


def _target(a: argparse.Namespace, extra: list[str]) -> Any:
    from .targets import FunctionTarget, load_function

    if a.target == "titan":
        from ...torchtitan.plan_target import TitanTarget

        return TitanTarget.from_args(extra, world_size=a.world_size)
    _no_extra(extra)
    if not a.world_size or a.world_size < 1:
        raise UCPError(f"--target {a.target}: give the job's --world-size")
    return FunctionTarget(load_function(a.target), a.world_size, name=a.target)


def _no_extra(extra: list[str]) -> None:
    if extra:
        raise UCPError(f"unrecognized arguments: {' '.join(extra)}")


def _progress(option: bool | None) -> RankProgress | None:
    """The plan's per-rank progress printer, or None when progress is off."""
    if option is not None:
        set_enabled(option)
    printer = RankProgress("plan")
    return printer if printer.on else None


def run(a: argparse.Namespace, extra: list[str]) -> int:
    """0: loads; 1: a real load would fail (problems listed); 2: bad arguments or unreadable checkpoint."""
    from .memory_source import annotate, is_memory_root, open_view
    from .report import Bandwidths, parse_rate

    try:
        bw = Bandwidths(*(parse_rate(x) if x else None for x in (a.bandwidth, a.aggregate_bandwidth, a.network)))
        if a.request_rate is not None:
            if a.request_rate <= 0:
                raise UCPError(f"--request-rate {a.request_rate:g}: expected requests per second > 0")
            bw = dataclasses.replace(bw, requests=a.request_rate)
        target = _target(a, extra)
    except UCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hosts = [h for h in (a.hosts or "").split(",") if h] or None
    if not is_memory_root(a.checkpoint):
        return _printed(_plan(a, target, a.checkpoint), a, bw)
    try:  # a memory-tier root: the generation a restart on these hosts would load
        view = open_view(a.checkpoint, a.durable, hosts)
    except UCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if view.tier == "memory":
        a.read_once = "off"  # as MemoryReader loads: a host's missing fragments come from its peers instead
    with view:
        report = _plan(a, target, view.path)
    annotate(report, view, hosts)
    report.warnings += [f"memory root: passed over {n}" for n in view.notes]
    return _printed(report, a, bw)


def _plan(a: argparse.Namespace, target: Any, path: str) -> Any:
    from .simulate import plan_load

    return plan_load(
        path,
        target,
        read_once=a.read_once,
        ranks_per_node=a.ranks_per_node,
        device=a.device,
        check_symmetry=not a.no_check_symmetry,
        trust=a.trust,
        thread_count=a.threads,
        allow_partial_load=a.allow_partial_load,
        allow_lossy_dtype=a.allow_lossy_dtype,
        progress=_progress(a.progress),
        store_ranges=a.store_ranges,
        workers=a.workers,
    )


def _printed(report: Any, a: argparse.Namespace, bw: Any) -> int:
    from .report import format_report, report_json

    if a.json == "-":
        print(json.dumps(report_json(report, bw), indent=1, default=str))
    else:
        print(format_report(report, bw))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report_json(report, bw), f, indent=1, default=str)
    if any(p.where == "open" for p in report.problems):
        return 2
    return 0 if report.loads else 1
