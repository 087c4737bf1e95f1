"""ucp_dcp inside torch_checkpointing (Meta's ``CheckpointManager``, what torchtitan moves to): a
``Resharder`` that brings our atoms, rules and checks to its resharding loads.

    from ucp_dcp.peers.torch_checkpointing import UCPResharder
    res = UCPResharder(patterns=[...], stage_map=..., expert_map=...)   # ucp_dcp.save's options, per rank
    items = {k: ItemSpec(resharder=res) for k in ("model", "optim", "train_state")}

Why its resharding interface and not its storage: torch_checkpointing's ``Storage`` moves whole files of
bytes; names, layouts and values are only seen by the resharder, whose ``extract_sharding_metadata`` runs
on every rank at save (its result is stored in the checkpoint's JSON metadata) and whose ``load`` receives
that metadata, the target and the storage. So at save we record each leaf's atoms and fragments (the
resolution ``ucp_dcp.save`` runs: name rules, stage/expert maps, ``Fused``, ``Padded``, ``Tied``,
``Reduce``), and at load we resolve the target the same way and copy box by box, refusing with our
``UCPError`` what a ``ucp_dcp.load`` would refuse: missing atoms, shape changes, lossy dtypes, boxes not
covered exactly once, replicas of a ``Replicated(check="error")`` tensor that differ, group
hyperparameters that disagree. Files are torch_checkpointing's own (``<item>_<rank>.pt``), opened with
``weights_only=True`` (no code from the checkpoint runs) and memory-mapped when on a local disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import (
    CoverageError,
    DtypeConversionError,
    ParamGroupError,
    ReplicaMismatchError,
    ShapeMismatchError,
    UCPError,
)
from ..layout.dtypes import check_range, conversion
from ..layout.fragments import Box
from ..layout.index_maps import IndexMap
from ..layout.naming import NameRules
from ..layout.patterns import Patterns, Rule
from ..layout.placements import dtype_from_name
from ..planning.consistency import reduce_values
from ..planning.entries import local_tensor, set_value
from ..planning.load_steps import combine_problems, same_value
from ..planning.resolve import Resolved, Resolver
from .tc_records import LeafRecord, NestedPath, record_leaves
from .tc_saved import Copy, Files, Piece, Saved, agreed, missing_error, sub_box

try:
    from torch_checkpointing.distributed_metadata import ShardingMetadata
    from torch_checkpointing.resharding import Resharder
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "ucp_dcp.peers.torch_checkpointing needs torch_checkpointing: pip install 'ucp-dcp[torch-checkpointing]'"
    ) from e

__all__ = ["UCPResharder", "UCPShardingMetadata"]


@dataclass(frozen=True, eq=True)
class UCPShardingMetadata(ShardingMetadata, type_name="ucp_dcp"):
    """torch_checkpointing's per-leaf metadata entry holding a :class:`LeafRecord` (JSON, no pickle)."""

    record: LeafRecord
    """The leaf's atoms and fragments on the saving rank."""

    def to_dict(self) -> dict[str, Any]:
        return self.record.to_dict()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UCPShardingMetadata:
        return cls(LeafRecord.from_dict(d))

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


class UCPResharder(Resharder):
    """A torch_checkpointing ``Resharder`` that loads through ucp_dcp's atoms, rules and checks.

    Takes the layout options of ``ucp_dcp.save``/``load`` (per rank, like them): ``patterns``,
    ``stage_map``, ``expert_map``, ``name_rules``, ``data_slot``. Give it to every item (model, optimizer,
    train state) from the first save: the metadata it records is what a later load reshards from.
    """

    def __init__(
        self,
        *,
        patterns: Sequence[Rule] = (),
        stage_map: IndexMap | None = None,
        expert_map: IndexMap | None = None,
        name_rules: NameRules | None = None,
        data_slot: int | None = None,
    ) -> None:
        self.patterns = tuple(patterns)
        self.maps = tuple(m for m in (stage_map, expert_map) if m is not None)
        self.names = name_rules or NameRules()
        self.data_slot = data_slot
        Patterns(self.patterns)  # bad regexes fail here

    def _resolver(self) -> Resolver:
        return Resolver(self.names, Patterns(self.patterns, strict=False), self.maps)

    # -- save: what torch_checkpointing stores in its metadata ------------------------------------------------

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[NestedPath, ShardingMetadata]:
        recs = record_leaves(self._resolver(), item_key, item_value, self.data_slot)
        return {p: UCPShardingMetadata(r) for p, r in recs.items()}

    def should_reshard(self, source_metadata: Any, target_metadata: Any) -> bool:
        """Always: names and values are ours to map (a stage-local layer has the same path and
        placement on another stage), and a direct read would skip every check."""
        return source_metadata is not None

    # -- load -------------------------------------------------------------------------------------------------

    def load(
        self,
        source_path: Path,
        item_key: str,
        target_metadata: Any,
        source_metadata: Any,
        target: Any,
        storage: Any,
    ) -> list[NestedPath]:
        saved = Saved.of(item_key, source_metadata)
        files = Files(Path(source_path), item_key, source_metadata, storage)
        root = {item_key: target}
        resolved, groups = self._resolver().resolve_state_dict(root, for_load=True)
        problems: list[UCPError] = []
        missing: list[str] = []
        copies: list[Copy] = []
        objects: list[tuple[Resolved, list[Piece]]] = []
        for r in resolved:
            if not r.present:
                continue
            if not r.entry.is_tensor or r.reduce is not None:
                pieces = saved.objects.get(r.name)
                if not pieces:
                    missing.append(r.name)
                else:
                    objects.append((r, pieces))
                continue
            try:
                copies += self._plan_tensor(r, saved, missing)
            except UCPError as err:
                problems.append(err)
        if missing:
            problems.insert(0, missing_error(missing, saved))
        if problems:
            raise combine_problems(problems)
        for c in copies:
            self._copy(c, files)
        for r in resolved:
            for b in r.fills if r.present and r.entry.is_tensor else ():
                sub_box(r.local, b, (0,) * len(b.offsets)).fill_(r.fill_value)  # type: ignore[arg-type]
        for r, pieces in objects:
            self._load_object(root, r, pieces, files)
        for g in groups:
            for hp in g.hyperparams:
                g.group[hp] = self._hyperparam([g.atom(p, hp) for p in g.params], saved, files)
        return []

    def _plan_tensor(self, r: Resolved, saved: Saved, missing: list[str]) -> list[Copy]:
        out: list[Copy] = []
        local = r.local
        if not isinstance(local, torch.Tensor):
            raise UCPError(f"'{r.name}' is a ShardedTensor with several local shards", atom=r.name, hint="use DTensors")
        for f in r.fragments:
            pieces = saved.tensors.get(f.atom)
            if not pieces:
                missing.append(f.atom)
                continue
            sshape, sdtype = saved.shapes[f.atom]
            wshape = tuple(r.atoms[f.atom]["shape"])
            if sshape != wshape:
                raise ShapeMismatchError(
                    f"Size mismatch between saved {torch.Size(sshape)} and current: {torch.Size(wshape)} for {f.atom}",
                    atom=f.atom,
                    saved=sshape,
                    wanted=wshape,
                    hint="the model config differs from the saved one, or a Padded/Fused rule is missing",
                )
            how = conversion(dtype_from_name(sdtype), local.dtype)
            if how == "lossy":
                raise DtypeConversionError(
                    f"atom '{f.atom}': saved dtype {sdtype}, wanted {local.dtype}: the conversion loses values",
                    atom=f.atom,
                    saved=sdtype,
                    wanted=str(local.dtype),
                    hint=f"load into a tensor of dtype {sdtype} and convert it yourself",
                )
            dest = f.view(local)
            if dest.numel() and dest.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
                raise UCPError(
                    f"'{f.atom}': the target's memory cannot be viewed as the atom's box (a copy, not a view)",
                    atom=f.atom,
                    hint="make the target tensor contiguous",
                )
            by_box: dict[Box, list[Piece]] = {}
            for p in pieces:
                assert p.frag is not None
                by_box.setdefault(Box(p.frag.offsets, p.frag.sizes), []).append(p)
            covered = 0
            for box, copies in by_box.items():
                ov = box.intersect(f.box)
                if ov is None:
                    continue
                covered += ov.volume
                # copies of a plain tensor are one value only if they agree: stage-local layer names saved
                # without a stage map look like replicas (ucp_dcp.save's global plan catches it at save;
                # torch_checkpointing's metadata step allows no collective, so the load checks)
                check = (r.replicated is not None and r.replicated.check == "error") or any(p.plain for p in copies)
                out.append(
                    Copy(copies[0], ov, dest, f.box.offsets, f.atom, how == "range", copies[1:] if check else [])
                )
            if covered != f.box.volume:
                raise CoverageError(
                    f"atom '{f.atom}': the saved pieces cover {covered} of the {f.box.volume} elements of box {f.box} "
                    "(each must be covered exactly once)",
                    atom=f.atom,
                    saved=sorted(str(b) for b in by_box),
                    wanted=str(f.box),
                    hint="the checkpoint is incomplete or its pieces overlap: save it again",
                )
        return out

    def _copy(self, c: Copy, files: Files) -> None:
        assert c.src.frag is not None
        src = sub_box(files.local(c.src), c.overlap, c.src.frag.offsets)
        for p in c.replicas:  # Replicated(check="error"): every saved copy must hold the same bytes
            assert p.frag is not None
            other = sub_box(files.local(p), c.overlap, p.frag.offsets)
            if not torch.equal(other, src):
                raise ReplicaMismatchError(
                    f"atom '{c.atom}': ranks {c.src.rank} and {p.rank} saved different values in box {c.overlap} "
                    "under one name, so it cannot be told which is the atom",
                    atom=c.atom,
                    saved=[c.src.rank, p.rank],
                    hint="layers numbered per pipeline stage need a stage_map (experts per rank an expert_map) given "
                    "to UCPResharder at save; replicas that drifted need fixing in the training step",
                )
        if c.check_range:
            check_range(c.atom, src, c.dest.dtype)
        sub_box(c.dest, c.overlap, c.dest_origin).copy_(src)

    def _values(self, atom: str, pieces: list[Piece], files: Files) -> list[tuple[Piece, Any]]:
        return [(p, files.leaf(p.rank, p.path)) for p in pieces]

    def _load_object(self, root: dict[str, Any], r: Resolved, pieces: list[Piece], files: Files) -> None:
        values = self._values(r.name, pieces, files)
        if r.reduce is not None:
            slots: dict[Any, list[Any]] = {}
            for p, v in values:
                slots.setdefault(("rank", p.rank) if p.data_slot is None else p.data_slot, []).append(v)
            per_slot = [reduce_values("equal", vs, r.name) for _, vs in sorted(slots.items(), key=str)]
            value = reduce_values(r.reduce.op, per_slot, r.name)
            rank = dist.get_rank() if dist.is_initialized() else 0
            keeps = rank == 0 if self.data_slot is None else self.data_slot == 0
            if r.reduce.op == "sum" and not keeps:  # one rank takes the total, so the next save sums right
                value = torch.zeros_like(value) if isinstance(value, torch.Tensor) else type(value)(0)
        else:
            value = agreed(r.name, values)
        if isinstance(r.value, torch.Tensor):
            local_tensor(r.value).copy_(value)  # type: ignore[union-attr]
        else:
            set_value(root, r.entry.path, value)

    def _hyperparam(self, atoms: list[str], saved: Saved, files: Files) -> Any:
        gone = [a for a in atoms if a not in saved.objects]
        if gone:
            raise missing_error(gone, saved)
        values = [(a, agreed(a, self._values(a, saved.objects[a], files))) for a in atoms]
        first = values[0]
        for a, v in values[1:]:
            if not same_value(first[1], v):
                raise ParamGroupError(
                    f"a target param group holds '{first[0]}' = {first[1]!r} and '{a}' = {v!r}: the saved "
                    "parameters had different hyperparameters",
                    atom=a,
                    saved=[first[1], v],
                    hint="group the target's parameters as they were grouped at save",
                )
        return first[1]
