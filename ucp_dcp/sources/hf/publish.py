"""A ucp_dcp checkpoint of any layout -> a Hugging Face safetensors folder, without assembling the model.

Every saved chunk of every mapped atom is read once (ranged and checksum-verified by
:class:`~ucp_dcp.storage.reader.UCPFileSystemReader`, several files at a time) and written straight to its
place in the output files, converting dtype and rotary row order on the way: memory holds a few
chunks, never a whole tensor. Under a process group the atoms are split across the ranks, which
write into the same pre-sized files. The folder appears under its name only when complete (written
as ``.ucp-hf-export-<id>.tmp`` next to it and renamed), so a crash never leaves a half-written export
that looks whole.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ...errors import UCPError
from ...layout.fragments import Box, exact_cover_problem
from ...storage.reader import UCPFileSystemReader
from .files import HFTensor, create_files, plan_files, write_box, write_index
from .mapping import HFMapping
from .source import local_folder_only

__all__ = ["export_hf", "ExportStats"]


@dataclass
class ExportStats:
    """What one rank did in :func:`export_hf`."""

    tensors: int = 0
    """HF tensors in the folder."""
    chunks: int = 0
    """Saved chunks this rank copied."""
    bytes_read: int = 0
    """Bytes this rank read from the checkpoint."""
    bytes_written: int = 0
    """Bytes this rank wrote into the folder."""
    seconds: float = 0.0
    """Wall time of the export on this rank."""


class _CopyPlanner(LoadPlanner):
    """Reads each planned chunk whole into a scratch tensor and writes it into the HF files
    (``commit_tensor`` runs on the reader's file threads; each chunk's box is its own region)."""

    def __init__(self, fds: dict[str, int], tensors: dict[str, list[HFTensor]], stats: ExportStats) -> None:
        self.fds, self.tensors, self.stats = fds, tensors, stats
        self._scratch: dict[int, torch.Tensor] = {}
        self.nonzero: list[str] = []
        """Zero atoms (``HFMapping.zero``) read with a non-zero value."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise UCPError(f"export_hf planned an object read ({read_item.storage_index.fqn})")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        buf = self._scratch.get(id(read_item))
        if buf is None:  # the reader may resolve an item twice (destination, then delivery): one buffer
            dtype = self.metadata.state_dict_metadata[read_item.storage_index.fqn].properties.dtype
            buf = self._scratch[id(read_item)] = torch.empty(tuple(read_item.lengths), dtype=dtype)
        return buf

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if read_item.storage_index.fqn not in self.tensors:  # a zero atom: checked, never written
            if bool(tensor.ne(0).any()):
                self.nonzero.append(read_item.storage_index.fqn)
            self._scratch.pop(id(read_item), None)
            return
        ts = self.tensors[read_item.storage_index.fqn]
        offsets = tuple(read_item.storage_index.offset or ())
        n = 0
        if len(ts) == 1 and ts[0].shape == self.metadata.state_dict_metadata[read_item.storage_index.fqn].size:
            n = write_box(self.fds[ts[0].file], ts[0], offsets, tensor)
        else:  # a stacked atom: slice k of the box is a box of HF tensor offsets[0] + k
            for k in range(tensor.shape[0]):
                t = ts[offsets[0] + k]
                n += write_box(self.fds[t.file], t, offsets[1:], tensor[k])
        self._scratch.pop(id(read_item), None)
        self.stats.bytes_written += n


def _mapped(md: Metadata, mapping: HFMapping, dtype: torch.dtype | None) -> dict[str, list[HFTensor]]:
    """Atom -> the HF tensors it becomes (one, or one per slice of a stacked atom); every mapped
    atom must be a tensor its saved chunks cover exactly."""
    out: dict[str, list[HFTensor]] = {}
    names: dict[str, str] = {}
    for atom, smd in md.state_dict_metadata.items():
        hit = mapping.hf_of(atom)
        if hit is None:
            continue
        rule, values = hit
        if not isinstance(smd, TensorStorageMetadata):
            raise UCPError(f"atom '{atom}' (HF '{rule.hf}') is saved as an object, not a tensor", atom=atom)
        shape = tuple(int(s) for s in smd.size)
        problem = exact_cover_problem(
            Box((0,) * len(shape), shape), [Box(tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks]
        )
        if problem:
            raise UCPError(f"atom '{atom}': {problem}", atom=atom, hint="the checkpoint is incomplete or damaged")
        if rule.stack is not None and not shape:
            raise UCPError(f"atom '{atom}' is a scalar; rule {rule.hf!r} stacks along dim 0", atom=atom)
        ts = (
            [HFTensor(rule.hf_name(values, k), dtype or smd.properties.dtype, shape[1:]) for k in range(shape[0])]
            if rule.stack is not None
            else [HFTensor(rule.hf_name(values), dtype or smd.properties.dtype, shape, rule.rotary_heads)]
        )
        for t in ts:
            if t.name in names:
                raise UCPError(
                    f"atoms '{names[t.name]}' and '{atom}' both map to HF tensor '{t.name}'",
                    atom=atom,
                    hint=f"fix the rules of the '{mapping.name}' mapping",
                )
            names[t.name] = atom
        out[atom] = ts
    if not out:
        raise UCPError(
            f"no atom of the checkpoint maps to a Hugging Face name under the '{mapping.name}' mapping "
            f"(prefix {mapping.prefix!r})",
            saved=sorted(md.state_dict_metadata)[:5],
            hint="pick the mapping of the model that was saved, with the prefix its state dict had",
        )
    return out


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    mapping: HFMapping,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
    thread_count: int | None = None,
    config: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> ExportStats:
    """Write the model atoms of ``checkpoint`` as a Hugging Face folder ``out`` (safetensors
    shards, index, ``config.json``) that ``transformers`` loads with ``from_pretrained``.

    Collective when a default process group exists (every rank calls it; each copies a share of
    the atoms); otherwise one process does all of it with ``thread_count`` file threads.

    Args:
        mapping: atom <-> HF names and row orders (e.g. :func:`ucp_dcp.torchtitan.mappings.hf_mapping`); its ``config`` is
            written as ``config.json`` unless ``config`` is given.
        dtype: dtype of the exported tensors (default: as saved, e.g. ``torch.bfloat16`` to halve
            an fp32 checkpoint).
        max_shard_bytes: most data bytes per file (HF's default 5 GB).
        overwrite: replace an existing ``out`` (else an existing folder is an error).
    """
    t0 = time.perf_counter()
    out = os.fspath(out)
    local_folder_only(out, "written")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if os.path.exists(out) and not overwrite:
        raise UCPError(f"{out} exists", hint="pass overwrite=True (or --overwrite) to replace it")
    reader = UCPFileSystemReader(checkpoint, thread_count=thread_count)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, is_coordinator=rank == 0)
    atoms = _mapped(md, mapping, dtype)
    _check_zero(reader, md, sorted(a for a in md.state_dict_metadata if mapping.zeroed(a) and a not in atoms), mapping)
    placed, files = plan_files([t for ts in atoms.values() for t in ts], max_shard_bytes)
    by_name = {t.name: t for t in placed}
    tensors = {a: [by_name[t.name] for t in ts] for a, ts in atoms.items()}
    stats = ExportStats(tensors=len(placed))
    tmp = _shared_tmp(out, rank, world)
    if rank == 0:
        os.makedirs(tmp)
        create_files(tmp, files)
    _barrier(world)
    items = _items(md, sorted(atoms)[rank::world])
    fds = {f.name: os.open(os.path.join(tmp, f.name), os.O_WRONLY) for f in files}
    error: BaseException | None = None
    try:
        planner = _CopyPlanner(fds, tensors, stats)
        planner.set_up_planner({}, md)
        reader.read_data(LoadPlan(items), planner).wait()
        for fd in fds.values():
            os.fsync(fd)
    except BaseException as e:  # the other ranks must not wait forever at the barrier
        error = e
    finally:
        for fd in fds.values():
            os.close(fd)
    stats.chunks, stats.bytes_read = len(items), reader.stats.bytes_read
    failed = _all_ok(error is None, world)
    if error is not None:
        raise error
    if failed:
        raise UCPError(f"export_hf failed on rank(s) {failed}; nothing was published at {out}")
    if rank == 0:
        write_index(tmp, files, placed, _config(config or mapping.config, dtype, md, atoms))
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
        _fsync_dir(os.path.dirname(os.path.abspath(out)))
    _barrier(world)
    stats.seconds = time.perf_counter() - t0
    return stats


def _items(md: Metadata, atoms: list[str]) -> list[ReadItem]:
    """Read items for every saved chunk of ``atoms``, each whole."""
    return [
        ReadItem(
            LoadItemType.TENSOR,
            MetadataIndex(a, c.offsets),
            torch.Size([0] * len(c.sizes)),
            MetadataIndex(a, c.offsets),
            torch.Size([0] * len(c.sizes)),
            c.sizes,
        )
        for a in atoms
        for c in md.state_dict_metadata[a].chunks
    ]


def _check_zero(reader: UCPFileSystemReader, md: Metadata, zero: list[str], mapping: HFMapping) -> None:
    """Refuse (collectively, before any file is written) a checkpoint whose ``mapping.zero`` atoms
    are not all zero: HF has no tensor for them, so the exported model would compute something else."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = [a for a in zero[rank::world] if isinstance(md.state_dict_metadata[a], TensorStorageMetadata)]
    planner = _CopyPlanner({}, {}, ExportStats())
    planner.set_up_planner({}, md)
    error: BaseException | None = None
    try:
        if mine:
            reader.read_data(LoadPlan(_items(md, mine)), planner).wait()
    except BaseException as e:  # the other ranks must not wait forever
        error = e
    failed = _all_ok(error is None and not planner.nonzero, world)
    if error is not None:
        raise error
    if failed:
        bad = sorted(set(planner.nonzero))
        raise UCPError(
            f"{len(bad) or 'some'} atom(s) the '{mapping.name}' Hugging Face format has no tensor for are not zero"
            + (f": {bad[:4]}" if bad else f" (found on rank(s) {failed})"),
            atom=bad[0] if bad else zero[0],
            saved="non-zero values",
            wanted="all zeros (the HF model is this model with them at zero)",
            hint="Hugging Face's format has no tensor for them: the exported model would compute something else "
            "(torchtitan's expert_bias_E: a different expert routing). Train without them (torchtitan: "
            "load_balance_coeff=None) or zero them before the save if that difference is acceptable",
        )


def _config(config: dict[str, Any], dtype: torch.dtype | None, md: Metadata, atoms: dict[str, list[HFTensor]]) -> dict:
    cfg = dict(config)
    first = next(iter(atoms.values()))[0]
    cfg["dtype"] = cfg["torch_dtype"] = str(dtype or first.dtype).removeprefix("torch.")  # v5 and v4 names
    return cfg


def _shared_tmp(out: str, rank: int, world: int) -> str:
    """One temporary folder name for all ranks (the coordinator's choice), next to ``out`` and not
    derived from its name: a crashed export must not look like a checkpoint to tools that scan the
    parent folder by name (torchtitan takes any name containing ``step-<N>``)."""
    parent = os.path.dirname(os.path.abspath(out))
    name = [os.path.join(parent, f".ucp-hf-export-{uuid.uuid4().hex[:12]}.tmp")]
    if world > 1:
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _all_ok(ok: bool, world: int) -> list[int]:
    if world == 1:
        return [] if ok else [0]
    flags = [None] * world
    dist.all_gather_object(flags, ok)
    return [r for r, f in enumerate(flags) if not f]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
