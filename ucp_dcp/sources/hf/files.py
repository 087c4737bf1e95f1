"""Laying out and writing an HF safetensors folder box by box.

The layout (which file, which offset) is fixed up front from the tensors' names, dtypes and shapes
alone, so the files can be created at their final size and every writer (thread or rank) writes
its boxes into them with ``pwrite`` at known offsets: no rank ever assembles a whole tensor, let
alone the model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from ...storage.format import box_grid
from .mapping import hf_rows
from .safetensors import encode_header
from .source import INDEX, SINGLE

__all__ = ["HFTensor", "HFFile", "plan_files", "write_box", "create_files", "write_index", "natural_key"]


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the folder being written."""

    name: str
    """HF name."""
    dtype: torch.dtype
    """Element type in the file."""
    shape: tuple[int, ...]
    """Shape in the file."""
    rotary_heads: int | None = None
    """Rows go from the atom's interleaved-pair order to HF's rotate-half order."""
    file: str = ""
    """File name (set by :func:`plan_files`)."""
    offset: int = 0
    """Absolute offset of element 0 (set by :func:`plan_files`)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class HFFile:
    """One safetensors file: its header and size."""

    name: str
    header: bytes
    size: int
    tensors: list[str] = field(default_factory=list)


def natural_key(name: str) -> tuple:
    """Sort key putting ``layers.10`` after ``layers.9``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def plan_files(tensors: list[HFTensor], max_shard_bytes: int) -> tuple[list[HFTensor], list[HFFile]]:
    """Tensors in name order packed into files of at most ``max_shard_bytes`` of data (a larger
    tensor gets a file of its own); one file is ``model.safetensors``, several are
    ``model-0000k-of-0000n.safetensors`` (HF's names)."""
    order = sorted(tensors, key=lambda t: natural_key(t.name))
    groups: list[list[HFTensor]] = []
    size = 0
    for t in order:
        if not groups or (size + t.nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    placed: list[HFTensor] = []
    files: list[HFFile] = []
    for k, group in enumerate(groups):
        name = SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        head, offs = encode_header([(t.name, t.dtype, t.shape) for t in group])
        end = len(head) + sum(t.nbytes for t in group)
        files.append(HFFile(name, head, end, [t.name for t in group]))
        placed += [HFTensor(t.name, t.dtype, t.shape, t.rotary_heads, name, offs[t.name]) for t in group]
    return placed, files


def create_files(folder: str, files: list[HFFile]) -> None:
    """Create every file at its final size with its header (the data is written box by box)."""
    for f in files:
        with open(os.path.join(folder, f.name), "wb") as out:
            out.write(f.header)
            out.truncate(f.size)


def write_index(folder: str, files: list[HFFile], tensors: list[HFTensor], config: dict) -> None:
    """``config.json`` and, for several files, ``model.safetensors.index.json``."""
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: t.file for t in sorted(tensors, key=lambda t: natural_key(t.name))},
        }
        with open(os.path.join(folder, INDEX), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_box(fd: int, t: HFTensor, offsets: tuple[int, ...], data: torch.Tensor) -> int:
    """Write ``data`` (a box of the atom at ``offsets``, atom row order) into tensor ``t`` of the
    open file ``fd``, converting dtype and, for rotary projections, rows; returns bytes written."""
    data = data.detach().to(t.dtype).contiguous()
    sizes = tuple(data.shape)
    if not data.numel():
        return 0
    if t.rotary_heads:
        rows = hf_rows(np.arange(offsets[0], offsets[0] + sizes[0]), t.shape[0], t.rotary_heads, t.name)
        order = np.argsort(rows, kind="stable")
        data = data[torch.from_numpy(order)].contiguous()
        rows = rows[order]
        runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
        boxes = [((int(r[0]), *offsets[1:]), (len(r), *sizes[1:])) for r in runs]
    else:
        boxes = [(tuple(offsets), sizes)]
    raw = memoryview(data.view(-1).view(torch.uint8).numpy())
    pos = written = 0
    for offs, lens in boxes:
        g = box_grid(t.shape, t.dtype.itemsize, offs, lens)
        starts = g.starts() + t.offset
        k = 0
        while k < len(starts):  # consecutive runs that touch are one write
            j = k + 1
            while j < len(starts) and starts[j] == starts[j - 1] + g.run:
                j += 1
            n = (j - k) * g.run
            _pwrite_all(fd, raw[pos : pos + n], int(starts[k]))
            pos += n
            written += n
            k = j
    return written


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
