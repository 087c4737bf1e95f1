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

After the fragments of a layout come the transforms for layouts placements cannot describe (fused, padded),
then the load side's coverage: which saved chunks feed a wanted box, exactly once.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import AmbiguousLayoutError
from .placements import Layout, Placement, PlacementKind

__all__ = [
    "Box",
    "ChunkIndex",
    "Fragment",
    "LocalShards",
    "Segment",
    "boxes_fragments",
    "chunk_range",
    "clip_padding",
    "dim_runs",
    "exact_cover_problem",
    "fused_block_problem",
    "fused_segments",
    "layout_fragments",
    "local_shape",
    "shard_fragments",
    "split_fused",
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


# -- fragment transforms for layouts DTensor placements cannot describe (fused, padded) ------------------------------
# They act on the fragments of the *live* tensor (boxes in the live tensor's global coordinates) and
# return fragments of atoms:
#
# * :func:`fused_segments` / :func:`split_fused`: a dim holding several logical parameters side by
#   side, in ``blocks`` interleaved blocks (``[A_0; B_0; A_1; B_1; ...]``). One block is plain
#   concatenation; ``blocks = TP degree`` is Megatron's per-rank ``[q_r; k_r; v_r]`` layout;
#   ``blocks = n_kv_heads`` is the group-major (per KV head) QKV layout.
# * :func:`clip_padding`: a dim padded beyond its logical size; the tail is no atom's and is filled
#   on load.


@dataclass(frozen=True)
class Segment:
    """A run of the fused dim that belongs to one part."""

    start: int
    """First index in the live (fused) dim."""
    length: int
    """Number of indices."""
    part: int
    """Index of the part (sub-parameter)."""
    atom_start: int
    """Where the run starts in the part's own dim."""


def fused_segments(part_sizes: Sequence[int], blocks: int) -> list[Segment]:
    """Segments of a dim holding ``part_sizes`` in ``blocks`` interleaved blocks. Callers check
    divisibility first (see :func:`fused_block_problem`)."""
    widths = [s // blocks for s in part_sizes]
    per_block = sum(widths)
    segs = []
    for b in range(blocks):
        off = b * per_block
        for p, w in enumerate(widths):
            if w:
                segs.append(Segment(off, w, p, b * w))
                off += w
    return segs


def fused_block_problem(part_sizes: Sequence[int], blocks: int, live_size: int) -> str | None:
    """Why ``part_sizes`` in ``blocks`` blocks cannot describe a dim of ``live_size`` (None if they can)."""
    if blocks < 1:
        return f"{blocks} blocks"
    bad = [s for s in part_sizes if s % blocks]
    if bad:
        return f"part sizes {list(part_sizes)} are not all divisible by {blocks} blocks"
    if sum(part_sizes) != live_size:
        return f"parts sum to {sum(part_sizes)} but the live dim has {live_size}"
    return None


def _narrow(box: Box, dim: int, start: int, length: int) -> Box:
    offs = list(box.offsets)
    sizes = list(box.sizes)
    offs[dim] += start
    sizes[dim] = length
    return Box(tuple(offs), tuple(sizes))


def _moved(box: Box, dim: int, new_start: int, length: int) -> Box:
    offs = list(box.offsets)
    sizes = list(box.sizes)
    offs[dim] = new_start
    sizes[dim] = length
    return Box(tuple(offs), tuple(sizes))


def split_fused(
    frags: Sequence[Fragment], dim: int, segments: Sequence[Segment], part_atoms: Sequence[str]
) -> list[Fragment]:
    """Cut live fragments at segment boundaries along ``dim``; each piece becomes a fragment of its
    part's atom, with its box moved to the part's coordinates and its local region narrowed."""
    starts = [s.start for s in segments]
    out: list[Fragment] = []
    for f in frags:
        lo = f.box.offsets[dim]
        hi = lo + f.box.sizes[dim]
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(segments) and segments[i].start < hi:
            s = segments[i]
            a, b = max(lo, s.start), min(hi, s.start + s.length)
            if b > a:
                rel = a - lo
                out.append(
                    Fragment(
                        part_atoms[s.part],
                        _moved(f.box, dim, s.atom_start + (a - s.start), b - a),
                        _narrow(f.local, dim, rel, b - a),
                        f.view_shape,
                    )
                )
            i += 1
    return out


def clip_padding(frags: Sequence[Fragment], dim: int, size: int) -> tuple[list[Fragment], list[Box]]:
    """Keep the part of each fragment below ``size`` on ``dim``; return the kept fragments and the
    local boxes of the padding (at or beyond ``size``)."""
    kept: list[Fragment] = []
    pad: list[Box] = []
    for f in frags:
        lo = f.box.offsets[dim]
        n = f.box.sizes[dim]
        inside = max(0, min(n, size - lo))
        if inside:
            kept.append(
                Fragment(f.atom, _narrow(f.box, dim, 0, inside), _narrow(f.local, dim, 0, inside), f.view_shape)
            )
        if inside < n:
            pad.append(_narrow(f.local, dim, inside, n - inside))
    return kept, pad


# -- coverage: which saved chunks feed a wanted box, and whether they cover it exactly once --------------------------


@dataclass
class ChunkIndex:
    """Saved chunks of one atom, indexed along the dim with the largest extent (like DCP's sweep)."""

    boxes: list[Box]
    """Saved chunks, in metadata order (their position is the storage index hint)."""

    def __post_init__(self) -> None:
        ndim = len(self.boxes[0].offsets) if self.boxes else 0
        self._dim = max(range(ndim), key=lambda d: max(b.offsets[d] + b.sizes[d] for b in self.boxes), default=-1)
        if self._dim < 0:
            return
        order = sorted(range(len(self.boxes)), key=lambda i: self.boxes[i].offsets[self._dim])
        self._order = order
        self._starts = [self.boxes[i].offsets[self._dim] for i in order]
        self._max_len = max(b.sizes[self._dim] for b in self.boxes)

    def overlaps(self, box: Box) -> list[tuple[int, Box]]:
        """``(chunk position, overlap box)`` for every saved chunk meeting ``box``."""
        if self._dim < 0:  # 0-d atoms: every chunk is the whole value
            return [(i, Box((), ())) for i in range(len(self.boxes))]
        lo = box.offsets[self._dim]
        hi = lo + box.sizes[self._dim]
        # candidates start in (lo - max_len, hi)
        a = bisect.bisect_right(self._starts, lo - self._max_len)
        b = bisect.bisect_left(self._starts, hi)
        out = []
        for j in range(a, b):
            i = self._order[j]
            ov = box.intersect(self.boxes[i])
            if ov is not None:
                out.append((i, ov))
        out.sort(key=lambda x: x[0])
        return out


def exact_cover_problem(box: Box, pieces: Sequence[Box]) -> str | None:
    """None if ``pieces`` (each inside ``box``) cover every element of ``box`` exactly once; else a
    short description of the hole or overlap."""
    total = sum(p.volume for p in pieces)
    if len(box.sizes) > 0:
        ordered = sorted(pieces, key=lambda p: p.offsets)
        d = 0
        active: list[Box] = []
        for p in ordered:
            start = p.offsets[d]
            active = [q for q in active if q.offsets[d] + q.sizes[d] > start]
            for q in active:
                if p.intersect(q) is not None:
                    return f"saved chunks overlap at {p.intersect(q)}"
            active.append(p)
    elif len(pieces) > 1:
        return f"{len(pieces)} saved copies of a scalar"
    if total != box.volume:
        return f"saved chunks cover {total} of {box.volume} elements"
    return None
