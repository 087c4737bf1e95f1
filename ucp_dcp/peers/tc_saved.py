"""The checkpoint side of :class:`~ucp_dcp.peers.torch_checkpointing.UCPResharder`'s load: the saved atoms from
an item's torch_checkpointing metadata (:class:`Saved`), the saving ranks' files (:class:`Files`), and the checks
on saved copies. No torch_checkpointing import: its metadata objects are read by attribute.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CatalogError, MissingAtomsError, ReplicaMismatchError, UCPError
from ..layout.fragments import Box
from ..planning.entries import local_tensor
from ..planning.load_steps import same_value
from .tc_records import FragmentRecord, LeafRecord, NestedPath, leaf_at

__all__ = ["Piece", "Saved", "Files", "Copy", "sub_box", "agreed", "missing_error"]


@dataclass(frozen=True)
class Piece:
    """A saved leaf (or fragment of one) holding part of an atom."""

    rank: int
    """The saving rank (its file)."""
    path: NestedPath
    """The leaf's path within the item."""
    frag: FragmentRecord | None = None
    """Tensor pieces: the fragment; objects: None."""
    data_slot: int | None = None
    """The saving rank's data slot."""
    plain: bool = False
    """Saved from a plain tensor (copies on several ranks must agree to be one value)."""


@dataclass
class Saved:
    """The checkpoint's atoms, from the item's metadata."""

    tensors: dict[str, list[Piece]] = field(default_factory=dict)
    objects: dict[str, list[Piece]] = field(default_factory=dict)
    shapes: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)

    @classmethod
    def of(cls, item_key: str, source_metadata: Any) -> Saved:
        out = cls()
        for path, groups in source_metadata.nested_path_to_metadata.items():
            for g in groups:
                md = g.sharding_metadata
                rec = getattr(md, "record", None)
                if not isinstance(rec, LeafRecord):
                    raise CatalogError(
                        f"item '{item_key}' was saved without UCPResharder ({type(md).__name__} at "
                        f"{'.'.join(map(str, path))}): its metadata holds no atoms",
                        saved=type(md).__name__,
                        wanted="UCPShardingMetadata",
                        hint="load it with the resharder it was saved with (DefaultResharder), and save with "
                        "ItemSpec(resharder=UCPResharder(...)) from then on",
                    )
                for rank in g.ranks:
                    out._add(rec, int(rank), tuple(path))
        return out

    def _add(self, rec: LeafRecord, rank: int, path: NestedPath) -> None:
        if rec.kind == "tensor":
            for atom, shape, dtype in rec.atoms:
                self.shapes.setdefault(atom, (shape, dtype))
            for f in rec.fragments:
                self.tensors.setdefault(f.atom, []).append(Piece(rank, path, f, rec.data_slot, rec.plain))
        else:
            for atom, _, _ in rec.atoms:
                self.objects.setdefault(atom, []).append(Piece(rank, path, None, rec.data_slot))

    def names(self) -> set[str]:
        return set(self.tensors) | set(self.objects)


class Files:
    """Each saving rank's item file, opened once per load: ``weights_only`` always, memory-mapped on a
    local disk (only the pages of the pieces read are touched)."""

    def __init__(self, root: Path, item_key: str, source_metadata: Any, storage: Any) -> None:
        self.root, self.item_key, self.md, self.storage = root, item_key, source_metadata, storage
        self._open: dict[int, Any] = {}

    def leaf(self, rank: int, path: NestedPath) -> Any:
        if rank not in self._open:
            rel = self.md.get_layout_info(rank, self.item_key).file_path
            full = self.root / rel
            if os.path.isfile(full):
                self._open[rank] = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
            else:
                with self.storage.stream_read(full) as f:
                    self._open[rank] = torch.load(f, map_location="cpu", weights_only=True)
        return leaf_at(self._open[rank], path)

    def local(self, p: Piece) -> torch.Tensor:
        assert p.frag is not None
        return p.frag.fragment().view(local_tensor(self.leaf(p.rank, p.path)))


@dataclass
class Copy:
    """One box copied from a saved piece into the target."""

    src: Piece
    overlap: Box
    dest: torch.Tensor
    dest_origin: tuple[int, ...]
    atom: str
    check_range: bool
    replicas: list[Piece]


def sub_box(t: torch.Tensor, box: Box, origin: Sequence[int]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(box.offsets, box.sizes)):
        t = t.narrow(d, o - origin[d], s)
    return t


def agreed(atom: str, values: list[tuple[Piece, Any]]) -> Any:
    (p0, v0), rest = values[0], values[1:]
    for p, v in rest:
        if not same_value(v0, v):
            raise ReplicaMismatchError(
                f"atom '{atom}' was saved with different values by ranks {p0.rank} ({v0!r}) and {p.rank} ({v!r})",
                atom=atom,
                saved=[v0, v],
                hint="declare a Reduce rule for a per-rank counter, or give the value a per-rank name",
            )
    return v0


def missing_error(missing: list[str], saved: Saved) -> UCPError:
    names = sorted(saved.names())
    lines = []
    for i, name in enumerate(missing[:20]):
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.8) if i < 5 else []
        lines.append(f"  {name}" + (f"  (closest saved: {close[0]})" if close else ""))
    return MissingAtomsError(
        f"Missing key in checkpoint state_dict: {missing[0]}.\n{len(missing)} atom(s) wanted by the target are not "
        "in the checkpoint:\n" + "\n".join(lines),
        atom=missing[0],
        wanted=list(missing),
        hint="check the model config, the stage/expert maps and the rules given to UCPResharder at save and load",
    )
