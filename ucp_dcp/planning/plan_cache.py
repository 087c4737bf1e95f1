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
  (:class:`CachedLoadPlan`, :class:`KeyedSummary`) instead of its plan and summary;
* the coordinator keeps the payloads and summaries it received by those keys (content-addressed: a key
  stands for one plan whichever process group, checkpoint folder or load it came with), and its global
  results by the tuple of every rank's key: when every rank sent a marker of a tuple it planned before,
  nothing is planned again and each rank is answered "your cached answer" (:class:`KeyedTransport`); when
  some rank re-planned, the global step runs again on the cached plans of the others and the new ones;
* what a rank's reads need at read time that depends on the target *objects* (sinks of non-tensor values,
  param-group collectors, fragments of fused tensors that fell back to their unsplit form, values to zero)
  is rebuilt on a hit from the current planner state, never taken from an earlier load.

A rank only sends a marker for a plan a finished load of this process planned (committed when the answer
arrived); after a load that failed before that, it plans afresh once. A coordinator that lacks a key (a
process that restarted, a coordinator elsewhere) raises :class:`PlanCacheMissError` on every rank; the load
changed nothing, and ``ucp_dcp.load`` runs it again without the cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch.distributed.checkpoint.planner import ReadItem

from ..errors import UCPError
from .payloads import LoadPlanPayload, ReadOnceMode, ReadSummary, TransportPlan, _Compact

__all__ = [
    "ENTRIES",
    "PlanCacheMissError",
    "CachedLoadPlan",
    "KeyedSummary",
    "KeyedTransport",
    "LocalEntry",
    "ReaderEntry",
    "counters",
    "clear",
    "begin",
    "finish",
    "local_entry",
    "put_local",
    "reader_entry",
    "put_reader",
    "remember_payload",
    "cached_payload",
    "touch_payloads",
    "touch_summaries",
    "remember_summary",
    "cached_summary",
    "checks_passed",
    "pass_checks",
    "cached_transports",
    "put_transports",
    "count",
]

ENTRIES = 4
"""Plans kept per rank (its last distinct layouts x checkpoints), and global plans on the coordinator; the
coordinator keeps ``ENTRIES`` x world-size local plans (at least 64)."""


class PlanCacheMissError(UCPError):
    """A rank sent a cached-plan marker the coordinator does not hold (the coordinator is another process
    than the one that planned it). Raised by the coordinator's global step, so every rank raises it and the
    load changed nothing: run it again with ``cache_plans=False`` (``ucp_dcp.load`` does)."""


# -- wire types --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedLoadPlan(_Compact):
    """A loading rank's ``LoadPlan.planner_data`` when its local plan is the one cached under ``key``: the
    coordinator takes the rank's :class:`~ucp_dcp.planning.payloads.LoadPlanPayload` from its cache. Meets
    :class:`~ucp_dcp.planning.handshake.ReadOnceRequest` as the payload does."""

    key: bytes
    """The rank's plan key (:mod:`ucp_dcp.planning.plan_keys`)."""
    read_once: ReadOnceMode = "hosts"
    keeps_items: bool = True


@dataclass(frozen=True)
class KeyedSummary(_Compact):
    """A loading rank's ``LoadPlan.storage_data`` when plans are cached: its read-once summary and the key
    it is cached under, or only the key (the coordinator holds the summary)."""

    key: bytes
    """The reader's key: the plan key, the read-once mode, the global rank and the host."""
    summary: ReadSummary | None = None
    """The summary; None: the coordinator's cached one for ``key``."""
    last: bytes | None = None
    """The global key of the answer this rank holds for ``key`` (the coordinator then answers with a marker)."""


@dataclass(frozen=True)
class KeyedTransport(_Compact):
    """The coordinator's read-once answer to a rank that sent a :class:`KeyedSummary`."""

    key: bytes | None
    """The global key (of every rank's reader key, in plan order); None when some rank's plan was not keyed."""
    plan: TransportPlan | None = None
    """The answer; None: the one the rank holds for ``key`` (its ``KeyedSummary.last``)."""


# -- what each side keeps ----------------------------------------------------------------------------------------


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


@dataclass
class ReaderEntry:
    """A rank's read-once side: the coordinator's last answer for this reader key."""

    answer_key: bytes | None
    """Its global key (None: the answer was not keyed)."""
    transport: TransportPlan | None
    """The answer."""


_LOCAL: dict[bytes, LocalEntry] = {}
_READER: dict[bytes, ReaderEntry] = {}
_PAYLOADS: dict[bytes, LoadPlanPayload] = {}
_SUMMARIES: dict[bytes, ReadSummary] = {}
_CHECKED: dict[bytes, bool] = {}
_TRANSPORTS: dict[bytes, list[TransportPlan]] = {}
_UNFINISHED: dict[str, bool] = {}
"""``"planner"``/``"reader"`` -> a load of this process keyed a plan and did not get its answer (it failed)."""

counters: dict[str, int] = {}
"""What the cache did in this process, by event (``local_hit``, ``local_miss``, ``reader_hit``, ``reader_miss``,
``checks_reused``, ``checks_run``, ``transport_reused``, ``transport_planned``, ``expanded``: markers the
coordinator expanded into cached plans for a global step that ran again). For tests and benchmarks."""


def _count(event: str, n: int = 1) -> None:
    counters[event] = counters.get(event, 0) + n


def clear() -> None:
    """Forget every cached load plan of this process."""
    for d in (_LOCAL, _READER, _PAYLOADS, _SUMMARIES, _CHECKED, _TRANSPORTS, _UNFINISHED):
        d.clear()


T = TypeVar("T")


# -- a rank's side -----------------------------------------------------------------------------------------------


def _get(d: dict[bytes, T], key: bytes) -> T | None:
    """``d[key]``, now the most recently used (dicts keep insertion order)."""
    value = d.pop(key, None)
    if value is not None:
        d[key] = value
    return value


def _put(d: dict[bytes, T], key: bytes, value: T, limit: int) -> None:
    d.pop(key, None)
    d[key] = value
    while len(d) > limit:
        del d[next(iter(d))]


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
    return _get(_LOCAL, key)


def put_local(key: bytes, entry: LocalEntry) -> None:
    _put(_LOCAL, key, entry, ENTRIES)


def reader_entry(key: bytes) -> ReaderEntry | None:
    return _get(_READER, key)


def put_reader(key: bytes, entry: ReaderEntry) -> None:
    _put(_READER, key, entry, ENTRIES)


# -- the coordinator's side --------------------------------------------------------------------------------------


def _limit(world: int) -> int:
    return max(64, ENTRIES * world)


def _miss(rank: int, what: str) -> PlanCacheMissError:
    return PlanCacheMissError(
        f"rank {rank} sent a marker for its cached load {what}, which the coordinator does not hold (a "
        "process restarted, or another process coordinates than the one that planned it)",
        hint="load again with cache_plans=False (ucp_dcp.load does so by itself), or call "
        "ucp_dcp.planning.plan_cache.clear() on every rank",
    )


def remember_payload(key: bytes, payload: LoadPlanPayload, world: int) -> None:
    _put(_PAYLOADS, key, payload, _limit(world))


def cached_payload(key: bytes, rank: int) -> LoadPlanPayload:
    found = _get(_PAYLOADS, key)
    if found is None:
        raise _miss(rank, "plan")
    _count("expanded")
    return found


def touch_payloads(keys: Iterable[bytes | None]) -> None:
    """Mark these ranks' payloads used (a global step that reused its checks did not need them)."""
    for k in keys:
        if k is not None:
            _get(_PAYLOADS, k)


def touch_summaries(keys: Iterable[bytes]) -> None:
    """Mark these ranks' summaries used (a global step that reused its read-once answers did not need them)."""
    for k in keys:
        _get(_SUMMARIES, k)


def remember_summary(key: bytes, summary: ReadSummary, world: int) -> None:
    _put(_SUMMARIES, key, summary, _limit(world))


def cached_summary(key: bytes, rank: int) -> ReadSummary:
    found = _get(_SUMMARIES, key)
    if found is None:
        raise _miss(rank, "read-once summary")
    return found


def checks_passed(key: bytes) -> bool:
    """Whether the coordinator's checks passed for these plans (the key of every rank's plan key)."""
    hit = _get(_CHECKED, key) is not None
    _count("checks_reused" if hit else "checks_run")
    return hit


def pass_checks(key: bytes) -> None:
    _put(_CHECKED, key, True, ENTRIES)


def cached_transports(key: bytes) -> list[TransportPlan] | None:
    found = _get(_TRANSPORTS, key)
    _count("transport_reused" if found is not None else "transport_planned")
    return found


def put_transports(key: bytes, plans: list[TransportPlan]) -> None:
    _put(_TRANSPORTS, key, plans, ENTRIES)


def count(event: str) -> None:
    """Count an event of a rank's side (``local_hit``, ``reader_miss``, ...)."""
    _count(event)
