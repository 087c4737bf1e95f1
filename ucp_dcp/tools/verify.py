"""``python -m ucp_dcp verify CKPT``: re-hash every byte of a checkpoint against its checksums.

A load verifies the blocks it reads; ``verify`` checks all of them, before a job depends on the
checkpoint or after it was copied: the metadata against its sidecar (when opening), every data
file's size, every checksum block of tensor data, every item's frame (its zip bytes around the data)
and every object. Files are hashed in parallel straight from a read-only mapping (no copy).
"""

from __future__ import annotations

import math
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError, UCPError
from ..planning.catalog import load_catalog
from ..planning.ties import catalog_aliases
from ..storage.format import (
    BLOCK,
    HASHES,
    IO_KEY,
    RECORD_ALIGN,
    block_checksums,
    digest_name,
    entry_sums,
    item_key,
)
from ..storage.object_store import OBJECT_PROTOCOLS, ObjectStore, object_protocol
from ..storage.tiles import saved_tile_grid, tile_checksums

__all__ = ["Problem", "VerifyReport", "verify", "format_report"]

EXIT = {"ok": 0, "corrupt": 1, "incomplete": 2, "not_found": 2, "unchecksummed": 3, "unsafe": 4}
"""Exit status of ``verify`` per report status."""


@dataclass
class Problem:
    """One thing that is wrong with a checkpoint."""

    file: str | None
    """Data file (None: the checkpoint as a whole)."""
    atom: str | None
    """Atom whose bytes are affected."""
    box: str | None
    """Affected region in the atom's global coordinates, e.g. ``[512:600, 0:500]``."""
    what: str
    """What is wrong."""


@dataclass
class VerifyReport:
    """Result of :func:`verify`."""

    path: str
    """The checkpoint folder."""
    status: str
    """``ok``, ``corrupt``, ``incomplete``, ``not_found``, ``unchecksummed`` or ``unsafe``."""
    integrity: str = ""
    """What the checkpoint's checksums cover (:meth:`Integrity.describe`)."""
    files: int = 0
    """Data files checked."""
    bytes: int = 0
    """Bytes hashed."""
    blocks: int = 0
    """Checksums compared (tensor blocks, frames and objects)."""
    seconds: float = 0.0
    """Wall time of the hashing."""
    problems: list[Problem] = field(default_factory=list)
    """Everything found wrong, in file order."""

    @property
    def exit_code(self) -> int:
        return EXIT[self.status]

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"exit_code": self.exit_code}


@dataclass
class _Item:
    index: MetadataIndex
    offset: int
    length: int
    entry: Any
    shape: tuple[int, ...] | None
    itemsize: int


def _box(item: _Item, lo: int, hi: int) -> str:
    """Rows of the atom touched by bytes ``[lo, hi)`` of a chunk's data, as a global box."""
    shape, offs = item.shape or (), tuple(item.index.offset or ())
    if not shape:
        return "[]"
    row = math.prod(shape[1:]) * item.itemsize
    r0, r1 = lo // row, -(-hi // row)
    dims = [f"{offs[0] + r0}:{offs[0] + r1}"] + [f"{o}:{o + n}" for o, n in zip(offs[1:], shape[1:])]
    return f"[{', '.join(dims)}]"


def _check_file(
    folder: str, rel: str, size: int | None, items: list[_Item], algo: str, block: int
) -> tuple[int, int, list[Problem]]:
    atoms = sorted({it.index.fqn for it in items})
    if object_protocol(folder) in OBJECT_PROTOCOLS:  # every byte is hashed: the whole object, one GET
        data = ObjectStore(folder).get(f"{folder.rstrip('/')}/{rel}")
        if data is None:
            return (
                0,
                0,
                [Problem(rel, atoms[0] if atoms else None, None, f"object is missing (holds {len(atoms)} atom(s))")],
            )
        want = size if size is not None else max((it.offset + it.length for it in items), default=0)
        if len(data) != want:
            what = "truncated" if len(data) < want else "too long"
            return (
                0,
                0,
                [
                    Problem(
                        rel,
                        atoms[0] if atoms else None,
                        None,
                        f"object has {len(data)} bytes, {want} were written ({what})",
                    )
                ],
            )
        return _check_items(data, rel, len(data), items, algo, block)
    path = os.path.join(folder, rel)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0, 0, [Problem(rel, atoms[0] if atoms else None, None, f"file is missing (holds {len(atoms)} atom(s))")]
    try:
        have = os.fstat(fd).st_size
        want = size if size is not None else max((it.offset + it.length for it in items), default=0)
        if have != want:
            return (
                0,
                0,
                [
                    Problem(
                        rel,
                        atoms[0] if atoms else None,
                        None,
                        f"file has {have} bytes, {want} were written ({'truncated' if have < want else 'too long'})",
                    )
                ],
            )
        if have == 0:
            return 0, 0, []
        mm = mmap.mmap(fd, have, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        return _check_items(mm, rel, have, items, algo, block)
    finally:
        mm.close()


def _check_items(
    mm: mmap.mmap | bytes, rel: str, size: int, items: list[_Item], algo: str, block: int
) -> tuple[int, int, list[Problem]]:
    """Hash every item of one mapped file (every view of the mapping dies with this frame)."""
    problems: list[Problem] = []
    hashed = checks = 0
    view = memoryview(mm)
    pos = 0
    for it in sorted(items, key=lambda i: i.offset):
        if it.offset != pos and not _alignment_gap(view, pos, it.offset):
            problems.append(Problem(rel, it.index.fqn, None, f"bytes {pos}..{it.offset} belong to no item"))
        pos = it.offset + it.length
        raw = view[it.offset : it.offset + it.length]
        hashed += len(raw)
        if it.entry is None:
            problems.append(Problem(rel, it.index.fqn, None, "item has no checksum in the I/O table"))
            continue
        data_offset = it.entry[0]
        try:  # the record's own block (version 4 tensor entries), else the table's
            crcs = entry_sums(it.entry, block, it.index)
        except UCPError as e:
            problems.append(Problem(rel, it.index.fqn, None, e.message))
            continue
        sums, B = crcs.sums, crcs.block
        frame = it.entry[2] if len(it.entry) > 2 else None
        if it.shape is None:  # an object: blocks over the whole item
            data, what = raw, "object"
        else:
            nbytes = math.prod(it.shape) * it.itemsize
            data = raw[data_offset : data_offset + nbytes] if data_offset >= 0 and nbytes else raw[:0]
            what = "tensor"
            if frame is not None:
                h = HASHES[algo]()
                h.update(raw[: max(data_offset, 0)])
                h.update(raw[max(data_offset, 0) + len(data) :])
                checks += 1
                if int(h.intdigest()) != frame:
                    problems.append(
                        Problem(
                            rel,
                            it.index.fqn,
                            None,
                            f"item frame (zip bytes around the data of chunk at "
                            f"{list(it.index.offset or ())}) does not match its checksum",
                        )
                    )
        before = len(problems)
        # every block hashed in one pass (one call per block: 1 KiB blocks of small records cost per call)
        # an empty tensor has no sums (nothing to hash): not a missing checksum
        got = block_checksums(data, B, algo) if len(data) or sums else []
        checks += len(got)
        for b, h in enumerate(got):
            if b >= len(sums) or h != sums[b]:
                lo, hi = b * B, min((b + 1) * B, len(data))
                where = f"chunk at {list(it.index.offset or ())}" if what == "tensor" else "value"
                problems.append(
                    Problem(
                        rel,
                        it.index.fqn,
                        _box(it, lo, hi) if what == "tensor" else None,
                        f"{what} block {b} (bytes {lo}..{hi} of the {where}) does not match its {digest_name(algo)} checksum",
                    )
                )
        tiles = it.entry[3] if what == "tensor" and len(it.entry) > 3 else None
        if tiles and len(problems) == before:  # bytes the blocks found bad: their tiles add nothing
            checks += 1
            problems.extend(_check_tiles(rel, it, data, tiles, algo))
    if pos != size:
        problems.append(Problem(rel, None, None, f"bytes {pos}..{size} belong to no item"))
    return hashed, checks, problems


def _alignment_gap(view: memoryview, pos: int, offset: int) -> bool:
    """Bytes ``pos..offset`` are the writer's padding before a record: zeros, fewer than
    :data:`~ucp_dcp.storage.format.RECORD_ALIGN`, ending on a multiple of it."""
    n = offset - pos
    return 0 < n < RECORD_ALIGN and offset % RECORD_ALIGN == 0 and view[pos:offset] == bytes(n)


def _check_tiles(rel: str, it: _Item, data: memoryview, tiles: list, algo: str) -> list[Problem]:
    """The chunk's tile sums (what column reads verify against) agree with its bytes."""
    where = f"chunk at {list(it.index.offset or ())}"
    try:
        grid = saved_tile_grid(tiles, it.shape or (), it.itemsize, it.index)
    except UCPError as e:
        return [Problem(rel, it.index.fqn, None, f"{where}: {e}")]
    got = tile_checksums(data, grid, HASHES[algo]) if len(data) == grid.rows * grid.row_bytes else []
    bad = [t for t, (a, b) in enumerate(zip(got, tiles[2])) if a != b] if got else [0]
    return (
        [
            Problem(
                rel,
                it.index.fqn,
                None,
                f"{where}: tile {bad[0]} (of {len(tiles[2])}; {len(bad)} differ) does not match its {digest_name(algo)} checksum",
            )
        ]
        if bad
        else []
    )


def _items(md: Metadata) -> dict[str, list[_Item]]:
    io = (md.storage_data or {}).get(MetadataIndex(IO_KEY)) or {}
    table = io.get("items", {})
    chunks = {
        (fqn, tuple(c.offsets)): c
        for fqn, smd in md.state_dict_metadata.items()
        if isinstance(smd, TensorStorageMetadata)
        for c in smd.chunks
    }
    out: dict[str, list[_Item]] = {}
    storage = md.storage_data or {}
    aliases = catalog_aliases(load_catalog(md.planner_data))
    for index, info in storage.items():
        if index.fqn == IO_KEY:
            continue
        if index.fqn in aliases and storage.get(MetadataIndex(aliases[index.fqn], index.offset)) == info:
            continue  # a tied key: its entries point at its atom's bytes, checked once there
        smd = md.state_dict_metadata.get(index.fqn)
        shape, itemsize = None, 1
        if isinstance(smd, TensorStorageMetadata):
            chunk = chunks.get((index.fqn, tuple(index.offset or ())))
            if chunk is None:
                raise CorruptCheckpointError(
                    f"storage entry of '{index.fqn}' at {list(index.offset or ())} "
                    "matches no chunk of the tensor table",
                    atom=index.fqn,
                )
            shape = tuple(int(s) for s in chunk.sizes)
            itemsize = smd.properties.dtype.itemsize
        out.setdefault(info.relative_path, []).append(
            _Item(index, int(info.offset), int(info.length), table.get(item_key(index)), shape, itemsize)
        )
    return out


_OPEN_FAILURES = (
    (CheckpointNotFoundError, "not_found"),
    (IncompleteCheckpointError, "incomplete"),
    (CorruptCheckpointError, "corrupt"),
    (UCPError, "unsafe"),
)


def verify(path: str | os.PathLike, *, threads: int | None = None, trust: bool = False) -> VerifyReport:
    """Check every byte of the checkpoint at ``path`` (local folder or object-store URL) against its checksums."""
    from ..storage.opening import open_path

    folder = str(path)
    report = VerifyReport(folder, "ok")
    try:
        md, integ = open_path(folder, trust=trust)
    except UCPError as e:  # the checkpoint cannot be opened: say why, check nothing else
        report.status = next(status for cls, status in _OPEN_FAILURES if isinstance(e, cls))
        report.problems = [Problem(None, None, None, e.message)]
        return report
    report.integrity = integ.describe()
    io = (md.storage_data or {}).get(MetadataIndex(IO_KEY)) or {}
    algo = io.get("algo")
    if integ.status != "verified" or algo not in HASHES:
        report.status = "unchecksummed"
        report.problems.append(
            Problem(
                None,
                None,
                None,
                (
                    "checkpoint has no checksums (written by stock DCP or with checksums=False): nothing can be verified"
                    if integ.status == "none"
                    else "checkpoint was written by an older ucp_dcp: its metadata and values carry no checksums; "
                    "save it again to protect them"
                    if integ.status == "partial"
                    else f"checkpoint checksums use '{algo}', which this ucp_dcp cannot compute"
                ),
            )
        )
        return report
    by_file = _items(md)
    files = dict(integ.files or {})
    for rel in by_file:
        files.setdefault(rel, None)  # type: ignore[arg-type]
    block = int(io.get("block", BLOCK))  # objects', and every record's of a table up to version 3
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
        futs = [
            pool.submit(_check_file, folder, rel, files[rel], by_file.get(rel, []), algo, block)
            for rel in sorted(files)
        ]
        for fut in futs:
            hashed, checks, problems = fut.result()
            report.bytes += hashed
            report.blocks += checks
            report.problems.extend(problems)
    report.seconds = time.perf_counter() - t0
    report.files = len(files)
    if report.problems:
        report.status = "corrupt"
    return report


_COVERAGE = {"verified": "full", "partial": "tensor data only", "none": "none"}
"""How much of a checkpoint its checksums cover, by :meth:`Integrity.describe`'s status word."""


def format_report(r: VerifyReport) -> str:
    """The report for a person: one verdict on the first line, then what was checked and every problem."""
    head = {
        "ok": "OK",
        "corrupt": "CORRUPT",
        "incomplete": "INCOMPLETE CHECKPOINT",
        "not_found": "NOT FOUND",
        "unchecksummed": "NOT VERIFIABLE",
        "unsafe": "UNSAFE",
    }[r.status]
    count = f" ({len(r.problems)} problem(s))" if r.status == "corrupt" else ""
    lines = [f"{head}: {r.path}{count}"]
    if r.integrity:
        # what the checksums cover, without Integrity's own status word: "verified" there means fully
        # protected, and read under a CORRUPT verdict it contradicted it (issue 47)
        level, _, covers = r.integrity.partition(": ")
        lines.append(f"  checksums ({_COVERAGE.get(level, level)}): {covers or level}")
    if r.files:
        rate = r.bytes / r.seconds / 1e9 if r.seconds else 0.0
        lines.append(
            f"  {r.files} file(s), {r.bytes / 2**20:.1f} MiB, {r.blocks} checksums in {r.seconds:.2f} s "
            f"({rate:.2f} GB/s)"
        )
    for p in r.problems[:200]:
        where = ", ".join(
            x for x in (p.file, f"atom '{p.atom}'" if p.atom else None, f"box {p.box}" if p.box else None) if x
        )
        lines.append(f"  - {where + ': ' if where else ''}{p.what}")
    if len(r.problems) > 200:
        lines.append(f"  ... and {len(r.problems) - 200} more")
    return "\n".join(lines)
