"""Pure fragment transforms for layouts DTensor placements cannot describe.

They act on the fragments of the *live* tensor (boxes in the live tensor's global coordinates) and
return fragments of atoms:

* :func:`fused_segments` / :func:`split_fused`: a dim holding several logical parameters side by
  side, in ``blocks`` interleaved blocks (``[A_0; B_0; A_1; B_1; ...]``). One block is plain
  concatenation; ``blocks = TP degree`` is Megatron's per-rank ``[q_r; k_r; v_r]`` layout;
  ``blocks = n_kv_heads`` is the group-major (per KV head) QKV layout.
* :func:`clip_padding`: a dim padded beyond its logical size; the tail is no atom's and is filled
  on load.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from .fragments import Box, Fragment

__all__ = ["Segment", "fused_segments", "fused_block_problem", "split_fused", "clip_padding"]


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
