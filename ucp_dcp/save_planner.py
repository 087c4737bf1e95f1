"""``UCPSavePlanner``: writes every value as fragments of canonical atoms, plus the catalog."""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    STATE_DICT_TYPE,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from . import compact
from ._version import __version__
from .digests import value_digest
from .errors import AmbiguousLayoutError, PatternError
from .layout import Layout
from .options import UCPOptions, split_options
from .patterns import Patterns
from .resolve import Resolved, Resolver
from .save_global import check_all, coordinate_save, merge_cached, reduce_all
from .save_local import avg_key, build_local, frag_key, is_averaged
from .collectives import p2p_group, send_device

__all__ = ["UCPSavePlanner"]

logger = logging.getLogger(__name__)

_CHECK_MODES = ("error", "warn", "off")


class UCPSavePlanner(DefaultSavePlanner):
    """Save planner that stores parallelism-independent atoms.

    Args:
        options: the layout description shared with the load planner (:class:`UCPOptions`:
            ``patterns``, ``strict``, ``stage_map``, ``expert_map``, ``name_rules``, ``data_slot``),
            or those fields as keyword arguments.
        check_replicas: what to do when a plain tensor or object saved under one name by several
            ranks differs between them: ``"error"`` (default), ``"warn"`` or ``"off"``.
        dedup_save_to_lowest_rank, enable_plan_caching: as in ``DefaultSavePlanner``; with plan
            caching on, a changed *layout* (not only changed boxes) invalidates the cached plan.
    """

    def __init__(
        self,
        options: UCPOptions | None = None,
        *,
        check_replicas: str = "error",
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        **layout: Any,
    ) -> None:
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=True,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=enable_plan_caching,
        )
        if check_replicas not in _CHECK_MODES:
            raise ValueError(f"check_replicas must be one of {_CHECK_MODES}, got {check_replicas!r}")
        self.check_replicas = check_replicas
        self.options = split_options(options, layout)
        self._config = {"check_replicas": check_replicas, "dedup_save_to_lowest_rank": dedup_save_to_lowest_rank,
                        "enable_plan_caching": enable_plan_caching}

    def __reduce__(self) -> tuple[Any, ...]:
        # async_save's process mode pickles the planner: it travels as its configuration, rebuilt
        # by __init__ on the other side, never with tensors, groups or a half-run plan
        return (_rebuild, (type(self), self.options, self._config))

    name_rules = property(lambda self: self.options.name_rules)
    rules = property(lambda self: self.options.patterns)
    strict = property(lambda self: self.options.strict)
    maps = property(lambda self: self.options.maps)
    data_slot = property(lambda self: self.options.data_slot)

    # -- local -------------------------------------------------------------------------------------

    def set_up_planner(
        self, state_dict: STATE_DICT_TYPE, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        self._patterns = Patterns(self.rules, strict=self.strict)
        self._resolver = Resolver(self.name_rules, self._patterns, self.maps)
        resolved, _ = self._resolver.resolve_state_dict(state_dict, for_load=False)
        owner: dict[str, Resolved] = {}
        self._resolved: list[Resolved] = []
        self._ties: list[tuple[Resolved, Resolved]] = []
        for r in resolved:
            if not r.present:
                continue
            if isinstance(r.value, DTensor) and Layout.from_dtensor(r.value).partial_dims():
                raise AmbiguousLayoutError(
                    f"atom '{r.name}' has a Partial placement ({Layout.from_dtensor(r.value).describe()}); its "
                    "logical value is a pending reduction, not a tensor",
                    atom=r.name, saved=Layout.from_dtensor(r.value).describe(),
                    hint="redistribute to Replicate/Shard (e.g. `.redistribute(placements=...)`) before saving",
                )
            clash = next((owner[a] for a in r.atoms if a in owner), None)
            if clash is not None:
                if r.tied and clash.tied:  # a second copy of a tied parameter on this rank: compare, save once
                    self._ties.append((clash, r))
                    continue
                raise AmbiguousLayoutError(
                    f"atom '{next(a for a in r.atoms if a in owner)}' is produced by two live keys: "
                    f"'{clash.entry.key}' and '{r.entry.key}'",
                    atom=next(a for a in r.atoms if a in owner),
                    hint="the keys differ only by wrapper segments (or two rules map them to one atom); save "
                    "one of them, declare them Tied, or pass name_rules that keep the distinguishing segment",
                )
            for a in r.atoms:
                owner[a] = r
            self._resolved.append(r)
        self.mappings = {a: p for r in self._resolved for a, p in r.paths.items()}
        self.state_dict = {r.name: r.value for r in self._resolved}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        local = build_local(self._resolved, self.mappings, self.check_replicas)
        self._local = local
        self._pieces = local.pieces
        claims = sorted({c for r in self._resolved for c in r.index_claims}, key=str)
        summary = {
            **local.summary,
            "slot": self.data_slot,
            "local_mismatch": self._local_tie_mismatches(),
            "used": sorted(self._patterns.used),
            "claims": claims,
            "map_totals": {m.key: m.total for m in self.maps},
            "coordinator": self.is_coordinator,
            "warn_keys": sorted({k for r in self._resolved if r.replicated is not None
                                 and r.replicated.check == "warn" for k in r.atoms}),
            "average": sorted({avg_key(f) for r in self._resolved if is_averaged(r) for f in r.fragments}),
            "global_rank": dist.get_rank() if dist.is_initialized() else 0,
        }
        packed = compact.pack(local.structure, local.items)
        plan = SavePlan([], planner_data={**packed, **summary})
        self.plan = plan
        if self._enable_plan_caching:
            cache = _CACHE.setdefault(self._cached_plans_key, {})
            if cache.get("local") == (packed["sh"], packed["it"]):
                logger.info("UCP: local plan and layout unchanged; reusing the cached global plan")
                return SavePlan([], usable=False, planner_data=summary)
            self._pending_local = (packed["sh"], packed["it"])
        return plan

    def _local_tie_mismatches(self) -> list[str]:
        bad = []
        for kept, dup in self._ties:
            if isinstance(kept.value, torch.Tensor):
                same = {frag_key(f): value_digest(f.view(kept.local)) for f in kept.fragments} == {
                    frag_key(f): value_digest(f.view(dup.local)) for f in dup.fragments}
            else:
                same = value_digest(kept.value) == value_digest(dup.value)
            if not same:
                bad.append(kept.name)
        return bad

    # -- coordinator -------------------------------------------------------------------------------

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cache = _CACHE.setdefault(self._cached_plans_key, {}) if self._enable_plan_caching else {}
        pds = merge_cached([p.planner_data or {} for p in all_plans], cache.get("all"))
        structures = {pd["sh"]: None for pd in pds}
        for pd in pds:
            if structures[pd["sh"]] is None:
                structures[pd["sh"]] = compact.unpack_structure(pd["s"])
        check_all(self._patterns, pds, structures, {m.key: m.total for m in self.maps}, self.check_replicas)
        self._reduced = reduce_all(self._patterns, pds)
        unchanged = self._enable_plan_caching and not any(p.usable for p in all_plans) and "global" in cache
        if unchanged:
            plans, metadata = cache["global"]
            return [SavePlan([], usable=False)] * len(all_plans), metadata
        plans, metadata = coordinate_save(pds, self._reduced, self.dedup_save_to_lowest_rank, _writer_info(),
                                          self._patterns.to_json(), [m.key for m in self.maps])
        if self._enable_plan_caching:
            cache["all"], cache["global"] = pds, (plans, metadata)
        return plans, metadata

    # -- all ranks, after the global plan succeeded ----------------------------------------------------

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        cache = _CACHE.setdefault(self._cached_plans_key, {}) if self._enable_plan_caching else {}
        if not new_plan.usable:
            new_plan = cache["final"]
        elif self._enable_plan_caching:
            cache["final"] = new_plan
        if self._enable_plan_caching and getattr(self, "_pending_local", None) is not None:
            cache["local"] = self._pending_local
            self._pending_local = None
        data = new_plan.planner_data or {}
        keep = np.unpackbits(np.frombuffer(data["keep"], dtype=np.uint8), count=data["n"]).astype(bool)
        items = compact.write_items(self._local.structure, self._local.items, keep)
        for name, kind, offsets, sizes, dtype in data.get("extra", ()):
            items.append(_reduced_item(name, kind, offsets, sizes, dtype))
        self._averaged = self._average_replicas(data.get("average") or {}) if data.get("exchange") else {}
        self.plan = dataclasses.replace(new_plan, items=items, planner_data=None)
        return self.plan

    def _average_replicas(self, todo: dict[str, tuple[int, list[int]]]) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
        """``Replicated(check="average")``: every holder of a replicated piece sends it to the rank
        that writes it, which saves the mean (point-to-point, global ranks, so any save group works;
        keys are visited in the same order everywhere). Called on every rank when any rank averages."""
        if threading.current_thread() is not threading.main_thread():
            atom = next(iter(todo), "a Replicated(check='average') atom")
            raise PatternError(
                "Replicated(check='average') needs collectives and cannot run inside async_save's "
                f"background thread (atom '{atom}')", atom=atom,
                hint="use a synchronous dcp.save, or check='error'/'warn' with async_save",
            )
        p2p_group()  # every rank at once: a side group, if the default group cannot carry host tensors
        if not todo:
            return {}
        me = dist.get_rank()
        frags = {avg_key(f): (r, f) for r in self._resolved if is_averaged(r) for f in r.fragments}
        out = {}
        for key in sorted(todo):
            writer, holders = todo[key]
            r, f = frags[key]
            local = f.view(r.local).detach()
            # device tensors over NCCL, host tensors over gloo (the default group or a side group)
            device, group = send_device(local)
            mine = local.to(device=device, dtype=torch.float64).contiguous()
            if me != writer:
                dist.isend(mine, writer, group=group).wait()
                continue
            parts = {me: mine}
            bufs = {h: torch.empty_like(mine) for h in holders if h != me}
            for w in [dist.irecv(buf, h, group=group) for h, buf in bufs.items()]:
                w.wait()
            parts.update(bufs)
            total = sum(parts[h] for h in sorted(parts))
            out[(f.atom, f.box.offsets)] = (total / len(parts)).to(device=r.local.device, dtype=r.local.dtype)
        return out

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        name = write_item.index.fqn
        reduced = getattr(self, "_reduced", {})
        if name in reduced:
            return _as_data(reduced[name], write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            r, _ = self._pieces[(name, None)]
            return _as_data(r.value, write_item)
        offsets = tuple(write_item.index.offset)
        r, f = self._pieces[(name, offsets)]
        if f is None:
            return torch.empty(tuple(r.atoms[name]["shape"]), dtype=r.local.dtype)
        averaged = getattr(self, "_averaged", {}).get((name, offsets))
        if averaged is not None:
            return averaged
        return f.view(r.local).detach()


def _as_data(value: Any, item: WriteItem) -> torch.Tensor | io.BytesIO:
    if item.type != WriteItemType.BYTE_IO:
        return value
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf


def _reduced_item(name: str, kind: int, offsets: tuple, sizes: tuple, dtype: Any) -> WriteItem:
    if kind == compact.BYTES:
        return WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)
    return WriteItem(
        index=MetadataIndex(name, offsets),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(sizes),
        ),
    )


_CACHE: dict[str, dict[str, Any]] = {}
"""Plan cache per planner class (like DCP's): the last local plan, all plans, global plans, final plan."""


def _writer_info() -> dict[str, str]:

    return {"ucp_dcp": __version__, "torch": torch.__version__.split("+")[0]}


def _rebuild(cls: type, options: UCPOptions, config: dict[str, Any]) -> Any:
    return cls(options, **config)
