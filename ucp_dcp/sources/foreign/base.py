"""``ForeignReader``: a checkpoint of another framework as a DCP checkpoint of atoms.

A subclass says what the foreign files hold — tensor :class:`~ucp_dcp.sources.foreign.pieces.Piece` s (boxes
of atoms at byte offsets) and plain values (step counters, param-group hyperparameters) — and this
base presents them to ``dcp.load`` as saved chunks and objects: ``UCPLoadPlanner`` plans any target
layout against them as against a ucp_dcp checkpoint, and the reads are the ranged, file-ordered,
read-once reads of :class:`~ucp_dcp.storage.reader.UCPFileSystemReader`. Before anything is read, every
atom must be covered by its pieces exactly once and every piece must lie inside its file.

:func:`row_layout` turns the *target's* own ``Fused``/``Padded`` rules into the source's row layout
(with the source's degrees, e.g. ``tp=1`` for a DeepSpeed DP-only run), so a source that stores a
fused parameter needs no rule of its own.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from ..._compat import _StorageInfo, narrow_tensor_by_index
from ...errors import CorruptCheckpointError, UCPError, UnverifiedCheckpointWarning
from ...layout.fragments import Box, Segment, exact_cover_problem, fused_block_problem, fused_segments
from ...layout.patterns import Fused, Padded, Rule
from ...planning.device import StagingMode
from ...planning.opened import raise_if_unopened
from ...planning.payloads import ReadOnceMode
from ...storage.commit import Integrity
from ...storage.format import TensorRecord
from ...storage.reader import UCPFileSystemReader
from .pieces import Piece, RowLayout

__all__ = ["ForeignReader", "FOREIGN_KEY", "row_layout"]

FOREIGN_KEY = "__ucp_foreign__"
"""Reserved ``storage_data`` entry: encoded plain values and file sizes (any rank sets up from it)."""


def row_layout(
    param: str,
    rows: int,
    rules: Sequence[Rule],
    degrees: dict[str, int] | None = None,
    prefix: str = "",
    suffix: str = "",
) -> RowLayout:
    """How ``param`` (``rows`` long on dim 0) holds atoms in the source: the first dim-0 ``Fused``
    rule matching it (``blocks`` naming a mesh dim takes the source's degree from ``degrees``,
    default 1) and the first dim-0 ``Padded`` rule. Atoms are ``prefix + part + suffix``
    (``"model."``; ``"optim.state."`` and ``".exp_avg"``)."""
    degrees = degrees or {}
    size = rows
    for r in rules:
        if isinstance(r, Padded) and r.dim == 0 and re.fullmatch(r.pattern, param):
            size = min(rows, r.size)
            break
    for r in rules:
        m = re.fullmatch(r.pattern, param) if isinstance(r, Fused) and r.dim == 0 else None
        if m is None:
            continue
        blocks = r.blocks if isinstance(r.blocks, int) else degrees.get(r.blocks, 1)
        sizes = [n for _, n in r.parts]
        problem = fused_block_problem(sizes, blocks, rows)
        if problem:
            raise UCPError(
                f"'{param}' ({rows} rows) is not fused as {r}: {problem}",
                atom=param,
                saved=rows,
                wanted=sum(sizes),
                hint="check the source's degrees and the model sizes of the rules",
            )
        return RowLayout(
            tuple(prefix + m.expand(t) + suffix for t, _ in r.parts), tuple(fused_segments(sizes, blocks)), rows
        )
    return RowLayout((prefix + param + suffix,), (Segment(0, rows, 0, 0),), size)


class ForeignReader(UCPFileSystemReader):
    """Base of the readers of other frameworks' checkpoints (see module doc). Subclasses implement
    :meth:`describe`; ``source`` names the format in messages."""

    source = "foreign"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int | None = None,
        staging: StagingMode | None = None,
        read_once: ReadOnceMode | None = None,
    ) -> None:
        super().__init__(path, thread_count=thread_count, verify_checksums=False, staging=staging, read_once=read_once)

    def describe(self) -> tuple[list[Piece], dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, Any]]:
        """``(pieces, atom dtype and shape, plain values by atom)`` of the checkpoint at ``self.path``."""
        raise UCPError(
            f"{type(self).__name__} reads no format: ForeignReader is the base of the foreign readers",
            hint="use DeepSpeedReader or MegatronReader, or a subclass that implements describe()",
        )

    def _open(self) -> tuple[Metadata, Integrity]:
        return self._metadata(), Integrity("none")  # no checksums: this reader warns, in its own words

    def _metadata(self) -> Metadata:
        pieces, atoms, values = self.describe()
        by_atom: dict[str, list[Piece]] = {}
        for p in pieces:
            by_atom.setdefault(p.atom, []).append(p)
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        sizes: dict[str, int] = {}
        for atom, (dtype, shape) in sorted(atoms.items()):
            ps = by_atom.pop(atom, [])
            problem = exact_cover_problem(Box((0,) * len(shape), tuple(shape)), [Box(p.offsets, p.sizes) for p in ps])
            if problem:
                raise CorruptCheckpointError(
                    f"{self.source} checkpoint {self.path}: atom '{atom}' {list(shape)}: {problem}",
                    atom=atom,
                    hint="the checkpoint is incomplete, or its layout is not what the "
                    "reader was told (degrees, model sizes)",
                )
            for p in ps:
                if p.dtype != dtype:
                    raise CorruptCheckpointError(f"atom '{atom}' has pieces of {p.dtype} and {dtype}", atom=atom)
                storage[MetadataIndex(atom, p.offsets)] = _StorageInfo(p.file, p.byte_offset, p.nbytes)
                sizes[p.file] = max(sizes.get(p.file, 0), p.byte_offset + p.nbytes)
            state[atom] = TensorStorageMetadata(
                TensorProperties(dtype=dtype),
                torch.Size(shape),
                [
                    ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes))
                    for p in sorted(ps, key=lambda p: p.offsets)
                ],
            )
        if by_atom:
            raise UCPError(f"pieces of undeclared atoms {sorted(by_atom)[:4]}")
        encoded: dict[str, bytes] = {}
        tensors: dict[str, bytes] = {}
        for atom, value in sorted(values.items()):
            if isinstance(value, torch.Tensor):  # a tensor the format keeps as a number (a step in a dict)
                t = value.detach().contiguous()
                tensors[atom] = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                zeros = (0,) * t.dim()
                state[atom] = TensorStorageMetadata(
                    TensorProperties(dtype=t.dtype), t.size(), [ChunkStorageMetadata(torch.Size(zeros), t.size())]
                )
                storage[MetadataIndex(atom, zeros)] = _StorageInfo("", 0, len(tensors[atom]))
                continue
            buf = io.BytesIO()
            torch.save(value, buf)
            encoded[atom] = buf.getvalue()
            state[atom] = BytesStorageMetadata()
            storage[MetadataIndex(atom)] = _StorageInfo("", 0, len(encoded[atom]))
        for rel, need in sizes.items():  # every piece inside its file
            have = os.path.getsize(os.path.join(self.path, rel))
            if have < need:
                raise CorruptCheckpointError(
                    f"{self.path}/{rel} has {have} bytes; its pieces reach {need}",
                    saved=need,
                    wanted=have,
                    hint="the file is truncated",
                )
        storage[MetadataIndex(FOREIGN_KEY)] = {
            "values": encoded,
            "tensors": tensors,
            "files": {k: os.path.getsize(os.path.join(self.path, k)) for k in sizes},
        }
        return Metadata(state_dict_metadata=state, planner_data={}, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        raise_if_unopened(metadata)
        table = (metadata.storage_data or {}).get(MetadataIndex(FOREIGN_KEY))
        if not isinstance(table, dict):
            raise UCPError(
                f"{type(self).__name__} was set up with metadata it did not read",
                hint="let dcp.load call read_metadata() on this reader",
            )
        self._values: dict[str, bytes] = table["values"]
        self._tensors: dict[str, bytes] = table.get("tensors", {})
        self.integrity = Integrity("none", files=table["files"])
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if is_coordinator:
            warnings.warn(
                f"{self.source} checkpoint {self.path} carries no checksums ucp_dcp can verify: its "
                "structure is validated, its tensor bytes cannot be",
                UnverifiedCheckpointWarning,
                stacklevel=2,
            )

    def _record(self, f: Any, index: MetadataIndex, info: Any) -> TensorRecord | None:
        dtype, shape = self._chunk_meta[index]
        return TensorRecord(0, dtype, shape, True)  # info.offset is the piece's first byte

    def _read_local(self, job: Any, skip: set[int]) -> None:
        # plain values are decoded from the metadata, not read from a file
        mine = set(skip)
        for i, item in enumerate(job.plan.items):
            fqn = item.storage_index.fqn
            if i in skip:
                continue
            if item.type == LoadItemType.BYTE_IO and fqn in self._values:
                data = memoryview(self._values[fqn])
                job.keep_if_sent(item, data)
                job.objects.append((item, data))
                mine.add(i)
            elif item.type != LoadItemType.BYTE_IO and fqn in self._tensors:
                dtype, shape = self._chunk_meta[item.storage_index]
                whole = (
                    torch.frombuffer(bytearray(self._tensors[fqn]), dtype=dtype).view(shape)
                    if shape
                    else torch.frombuffer(bytearray(self._tensors[fqn]), dtype=dtype).view(())
                )
                box = narrow_tensor_by_index(whole, item.storage_offsets, item.lengths).contiguous()
                data = memoryview(box.view(-1).view(torch.uint8).numpy()) if box.numel() else memoryview(b"")
                job.keep_if_sent(item, data)
                job.deliver(item, data, dtype)
                mine.add(i)
        super()._read_local(job, mine)
