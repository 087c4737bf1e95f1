"""Pure math: pieces of foreign tensors as saved chunks of atoms.

A foreign checkpoint stores bytes in its own layout: a ZeRO rank's flat fp32 partition, a Megatron
layer-stacked ``linear_qkv``, DeepSpeed's merged atom files. Each becomes a list of :class:`Piece` s:
boxes of atoms whose bytes are *contiguous* somewhere in a file, so the ranged reader reads any
box of them as it reads its own chunks. Two steps get there:

* :func:`flat_boxes` — a flat element range of a row-major tensor (a parameter's slice of a ZeRO
  partition) as the few boxes it is made of (partial first row, whole rows, partial last row,
  recursively over dims);
* :func:`split_rows` — a box of a *source parameter* into boxes of its atoms along dim 0, where the
  source fuses parts (``Fused`` rules, e.g. group-major QKV, ``[w1_r; w3_r]`` per TP rank) or pads
  (``Padded``: rows past the logical size are nobody's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...layout.fragments import Segment

__all__ = ["Piece", "RowLayout", "flat_boxes", "split_rows"]


@dataclass(frozen=True)
class Piece:
    """A box of an atom stored as contiguous row-major bytes in a file."""

    atom: str
    offsets: tuple[int, ...]
    """Where the box starts in the atom."""
    sizes: tuple[int, ...]
    file: str
    """File, relative to the checkpoint folder."""
    byte_offset: int
    """Absolute offset of the box's first element in the file."""
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.dtype.itemsize


def flat_boxes(shape: Sequence[int], start: int, numel: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The elements ``[start, start + numel)`` of a row-major tensor of ``shape`` as boxes, in
    order: ``(offsets, sizes, flat index of the box's first element)``. Each box is contiguous."""
    if numel <= 0:
        return []
    if not shape:
        return [((), (), 0)]
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    inner = math.prod(shape[1:])
    end = start + numel
    pos = start
    while pos < end:
        row, col = divmod(pos, inner) if inner else (pos, 0)
        if col or end - pos < inner:  # a partial row: recurse inside it
            take = min(end, (row + 1) * inner) - pos
            for offs, sizes, first in flat_boxes(shape[1:], col, take):
                out.append(((row, *offs), (1, *sizes), row * inner + first))
            pos += take
            continue
        rows = (end - pos) // inner
        out.append(((row, *([0] * (len(shape) - 1))), (rows, *shape[1:]), pos))
        pos += rows * inner
    return out


@dataclass(frozen=True)
class RowLayout:
    """How a source parameter's dim 0 holds atoms."""

    atoms: tuple[str, ...]
    """Part atoms in layout order (one: the parameter is one atom)."""
    segments: tuple[Segment, ...]
    """Runs of dim 0 per part (``fused_segments``), or one run for a plain parameter."""
    size: int
    """Rows that belong to atoms (a padded dim's logical size); rows past it are padding."""


def split_rows(
    layout: RowLayout, offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int]
) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
    """A box of the source parameter, stored as its own row-major tensor, as boxes of its atoms:
    ``(atom, offsets in the atom, sizes, element offset from the box's first element)``."""
    if not shape:
        return [(layout.atoms[0], (), (), 0)]
    row = math.prod(sizes[1:])
    lo, hi = offsets[0], offsets[0] + sizes[0]
    out = []
    for s in layout.segments:
        a, b = max(lo, s.start), min(hi, s.start + s.length, layout.size)
        if b <= a:
            continue
        out.append(
            (layout.atoms[s.part], (s.atom_start + a - s.start, *offsets[1:]), (b - a, *sizes[1:]), (a - lo) * row)
        )
    return out
