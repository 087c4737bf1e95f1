"""A plan's answer for people (what fails, where the time goes) and for programs (JSON)."""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import UCPError
from ...planning.checkpoint_group import EXCHANGE_GATES, GATES, beat_s, call_requests
from .simulate import PlanReport, RankPlan

__all__ = ["Bandwidths", "parse_rate", "estimate", "format_report", "report_json", "rank_ranges"]

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_rate(text: str) -> float:
    """``"2GB/s"``, ``"800 MiB/s"``, ``"1.5e9"`` -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?(?:/s)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise UCPError(f"bandwidth {text!r}: expected a rate such as 2GB/s, 800MiB/s or 1.5e9")
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


@dataclass(frozen=True)
class Bandwidths:
    """Storage and network rates the estimate assumes (bytes per second)."""

    node: float | None = None
    """Storage read bandwidth of one node (``--bandwidth``)."""
    aggregate: float | None = None
    """Storage bandwidth shared by all nodes (``--aggregate-bandwidth``); None: nodes x ``node``."""
    network: float | None = None
    """Per-node network bandwidth for read-once transfers (``--network``); None: not counted."""
    requests: float | None = None
    """Requests per second one node's reads can get answered (``--request-rate``: an object store's
    ranged GETs, each a round trip); a node's reads then take at least its requests over this rate.
    None: reads cost only their bytes (a file system)."""


def estimate(report: PlanReport, bw: Bandwidths) -> dict[str, Any] | None:
    """Load-time estimate: storage reads bounded by the busiest node and by the aggregate rate,
    then read-once transfers into the node receiving most (reads and exchange run in sequence)."""
    if bw.node is None or not report.ranks:
        return None
    nodes: dict[int, list[RankPlan]] = {}
    for r in report.ranks:
        nodes.setdefault(r.node, []).append(r)
    node_bytes = {n: sum(r.bytes_read for r in rs) for n, rs in nodes.items()}
    node_recv = {n: sum(r.bytes_received for r in rs) for n, rs in nodes.items()}
    busiest = max(node_bytes, key=lambda n: (node_bytes[n], -n))
    total = sum(node_bytes.values())
    aggregate = bw.aggregate or bw.node * len(nodes)
    node_reads = {n: sum(r.reads for r in rs) for n, rs in nodes.items()}
    if bw.requests:  # a store: a node waits on its bytes or on its requests, whichever takes longer
        t_nodes = {n: max(node_bytes[n] / bw.node, node_reads[n] / bw.requests) for n in nodes}
        busiest = max(t_nodes, key=lambda n: (t_nodes[n], -n))
    t_node = max(node_bytes[busiest] / bw.node, node_reads[busiest] / bw.requests if bw.requests else 0.0)
    t_agg = total / aggregate
    recv_node = max(node_recv, key=lambda n: (node_recv[n], -n))
    t_net = node_recv[recv_node] / bw.network if bw.network else 0.0
    bound = "busiest node" if t_node >= t_agg else "aggregate storage bandwidth"
    if bw.requests and t_node >= t_agg and node_reads[busiest] / bw.requests > node_bytes[busiest] / bw.node:
        bound = "busiest node's requests"
    return {
        "seconds": max(t_node, t_agg) + t_net,
        "storage_seconds": max(t_node, t_agg),
        "bound_by": bound,
        "busiest_node": busiest,
        "busiest_node_bytes": node_bytes[busiest],
        "busiest_node_seconds": t_node,
        "busiest_node_ranks": [r.rank for r in nodes[busiest]],
        "total_bytes": total,
        "aggregate_seconds": t_agg,
        "aggregate_bandwidth": aggregate,
        "node_bandwidth": bw.node,
        "busiest_node_reads": node_reads[busiest],
        "request_rate": bw.requests,
        "network_seconds": t_net,
        "network_bandwidth": bw.network,
        "most_received_node": recv_node,
        "most_received_bytes": node_recv[recv_node],
    }


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, rs = [], sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _secs(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.1f} s"


def _spread(values: list[int], fmt: Any = str) -> str:
    return f"min {fmt(min(values))}, median {fmt(statistics.median_low(values))}, max {fmt(max(values))}"


_DEVICE_BASIS = {
    "--device": "",
    "target": "",
    "tensors": " (where the target's tensors are)",
    "assumed": " (assumed: the target's tensors are on the meta device; --device cpu plans a CPU job)",
}
"""What the report's first line says of where the state's device came from (:attr:`PlanReport.device_basis`)."""


def format_report(report: PlanReport, bw: Bandwidths = Bandwidths()) -> str:
    n = report.world_size
    nodes = -(-n // report.ranks_per_node)
    lines = [
        f"plan: {report.checkpoint} -> {report.target} ({n} ranks on {nodes} node(s) of {report.ranks_per_node}; "
        f"state on {report.device}{_DEVICE_BASIS[report.device_basis]}; read-once {report.read_once})",
        f"checkpoint integrity: {report.integrity}",
    ]
    if report.problems:
        lines.append(f"DOES NOT LOAD: {len(report.problems)} problem(s) a real load would raise")
        for k, p in enumerate(report.problems, 1):
            where = f"ranks {rank_ranges(p.ranks)}" if p.ranks else "every rank"
            lines.append(f"  [{k}] {p.error} ({p.where}, {where}):")
            lines += [f"      {line}" for line in p.message.splitlines()]
    else:
        lines.append("LOADS: every rank's plan validates (atoms, shapes, coverage, rules, param groups)")
    for w in report.warnings:
        lines.append(f"warning: {w.splitlines()[0]}")
    if report.ranks:
        rs = report.ranks
        slow = max(rs, key=lambda r: (r.bytes_read, r.reads, -r.rank))
        lines += [
            f"per rank: bytes read {_spread([r.bytes_read for r in rs], _mib)}",
            f"          reads {_spread([r.reads for r in rs])}; files {_spread([len(r.files) for r in rs])}",
            f"          received (read-once) {_spread([r.bytes_received for r in rs], _mib)}; "
            f"extra host memory <= {_mib(max(r.extra_host_bytes for r in rs))}",
            f"slowest rank: {slow.rank} (node {slow.node}): {_mib(slow.bytes_read)} in {slow.reads} reads from "
            f"{len(slow.files)} file(s); ranks reading as much: "
            f"{rank_ranges([r.rank for r in rs if r.bytes_read == slow.bytes_read])}",
            f"total: {_mib(sum(r.bytes_read for r in rs))} read from storage, "
            f"{_mib(sum(r.bytes_received for r in rs))} sent between ranks, "
            f"{len({f for r in rs for f in r.files})} file(s)",
        ]
        big = max(rs, key=lambda r: (r.plan_bytes, -r.rank))
        lines.append(
            f"gathered plans: the coordinator receives {_mib(report.gathered_plan_bytes)} of pickled local plans "
            f"in DCP's plan gather ({n} ranks; largest {big.plan_bytes / 2**10:.1f} KiB, rank {big.rank})"
        )
        lines += control_lines(report)
        sources: dict[str, list[int]] = {}
        for r in rs:
            if r.source is not None:
                sources.setdefault(r.source, []).append(r.rank)
        for src, ranks in sorted(sources.items(), key=lambda kv: kv[1][0]):
            lines.append(f"served by: ranks {rank_ranges(ranks)}: {src}")
        est = estimate(report, bw)
        if est is None:
            lines.append("estimated load time: give --bandwidth (per node, e.g. 2GB/s) for one")
        else:
            rate = f" and {est['request_rate']:g} requests/s" if est["request_rate"] else ""
            net = (
                f" + read-once transfers {_secs(est['network_seconds'])} (node {est['most_received_node']} "
                f"receives {_mib(est['most_received_bytes'])})"
                if est["network_bandwidth"]
                else ""
            )
            lines.append(
                f"estimated load time: {_secs(est['seconds'])}, bound by the {est['bound_by']}: node "
                f"{est['busiest_node']} (ranks {rank_ranges(est['busiest_node_ranks'])}) reads "
                f"{_mib(est['busiest_node_bytes'])} in {est['busiest_node_reads']} reads = "
                f"{_secs(est['busiest_node_seconds'])} at {est['node_bandwidth'] / 1e9:g} GB/s"
                f"{rate}; all nodes {_mib(est['total_bytes'])} = "
                f"{_secs(est['aggregate_seconds'])} at {est['aggregate_bandwidth'] / 1e9:g} GB/s{net}"
            )
    lines.append(
        f"planned in {report.seconds:.1f} s ({report.built} rank(s) built, {n - report.built} rebound), "
        f"peak memory {_mib(report.peak_memory)} (this process and its workers)"
    )
    return "\n".join(lines)


def control(report: PlanReport) -> dict[str, Any]:
    """The store requests the load would make besides DCP's collectives (which run on gloo): its gates
    (:data:`~ucp_dcp.planning.checkpoint_group.GATES`, two more when ranks send each other bytes) and what each
    costs (:func:`~ucp_dcp.planning.checkpoint_group.call_requests`, the model CI checks against real calls)."""
    n = report.world_size
    exchange = any(r.bytes_received for r in report.ranks)
    gates = GATES["load"] + (EXCHANGE_GATES if exchange else 0)
    requests = call_requests(n, gates)
    return {
        "gates": gates,
        "read_once_exchange": exchange,
        "requests": requests,
        "requests_total": sum(requests.values()),
        "requests_per_rank": sum(requests.values()) / n if n else 0.0,
        "beats_per_s_per_rank": 1 / beat_s(),
    }


def control_lines(report: PlanReport) -> list[str]:
    c = control(report)
    n = report.world_size
    kinds = ", ".join(f"{v} {k}" for k, v in c["requests"].items())
    return [
        f"control messages: {c['gates']} gates"
        + (" (2 of them the read-once exchange's)" if c["read_once_exchange"] else "")
        + f": {c['requests_total']} store requests ({c['requests_per_rank']:.1f} a rank: {kinds});",
        f"          while the call runs each rank beats {c['beats_per_s_per_rank']:g} times a second and at each "
        f"gate and step, and the coordinator reads the {n} beats once a second while it waits; nothing between "
        "calls; DCP's plan gather and scatter run on gloo, not through the store",
    ]


def report_json(report: PlanReport, bw: Bandwidths = Bandwidths()) -> dict[str, Any]:
    out = asdict(report)
    out["loads"] = report.loads
    out["estimate"] = estimate(report, bw)
    out["control"] = control(report)
    return out
