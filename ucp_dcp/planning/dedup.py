"""Dedup of replicated pieces: every rank's items in one table, and one writer per piece.

DCP's ``dedup_save_plans`` walks ``WriteItem`` objects; here all ranks' items are rows of a few
arrays, a piece is a row key ``(atom, offsets)``, and pieces held by several ranks go to the least
loaded holder (or to the lowest rank), as in DCP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import UCPError
from .payloads import LocalItems, LocalPlanPayload, PieceKey, PlanStructure

__all__ = ["Rows", "choose_writers", "replica_copies_to_verify"]


@dataclass
class Rows:
    """All ranks' items, concatenated in rank order (one row each)."""

    rank: np.ndarray
    """The rank that holds the row."""
    atom: np.ndarray
    """Global atom id."""
    kind: np.ndarray
    """:class:`~ucp_dcp.planning.payloads.ItemKind`."""
    off: np.ndarray
    """``(n, D)`` offsets, -1 padded."""
    size: np.ndarray
    """``(n, D)`` sizes, -1 padded."""

    @classmethod
    def concat(cls, items: list[LocalItems], remaps: list[np.ndarray]) -> Rows:
        """``items`` per rank, with ``remaps`` per rank from its atom indices to global atom ids."""
        width = max([it.off.shape[1] if it.off.ndim == 2 else 0 for it in items] + [1])
        counts = [len(it.atom) for it in items]
        rank = np.repeat(np.arange(len(items)), counts)
        if sum(counts):
            atom = np.concatenate([remap[it.atom] for remap, it in zip(remaps, items)])
            kind = np.concatenate([it.kind for it in items])
        else:
            atom, kind = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
        off = np.full((len(atom), width), -1, dtype=np.int64)
        size = np.full((len(atom), width), -1, dtype=np.int64)
        pos = 0
        for it in items:
            n, d = it.off.shape if it.off.ndim == 2 else (len(it.atom), 0)
            off[pos : pos + n, :d] = it.off
            size[pos : pos + n, :d] = it.size
            pos += n
        return cls(rank, atom, kind, off, size)

    @property
    def volume(self) -> np.ndarray:
        """Elements per row (objects: 1)."""
        return np.where(self.size >= 0, self.size, 1).prod(axis=1)


def choose_writers(rows: Rows, nbytes: np.ndarray, ranks: int, lowest_rank: bool) -> np.ndarray:
    """A bool mask over ``rows``: one writer for every piece. A piece on several ranks goes to the
    lowest one with ``lowest_rank``, else to the holder with the fewest bytes to write so far
    (largest pieces first)."""
    key = np.concatenate([rows.atom[:, None], rows.off], axis=1)
    _, inverse, cnt = np.unique(
        np.ascontiguousarray(key).view(np.dtype((np.void, key.dtype.itemsize * key.shape[1]))),
        return_inverse=True,
        return_counts=True,
    )
    inverse = inverse.reshape(-1)
    keep = np.zeros(len(rows.atom), dtype=bool)
    shared = cnt[inverse] > 1
    keep[~shared] = True
    if not shared.any():
        return keep
    rank = rows.rank
    load = np.bincount(rank[~shared], weights=nbytes[~shared], minlength=ranks).astype(np.int64)
    idx = np.nonzero(shared)[0]
    order = idx[np.lexsort((rank[idx], inverse[idx]))]
    groups = np.split(order, np.nonzero(np.diff(inverse[order]))[0] + 1)
    if lowest_rank:
        for g in groups:
            keep[g[0]] = True
        return keep
    for g in sorted(groups, key=lambda g: -int(nbytes[g[0]])):
        w = g[int(np.argmin(load[rank[g]]))]
        keep[w] = True
        load[rank[w]] += int(nbytes[w])
    return keep


def replica_copies_to_verify(
    payloads: Sequence[LocalPlanPayload],
    structures: Sequence[PlanStructure],
    items: Sequence[LocalItems],
    keep: Sequence[np.ndarray],
) -> dict[int, list[PieceKey]]:
    """Per rank, the deferred replicated pieces it holds but another rank writes: it hashes its
    copy during the write and the storage writer compares it with the written one's checksums.
    Refuses deferred pieces when some rank's storage writer does not compare them."""
    deferred = {(a, tuple(o)) for p in payloads for a, o, _ in p.deferred}
    if not deferred:
        return {}
    blind = [rank for rank, p in enumerate(payloads) if p.deferred and not p.writer_verifies]
    if blind:
        writers = sorted({_writer_name(payloads[r]) for r in blind})
        raise UCPError(
            f"UCPSavePlanner(replica_digests='writer') with {' / '.join(writers)}: rank(s) {blind[:8]} left their "
            "replica comparison to the storage writer, which does not compare replicas; refused before any write",
            wanted="UCPFileSystemWriter with checksums=True",
            saved=writers,
            hint="save with storage_writer=UCPFileSystemWriter(path) and checksums on (ucp_dcp.save does), or "
            "leave replica_digests at 'plan' (any storage writer)",
        )
    writer: dict[PieceKey, int] = {}
    for rank, (st, its, kept) in enumerate(zip(structures, items, keep)):
        for i in np.nonzero(kept)[0].tolist():
            a = int(its.atom[i])
            if st.shapes[a] is None:
                continue
            key = (st.names[a], tuple(its.off[i, : len(st.shapes[a])].tolist()))
            if key in deferred:
                writer[key] = rank
    out: dict[int, list[PieceKey]] = {}
    for rank, p in enumerate(payloads):
        mine = [(a, tuple(o)) for a, o, _ in p.deferred if writer.get((a, tuple(o)), rank) != rank]
        if mine:
            out[rank] = mine
    return out


def _writer_name(payload: LocalPlanPayload) -> str:
    """The storage writer a payload came through, as a message names it."""
    if payload.writer is None:
        return "a storage writer that is not ucp_dcp's (e.g. DCP's FileSystemWriter)"
    return f"{payload.writer} (checksums off)" if not payload.writer_verifies else payload.writer
