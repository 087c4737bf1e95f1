"""``HFStorageReader``: a Hugging Face safetensors folder as one more source layout of ``dcp.load``.

The folder (``model.safetensors``, or shards listed by ``model.safetensors.index.json``) is
presented to DCP as a checkpoint whose keys are atoms: each HF tensor, renamed by an
:class:`~ucp_dcp.sources.hf.mapping.HFMapping`, is one saved chunk covering its whole atom, located by its
safetensors header. ``UCPLoadPlanner`` then plans the target's fragments against those atoms as
against any checkpoint (fused targets from their parts, padded vocabularies, tied copies,
stage-local and expert-local names), and this reader serves every read item with the byte runs of
its box — ranged, in file order, read once per host, converting dtype on the way, as
:class:`~ucp_dcp.storage.reader.UCPFileSystemReader` does. Rows of rotary projections are taken in the
atom's order from HF's rotate-half order (:func:`~ucp_dcp.sources.hf.mapping.hf_rows`), still reading
only the rows a box needs. No rank ever holds a whole tensor it does not own.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..._compat import _StorageInfo
from ...errors import CheckpointNotFoundError, CorruptCheckpointError, UCPError, UnverifiedCheckpointWarning
from ...planning.device import StagingMode
from ...planning.opened import raise_if_unopened
from ...planning.payloads import ReadOnceMode
from ...storage.commit import Integrity
from ...storage.format import TensorRecord, box_grid
from ...storage.object_store import object_protocol
from ...storage.reader import UCPFileSystemReader
from .mapping import HFMapping, hf_rows
from .safetensors import SafetensorsFile, read_header

__all__ = ["HFStorageReader", "HF_KEY", "INDEX", "SINGLE", "scan_hf"]

HF_KEY = "__ucp_hf__"
"""Reserved ``storage_data`` entry: what the reader needs besides DCP's tables (rotary rows per
atom, file sizes, HF names), so any rank can set up from the metadata alone."""
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _plain_name(name: Any, where: str) -> str:
    """A file name from an untrusted index: no directories, no way out of the folder."""
    if (
        not isinstance(name, str)
        or not name
        or name != os.path.basename(name)
        or name in (".", "..")
        or not name.endswith(".safetensors")
    ):
        raise CorruptCheckpointError(
            f"{where} names {name!r}, not a .safetensors file of the folder",
            hint="the index is damaged or crafted; every shard must be a plain file name",
        )
    return name


def local_folder_only(path: str, verb: str) -> None:
    """Refuse an URL (``s3://...``) for a Hugging Face folder: safetensors folders are read with mappings and
    written with ``pwrite`` into files of a final size, which object stores do not offer (not "no checkpoint")."""
    proto = object_protocol(path)
    if proto not in (None, "file"):
        raise UCPError(
            f"Hugging Face folders are {verb} on local (or mounted) folders only, not {proto}:// ({path})",
            wanted=path,
            hint="copy the folder to local disk first (e.g. `aws s3 sync`), or from it after an export; "
            "ucp_dcp's own checkpoints (ucp_dcp.save/load) go to s3:// directly",
        )


def scan_hf(path: str | os.PathLike) -> dict[str, tuple[str, SafetensorsFile]]:
    """Every tensor of the HF folder at ``path``: name -> (file, parsed header of that file)."""
    path = os.fspath(path)
    local_folder_only(path, "read")
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(
            f"no Hugging Face checkpoint at {path}: not a folder",
            hint="pass the folder that holds model.safetensors (or its index)",
        )
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index, "rb") as f:
            try:
                body = json.load(f)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CorruptCheckpointError(f"{index} is not JSON ({e})") from None
        wmap = body.get("weight_map") if isinstance(body, dict) else None
        if not isinstance(wmap, dict):
            raise CorruptCheckpointError(f"{index} has no weight_map object", hint="the index is damaged")
        wanted = {str(k): _plain_name(v, INDEX) for k, v in wmap.items()}
    elif os.path.exists(os.path.join(path, SINGLE)):
        wanted = None
    else:
        raise CheckpointNotFoundError(
            f"no Hugging Face checkpoint at {path}: neither {SINGLE} nor {INDEX}",
            hint="pass the folder save_pretrained wrote (or a hub snapshot folder)",
        )
    files = sorted(set(wanted.values())) if wanted is not None else [SINGLE]
    out: dict[str, tuple[str, SafetensorsFile]] = {}
    for rel in files:
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointNotFoundError(
                f"{INDEX} lists {rel}, which is not in {path}",
                hint="the download is incomplete; fetch the missing shard",
            )
        st = read_header(full)
        for name in st.tensors:
            if wanted is not None and wanted.get(name) != rel:
                raise CorruptCheckpointError(
                    f"{rel} holds '{name}', which {INDEX} puts in {wanted.get(name)!r}",
                    atom=name,
                    hint="the index and the shards disagree",
                )
            out[name] = (rel, st)
    if wanted is not None:
        lost = sorted(set(wanted) - set(out))
        if lost:
            raise CorruptCheckpointError(
                f"{INDEX} lists {len(lost)} tensor(s) no shard holds: {lost[:5]}",
                atom=lost[0],
                hint="a shard is damaged or from another model",
            )
    return out


class HFStorageReader(UCPFileSystemReader):
    """Reads a Hugging Face safetensors folder into any target layout inside ``dcp.load``.

    Use with :class:`~ucp_dcp.UCPLoadPlanner` (the target's patterns: fused, padded, tied, stage and
    expert maps) and an :class:`~ucp_dcp.sources.hf.mapping.HFMapping` (or a preset of
    :func:`ucp_dcp.torchtitan.mappings.hf_mapping`)::

        dcp.load(model_sd, storage_reader=HFStorageReader(hf_dir, llama3_mapping(args)),
                 planner=UCPLoadPlanner(patterns=...))

    Args:
        path: the folder (``model.safetensors`` or ``model.safetensors.index.json`` and shards).
        mapping: HF names and row orders -> atoms.
        thread_count, staging, read_once: as :class:`~ucp_dcp.storage.reader.UCPFileSystemReader`.

    safetensors has no checksums: headers are validated (JSON only, offsets inside the file, sizes
    matching dtype x shape, no overlaps, file sizes), tensor bytes cannot be; the coordinator warns
    once (:class:`~ucp_dcp.errors.UnverifiedCheckpointWarning`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        mapping: HFMapping,
        *,
        thread_count: int | None = None,
        staging: StagingMode | None = None,
        read_once: ReadOnceMode | None = None,
    ) -> None:
        super().__init__(path, thread_count=thread_count, verify_checksums=False, staging=staging, read_once=read_once)
        self.mapping = mapping
        self.hf_names: dict[str, str] = {}
        """Atom -> the HF tensor it is read from (set when the metadata is read)."""

    def _open(self) -> tuple[Metadata, Integrity]:
        return self._metadata(), Integrity("none")  # no checksums: this reader warns, in its own words

    def _metadata(self) -> Metadata:
        tensors = scan_hf(self.path)
        names: dict[str, str] = {}
        rotary: dict[str, int] = {}
        stacks: dict[str, dict[int, tuple[str, str, Any]]] = {}
        state: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        sizes: dict[str, int] = {}
        unmapped: list[str] = []
        for name, (rel, st) in sorted(tensors.items()):
            info = st.tensors[name]
            sizes[rel] = st.size
            hit = self.mapping.atom_of(name)
            if hit is None:
                if not self.mapping.ignored(name):
                    unmapped.append(name)
                continue
            atom, rule, index = hit
            if index is not None:  # one slice of a stacked atom: assembled below
                stacks.setdefault(atom, {})[index] = (name, rel, info)
                continue
            if atom in names:
                raise UCPError(
                    f"HF tensors '{names[atom]}' and '{name}' both map to atom '{atom}'",
                    atom=atom,
                    hint=f"fix the rules of the '{self.mapping.name}' mapping",
                )
            names[atom] = name
            zeros = (0,) * len(info.shape)
            state[atom] = TensorStorageMetadata(
                TensorProperties(dtype=info.dtype),
                torch.Size(info.shape),
                [ChunkStorageMetadata(torch.Size(zeros), torch.Size(info.shape))],
            )
            storage[MetadataIndex(atom, zeros)] = _StorageInfo(rel, info.offset, info.nbytes)
            if rule.rotary_heads:
                hf_rows(np.zeros(0), info.shape[0], rule.rotary_heads, name)  # validates the head split
                rotary[atom] = rule.rotary_heads
        for atom, parts in stacks.items():
            state[atom] = self._stacked(atom, parts, storage, names)
        if unmapped:
            raise UCPError(
                f"{len(unmapped)} tensor(s) of the Hugging Face checkpoint match no rule of the "
                f"'{self.mapping.name}' mapping: {unmapped[:6]}",
                atom=unmapped[0],
                saved=unmapped,
                hint="add an HFRule for them, or list them in HFMapping.ignore if the target has no such weight",
            )
        storage[MetadataIndex(HF_KEY)] = {"rotary": rotary, "files": sizes, "names": names}  # type: ignore[assignment]
        return Metadata(state_dict_metadata=state, planner_data={}, storage_data=storage)

    def _stacked(
        self, atom: str, parts: dict[int, tuple[str, str, Any]], storage: dict, names: dict[str, str]
    ) -> TensorStorageMetadata:
        """A stacked atom ``[n, *shape]`` whose chunk ``[k:k+1]`` is HF tensor ``k``: every index
        ``0..n-1`` present, all of one dtype and shape."""
        n = len(parts)
        if atom in names or sorted(parts) != list(range(n)):
            raise UCPError(
                f"atom '{atom}' is stacked from HF tensors with indices {sorted(parts)[:8]}: expected "
                f"0..{n - 1}, each once",
                atom=atom,
                saved=sorted(parts),
                hint="the checkpoint lacks some experts, or two rules map to this atom",
            )
        first = parts[0][2]
        for k, (name, rel, info) in sorted(parts.items()):
            if (info.dtype, info.shape) != (first.dtype, first.shape):
                raise UCPError(
                    f"'{name}' is {info.dtype}{list(info.shape)}, '{parts[0][0]}' is "
                    f"{first.dtype}{list(first.shape)}: they cannot stack into atom '{atom}'",
                    atom=atom,
                )
            storage[MetadataIndex(atom, (k,) + (0,) * len(info.shape))] = _StorageInfo(rel, info.offset, info.nbytes)
        names[atom] = parts[0][0]
        chunks = [
            ChunkStorageMetadata(torch.Size((k,) + (0,) * len(first.shape)), torch.Size((1, *first.shape)))
            for k in range(n)
        ]
        return TensorStorageMetadata(TensorProperties(dtype=first.dtype), torch.Size((n, *first.shape)), chunks)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        raise_if_unopened(metadata)
        hf = (metadata.storage_data or {}).get(MetadataIndex(HF_KEY))
        if not isinstance(hf, dict):
            raise UCPError(
                "HFStorageReader was set up with metadata it did not read",
                hint="let dcp.load call read_metadata() on this reader",
            )
        self._rotary: dict[str, int] = hf["rotary"]
        self.hf_names = hf["names"]
        self._tensors = {k: (v.properties.dtype, tuple(v.size)) for k, v in metadata.state_dict_metadata.items()}
        self.integrity = Integrity("none", files=hf["files"])
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if is_coordinator:
            warnings.warn(
                f"Hugging Face checkpoint {self.path}: safetensors files carry no checksums; headers and "
                "sizes are validated, tensor bytes cannot be",
                UnverifiedCheckpointWarning,
                stacklevel=2,
            )

    # -- data ----------------------------------------------------------------------------------------

    def _record(self, f: Any, index: MetadataIndex, info: Any) -> TensorRecord | None:
        dtype, shape = self._chunk_meta[index]
        return TensorRecord(0, dtype, shape, True)  # info.offset is the chunk's first byte

    def _read_chunk(self, f: Any, rel: str, c: Any, job: Any) -> None:
        heads = self._rotary.get(c.index.fqn)
        if heads is None:
            super()._read_chunk(f, rel, c, job)
            return
        info = self.storage_data[c.index]
        dtype, shape = self._tensors[c.index.fqn]
        for item in c.items:
            data = self._read_rows(f, info.offset, dtype, shape, heads, item, c.index)
            mv = memoryview(data.view(-1).view(torch.uint8).numpy())
            job.keep_if_sent(item, mv)
            job.deliver(item, mv, dtype)

    def _read_rows(
        self, f: Any, base: int, dtype: torch.dtype, shape: tuple[int, ...], heads: int, item: Any, index: MetadataIndex
    ) -> torch.Tensor:
        """The item's box (atom row order) read from HF's rotate-half rows: only the rows it needs,
        as runs of consecutive HF rows."""
        o, n = list(item.storage_offsets), list(item.lengths)
        out = torch.empty(n, dtype=dtype)
        if not out.numel():
            return out
        want = hf_rows(np.arange(o[0], o[0] + n[0]), shape[0], heads, self.hf_names.get(index.fqn, index.fqn))
        rows = np.unique(want)
        buf = torch.empty((len(rows), *n[1:]), dtype=dtype)
        flat = memoryview(buf.view(-1).view(torch.uint8).numpy())
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        pos = 0
        for run in np.split(rows, breaks):
            g = box_grid(shape, dtype.itemsize, [int(run[0]), *o[1:]], [len(run), *n[1:]])
            self._pread_runs(f, base, g.starts(), g.run, flat[pos : pos + g.nbytes], index)
            pos += g.nbytes
        out.copy_(buf[torch.from_numpy(np.searchsorted(rows, want))])
        return out
