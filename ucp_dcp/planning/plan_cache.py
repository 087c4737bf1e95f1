"""Load plans cached per process: a repeated load at an unchanged layout plans once.

DCP plans every ``dcp.load`` from scratch: each rank plans its reads, the plans are gathered on the
coordinator, which runs the global step (``UCPLoadPlanner``'s checks, ``UCPFileSystemReader``'s read-once
assignment) and scatters the answers. A job that loads the same checkpoint into the same target again
(a restart from the memory tier, an evaluation loading into one model repeatedly) would plan the same
again. With ``UCPLoadPlanner(cache_plans=True)`` (``ucp_dcp.load``'s default):

* every rank keys its local plan by a digest of what it depends on (the keys, below): the
  checkpoint's metadata (the hash of its ``.metadata`` bytes), the resolved target layout (keys, atoms,
  fragments, dtypes, devices, memory aliasing, DTensor meshes and placements), the planner's options and
  class, the rank's coordinator role and the staging settings; the reader adds its own (read-once mode,
  global rank, host). A rank that finds its key sends a marker of a few bytes in DCP's plan gather
  (:class:`CachedLoadPlan`, and the reader's keyed summary: :mod:`ucp_dcp.storage.reader`) instead of
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

The module reads in the order a load uses it: the keys (what a plan depends on, digested), then the
caches that hold plans by those keys. It holds the planner's side (its plans, the coordinator's payloads
and checks) and what both sides share: the least-recently-used caches (:class:`ProcessCache`, all emptied
by :func:`clear`), the markers of unfinished loads, the counters. The reader's side -- its read-once summaries and answers, storage's own wire
types -- is :mod:`ucp_dcp.storage.reader` (storage imports planning, never the reverse).
"""

from __future__ import annotations

import hashlib
import marshal
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from .. import settings
from ..errors import PeerFailedError, UCPError, peer_class
from .opened import CheckedMetadata
from .payloads import Compact, LoadPlanPayload, ReadOnceMode

__all__ = [
    "ENTRIES",
    "PlanCacheMissError",
    "CachedLoadPlan",
    "LocalEntry",
    "ProcessCache",
    "coordinator_entries",
    "plan_key_of",
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
    "SIGNED_FIELDS",
    "digest",
    "metadata_digest",
    "target_signature",
    "reader_key",
    "this_host",
]

# -- keys: what a plan depends on, digested ------------------------------------------------------------------------
# A rank's plan key covers the checkpoint's metadata (:func:`metadata_digest`), the resolved target
# (:func:`target_signature`) and the planner's options, class, coordinator role and staging settings
# (``UCPLoadPlanner._plan_key``); a reader's key adds what its read-once summary depends on
# (:func:`reader_key`). Equal keys mean equal plans: a key that misses something a plan depends on would load
# wrong state, so the tests check that every field of the resolved target is covered (:data:`SIGNED_FIELDS`).


def digest(*parts: Any) -> bytes:
    """16-byte BLAKE2b of ``parts``: bytes as they are, anything else by its ``repr`` (value-based for the
    dataclasses, tuples and dicts keys are made of)."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        b = p if isinstance(p, bytes) else repr(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def metadata_digest(md: Metadata) -> bytes | None:
    """What identifies the checkpoint's metadata: the hash of its ``.metadata`` bytes when a ucp_dcp reader
    opened it, else a hash of the pickled tables (None: they do not pickle)."""
    if isinstance(md, CheckedMetadata) and md.digest:
        return md.digest.encode()
    try:
        data = pickle.dumps((md.state_dict_metadata, md.planner_data, md.storage_data, md.version), protocol=5)
    except Exception:  # metadata of a foreign reader holding objects pickle refuses: not cached, planned afresh
        return None
    return hashlib.blake2b(data, digest_size=16).digest()


def _memory(t: torch.Tensor, storages: dict[tuple[Any, Any], int], names: dict[Any, str]) -> tuple[Any, ...]:
    """A tensor's memory as the plan sees it; its storage as the ordinal of its first sighting (the start of
    its storage: ``data_ptr`` less the offset, without building a storage object). ``names``: dtype, device
    and layout names (their ``repr`` is slow)."""
    offset = t.storage_offset()
    device = t.device
    ordinal = storages.setdefault((device, t.data_ptr() - offset * t.element_size()), len(storages))
    kind = (t.dtype, device, t.layout)
    name = names.get(kind)
    if name is None:
        name = names[kind] = str(kind)
    return (name, tuple(t.shape), t.stride(), offset, ordinal)


def _fragments(fs: Sequence[Any] | None) -> Any:
    """Fragments as plain tuples (their dataclass ``repr`` costs as much as the rest of a signature)."""
    if fs is None:
        return None
    return [(f.atom, f.box.offsets, f.box.sizes, f.local.offsets, f.local.sizes, f.view_shape, f.shard) for f in fs]


SIGNED_FIELDS = {
    "Resolved": (
        "entry",
        "atom",
        "atoms",
        "paths",
        "fragments",
        "fills",
        "fill_value",
        "padding_rule",
        "fanout",
        "present",
        "tied",
        "replicated",
        "reduce",
        "index_claims",
        "unsplit",
        "memory",
    ),
    "Entry": ("key", "atom", "value", "path", "stock"),
    "Fragment": ("atom", "box", "local", "view_shape", "shard"),
    "Box": ("offsets", "sizes"),
    "GroupTarget": ("group", "prefix", "index", "params", "hyperparams"),
}
"""The fields of the resolved target :func:`target_signature` covers (a test checks no field is added unseen)."""


def target_signature(targets: Iterable[Any], raw: Any, groups: Sequence[Any]) -> bytes | None:
    """A digest of everything ``UCPLoadPlanner.create_local_plan`` reads of the resolved target: per entry its
    key, paths, atoms and their records (shapes, dtypes, DTensor meshes and placements), fragments, fills and
    rules, and its local memory (dtype, device, shape, strides, offset, and which entries share a storage:
    aliasing decides reads); the raw optimizers' parameter positions; the param groups' names. Values never
    count (an entry's own atom is its ``Entry.atom`` renamed). None when some memory cannot be described (no
    plain storage)."""
    storages: dict[tuple[Any, Any], int] = {}
    names: dict[Any, str] = {}
    rows: list[Any] = []
    try:
        for r in targets:
            e = r.entry
            mem: Any = None
            if isinstance(e.value, torch.Tensor):
                local = r.local  # ``memory`` when set, else the value's local tensor
                mem = (
                    tuple(_memory(t, storages, names) for t in local)
                    if isinstance(local, tuple)
                    else _memory(local, storages, names)
                )
            rows.append(
                (
                    e.key,
                    e.path,
                    e.stock,
                    type(e.value).__module__,
                    type(e.value).__qualname__,
                    r.atom.prefix,
                    r.atom.param,
                    r.atom.suffix,
                    r.atom.kind,
                    r.atom.path,
                    r.atom.form,
                    r.atoms,
                    r.paths,
                    _fragments(r.fragments),
                    [(b.offsets, b.sizes) for b in r.fills],
                    r.fill_value,
                    _rule(r.padding_rule),
                    r.fanout,
                    r.present,
                    r.tied,
                    _rule(r.replicated),
                    _rule(r.reduce),
                    r.index_claims,
                    _fragments(r.unsplit),
                    mem,
                )
            )
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without plain storage
        return None
    groups_sig = [(g.prefix, g.index, g.params, g.hyperparams) for g in groups]
    return digest(b"ucp-load-target-1", _encode(rows), raw, groups_sig)


def _rule(rule: Any) -> str | None:
    return None if rule is None else repr(rule)  # a frozen dataclass: its repr is its value


def _encode(rows: list[Any]) -> bytes:
    """``rows`` as bytes: ``marshal`` format 2 (value-based: no references between objects; five times faster
    than ``repr``), or their ``repr`` when they hold other types."""
    try:
        return b"m" + marshal.dumps(rows, 2)
    except ValueError:
        return b"r" + repr(rows).encode()


def this_host() -> str:
    """The host read-once groups ranks by (as :func:`ucp_dcp.storage.transport.local_summary` names it)."""
    return settings.host()


def reader_key(plan_key: bytes, reader: type, mode: str) -> bytes:
    """The key of a reader's summary of the plan ``plan_key``: what else the summary depends on."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return digest(b"ucp-load-reader-1", plan_key, f"{reader.__module__}.{reader.__qualname__}", mode, rank, this_host())


# -- the cache's size and its miss ---------------------------------------------------------------------------------

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
    """The rank's plan key (:func:`target_signature`, :func:`metadata_digest`)."""
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
    by :func:`clear`, the reader's (:mod:`ucp_dcp.storage.reader`) too: they register here when made."""

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


def plan_key_of(planner_data: Any) -> bytes | None:
    """The plan key a rank's ``planner_data`` carries (a cached plan's marker, or a payload to cache)."""
    if isinstance(planner_data, CachedLoadPlan):
        return planner_data.key
    if isinstance(planner_data, LoadPlanPayload):
        return planner_data.cache_key
    return None


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
