"""Pure box math for load planning: which saved chunks feed a wanted box, and whether they cover
it exactly once."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from .fragments import Box

__all__ = ["ChunkIndex", "exact_cover_problem"]


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
