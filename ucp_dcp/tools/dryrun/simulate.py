"""``plan_load``: run a load's planning for every rank of a target job, on this machine's CPUs.

For each rank (:mod:`.ranks`; runs of ranks side by side in forked workers, :mod:`.workers`): its state dict
(built, or rebound from its class's representative), the real ``UCPLoadPlanner`` set-up, validation and
local plan, and the reader's read-once summary; then the coordinator's global checks and read-once
assignment over all ranks, and per rank what the reader would request from storage
(:mod:`ucp_dcp.tools.dryrun.read_cost`) and what its plan adds to the coordinator's plan gather. No tensor
memory is allocated for targets, no byte of tensor data is read, no process group talks to anyone."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlan

from ...errors import MissingFileError, TruncatedFileError, UCPError
from ...planning.device import STAGE_BYTES, staging_forced
from ...planning.opened import checked
from ...planning.payloads import ReadOnceMode
from ...storage.file_ranges import REMOTE_GAP, StoreRanges, reading_threads
from ...storage.format import check_tables
from ...storage.opening import open_path
from ...storage.staging import BUFFERS_PER_THREAD
from ...storage.transport import plan_transport
from .ranks import Problem, Ranks, problem_of
from .read_cost import CostModel, Piece
from .targets import Target
from .workers import Split, plan_workers

__all__ = ["RankPlan", "Problem", "PlanReport", "plan_load"]


@dataclass
class RankPlan:
    """One target rank's part of the load."""

    rank: int
    node: int
    """``rank // ranks_per_node``."""
    read_items: int = 0
    """Read items the planner made (after cuts for staging)."""
    bytes_read: int = 0
    """Bytes this rank requests from storage (as ``ReadStats.bytes_read``)."""
    reads: int = 0
    """Read calls (as ``ReadStats.ranges``)."""
    files: list[str] = field(default_factory=list)
    """Data files it opens."""
    bytes_received: int = 0
    """Bytes other ranks read for it and send (read-once), as ``ReadStats.bytes_received``."""
    bytes_sent: int = 0
    """Bytes it sends to other ranks (each consumer counted)."""
    fallbacks: int = 0
    """Items read whole (as ``ReadStats.fallbacks``)."""
    items: list[str] | None = None
    """Storage items (``fqn|offsets``) it reads bytes of (as ``set(ReadStats.items)``); only with
    ``plan_load(..., keep_items=True)``."""
    extra_host_bytes: int = 0
    """Upper bound of the host memory the load needs besides the targets: staging buffers (device
    targets), the largest merged read buffer per reading thread, kept copies of bytes it sends,
    and the largest bundle it receives."""
    source: str | None = None
    """Planned on a memory-tier root: the tier serving this rank (:mod:`.memory_source`)."""
    plan_bytes: int = 0
    """Its local plan in DCP's plan gather: the plan ``UCPFileSystemReader.prepare_local_plan`` returns,
    pickled as ``gather_object`` pickles it (what the coordinator receives from this rank)."""


@dataclass
class PlanReport:
    """The answer: loads or not, every problem, and what each rank will read."""

    checkpoint: str
    target: str
    world_size: int
    problems: list[Problem] = field(default_factory=list)
    ranks: list[RankPlan] = field(default_factory=list)
    integrity: str = "none"
    """``verified`` | ``partial`` | ``none`` (what the checkpoint's checksums cover)."""
    read_once: ReadOnceMode = "hosts"
    ranks_per_node: int = 8
    device: str = "cuda"
    device_basis: str = "--device"
    """Where :attr:`device` comes from: ``--device``, ``target`` (it declares it), ``tensors`` (those the target
    built are there) or ``assumed`` (they are on the meta device: a GPU job is assumed)."""
    built: int = 0
    """Ranks whose state dict was built by the target's own code (the others were rebound)."""
    seconds: float = 0.0
    peak_memory: int = 0
    """Peak resident memory of the planning process (``ru_maxrss``, whole process), bytes."""
    warnings: list[str] = field(default_factory=list)
    gathered_plan_bytes: int = 0
    """The coordinator's gathered plans: every rank's :attr:`RankPlan.plan_bytes` (what rank 0 receives in
    DCP's plan gather for this load)."""

    @property
    def loads(self) -> bool:
        return not self.problems


def _merge(problems: list[Problem]) -> list[Problem]:
    """Problems with the same error and text become one, with all their ranks."""
    out: dict[tuple[str, str, str], Problem] = {}
    for p in problems:
        key = (p.error, p.message, p.where)
        if key in out:
            out[key].ranks += p.ranks
        else:
            out[key] = Problem(p.error, p.message, list(p.ranks), p.where)
    return list(out.values())


def plan_load(
    checkpoint: str | os.PathLike,
    target: Target,
    *,
    read_once: ReadOnceMode = "hosts",
    ranks_per_node: int = 8,
    device: str | None = None,
    check_symmetry: bool = True,
    trust: bool = False,
    verify_checksums: bool = True,
    thread_count: int | None = None,
    allow_partial_load: bool = False,
    allow_lossy_dtype: bool = False,
    keep_items: bool = False,
    progress: Callable[[int, int], None] | None = None,
    store_ranges: StoreRanges = "few",
    workers: int | None = None,
) -> PlanReport:
    """Plan the load of ``checkpoint`` into every rank of ``target`` (see the module docstring).

    ``read_once``, ``thread_count``, ``verify_checksums``, ``allow_*``, ``trust`` and ``store_ranges`` are the
    load's own settings (``UCPLoadPlanner`` / ``UCPFileSystemReader``); ``device`` is where the job's
    state lives (``cuda``: reads are cut to staging buffers; ``cpu``: read in place; None: the target's
    ``device``, else where rank 0's built tensors are, else ``cuda``: :attr:`PlanReport.device_basis` says which);
    ``ranks_per_node`` places ranks on hosts (read-once only sends across hosts by default);
    ``thread_count`` None: the reader's own choice for ``ranks_per_node`` ranks on this machine's cores.
    ``workers``: processes planning runs of ranks side by side (:mod:`.workers`; None: one per 256 ranks up
    to the cores this process may use, or ``UCP_DCP_PLAN_WORKERS``); the answer does not depend on it."""
    t0 = time.perf_counter()
    if thread_count is None:
        thread_count = reading_threads(local_ranks=ranks_per_node)
    report = PlanReport(
        str(checkpoint),
        target.name,
        target.world_size,
        read_once=read_once,
        ranks_per_node=ranks_per_node,
        device=device or "",
    )
    try:
        _plan(
            report,
            checkpoint,
            target,
            check_symmetry,
            trust,
            verify_checksums,
            thread_count,
            allow_partial_load,
            allow_lossy_dtype,
            keep_items,
            progress,
            REMOTE_GAP if store_ranges == "few" else 0,
            workers,
        )
    finally:
        # this process and its workers (:mod:`.workers`; each at most what this one held when it forked, plus its ranks)
        peak = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        )
        report.peak_memory = peak * 1024
        report.seconds = time.perf_counter() - t0
    return report


def _plan(
    report: PlanReport,
    checkpoint: Any,
    target: Target,
    check_symmetry: bool,
    trust: bool,
    verify: bool,
    threads: int,
    allow_partial_load: bool,
    allow_lossy_dtype: bool,
    keep_items: bool,
    progress: Callable[[int, int], None] | None,
    store_gap: int = REMOTE_GAP,
    workers: int | None = None,
) -> None:
    try:
        md, integrity = open_path(checkpoint, trust=trust)
        check_tables(md)
    except UCPError as e:
        report.problems.append(problem_of(e, None, "open"))
        return
    report.integrity = integrity.status
    md = checked(md, integrity.status)  # as UCPFileSystemReader hands it to the planner
    # checks a target's job makes before dcp.load (torchtitan's dataloader policy), raised on every rank
    preflight = getattr(target, "preflight", None)
    if preflight is not None:
        try:
            errors = list(preflight(md))
        except UCPError as e:
            errors = [e]
        report.problems += [problem_of(e, None, "preflight") for e in errors]
    n, rpn = target.world_size, report.ranks_per_node
    try:
        classes = [target.symmetry(r) for r in range(n)]
    except UCPError as e:
        report.problems.append(problem_of(e, None, "target"))
        return
    ranks = Ranks(report, md, target, classes, check_symmetry, trust, allow_partial_load, allow_lossy_dtype)
    model = CostModel(md, str(checkpoint), verify=verify, local_files="://" not in str(checkpoint), store_gap=store_gap)
    staged = staging_forced() or report.device != "cpu"

    def finish(r: int, transport: Any) -> RankPlan:
        summary = ranks.summaries[r]
        sizes = summary.sizes if summary is not None else None
        return _rank_plan(r, rpn, ranks.reads.pop(r), sizes, transport, model, threads, staged, keep_items)

    split = Split(n, plan_workers(n, workers), ranks.plan, finish, progress)
    try:
        outs = split.planned()
        local = [o.problem for o in outs if o.problem is not None]
        for o in outs:
            report.built += o.built
            report.warnings += [w for w in o.warnings if w not in report.warnings]
        if local:
            report.problems += _merge(local)
            return
        assert ranks.coordinator is not None
        try:
            ranks.coordinator.create_global_plan([LoadPlan([], planner_data=o.payload) for o in outs])
        except UCPError as e:
            report.problems.append(problem_of(e, None, "global plan"))
            return
        report.ranks = split.finish(plan_transport([o.summary for o in outs]))
    finally:
        split.close()
    touched: set[str] = set()
    for o, rp in zip(outs, report.ranks):
        rp.plan_bytes = o.plan_bytes
        touched.update(rp.files)
    report.gathered_plan_bytes = sum(o.plan_bytes for o in outs)
    report.problems += _file_problems(checkpoint, touched, integrity)


def _rank_plan(
    r: int,
    rpn: int,
    items: list[Piece],
    sizes: Any,
    transport: Any,
    model: CostModel,
    threads: int,
    staged: bool,
    keep_items: bool,
) -> RankPlan:
    recv = {int(i) for msgs in transport.recv.values() for pieces_ in msgs for i in pieces_}
    own = [it for i, it in enumerate(items) if i not in recv]
    cost = model.cost(own)
    sizes = [int(x) for x in sizes] if sizes is not None else [0] * len(items)
    received = sum(sizes[i] for i in recv)
    biggest_in = max((sum(sizes[int(i)] for i in ps) for msgs in transport.recv.values() for ps in msgs), default=0)
    sent_kept = sum(sum(sizes[int(i)] for i in ps) for ps, _ in transport.send)
    sent = sum(sum(sizes[int(i)] for i in ps) * len(dsts) for ps, dsts in transport.send)
    n_staged = sum(1 for it in own if it[1] is not None) if staged else 0
    staging = min(n_staged, BUFFERS_PER_THREAD * max(1, threads)) * STAGE_BYTES
    # reading tasks are files or runs of whole chunks of one: at most one buffer per chunk in flight
    extra = staging + cost.largest_buffer * min(threads, max(1, len(cost.items))) + sent_kept + biggest_in
    return RankPlan(
        r,
        r // rpn,
        len(items),
        cost.bytes_read,
        cost.ranges,
        sorted(cost.files),
        received,
        sent,
        cost.fallbacks,
        sorted(cost.items) if keep_items else None,
        extra,
    )


def _file_problems(checkpoint: Any, files: set[str], integrity: Any) -> list[Problem]:
    """Data files the load needs that are missing or of the wrong size (the reader would stop there)."""
    if "://" in str(checkpoint):
        return []
    out = []
    sizes = integrity.files or {}
    for rel in sorted(files):
        p = os.path.join(str(checkpoint), rel)
        if not os.path.exists(p):
            out.append(
                Problem(MissingFileError.__name__, f"checkpoint file {rel} is missing from {checkpoint}", [], "files")
            )
        elif rel in sizes and os.path.getsize(p) != sizes[rel]:
            have = os.path.getsize(p)
            out.append(
                Problem(
                    TruncatedFileError.__name__,
                    f"checkpoint file {rel} has {have} bytes, {sizes[rel]} were written",
                    [],
                    "files",
                )
            )
    return out
