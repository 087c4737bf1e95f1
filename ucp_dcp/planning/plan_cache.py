"""Load plans cached per process: a repeated load at an unchanged layout plans once.

DCP plans every ``dcp.load`` from scratch: each rank plans its reads, the plans are gathered on the
coordinator, which runs the global step (``UCPLoadPlanner``'s checks, ``UCPFileSystemReader``'s read-once
assignment) and scatters the answers. A job that loads the same checkpoint into the same target again
(a restart from the memory tier, an evaluation loading into one model repeatedly) would plan the same
again. With ``UCPLoadPlanner(cache_plans=True)`` (``ucp_dcp.load``'s default):

* every rank keys its local plan by a digest of what it depends on (:mod:`ucp_dcp.planning.plan_keys`): the
  checkpoint's metadata (the hash of its ``.metadata`` bytes), the resolved target layout (keys, atoms,
  fragments, dtypes, devices, memory aliasing, DTensor meshes and placements), the planner's options and
  class, the rank's coordinator role and the staging settings; the reader adds its own (read-once mode,
  global rank, host). A rank that finds its key sends a marker of a few bytes in DCP's plan gather
  (:class:`CachedLoadPlan`, and the reader's keyed summary: :mod:`ucp_dcp.storage.keyed_plans`) instead of
  its plan and summary;
* the coordinator keeps the payloads and summaries it received by those keys (content-addressed: a key
  stands for one plan whichever process group, checkpoint folder or load it came with), and its global
  results by the tuple of every rank's key: when every rank sent a marker of a tuple it planned before,
  nothing is planned again and each rank is answered "your cached answer" (a marker of the reader's); when
  some rank re-planned, the global step runs again on the cached plans of the others and the new ones;
* what a rank's reads need at read time that depends on the target *objects* (sinks of non-tensor values,
  param-group collectors, fragments of fused tensors that fell back to their unsplit form, values to zero)
  is rebuilt on a hit from the current planner state, never taken from an earlier load.

A rank only sends a marker for a plan a finished load of this process planned (committed when the answer
arrived); after a load that failed before that, it plans afresh once. A coordinator that lacks a key (a
process that restarted, a coordinator elsewhere) raises :class:`PlanCacheMissError` on every rank; the load
changed nothing, and ``ucp_dcp.load`` runs it again without the cache.

This module holds the planner's side (its plans, the coordinator's payloads and checks) and what both sides
share: the least-recently-used caches (:class:`ProcessCache`, all emptied by :func:`clear`), the markers of
unfinished loads, the counters. The reader's side -- its read-once summaries and answers, storage's own wire
types -- is :mod:`ucp_dcp.storage.keyed_plans` (storage imports planning, never the reverse).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch.distributed.checkpoint.planner import ReadItem

from ..errors import PeerFailedError, UCPError, peer_class
from .payloads import Compact, LoadPlanPayload, ReadOnceMode

__all__ = [
    "ENTRIES",
    "PlanCacheMissError",
    "CachedLoadPlan",
    "LocalEntry",
    "ProcessCache",
    "coordinator_entries",
    "counters",
    "clear",
    "begin",
    "finish",
    "local_entry",
    "put_local",
    "remember_payload",
    "cached_payload",
    "touch_payloads",
    "checks_passed",
    "pass_checks",
    "count",
]

ENTRIES = 4
"""Plans kept per rank (its last distinct layouts x checkpoints), and global plans on the coordinator; the
coordinator keeps ``ENTRIES`` x world-size local plans (at least 64)."""


class PlanCacheMissError(UCPError):
    """A rank sent a cached-plan marker the coordinator does not hold (the coordinator is another process
    than the one that planned it). Raised by the coordinator's global step, so every rank raises it and the
    load changed nothing: run it again with ``cache_plans=False`` (``ucp_dcp.load`` does)."""

    @classmethod
    def of_marker(cls, rank: int, what: str) -> PlanCacheMissError:
        """The miss of rank ``rank``'s marker for its cached ``what`` (``plan``, ``read-once summary``)."""
        return cls(
            f"rank {rank} sent a marker for its cached load {what}, which the coordinator does not hold (a "
            "process restarted, or another process coordinates than the one that planned it)",
            hint="load again with cache_plans=False (ucp_dcp.load does so by itself), or call "
            "ucp_dcp.planning.plan_cache.clear() on every rank",
        )


@peer_class  # beside its cause: ucp_dcp.errors, the lowest layer, cannot import this module
class PeerPlanCacheMissError(PeerFailedError, PlanCacheMissError):
    """Another rank's :class:`PlanCacheMissError` (the coordinator's: ``except PlanCacheMissError`` catches it)."""


# -- wire types --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedLoadPlan(Compact):
    """A loading rank's ``LoadPlan.planner_data`` when its local plan is the one cached under ``key``: the
    coordinator takes the rank's :class:`~ucp_dcp.planning.payloads.LoadPlanPayload` from its cache. Meets
    :class:`~ucp_dcp.planning.handshake.ReadOnceRequest` as the payload does."""

    key: bytes
    """The rank's plan key (:mod:`ucp_dcp.planning.plan_keys`)."""
    read_once: ReadOnceMode = "hosts"
    keeps_items: bool = True


# -- what the planner's side keeps ------------------------------------------------------------------------------


@dataclass
class LocalEntry:
    """A rank's local plan, as a hit needs it (everything tied to the target objects is rebuilt)."""

    reads: list[ReadItem]
    """The plan's read items, cut for staging, in plan order; the param-group reads last."""
    payload: LoadPlanPayload
    """What the rank sent the coordinator."""
    missing: list[str]
    """Atoms the checkpoint lacks (a partial load)."""
    zero: list[str]
    """Keys of ``Reduce(op="sum")`` targets this rank zeroes."""
    unsplit: list[str]
    """Keys of fused targets loaded as their unsplit tensor (a stock checkpoint saved them fused)."""
    object_sinks: list[str]
    """Keys of non-tensor targets with a read (their sinks are rebuilt)."""
    group_reads: list[tuple[str, Any]]
    """``(saved key, item type)`` of the param-group reads (the last ones): rebuilt on a hit, with their sinks."""
    compared: dict[str, str] = field(default_factory=dict)
    """Tied keys whose saved copies are compared when read -> the key whose value loads (``tie_reads``)."""


# -- the caches (both sides') -------------------------------------------------------------------------------------

T = TypeVar("T")


class ProcessCache(dict[bytes, T]):
    """One cache of this process's load plans: a dict kept in least-recently-used order (dicts keep insertion
    order; :meth:`use` moves a key to the end, :meth:`keep` drops the oldest past a limit). Every one is emptied
    by :func:`clear`, the reader's (:mod:`ucp_dcp.storage.keyed_plans`) too: they register here when made."""

    def __init__(self) -> None:
        super().__init__()
        _CACHES.append(self)

    def use(self, key: bytes) -> T | None:
        """``self[key]`` (None: not held), now the most recently used."""
        value = self.pop(key, None)
        if value is not None:
            self[key] = value
        return value

    def keep(self, key: bytes, value: T, limit: int) -> None:
        """Hold ``value`` under ``key``, the most recently used; the oldest go past ``limit`` entries."""
        self.pop(key, None)
        self[key] = value
        while len(self) > limit:
            del self[next(iter(self))]


_CACHES: list[ProcessCache[Any]] = []
"""Every :class:`ProcessCache` of this process (:func:`clear` empties them)."""
_LOCAL: ProcessCache[LocalEntry] = ProcessCache()
_PAYLOADS: ProcessCache[LoadPlanPayload] = ProcessCache()
_CHECKED: ProcessCache[bool] = ProcessCache()
_UNFINISHED: dict[str, bool] = {}
"""``"planner"``/``"reader"`` -> a load of this process keyed a plan and did not get its answer (it failed)."""

counters: dict[str, int] = {}
"""What the cache did in this process, by event (``local_hit``, ``local_miss``, ``reader_hit``, ``reader_miss``,
``checks_reused``, ``checks_run``, ``transport_reused``, ``transport_planned``, ``expanded``: markers the
coordinator expanded into cached plans for a global step that ran again). For tests and benchmarks."""


def _count(event: str, n: int = 1) -> None:
    counters[event] = counters.get(event, 0) + n


def clear() -> None:
    """Forget every cached load plan of this process (the planner's and the reader's)."""
    for d in _CACHES:
        d.clear()
    _UNFINISHED.clear()


# -- a rank's side -----------------------------------------------------------------------------------------------


def begin(side: str) -> bool:
    """A load keys a plan on this side (``"planner"``/``"reader"``): whether the previous one got its answer
    (else this load plans afresh: the coordinator may not hold what it failed with)."""
    finished = not _UNFINISHED.get(side, False)
    _UNFINISHED[side] = True
    return finished


def finish(side: str) -> None:
    """The coordinator's answer arrived: the side's keys are known to the coordinator."""
    _UNFINISHED[side] = False


def local_entry(key: bytes) -> LocalEntry | None:
    return _LOCAL.use(key)


def put_local(key: bytes, entry: LocalEntry) -> None:
    _LOCAL.keep(key, entry, ENTRIES)


# -- the coordinator's side --------------------------------------------------------------------------------------


def coordinator_entries(world: int) -> int:
    """How many ranks' entries the coordinator keeps: ``ENTRIES`` loads of ``world`` ranks, at least 64."""
    return max(64, ENTRIES * world)


def remember_payload(key: bytes, payload: LoadPlanPayload, world: int) -> None:
    _PAYLOADS.keep(key, payload, coordinator_entries(world))


def cached_payload(key: bytes, rank: int) -> LoadPlanPayload:
    found = _PAYLOADS.use(key)
    if found is None:
        raise PlanCacheMissError.of_marker(rank, "plan")
    _count("expanded")
    return found


def touch_payloads(keys: Iterable[bytes | None]) -> None:
    """Mark these ranks' payloads used (a global step that reused its checks did not need them)."""
    for k in keys:
        if k is not None:
            _PAYLOADS.use(k)


def checks_passed(key: bytes) -> bool:
    """Whether the coordinator's checks passed for these plans (the key of every rank's plan key)."""
    hit = _CHECKED.use(key) is not None
    _count("checks_reused" if hit else "checks_run")
    return hit


def pass_checks(key: bytes) -> None:
    _CHECKED.keep(key, True, ENTRIES)


def count(event: str) -> None:
    """Count an event (``local_hit``, ``reader_miss``, ``transport_reused``, ...; the reader's side counts its
    own here)."""
    _count(event)
