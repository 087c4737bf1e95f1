"""Ties found from the state: keys that are one tensor (a tied embedding and output head).

A tied model holds one ``Parameter`` under two names; ``model.state_dict()`` and ``get_state_dict``
list both, as views of the same memory. At save such keys are one atom: written once, under the
first key, and the others recorded in its catalog record as ``aliases`` (with ucp_dcp's writer the
aliases are also keys of the metadata pointing at the same bytes, so stock DCP reads them). At load
an alias resolves to its atom, so the same tied model, or an untied one, gets the value in both
names without any rule.

Two atoms saved separately (a checkpoint written before ties were found, a model whose copies were
not one tensor, or a tied model saved by stock DCP, which writes each name) are one value only if
their bytes are: the checkpoint's per-chunk digests (the block checksums ucp_dcp's writer records)
tell, without reading the data; without them a tied target reads both copies and compares them
(:mod:`ucp_dcp.planning.load_steps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, is_checkpointable_tensor
from ..errors import AmbiguousLayoutError
from ..layout.naming import Path
from .catalog import CATALOG_KEY, Catalog, load_catalog
from .entries import local_tensor
from .resolve import Resolved

__all__ = [
    "IO_KEY",
    "item_key",
    "storage_identity",
    "fold_shared_storage",
    "catalog_aliases",
    "check_aliases",
    "saved_equal",
    "add_alias_keys",
]

IO_KEY = "__ucp_io__"
"""Reserved ``MetadataIndex.fqn`` of the ``Metadata.storage_data`` entry holding ucp_dcp's I/O table
(per-item data offsets and block checksums; :mod:`ucp_dcp.storage.format`). Defined here, below the
storage layer, because the load planner compares saved atoms by those checksums."""


def item_key(index: MetadataIndex) -> str:
    """Builtins key of a stored item in the ``__ucp_io__`` table."""
    return f"{index.fqn}|{','.join(map(str, index.offset or ()))}"


def storage_identity(value: Any) -> tuple[Any, ...] | None:
    """What makes two live tensors one tensor: the same memory, viewed with the same offset, shape,
    strides and dtype (and for a DTensor the same mesh, placements and global shape). None for values
    that are never folded: objects, empty, meta or sparse tensors (no plain memory to share),
    ShardedTensors and CheckpointableTensors (their pieces are stated, not viewed)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, ShardedTensor) or is_checkpointable_tensor(value):
        return None
    t = local_tensor(value)
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0 or t.layout != torch.strided:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # a tensor without plain storage (wrapper subclasses)
        return None
    key: tuple[Any, ...] = (
        str(t.device),
        ptr,
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )
    if isinstance(value, DTensor):
        # the mesh itself: DeviceMesh's equality is torch's own "same mesh" (ranks, layout, names) and its hash
        # is cached; ``mesh.mesh`` rebuilds the rank tensor on every access (1.5 ms a tensor on torch 2.13)
        key += (value.device_mesh, tuple(value.placements), tuple(value.shape))
    return key


def _foldable(r: Resolved) -> bool:
    """An entry saved as one atom cut by placements alone: no rule reshapes it (a fused or padded
    parameter, a reduced counter) and it is not already one copy of a declared tie."""
    return (
        r.present
        and not r.tied
        and not r.fanout
        and not r.fills
        and r.reduce is None
        and not r.entry.stock
        and list(r.atoms) == [r.name]
    )


def fold_shared_storage(resolved: Sequence[Resolved]) -> tuple[list[Resolved], dict[str, Path]]:
    """The entries to save, keys that view one tensor folded into the first of them (whose catalog
    record lists the others as ``aliases``); and each folded atom's flatten path."""
    first: dict[tuple[Any, ...], Resolved] = {}
    kept: list[Resolved] = []
    aliases: dict[str, list[str]] = {}
    paths: dict[str, Path] = {}
    for r in resolved:
        ident = storage_identity(r.value) if _foldable(r) else None
        owner = first.get(ident) if ident is not None else None
        if owner is None or owner.name == r.name:
            if ident is not None:
                first.setdefault(ident, r)
            kept.append(r)
            continue
        aliases.setdefault(owner.name, []).append(r.name)
        paths[r.name] = r.paths[r.name]
    for r in kept:
        if r.name in aliases:
            r.atoms[r.name] = {**r.atoms[r.name], "aliases": sorted(aliases[r.name])}
    return kept, paths


def catalog_aliases(catalog: Catalog | None) -> dict[str, str]:
    """Alias atom -> the atom it was saved as, from a catalog's records."""
    return catalog.aliases() if catalog is not None else {}


def check_aliases(catalog: Catalog) -> None:
    """Refuse a save where a key is one tensor with another on some rank but a tensor of its own on
    another rank (or the alias of two atoms): the checkpoint could not give it one value."""
    owners: dict[str, list[str]] = {}
    for name, rec in catalog.atoms.items():
        for alias in rec.aliases:
            owners.setdefault(alias, []).append(name)
    for alias, of in sorted(owners.items()):
        if alias in catalog.atoms or len(of) > 1:
            saved = sorted(of) + ([alias] if alias in catalog.atoms else [])
            raise AmbiguousLayoutError(
                f"'{alias}' shares memory with {sorted(of)[0]!r} on some rank but is saved as "
                f"{'a tensor of its own' if alias in catalog.atoms else 'a copy of ' + repr(sorted(of)[1])} "
                "by another: the checkpoint cannot hold one value for it",
                atom=alias,
                saved=saved,
                wanted="one tensor under both names on every rank",
                hint="tie the parameters the same way on every rank (or on none), or declare the tie explicitly "
                "with ucp_dcp.Tied(<param>, [<alias>]) at save and load",
            )


def saved_equal(md: Metadata, a: str, b: str) -> bool | None:
    """Whether saved keys ``a`` and ``b`` hold bitwise the same tensor, judged by the checkpoint's
    digests without reading data: False when shapes or dtypes differ or a chunk's digests do; True when
    both were saved in the same chunks with equal digests; None when the checkpoint cannot tell (no
    digests: a writer without checksums or stock DCP's; or the two were cut into other chunks)."""
    sa, sb = md.state_dict_metadata.get(a), md.state_dict_metadata.get(b)
    if not isinstance(sa, TensorStorageMetadata) or not isinstance(sb, TensorStorageMetadata):
        return None
    if tuple(sa.size) != tuple(sb.size) or sa.properties.dtype != sb.properties.dtype:
        return False
    boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in sa.chunks)
    if boxes != sorted((tuple(c.offsets), tuple(c.sizes)) for c in sb.chunks):
        return None
    io = (md.storage_data or {}).get(MetadataIndex(IO_KEY)) if isinstance(md.storage_data, dict) else None
    if not isinstance(io, dict) or not io.get("algo"):
        return None
    table = io.get("items") or {}
    for offsets, _ in boxes:
        ea = table.get(item_key(MetadataIndex(a, torch.Size(offsets))))
        eb = table.get(item_key(MetadataIndex(b, torch.Size(offsets))))
        if not ea or not eb or not isinstance(ea[1], list) or not isinstance(eb[1], list):
            return None
        if ea[4:5] != eb[4:5]:  # sums over different blocks (I/O table version 4) say nothing of the bytes
            return None
        if ea[1] != eb[1]:
            return False
    return True


def add_alias_keys(md: Metadata, storage: dict[MetadataIndex, Any], table: dict[str, Any]) -> None:
    """Make every alias the catalog records a key of ``md`` whose chunks are its atom's stored bytes
    (``storage``: the writer's storage entries, ``table``: its I/O table): the bytes stay written
    once, and stock DCP finds the alias like any key. Called by a writer that controls the storage
    entries (DCP's own writer does not: its checkpoints keep aliases in the catalog only)."""
    raw = (md.planner_data or {}).get(CATALOG_KEY) if isinstance(md.planner_data, dict) else None
    atoms = raw.get("atoms") if isinstance(raw, dict) else None
    if isinstance(atoms, dict) and not any(isinstance(r, dict) and r.get("aliases") for r in atoms.values()):
        return  # no tie recorded (the common case): parsing the whole catalog again costs ~0.2 ms an atom a save
    for alias, atom in catalog_aliases(load_catalog(md.planner_data)).items():
        smd = md.state_dict_metadata.get(atom)
        if not isinstance(smd, TensorStorageMetadata) or alias in md.state_dict_metadata:
            continue
        indices = [MetadataIndex(atom, c.offsets) for c in smd.chunks]
        if not all(i in storage for i in indices):
            continue
        md.state_dict_metadata[alias] = smd
        for i in indices:
            storage[MetadataIndex(alias, i.offset)] = storage[i]
            if item_key(i) in table:
                table[item_key(MetadataIndex(alias, i.offset))] = table[item_key(i)]
