"""``plan_load``: run a load's planning for every rank of a target job in one CPU process.

For each rank: its state dict (built, or rebound from its class's representative), the real
``UCPLoadPlanner`` set-up, validation and local plan, and the reader's read-once summary; then the
coordinator's global checks and read-once assignment over all ranks, and per rank what the reader
would request from storage (:mod:`ucp_dcp.tools.dryrun.read_cost`). No tensor memory is allocated for
targets, no byte of tensor data is read, no process group talks to anyone."""

from __future__ import annotations

import os
import resource
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ...errors import MissingFileError, TruncatedFileError, UCPError
from ...planning.device import STAGE_BYTES, staging_forced
from ...planning.load_planner import UCPLoadPlanner
from ...planning.opened import checked
from ...planning.payloads import ReadOnceMode, ReadSummary
from ...storage.file_ranges import REMOTE_GAP, StoreRanges
from ...storage.format import check_tables
from ...storage.opening import open_path
from ...storage.staging import BUFFERS_PER_THREAD
from ...storage.threads import reading_threads
from ...storage.transport import plan_transport, read_summary
from .read_cost import CostModel, Piece, pieces
from .targets import Target
from .world import fake_rank, rebind, structure

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


@dataclass
class Problem:
    """An error a real load would raise, and the ranks it would raise on."""

    error: str
    """The ``UCPError`` subclass (``ShapeMismatchError``, ``MissingAtomsError``, ...)."""
    message: str
    """Its text (the first rank's, when ranks differ only in details)."""
    ranks: list[int]
    """Ranks that raise it; empty for the coordinator's global checks (raised on every rank)."""
    where: str = "local plan"
    """``open``, ``preflight`` (the target job's own checks before ``dcp.load``), ``target`` (the
    target cannot be built), ``local plan``, ``global plan`` or ``files``."""


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
    built: int = 0
    """Ranks whose state dict was built by the target's own code (the others were rebound)."""
    seconds: float = 0.0
    peak_memory: int = 0
    """Peak resident memory of the planning process (``ru_maxrss``, whole process), bytes."""
    warnings: list[str] = field(default_factory=list)

    @property
    def loads(self) -> bool:
        return not self.problems


class _DryLoadPlanner(UCPLoadPlanner):
    """The real planner, minus memory for targets; staging decided by the simulated device."""

    _materialize = False
    _check_meshes = False
    """The per-rank mesh copies the dry run rebinds do not carry their slice position faithfully yet, so
    the load-side mesh-collision check (ucp_dcp.layout.structure) runs in real loads only (docs/plan.md)."""
    device = "cuda"
    shared: dict[str, Any] = {}
    """Per-checkpoint work every rank would repeat (the saved-key index), set by :func:`plan_load`."""

    def _read_catalog(self, metadata: Any) -> Any:
        if "catalog" not in self.shared:  # one parse, not one per simulated rank (22 ms each at 800 atoms)
            self.shared["catalog"] = super()._read_catalog(metadata)
        return self.shared["catalog"]

    def _saved_index(self) -> Any:
        key = repr(self.name_rules)
        if key not in self.shared:
            self.shared[key] = super()._saved_index()
        return self.shared[key]

    def _staged(self, item: ReadItem, forced: bool) -> bool:
        return forced or self.device != "cpu"


def _problem(err: BaseException, rank: int | None, where: str) -> Problem:
    if isinstance(err, UCPError):
        return Problem(type(err).__name__, str(err), [] if rank is None else [rank], where)
    return Problem(type(err).__name__, f"{type(err).__name__}: {err}", [] if rank is None else [rank], where)


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
    device: str = "cuda",
    check_symmetry: bool = True,
    trust: bool = False,
    verify_checksums: bool = True,
    thread_count: int | None = None,
    allow_partial_load: bool = False,
    allow_lossy_dtype: bool = False,
    keep_items: bool = False,
    progress: Callable[[int, int], None] | None = None,
    store_ranges: StoreRanges = "few",
) -> PlanReport:
    """Plan the load of ``checkpoint`` into every rank of ``target`` (see the module docstring).

    ``read_once``, ``thread_count``, ``verify_checksums``, ``allow_*``, ``trust`` and ``store_ranges`` are the
    load's own settings (``UCPLoadPlanner`` / ``UCPFileSystemReader``); ``device`` is where the job's
    state lives (``cuda``: reads are cut to staging buffers; ``cpu``: read in place);
    ``ranks_per_node`` places ranks on hosts (read-once only sends across hosts by default);
    ``thread_count`` None: the reader's own choice for ``ranks_per_node`` ranks on this machine's cores."""
    t0 = time.perf_counter()
    if thread_count is None:
        thread_count = reading_threads(local_ranks=ranks_per_node)
    report = PlanReport(
        str(checkpoint),
        target.name,
        target.world_size,
        read_once=read_once,
        ranks_per_node=ranks_per_node,
        device=device,
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
        )
    finally:
        report.peak_memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
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
) -> None:
    try:
        md, integrity = open_path(checkpoint, trust=trust)
        check_tables(md)
    except UCPError as e:
        report.problems.append(_problem(e, None, "open"))
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
        report.problems += [_problem(e, None, "preflight") for e in errors]
    n, rpn = target.world_size, report.ranks_per_node
    reps: dict[Any, tuple[int, dict[str, Any]]] = {}
    last_of: dict[Any, int] = {}
    try:
        classes = [target.symmetry(r) for r in range(n)]
    except UCPError as e:
        report.problems.append(_problem(e, None, "target"))
        return
    for r, key in enumerate(classes):
        if key is not None:
            last_of[key] = r
    reads: list[list[Piece]] = [[] for _ in range(n)]
    summaries: list[ReadSummary | None] = [None] * n
    payloads: list[Any] = [None] * n
    local: list[Problem] = []
    coordinator: _DryLoadPlanner | None = None
    forced = staging_forced()
    shared: dict[str, Any] = {}
    for r in range(n):
        with fake_rank(r, n), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                sd, built = _state_dict(target, r, classes[r], reps, last_of, check_symmetry)
                report.built += built
                planner = _DryLoadPlanner(
                    read_once=report.read_once,
                    allow_partial_load=allow_partial_load,
                    allow_lossy_dtype=allow_lossy_dtype,
                    trust=trust,
                    **target.options(r),
                )
                planner.device, planner.shared = report.device, shared
                planner.set_up_planner(sd, md, is_coordinator=r == 0)
                plan = planner.create_local_plan()
            except UCPError as e:
                local.append(_problem(e, r, "local plan"))
                continue
            finally:
                for w in caught:
                    text = f"{w.category.__name__}: {w.message}"
                    if text not in report.warnings:
                        report.warnings.append(text)
        if r == 0:
            coordinator = planner
        reads[r] = pieces(planner._reads)  # compact: 4096 ranks of read items would not fit
        payloads[r] = plan.planner_data
        keys, sizes = read_summary(planner._reads, md)
        summaries[r] = ReadSummary(r, report.read_once, keys, sizes, f"node{r // rpn}")
        if progress is not None:
            progress(r + 1, n)
    if local:
        report.problems += _merge(local)
        return
    assert coordinator is not None
    try:
        coordinator.create_global_plan([LoadPlan([], planner_data=p) for p in payloads])
    except UCPError as e:
        report.problems.append(_problem(e, None, "global plan"))
        return
    transport = plan_transport(summaries)
    model = CostModel(md, str(checkpoint), verify=verify, local_files="://" not in str(checkpoint), store_gap=store_gap)
    touched: set[str] = set()
    for r in range(n):
        sizes = summaries[r].sizes if summaries[r] is not None else None
        report.ranks.append(
            _rank_plan(
                r, rpn, reads[r], sizes, transport[r], model, threads, forced or report.device != "cpu", keep_items
            )
        )
        touched.update(report.ranks[-1].files)
    report.problems += _file_problems(checkpoint, touched, integrity)


def _state_dict(
    target: Target, r: int, key: Any, reps: dict[Any, tuple[int, dict[str, Any]]], last_of: dict[Any, int], check: bool
) -> tuple[dict[str, Any], bool]:
    """Rank ``r`` (symmetry class ``key``)'s state dict, and whether the target built it (else: rebound)."""
    if key is None:
        return rebind(target.build(r), r, keep_local=True), True
    if key not in reps:
        reps[key] = (r, rebind(target.build(r), r, keep_local=True))
        return reps[key][1], True
    sd = rebind(reps[key][1], r)
    if check and last_of.get(key) == r:  # the symmetry claim, checked on the class's last rank
        built = rebind(target.build(r), r, keep_local=True)
        a, b = structure(sd), structure(built)
        if a != b:
            diff = next((k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)), "?")
            raise UCPError(
                f"target {target.name}: rank {r}'s state dict differs from rank {reps[key][0]}'s rebound "
                f"to it at '{diff}' (built {b.get(diff)}, rebound {a.get(diff)})",
                hint="the target's symmetry() groups ranks whose state dicts differ; fix it or return None",
            )
        return built, True
    return sd, False


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
