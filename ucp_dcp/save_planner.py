"""``UCPSavePlanner``: writes every value as fragments of canonical atoms, plus the catalog."""

from __future__ import annotations

import dataclasses
import io
import logging
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    STATE_DICT_TYPE,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _compare_save_plans
from torch.distributed.tensor import DTensor

from . import catalog as cat_mod
from .dedup import balanced_dedup
from .digests import value_digest
from .errors import AmbiguousLayoutError, CoverageError, ReplicaMismatchError
from .fragments import Fragment, layout_fragments
from .layout import Layout, dtensor_coordinate, dtype_name, mesh_info
from .naming import NameRules
from .state import Entry, collect_entries, local_tensor

__all__ = ["UCPSavePlanner"]

logger = logging.getLogger(__name__)

_CHECK_MODES = ("error", "warn", "off")


class UCPSavePlanner(DefaultSavePlanner):
    """Save planner that stores parallelism-independent atoms.

    Args:
        check_replicas: what to do when a plain tensor or object saved under one name by several
            ranks differs between them: ``"error"`` (default), ``"warn"`` or ``"off"``.
        name_rules: wrapper segments stripped from names (default: compile, activation
            checkpointing, FSDP1 and DDP wrappers).
        dedup_save_to_lowest_rank, enable_plan_caching: as in ``DefaultSavePlanner``; with plan
            caching on, a changed *layout* (not only changed boxes) invalidates the cached plan.
    """

    def __init__(
        self,
        *,
        check_replicas: str = "error",
        name_rules: NameRules | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
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
        self.name_rules = name_rules or NameRules()

    def __getstate__(self) -> dict[str, Any]:
        # async_save's process mode pickles the planner: ship configuration, never tensors
        keep = {"check_replicas", "name_rules", "dedup_save_to_lowest_rank", "_enable_plan_caching",
                "_cached_plans_key", "flatten_state_dict", "flatten_sharded_tensors"}
        return {k: v for k, v in self.__dict__.items() if k in keep} | {"mappings": {}}

    # -- local -------------------------------------------------------------------------------------

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        entries, mappings, _ = collect_entries(state_dict, self.name_rules, for_load=False)
        by_atom: dict[str, Entry] = {}
        for e in entries:
            other = by_atom.get(e.name)
            if other is not None:
                raise AmbiguousLayoutError(
                    f"atom '{e.name}' is produced by two live keys: '{other.key}' and '{e.key}'",
                    atom=e.name,
                    hint="the keys differ only by wrapper segments; save one of them "
                    "(or pass name_rules that keep the segment that distinguishes them)",
                )
            if isinstance(e.value, DTensor):
                layout = Layout.from_dtensor(e.value)
                if layout.partial_dims():
                    raise AmbiguousLayoutError(
                        f"atom '{e.name}' has a Partial placement ({layout.describe()}); its logical "
                        "value is a pending reduction, not a tensor",
                        atom=e.name,
                        saved=layout.describe(),
                        hint="redistribute to Replicate/Shard (e.g. `.redistribute(placements=...)`) before saving",
                    )
            by_atom[e.name] = e
        self._entries = by_atom
        self.mappings = mappings
        self.state_dict = {name: e.value for name, e in by_atom.items()}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        self._pieces: dict[tuple[str, tuple[int, ...]], tuple[Entry, Fragment | None]] = {}
        local_cat = cat_mod.local_catalog()
        digests: dict[str, int] = {}
        for name, e in self._entries.items():
            rec: dict[str, Any] = {"kind": e.atom.kind, "param": e.atom.param}
            if not e.is_tensor:
                items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
                rec.update(value="object", pattern="object")
                local_cat["atoms"][name] = rec
                self._digest(digests, name, e.value)
                continue
            value = e.value
            if isinstance(value, DTensor):
                coord = dtensor_coordinate(value)
                if coord is None:  # this rank is not part of the value's mesh
                    continue
                layout = Layout.from_dtensor(value)
                mesh_idx = cat_mod.intern(local_cat["meshes"], mesh_info(value).to_json())
                rec["layout"] = {"mesh": mesh_idx, "placements": layout.encode_placements()}
                rec["pattern"] = "dtensor"
                item_type = WriteItemType.SHARD
            else:
                coord, layout = (), Layout.replicated()
                rec["pattern"] = "plain"
                item_type = WriteItemType.TENSOR
                self._digest(digests, name, value)
            shape = tuple(int(s) for s in value.shape)
            rec.update(value="tensor", shape=list(shape), dtype=dtype_name(value.dtype))
            local_cat["atoms"][name] = rec
            props = TensorProperties.create_from_tensor(local_tensor(value))
            frags: list[Fragment | None]
            if value.numel() == 0:  # keep empty atoms visible in the metadata: one empty chunk
                frags = [None]
            else:
                frags = list(layout_fragments(name, shape, layout, coord))
            for f in frags:
                offsets = f.box.offsets if f is not None else (0,) * len(shape)
                sizes = f.box.sizes if f is not None else shape
                items.append(
                    WriteItem(
                        index=MetadataIndex(name, offsets),
                        type=item_type,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                            properties=props,
                            size=torch.Size(shape),
                        ),
                    )
                )
                self._pieces[(name, tuple(offsets))] = (e, f)
        plan = SavePlan(
            items, planner_data={"mappings": self.mappings, "catalog": local_cat, "digests": digests}
        )
        self.plan = plan
        if self._enable_plan_caching:
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is not None and _same_local_plan(plan, cached):
                logger.info("UCP: local plan and layout unchanged; reusing the cached global plan")
                return SavePlan([], usable=False, planner_data={"digests": digests})
            self._pending_local_plan = plan
        return plan

    def _digest(self, digests: dict[str, int], name: str, value: Any) -> None:
        if self.check_replicas == "off":
            return
        d = value_digest(value)
        if d is not None:
            digests[name] = d

    # -- coordinator -------------------------------------------------------------------------------

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self._check_replicas(all_plans)
        return super().create_global_plan(all_plans)

    def _check_replicas(self, all_plans: list[SavePlan]) -> None:
        if self.check_replicas == "off":
            return
        seen: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for rank, plan in enumerate(all_plans):
            for name, d in ((plan.planner_data or {}).get("digests") or {}).items():
                seen[name][d].append(rank)
        bad = {name: by_digest for name, by_digest in seen.items() if len(by_digest) > 1}
        if not bad:
            return
        lines = []
        for name, by_digest in sorted(bad.items())[:10]:
            groups = "; ".join(f"ranks {ranks}" for ranks in by_digest.values())
            lines.append(f"  {name}: {len(by_digest)} different values ({groups})")
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        first = sorted(bad)[0]
        err = ReplicaMismatchError(
            f"{len(bad)} value(s) saved under a shared name differ across ranks; DCP would keep one "
            f"rank's copy and silently drop the others:\n" + "\n".join(lines) + more,
            atom=first,
            hint="give per-rank values distinct names (e.g. a rank suffix), make them DTensors, or "
            "declare how to reduce them; pass check_replicas='warn' to save anyway",
        )
        if self.check_replicas == "warn":
            logger.warning("%s", err)
            return
        raise err

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        if self.dedup_save_to_lowest_rank:
            return super()._dedup_save_plans(all_plans)
        return balanced_dedup(all_plans)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        local_cats, mappings, plans = [], {}, []
        for p in all_plans:
            pd = p.planner_data or {}
            local_cats.append(pd.get("catalog"))
            mappings.update(pd.get("mappings") or {})
            plans.append(dataclasses.replace(p, planner_data=None))
        catalog = cat_mod.merge_local_catalogs(local_cats, writer=_writer_info())
        global_plan, metadata = create_default_global_save_plan(self._dedup_save_plans(plans))
        planner_data: dict[str, Any] = dict(mappings)
        planner_data[cat_mod.CATALOG_KEY] = catalog
        metadata = dataclasses.replace(metadata, planner_data=planner_data)
        errors = _validate_global_plan(global_plan, metadata)
        if errors:
            raise CoverageError(
                "saved chunks do not tile their atoms: " + "; ".join(errors)[:1000],
                hint="some rank holds an unexpected layout for these atoms; this is a bug if the "
                "values are DTensors, please report it with the layouts from the message",
            )
        return global_plan, metadata

    # -- data ----------------------------------------------------------------------------------------

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        name = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self._entries[name].value, buf)
            return buf
        e, f = self._pieces[(name, tuple(write_item.index.offset))]
        if f is None:
            return torch.empty(tuple(e.value.shape), dtype=e.value.dtype)
        return f.view(local_tensor(e.value)).detach()


def _same_local_plan(plan: SavePlan, cached: SavePlan) -> bool:
    """DCP's cache compares boxes only; a layout change with identical boxes (TP ``Shard(0)`` vs
    FSDP ``Shard(0)``) must also re-plan, or the catalog would describe the old layout."""
    if not _compare_save_plans(plan, cached):
        return False
    mine, theirs = plan.planner_data or {}, cached.planner_data or {}
    return mine.get("catalog") == theirs.get("catalog") and mine.get("mappings") == theirs.get("mappings")


def _writer_info() -> dict[str, str]:
    from . import __version__

    return {"ucp_dcp": __version__, "torch": torch.__version__.split("+")[0]}
