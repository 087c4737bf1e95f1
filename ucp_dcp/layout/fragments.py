"""Fragments: the pieces of a rank's local tensor, each a box of some atom.

Pure functions only (no process group). For a DTensor layout the rank's global indices along each
tensor dim are an ordered list; we keep it as *runs* ``(global_start, length)`` in local order,
apply placements left to right exactly like DTensor does (``torch.chunk`` semantics, with
``_StridedShard`` splitting each of its ``split_factor`` pieces), and emit the Cartesian product of
the per-dim runs. A rank whose indices are not one contiguous range therefore gets several boxes,
never "first offset + local size" (which is what silently corrupts
``[Shard(0), _StridedShard(0, split_factor=2)]`` in stock DCP).

A ``ShardedTensor`` (FSDP1 ``SHARDED_STATE_DICT``, ``torch.distributed._shard``) states its boxes
directly: each local shard is one fragment (:func:`shard_fragments`). A rank may hold several local
shards, each its own tensor; their memory is then a :class:`LocalShards` and each fragment names
its shard (``Fragment.shard``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import AmbiguousLayoutError
from .placements import Layout, Placement, PlacementKind

__all__ = [
    "Box",
    "Fragment",
    "LocalShards",
    "chunk_range",
    "dim_runs",
    "local_shape",
    "layout_fragments",
    "shard_fragments",
    "boxes_fragments",
    "whole_fragment",
]

Run = tuple[int, int]
"""``(global_start, length)``: ``length`` consecutive global indices at consecutive local positions."""


@dataclass(frozen=True)
class Box:
    """An axis-aligned box: ``offsets`` and ``sizes`` per dim (0-d tensors: both empty)."""

    offsets: tuple[int, ...]
    """Start index per dim."""
    sizes: tuple[int, ...]
    """Extent per dim."""

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The overlap of two boxes of equal rank, or None when they do not overlap."""
        offs, sizes = [], []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(o1, o2), min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def shift(self, origin: Sequence[int]) -> Box:
        """This box in coordinates relative to ``origin``."""
        return Box(tuple(o - b for o, b in zip(self.offsets, origin)), self.sizes)

    def __str__(self) -> str:
        spans = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes))
        return f"[{spans}]"


@dataclass(frozen=True)
class Fragment:
    """One piece of a rank's local tensor: ``box`` of ``atom``, stored at ``local`` in local memory.

    ``view_shape`` (patterns only) reshapes the local tensor before ``local`` is cut from it, and
    the cut region is then viewed with ``box.sizes``; for plain layouts both are trivial.
    """

    atom: str
    """Canonical name of the logical tensor this piece belongs to."""
    box: Box
    """Where the piece sits in the atom's global coordinates."""
    local: Box
    """Where the piece sits in the (optionally reshaped) local tensor."""
    view_shape: tuple[int, ...] | None = None
    """Reshape of the local tensor before cutting ``local`` (None: use the local tensor as is)."""
    shard: int | None = None
    """Index of the tensor in the value's :class:`LocalShards` that holds the piece (a
    ``ShardedTensor`` with several local shards); None: the value's local memory is one tensor."""

    def view(self, local_tensor: torch.Tensor | LocalShards) -> torch.Tensor:
        """The piece as a tensor of shape ``box.sizes``; a view of ``local_tensor`` whenever the
        memory layout allows it (callers that write must check ``_is_alias``)."""
        if self.shard is not None:
            local_tensor = local_tensor[self.shard]
        t = local_tensor if self.view_shape is None else local_tensor.reshape(self.view_shape)
        for d, (o, s) in enumerate(zip(self.local.offsets, self.local.sizes)):
            if o != 0 or s != t.shape[d]:
                t = t.narrow(d, o, s)
        if tuple(t.shape) != self.box.sizes:
            t = t.reshape(self.box.sizes)
        return t


class LocalShards(tuple):
    """The local memory of a value held as several separate tensors (a ``ShardedTensor`` with more
    than one local shard on this rank): a tuple of the tensors, plus the ``dtype`` and ``device``
    they share (planners ask the local memory for both). Fragments pick theirs by ``shard``."""

    dtype: torch.dtype
    device: torch.device

    def __new__(cls, tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> LocalShards:
        self = super().__new__(cls, tensors)
        self.dtype, self.device = dtype, device
        return self

    def __reduce__(self) -> tuple:
        return (LocalShards, (tuple(self), self.dtype, self.device))


def chunk_range(n: int, k: int, i: int) -> Run:
    """``(start, length)`` of chunk ``i`` when ``n`` items are split into ``k`` chunks the way
    DTensor does (``torch.chunk``: ``ceil(n/k)`` per chunk, trailing chunks possibly empty)."""
    c = -(-n // k) if n else 0
    start = min(c * i, n)
    return start, max(0, min(c * (i + 1), n) - start)


def _select(runs: list[Run], start: int, length: int) -> list[Run]:
    """Local positions ``[start, start+length)`` of a run list, as a run list."""
    out: list[Run] = []
    pos = 0
    end = start + length
    for g, n in runs:
        lo, hi = max(start, pos), min(end, pos + n)
        if hi > lo:
            out.append((g + lo - pos, hi - lo))
        pos += n
        if pos >= end:
            break
    return out


def _merge(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for g, n in runs:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((g, n))
    return out


def _apply(runs: list[Run], p: Placement, k: int, i: int) -> list[Run]:
    n = sum(r[1] for r in runs)
    if p.kind is PlacementKind.SHARD:
        s, length = chunk_range(n, k, i)
        return _select(runs, s, length)
    # _StridedShard: cut into split_factor pieces, cut each piece into k chunks, keep chunk i of
    # every piece, concatenated in piece order.
    out: list[Run] = []
    for j in range(p.split_factor):
        ps, pl = chunk_range(n, p.split_factor, j)
        cs, cl = chunk_range(pl, k, i)
        out.extend(_select(runs, ps + cs, cl))
    return out


def dim_runs(global_shape: Sequence[int], layout: Layout, coordinate: Sequence[int]) -> list[list[Run]]:
    """Per tensor dim, the rank's global indices as merged runs in local order."""
    runs: list[list[Run]] = [[(0, int(n))] if n else [] for n in global_shape]
    for mesh_dim, p in enumerate(layout.placements):
        if p.kind.shards:
            if not 0 <= p.dim < len(global_shape):
                raise AmbiguousLayoutError(
                    f"placement {p} shards dim {p.dim} of a {len(global_shape)}-d tensor", saved=str(p)
                )
            runs[p.dim] = _apply(runs[p.dim], p, layout.mesh_shape[mesh_dim], coordinate[mesh_dim])
    return [_merge(r) for r in runs]


def local_shape(global_shape: Sequence[int], layout: Layout, coordinate: Sequence[int]) -> tuple[int, ...]:
    return tuple(sum(n for _, n in r) for r in dim_runs(global_shape, layout, coordinate))


def layout_fragments(
    atom: str, global_shape: Sequence[int], layout: Layout, coordinate: Sequence[int] | None
) -> list[Fragment]:
    """Fragments of the local tensor of a value with ``layout`` at mesh ``coordinate``.

    They tile the local tensor exactly, and over one coordinate per replica group they tile the
    global tensor exactly. Empty local tensors have no fragments.
    """
    if layout.is_plain or coordinate is None:
        return [whole_fragment(atom, global_shape)]
    per_dim = []
    for runs in dim_runs(global_shape, layout, coordinate):
        spans, pos = [], 0
        for g, n in runs:
            spans.append((g, pos, n))
            pos += n
        per_dim.append(spans)
    frags = []
    for combo in itertools.product(*per_dim):
        frags.append(
            Fragment(
                atom,
                Box(tuple(c[0] for c in combo), tuple(c[2] for c in combo)),
                Box(tuple(c[1] for c in combo), tuple(c[2] for c in combo)),
            )
        )
    return frags


def shard_fragments(atom: str, shards: Sequence[tuple[Sequence[int], Sequence[int]]], indexed: bool) -> list[Fragment]:
    """Fragments of a value whose pieces are stated as boxes ``(offsets, sizes)`` of the atom, one
    local tensor of exactly ``sizes`` per box (a ``ShardedTensor``'s local shards). ``indexed``: the
    pieces are separate tensors (a :class:`LocalShards`), so fragment ``i`` names shard ``i``;
    otherwise there is a single box and the local memory is its tensor. Empty boxes have no
    fragment (the indices of the others are kept)."""
    frags = []
    for i, (offsets, sizes) in enumerate(shards):
        box = Box(tuple(int(o) for o in offsets), tuple(int(n) for n in sizes))
        if box.volume:
            frags.append(Fragment(atom, box, Box((0,) * len(box.sizes), box.sizes), shard=i if indexed else None))
    return frags


def boxes_fragments(atom: str, shards: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> list[Fragment]:
    """Fragments of one local tensor that states its pieces as ``(global offsets, local offsets,
    sizes)`` (a ``CheckpointableTensor``): box ``sizes`` at the global offsets of the atom, held at the
    local offsets of the local tensor. Empty boxes have no fragment."""
    frags = []
    for goffs, loffs, sizes in shards:
        box = Box(tuple(int(o) for o in goffs), tuple(int(n) for n in sizes))
        if box.volume:
            frags.append(Fragment(atom, box, Box(tuple(int(o) for o in loffs), box.sizes)))
    return frags


def whole_fragment(atom: str, shape: Sequence[int]) -> Fragment:
    """A plain tensor is one fragment covering the whole atom."""
    box = Box((0,) * len(shape), tuple(int(s) for s in shape))
    return Fragment(atom, box, box)
