"""One simulated rank's planning (:class:`Ranks`): its state dict (built, or its class representative's rebound
to it), the real ``UCPLoadPlanner`` set-up and local plan, the reader's read-once summary and the bytes its
plan adds to the coordinator's gather. ``plan`` (:mod:`.simulate`) runs it for every rank, in one process or
several (:mod:`.workers`)."""

from __future__ import annotations

import pickle
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ...errors import UCPError
from ...planning.handshake import ReadOnceRequest
from ...planning.load_planner import UCPLoadPlanner
from ...storage.transport import ReadSummary, local_summary
from .read_cost import Piece, pieces
from .targets import Target
from .world import fake_rank, rebind, structure

__all__ = ["Problem", "problem_of", "RankOut", "Ranks", "gathered_bytes", "state_dict_of", "infer_device"]


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


def problem_of(err: BaseException, rank: int | None, where: str) -> Problem:
    if isinstance(err, UCPError):
        return Problem(type(err).__name__, str(err), [] if rank is None else [rank], where)
    return Problem(type(err).__name__, f"{type(err).__name__}: {err}", [] if rank is None else [rank], where)


@dataclass
class RankOut:
    """What planning one rank gives the coordinator's steps (it keeps the rank's reads)."""

    payload: Any = None
    summary: ReadSummary | None = None
    plan_bytes: int = 0
    built: bool = False
    warnings: list[str] = field(default_factory=list)
    problem: Problem | None = None


class Ranks:
    """Plans one simulated rank at a time (:meth:`plan`); the class representatives are built first, in rank
    order, so that processes planning other runs of ranks (:mod:`.workers`) rebind the same ones."""

    def __init__(
        self,
        report: Any,
        md: Any,
        target: Target,
        classes: list[Any],
        check_symmetry: bool,
        trust: bool,
        allow_partial_load: bool,
        allow_lossy_dtype: bool,
    ) -> None:
        self.report, self.md, self.target, self.classes, self.check = report, md, target, classes, check_symmetry
        self.options: dict[str, Any] = {
            "allow_partial_load": allow_partial_load,
            "allow_lossy_dtype": allow_lossy_dtype,
            "trust": trust,
        }
        self.last_of = {key: r for r, key in enumerate(classes) if key is not None}
        self.reps: dict[Any, tuple[int, dict[str, Any]]] = {}
        self.caught: dict[int, list[Any]] = {}  # warnings of a representative's build, shown with its rank's
        self.shared: dict[str, Any] = {}
        self.reads: dict[int, list[Piece]] = {}
        self.summaries: dict[int, ReadSummary | None] = {}
        self.coordinator: _DryLoadPlanner | None = None
        self.prebuilt: dict[int, dict[str, Any]] = {}
        """Rank 0's state dict when it was built here to find the job's device (its planning takes it)."""
        firsts: dict[Any, int] = {}
        for r, key in enumerate(classes):
            if key is not None:
                firsts.setdefault(key, r)
        for key, r in firsts.items():
            with fake_rank(r, len(classes)), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    self.reps[key] = (r, rebind(target.build(r), r, keep_local=True))
                except UCPError:
                    pass  # the rank's own planning builds it again, and reports the error there
            self.caught[r] = list(caught)
        if not report.device:
            self._infer_device(classes)

    def _infer_device(self, classes: list[Any]) -> None:
        """The job's device when ``--device`` did not say: the target's own word, else where rank 0's tensors are
        (a target that builds them on the CPU is a CPU job), else CUDA (meta tensors say nothing)."""
        report, declared = self.report, getattr(self.target, "device", None)
        if declared:
            report.device, report.device_basis = declared, "target"
            return
        sd = self.reps.get(classes[0], (0, None))[1] if classes[0] is not None else None
        if sd is None and classes[0] is None:
            with fake_rank(0, len(classes)), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    sd = self.prebuilt[0] = rebind(self.target.build(0), 0, keep_local=True)
                except UCPError:
                    pass  # rank 0's planning builds it again, and reports the error there
            self.caught[0] = list(caught)
        found = infer_device(sd) if sd is not None else None
        report.device, report.device_basis = (found, "tensors") if found else ("cuda", "assumed")

    def plan(self, r: int) -> RankOut:
        out = RankOut()
        report, n, rpn = self.report, len(self.classes), self.report.ranks_per_node
        with fake_rank(r, n), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if r in self.prebuilt:
                    sd, out.built = self.prebuilt.pop(r), True
                else:
                    sd, out.built = state_dict_of(self.target, r, self.classes[r], self.reps, self.last_of, self.check)
                planner = _DryLoadPlanner(read_once=report.read_once, **self.options, **self.target.options(r))
                planner.device, planner.shared = report.device, self.shared
                planner.set_up_planner(sd, self.md, is_coordinator=r == 0)
                plan = planner.create_local_plan()
            except UCPError as e:
                out.problem = problem_of(e, r, "local plan")
                return out
            finally:
                for w in self.caught.pop(r, []) + list(caught):
                    text = f"{w.category.__name__}: {w.message}"
                    if text not in out.warnings:
                        out.warnings.append(text)
        if r == 0:
            self.coordinator = planner
        self.reads[r] = pieces(planner._reads)  # compact: 4096 ranks of read items would not fit
        out.payload = plan.planner_data
        out.summary = self.summaries[r] = local_summary(
            planner._reads, self.md, report.read_once, rank=r, host=f"node{r // rpn}"
        )
        out.plan_bytes = gathered_bytes(plan, out.summary)
        if r != 0:
            # the planner's state is cyclic (its sinks are closures over it): dropped now, it is freed at once
            # instead of by the garbage collector, which then walks ~50,000 objects every 16 ranks
            planner.__dict__.clear()
        return out


def infer_device(sd: Any) -> str | None:
    """The device type holding most of the state dict's elements (a DTensor's: its local tensor's), or None
    when that is the meta device or there are no tensors. By elements, not by any tensor: a GPU job keeps
    small CPU tensors (optimizer steps), a meta model may come with CPU counters."""
    counts: Counter[str] = Counter()
    stack = [sd]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            counts[v.device.type] += max(1, v.numel())
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    if not counts:
        return None
    kind = counts.most_common(1)[0][0]
    return None if kind == "meta" else kind


def gathered_bytes(plan: LoadPlan, summary: ReadSummary | None) -> int:
    """The bytes of one rank's local plan in DCP's plan gather (``_DistWrapper.reduce_scatter``): the plan
    ``UCPFileSystemReader.prepare_local_plan`` returns for ``plan`` (the read summary as its storage data; no
    read items when the planner puts them back itself), pickled as ``gather_object`` pickles it."""
    pd = plan.planner_data
    keeps = isinstance(pd, ReadOnceRequest) and pd.keeps_items
    return len(pickle.dumps(LoadPlan([] if keeps else plan.items, storage_data=summary, planner_data=pd)))


def state_dict_of(
    target: Target, r: int, key: Any, reps: dict[Any, tuple[int, dict[str, Any]]], last_of: dict[Any, int], check: bool
) -> tuple[dict[str, Any], bool]:
    """Rank ``r`` (symmetry class ``key``)'s state dict, and whether the target built it (else: rebound)."""
    if key is None:
        return rebind(target.build(r), r, keep_local=True), True
    if key not in reps:
        reps[key] = (r, rebind(target.build(r), r, keep_local=True))
        return reps[key][1], True
    if reps[key][0] == r:  # the class's representative (built before any rank was planned)
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
