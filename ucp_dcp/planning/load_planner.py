"""``UCPLoadPlanner``: turns the target's fragments into reads of saved chunks of the same atoms.

The planner's side of the load-plan cache (:class:`CachedLoadPlans`, a mixin of its steps) comes first, then
the planner in DCP's call order.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from .._compat import _init_state_dict, set_element
from ..errors import InvalidArgumentError, UCPError, UnverifiedCheckpointWarning
from ..layout.dtypes import conversion
from ..layout.patterns import Patterns, rule_from_json
from ..layout.structure import check_map_orders, check_mesh_collisions, map_orders, target_meshes, unpack_meshes
from ..options import UCPOptions, options_first, protocol_error, require_flat, split_options
from . import device as _device
from . import plan_cache
from .catalog import Catalog, load_catalog
from .consistency import check_rule_usage, zero_like
from .device import needs_staging, split_reads, staging_forced
from .entries import raw_optimizers, set_value
from .hooks import LoadHooks, check_resolved, check_state_dict, overrides, plan_snapshot, state_view
from .load_steps import (
    GROUP_SINK,
    SavedIndex,
    alias_problems,
    check_forgotten_maps,
    combine_problems,
    decode_value,
    entry_reads,
    group_reads,
    itemsize,
    map_reads,
    missing_error,
    raw_optimizer_problems,
    raw_params_sink,
    reduce_problem,
    rule_conflicts,
    saved_names,
    split_stock_groups,
    tie_problem,
    use_unsplit,
    with_map_note,
    with_raw_note,
)
from .opened import integrity_of, raise_if_unopened
from .payloads import READ_ONCE_MODES, LoadPlanPayload, ReadOnceMode, RuleUsage
from .plan_cache import CachedLoadPlan, LocalEntry, plan_key_of
from .resolve import Resolved, Resolver

__all__ = ["UCPLoadPlanner", "CachedLoadPlans", "PLANNING_HOOKS"]

logger = logging.getLogger(__name__)

# -- the load-plan cache's steps (cache_plans=True) ----------------------------------------------------------------
# ``UCPLoadPlanner``'s side of the load-plan cache (``cache_plans=True``, :mod:`ucp_dcp.planning.plan_cache`).
#
# A mixin: the steps ``create_local_plan``, ``create_global_plan`` and ``finish_plan`` call. A hit skips the
# rank's planning -- the saved index, every entry's reads, the checks, the cuts for staging -- and sets up
# what the read step needs from the *current* targets: sinks of non-tensor values, the param groups'
# collectors (their reads planned again: they hold this load's group dicts), fused targets loaded unsplit,
# targets to zero.

PLANNING_HOOKS = ("create_local_plan", "create_global_plan", "_saved_index", "_read_catalog", "_staged")
"""Hooks whose override turns the plan cache off (what they return may depend on more than the key)."""


class CachedLoadPlans:
    """``UCPLoadPlanner``'s plan-cache steps (a mixin; the state it reads is the planner's)."""

    _hook_base: type
    _config: dict[str, Any]
    _targets: dict[str, Any]
    _raw: Any
    _groups: Any
    _resolver: Any
    _patterns: Any
    _reads: list[ReadItem]
    _sinks: dict[str, Callable[[Any], None]]
    _zero: list[Any]
    _untouched: set[str]
    _scratch: dict[int, Any]
    _compared: dict[str, str]
    _payload: Any
    options: Any
    metadata: Any
    is_coordinator: bool
    original_state_dict: Any
    missing_atoms: list[str]
    name_rules: Any

    def _init_plan_cache(self, cache_plans: bool) -> None:
        self.cache_plans = bool(cache_plans)
        self._cache_key: bytes | None = None
        self.plan_cache_hit: bool | None = None
        """The last ``create_local_plan``: True: reused this process's cached plan; False: planned (and cached
        it); None: not cached (``cache_plans=False``, an override of a planning hook, an unhashable layout)."""
        self.global_plan_cached: bool | None = None
        """The coordinator's last ``create_global_plan``: True: every rank's plan was one it had checked
        (nothing checked again); False: it checked; None: some plan was not keyed."""

    def _saved_index(self) -> Any: ...  # the planner's

    # -- a rank's plan -----------------------------------------------------------------------------------------

    def _plan_key(self) -> bytes | None:
        """The key of this rank's local plan: None when it is not cached."""
        if not self.cache_plans or any(overrides(self, self._hook_base, h) for h in PLANNING_HOOKS):
            return None
        md = plan_cache.metadata_digest(self.metadata)
        layout = plan_cache.target_signature(self._targets.values(), self._raw, self._groups)
        if md is None or layout is None:
            return None
        cls = type(self)
        return plan_cache.digest(
            b"ucp-load-plan-1",
            f"{cls.__module__}.{cls.__qualname__}",
            sorted(self._config.items()),
            self.options,
            md,
            layout,
            self.is_coordinator,
            staging_forced(),
            _device.STAGE_BYTES,
        )

    def _cached_local_plan(self) -> LoadPlan | None:
        """This rank's cached plan, set up on the current targets (None: plan it; then :meth:`_remember_plan`)."""
        self.__dict__.pop("_pending_entry", None)
        self._cache_key = key = self._plan_key()
        self.plan_cache_hit = None if key is None else False
        if key is None:
            return None
        entry = plan_cache.local_entry(key) if plan_cache.begin("planner") else None
        group = self._group_reads_again(entry) if entry is not None and entry.group_reads else ([], {})
        if entry is None or group is None:
            plan_cache.count("local_miss")
            return None
        sinks: dict[str, Callable[[Any], None]] = {}
        for k in entry.object_sinks:
            r = self._targets[k]
            sinks[k] = raw_params_sink(r, self._raw) or self._object_sink(r.entry.path)
        fresh, more = group  # the groups' collectors hold this load's group dicts: planned again
        sinks.update(more)
        for k in entry.unsplit:
            use_unsplit(self._targets[k])
        self._sinks, self._untouched, self._scratch = sinks, set(), {}
        self._compared = dict(entry.compared)
        self._zero = [self._targets[k] for k in entry.zero]
        self.missing_atoms = list(entry.missing)
        if self.missing_atoms:
            logger.warning(
                "UCP partial load: %d atom(s) not in the checkpoint were left as they are: %s",
                len(self.missing_atoms),
                ", ".join(self.missing_atoms[:10]),
            )
        self._patterns.used.update(entry.payload.usage.used)
        self._reads = entry.reads[: len(entry.reads) - len(fresh)] + fresh
        self._payload = CachedLoadPlan(key, entry.payload.read_once, entry.payload.keeps_items)
        self._pending_entry = entry
        self.plan_cache_hit = True
        plan_cache.count("local_hit")
        return LoadPlan(self._reads, planner_data=self._payload)

    def _object_sink(self, path: tuple[Any, ...]) -> Callable[[Any], None]:
        """Where a loaded object goes (``create_local_plan``'s sink of a non-tensor target)."""
        return object_sink(self.original_state_dict, path)

    def _group_reads_again(self, entry: LocalEntry) -> tuple[list[ReadItem], dict[str, Callable[[Any], None]]] | None:
        """The param groups' reads and sinks for this load's group dicts, as planned (None: they differ)."""
        saved = self._saved_index()
        reads: list[ReadItem] = []
        sinks: dict[str, Callable[[Any], None]] = {}
        try:
            rest, stock = split_stock_groups(self._groups, saved, self._resolver, self.name_rules)
            for g in rest:
                group, more, _ = group_reads(g, saved, self._resolver)
                reads += group
                sinks.update(more)
        except UCPError:
            return None
        for found in stock:
            sinks.update(found.sinks)
        reads += [r for found in stock for r in found.reads]
        if [(it.storage_index.fqn, it.type) for it in reads] != entry.group_reads:
            return None
        return reads, sinks

    def _remember_plan(self, payload: LoadPlanPayload) -> LoadPlanPayload:
        """After planning: the payload with this plan's key, and what a later hit of the plan needs (cached when
        the coordinator's answer arrives). The param groups' reads are the plan's last (objects: never cut for
        staging)."""
        if self._cache_key is None:
            return payload
        payload = dataclasses.replace(payload, cache_key=self._cache_key)
        n = 0
        while n < len(self._reads) and self._reads[-1 - n].dest_index.fqn.startswith(GROUP_SINK):
            n += 1
        group = self._reads[len(self._reads) - n :]
        if any(it.type != LoadItemType.BYTE_IO for it in group):
            return payload
        self._pending_entry = LocalEntry(
            reads=list(self._reads),
            payload=payload,
            missing=list(self.missing_atoms),
            zero=[r.entry.key for r in self._zero],
            unsplit=[k for k, r in self._targets.items() if r.unsplit is not None and r.fragments is r.unsplit],
            object_sinks=[k for k in self._sinks if k in self._targets],
            group_reads=[(it.storage_index.fqn, it.type) for it in group],
            compared=dict(self._compared),
        )
        return payload

    def _commit_plan(self, answer: LoadPlan) -> None:
        """``finish_plan``: the coordinator's answer arrived (not the local plan itself: no global step), so
        it holds this rank's plan under its key now."""
        pending = self.__dict__.pop("_pending_entry", None)
        if pending is not None and self._cache_key is not None and plan_key_of(answer.planner_data) is None:
            plan_cache.put_local(self._cache_key, pending)
            plan_cache.finish("planner")

    # -- the coordinator -----------------------------------------------------------------------------------------

    def _checks_key(self, global_plan: list[LoadPlan]) -> bytes | None:
        """The key of the coordinator's checks of these plans: its own plan key and every rank's (None: some
        plan, or the coordinator's own, is not keyed)."""
        keys = [plan_key_of(p.planner_data) for p in global_plan]
        if self._cache_key is None or any(k is None for k in keys):
            return None
        return plan_cache.digest(b"ucp-load-checks-1", self._cache_key, *keys)

    def _reused_checks(self, global_plan: list[LoadPlan]) -> bytes | None:
        """Whether every rank's plan is one the coordinator's checks passed for (``global_plan_cached``);
        returns the key to mark them passed with (:meth:`_passed_checks`)."""
        key = self._checks_key(global_plan)
        self.global_plan_cached = None if key is None else plan_cache.checks_passed(key)
        if self.global_plan_cached:
            plan_cache.touch_payloads(plan_key_of(p.planner_data) for p in global_plan)
        return key

    def _passed_checks(self, key: bytes | None) -> None:
        if key is not None:
            plan_cache.pass_checks(key)

    def _payloads(self, global_plan: list[LoadPlan]) -> list[Any]:
        """Every rank's payload: a cached plan's from the cache (which keeps the others' by their keys)."""
        out: list[Any] = []
        for rank, p in enumerate(global_plan):
            pd = p.planner_data
            if isinstance(pd, CachedLoadPlan):
                pd = plan_cache.cached_payload(pd.key, rank)
            elif isinstance(pd, LoadPlanPayload) and pd.cache_key is not None:
                plan_cache.remember_payload(pd.cache_key, pd, len(global_plan))
            out.append(pd)
        return out


def object_sink(state_dict: Any, path: tuple[Any, ...]) -> Callable[[Any], None]:
    """The sink that puts a loaded object at ``path`` of ``state_dict``.

    It holds the state dict, not the planner: a closure over the planner, kept in the planner's own sinks,
    made the planner, the checkpoint's metadata and the plans one reference cycle per load, which only a
    full collection frees -- at 16 ranks a 0.25 s pause that landed inside some rank's planning and held
    every other rank at the next collective."""
    return lambda v: set_value(state_dict, path, v)


class UCPLoadPlanner(LoadHooks, CachedLoadPlans, DefaultLoadPlanner):
    """Load planner that fills any target layout from the atoms of a checkpoint.

    A drop-in for ``DefaultLoadPlanner``: the first three parameters are DCP's, in DCP's order and
    with DCP's meaning; ucp_dcp's own options are keyword-only after them.

    Args:
        flatten_state_dict: as in DCP. ``True`` (default): nested dicts and lists are loaded leaf by
            leaf under their dotted keys. ``False``: the state dict must already be flat (no nested
            containers); then nothing changes. A nested one raises :class:`UCPError` at
            ``set_up_planner``: DCP would load each nested container as one pickled object, which
            cannot be resharded or renamed.
        flatten_sharded_tensors: as in DCP; it only concerns nested (2-D) ``ShardedTensor`` values,
            which DCP's planner first flattens into one. ucp_dcp never needs that step (it plans each
            value from the boxes of memory it holds, or refuses it), so both values behave the same.
        allow_partial_load: as in DCP: skip atoms the checkpoint lacks instead of raising
            :class:`MissingAtomsError` (they are listed in ``planner.missing_atoms``); and accept a
            load that a forgotten ``stage_map``/``expert_map`` would refuse (a warning names it).
        options: the layout description shared with the save planner (:class:`UCPOptions`:
            ``patterns`` for the *target* layout — the rules recorded in the checkpoint's catalog
            apply too —, ``strict``, ``stage_map``, ``expert_map``, ``name_rules`` (as at save),
            ``data_slot``: for ``Reduce(op="sum")`` the ranks of slot 0 receive the total and the
            others 0; default only the coordinator), or those fields as keyword arguments.
        read_once: saved bytes several ranks need (replicas) are read by one rank the coordinator
            picks and sent to the others by ``UCPFileSystemReader``. ``"hosts"`` (default): only
            ranks on *other* hosts receive them; ranks on the reader's host read for themselves,
            since that host's page cache already holds the bytes (on one machine nothing is sent).
            ``"ranks"``: every other rank receives them. ``"off"``: every rank reads what it needs.
            ``True``/``False`` mean ``"ranks"``/``"off"``. The host is ``socket.gethostname()``,
            or ``UCP_DCP_HOST`` when set (to simulate several hosts on one machine).
        allow_lossy_dtype: load atoms into targets of a dtype that loses values, the way
            ``Tensor.copy_`` converts (float -> int truncates, complex -> real drops the imaginary
            part, values outside the target's range wrap, become inf or saturate). By default such loads
            raise :class:`DtypeConversionError`: kind changes at planning, before any byte is read, values
            torch's cast changes beyond rounding when the data is read. Widening and rounding conversions
            (fp32 -> bf16, fp32 65519 -> fp16 65504, int32 -> int64, int -> float) are always allowed.
        trust: decode non-tensor values with a full unpickle. By default they are decoded with
            ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, dicts, tuples and
            the types registered with ``torch.serialization.add_safe_globals``; anything else is
            refused with :class:`UnsafeCheckpointError`, since unpickling it could run code.
        cache_plans: plan a repeated load once (``ucp_dcp.load`` turns it on): the same checkpoint into the
            same target layout with the same options as an earlier load of this process sends DCP's plan gather
            a few bytes per rank and plans nothing again (:mod:`ucp_dcp.planning.plan_cache`: what the key
            covers; ``plan_cache_hit``, ``global_plan_cached``). Anything different plans afresh.

    Call order (DCP's): ``set_up_planner`` → ``create_local_plan`` → [coordinator:
    ``create_global_plan``] → ``finish_plan`` → ``load_bytes``/``resolve_tensor``/``commit_tensor``.
    As with DCP's planner, ``finish_plan`` may also be given the local plan itself (one process, no
    global step). A missing step raises :class:`UCPError` naming it.

    Subclasses override DCP's hooks with DCP's meaning (``docs/concepts.md``, "Subclassing the
    planners"): ``resolve_tensor`` is ``lookup_tensor`` + ``transform_tensor`` (``dest_index.fqn``
    is the target's flattened key); a range-checked read is converted into its target before any
    ``commit_tensor`` override runs; dropped read items leave their target as it is.
    """

    _materialize = True
    """Give meta-device targets memory at set-up (``ucp_dcp.tools.dryrun`` plans without any)."""
    _check_meshes = True
    """Refuse one atom wanted whole at two pipeline/expert positions (``ucp_dcp.tools.dryrun`` leaves it to the load)."""

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        options: UCPOptions | None = None,
        read_once: ReadOnceMode | bool = "hosts",
        allow_lossy_dtype: bool = False,
        trust: bool = False,
        cache_plans: bool = False,
        **layout: Any,
    ) -> None:
        options = options_first(flatten_state_dict, options, "UCPLoadPlanner")
        super().__init__(
            flatten_state_dict=bool(flatten_state_dict),
            flatten_sharded_tensors=bool(flatten_sharded_tensors),
            allow_partial_load=allow_partial_load,
        )
        self.options = split_options(options, layout)
        self._config = {
            "flatten_state_dict": self.flatten_state_dict,
            "flatten_sharded_tensors": self.flatten_sharded_tensors,
            "read_once": read_once,
            "allow_partial_load": allow_partial_load,
            "allow_lossy_dtype": allow_lossy_dtype,
            "trust": trust,
            "cache_plans": cache_plans,
        }
        self._init_plan_cache(cache_plans)
        self.allow_lossy_dtype = bool(allow_lossy_dtype)
        self.trust = bool(trust)
        self.read_once = (
            {True: "ranks", False: "off"}.get(read_once, read_once) if isinstance(read_once, bool) else read_once
        )
        if self.read_once not in READ_ONCE_MODES:
            raise InvalidArgumentError(f"read_once={read_once!r}: expected 'hosts', 'ranks' or 'off'")
        self.missing_atoms: list[str] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.options, self._config))  # configuration only (see UCPSavePlanner)

    name_rules = property(lambda self: self.options.name_rules)
    rules = property(lambda self: self.options.patterns)
    strict = property(lambda self: self.options.strict)
    maps = property(lambda self: self.options.maps)
    data_slot = property(lambda self: self.options.data_slot)

    def set_up_planner(
        self, state_dict: STATE_DICT_TYPE, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        # a reused planner: the previous load's plan is gone
        for stale in ("_targets", "_reads", "_sinks", "_state_view", "_global_offered", "_ties"):
            self.__dict__.pop(stale, None)
        if metadata is None:
            raise UCPError(
                "set_up_planner(state_dict, metadata) was given no checkpoint metadata to plan against",
                hint="pass the Metadata of the checkpoint (storage_reader.read_metadata()), as dcp.load does",
            )
        raise_if_unopened(metadata)  # a ucp_dcp reader could not open it: its error
        if not self.flatten_state_dict:
            require_flat(state_dict, "load")
        if self._materialize:
            _init_state_dict(state_dict)  # meta targets get memory (DCP's behaviour)
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        if is_coordinator and integrity_of(metadata) is None:
            warnings.warn(
                "this load reads through a storage reader that verifies no checksums and unpickles the "
                "checkpoint's metadata: use ucp_dcp.load(state, path) or storage_reader=UCPFileSystemReader(path)",
                UnverifiedCheckpointWarning,
                stacklevel=2,
            )
        self._catalog = self._read_catalog(metadata)  # typed and checked; newer ones refused before any read
        saved_rules = [rule_from_json(d) for d in (self._catalog.rules if self._catalog else ())]
        self._saved_rules = saved_rules
        conflicts = rule_conflicts(self.rules, saved_rules, self._catalog)
        if conflicts and self.strict:
            raise combine_problems(conflicts)
        for c in conflicts:
            logger.warning("UCP (strict=False): %s", c)
        self._patterns = Patterns(self.rules, strict=self.strict).merged(saved_rules)
        self._resolver = Resolver(self.name_rules, self._patterns, self.maps)
        resolved, self._groups = self._resolver.resolve_state_dict(state_dict, for_load=True)
        self._targets: dict[str, Resolved] = {r.entry.key: r for r in resolved}
        self._raw = raw_optimizers(state_dict, self.name_rules, self._resolver.rewrite)
        self.state_dict = {r.entry.key: r.value for r in resolved}
        self._state_view = state_view(self.state_dict)
        self.mappings = {r.entry.key: r.entry.path for r in resolved}

    # -- planning --------------------------------------------------------------------------------

    def create_local_plan(self) -> LoadPlan:
        check_state_dict(self, "UCPLoadPlanner")
        if not hasattr(self, "_targets"):
            raise protocol_error("create_local_plan", "set_up_planner(state_dict, metadata)")
        cached = self._cached_local_plan()
        if cached is not None:
            return cached
        saved = self._saved_index()
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self._zero: list[Resolved] = []
        self._untouched: set[str] = set()  # keys whose every read an override dropped
        self._scratch: dict[int, tuple[int, torch.Tensor, str]] = {}
        self.missing_atoms = []
        reads: list[ReadItem] = []
        problems: list[UCPError] = []
        keys: dict[str, str] = {}  # missing atom -> the target key that wants it (for DCP's message)
        aliased, repeats, self._compared = alias_problems(list(self._targets.values()), saved)
        problems += aliased
        raw = raw_optimizer_problems(self._raw, self._catalog, (r.name for r in self._targets.values()))
        if raw:  # keys by position that name other parameters: every other problem follows from it
            raise combine_problems(raw)
        for r in self._targets.values():
            if not r.present:
                continue
            tied = tie_problem(r, saved, self._saved_rules, self.rules)
            if tied is None:
                tied = reduce_problem(r, self._catalog)
            if tied is not None:
                problems.append(tied)
                continue
            keeps_total = self.is_coordinator if self.data_slot is None else self.data_slot == 0
            if r.reduce is not None and r.reduce.op == "sum" and not keeps_total:
                self._zero.append(r)  # the coordinator takes the total; the next save sums right
                continue
            if r.entry.key in repeats:  # a tied key: the tensor's first key reads its value
                continue
            try:
                entry, missing = entry_reads(r, saved, self.allow_lossy_dtype)
            except UCPError as err:
                problems.append(err)
                continue
            reads += entry
            self.missing_atoms += missing
            keys.update((a, r.entry.key) for a in missing)
            if entry and not r.entry.is_tensor:
                self._sinks[r.entry.key] = raw_params_sink(r, self._raw) or object_sink(
                    self.original_state_dict, r.entry.path
                )
        rest, stock = split_stock_groups(self._groups, saved, self._resolver, self.name_rules)
        for found in stock:  # a stock-DCP checkpoint's groups, keyed by position, matched by membership
            self._sinks.update(found.sinks)
            self.missing_atoms += found.missing()
        for g in rest:
            try:
                group, sinks, missing = group_reads(g, saved, self._resolver)
            except UCPError as err:
                problems.append(err)
                continue
            reads += group
            self._sinks.update(sinks)
            self.missing_atoms += missing
        reads += [r for found in stock for r in found.reads]  # after the per-parameter groups, as always
        if self.missing_atoms and not self.allow_partial_load:
            problems.insert(0, missing_error(self.missing_atoms, saved, keys))
        elif self.missing_atoms:
            logger.warning(
                "UCP partial load: %d atom(s) not in the checkpoint were left as they are: %s",
                len(self.missing_atoms),
                ", ".join(self.missing_atoms[:10]),
            )
        if problems:
            err = with_map_note(
                combine_problems(problems), self._catalog.maps if self._catalog else (), [m.key for m in self.maps]
            )
            raise with_raw_note(err, problems, self._raw)
        self._patterns.note_names(saved_names(self.metadata, self._catalog))
        # reads into device targets are cut to the staging buffer's size (bounded host memory,
        # also for pieces other ranks send)
        forced = staging_forced()
        reads = split_reads(reads, lambda it: itemsize(self.metadata, it), lambda it: self._staged(it, forced))
        self._reads = reads
        usage = RuleUsage(
            sorted(self._patterns.used),
            [c for r in self._targets.values() for c in r.index_claims],
            {m.key: m.total for m in self.maps},
        )
        # the storage layer learns who reads shared bytes, and that finish_plan puts the items back
        meshes, mapped = target_meshes(self._targets.values()), map_reads(self._catalog, self.maps, reads)
        # an override of create_global_plan sees the items, as DCP's does (else they stay on the rank)
        keeps = not overrides(self, self._hook_base, "create_global_plan")
        payload = LoadPlanPayload(usage, self.read_once, keeps_items=keeps, meshes=meshes, map_reads=mapped)
        self._payload = payload = self._remember_plan(payload)  # cache_plans: keyed, kept once answered
        return LoadPlan(reads, planner_data=payload)

    def _read_catalog(self, metadata: Metadata) -> Catalog | None:
        """The checkpoint's catalog, parsed and checked (the dry run parses it once for all simulated ranks)."""
        return load_catalog(metadata.planner_data)

    def _saved_index(self) -> SavedIndex:
        """The checkpoint's keys by atom name (``ucp_dcp.tools.dryrun`` shares one across the ranks it plans)."""
        return SavedIndex(self.metadata, self.name_rules)

    def _staged(self, item: ReadItem, forced: bool) -> bool:
        """Whether the item's target is filled through host staging (its read is cut to fit)."""
        return needs_staging(self._targets[item.dest_index.fqn].local, forced)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        self._check_unedited(global_plan)
        answers = [LoadPlan([], storage_data=p.storage_data) for p in global_plan]  # the storage layer's, kept
        if (checked := self._reused_checks(global_plan)) and self.global_plan_cached:
            return answers  # every rank's plan is one these checks passed for (cache_plans)
        payloads = self._payloads(global_plan)  # cached plans' from the cache
        foreign = [i for i, p in enumerate(payloads) if not isinstance(p, LoadPlanPayload)]
        if foreign:
            raise UCPError(
                f"create_global_plan: the plan(s) of rank(s) {foreign} were not made by UCPLoadPlanner.create_local_plan",
                hint="give every rank a UCPLoadPlanner and pass create_global_plan the plans their create_local_plan "
                "returned",
            )
        usages = [p.usage for p in payloads]
        # a coordinator that planned nothing itself still checks the usage of its own rules
        patterns = getattr(self, "_patterns", None)
        if patterns is None:
            patterns = Patterns(self.rules, strict=self.strict)
        # facts before declarations: one atom wanted whole on two meshes is a forgotten map
        if self._check_meshes:
            check_mesh_collisions(unpack_meshes(p.meshes for p in payloads), set(), "at load")
        check_rule_usage(patterns, usages, {m.key: m.total for m in self.maps}, "at load")
        if getattr(self, "_catalog", None):
            check_map_orders(self._catalog.map_orders, map_orders(usages))
            reads = [p.map_reads for p in payloads]  # plain tensors: no mesh shows a lost map
            check_forgotten_maps(self._catalog, self.metadata, self.maps, reads, self.allow_partial_load)
        self._passed_checks(checked)
        return answers

    # -- data ------------------------------------------------------------------------------------

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        # the plan's items are this planner's own reads: the coordinator's answer carries none, and
        # the local plan itself (DCP's planner accepts it here too, with no global step) carries them
        if not hasattr(self, "_reads"):
            raise protocol_error("finish_plan", "create_local_plan()")
        self._commit_plan(new_plan)  # cache_plans: the coordinator holds this rank's plan now
        new_plan = LoadPlan(self._reads, storage_data=new_plan.storage_data, planner_data=new_plan.planner_data)
        self._final = plan_snapshot(self._reads)
        # the load is validated on every rank: now it is safe to touch the target
        with torch.no_grad():
            for r in self._targets.values():
                if r.entry.key in self._untouched:  # an override dropped its reads: it keeps its value
                    continue
                for box in r.fills:
                    region = r.local
                    for d, (o, n) in enumerate(zip(box.offsets, box.sizes)):
                        region = region.narrow(d, o, n)
                    region.fill_(r.fill_value)
            for r in self._zero:
                if isinstance(r.value, torch.Tensor):
                    r.local.zero_()
                else:
                    set_element(self.original_state_dict, r.entry.path, zero_like(r.value))
        return new_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if not hasattr(self, "_sinks"):
            raise protocol_error("load_bytes", "create_local_plan()")
        self._sinks[read_item.dest_index.fqn](decode_value(value, read_item.storage_index.fqn, self.trust))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if not hasattr(self, "_targets"):
            raise protocol_error("resolve_tensor", "set_up_planner(state_dict, metadata)")
        # DCP's: the lookup, then the transform (a narrow to the item's box)
        target = self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))
        check_resolved(target, read_item)
        saved = self.metadata.state_dict_metadata[read_item.storage_index.fqn].properties.dtype
        viewed = target.is_conj() or target.is_neg()  # its memory holds other bytes than its values
        if not viewed and (
            saved == target.dtype or self.allow_lossy_dtype or conversion(saved, target.dtype) != "range"
        ):
            return self._tie_read(read_item, target)  # the reader writes (and converts) straight into the target
        # a narrowing conversion: read into a scratch tensor of the saved dtype; the values are
        # range-checked and converted into the target before commit_tensor (_outer_commit_tensor)
        return self._tie_read(read_item, self._scratch_for(read_item, target, saved))


def _rebuild(cls: type, options: UCPOptions, config: dict[str, Any]) -> Any:
    return cls(options=options, **config)
