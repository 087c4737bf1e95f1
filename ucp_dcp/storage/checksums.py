"""Verifying checkpoint bytes against the I/O table's checksums, one block at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import ChecksumError
from .format import HASHES, block_hash

__all__ = ["BlockChecker"]


@dataclass(frozen=True)
class BlockChecker:
    """Checks bytes of a saved chunk against its per-block checksums (``crcs``, from the I/O table)."""

    block: int
    """Checksum block size in bytes."""
    algo: str
    """Hash name (a key of :data:`ucp_dcp.storage.format.HASHES`)."""

    def verify(self, buf: memoryview, start: int, crcs: list[int], rel: str, index: MetadataIndex) -> None:
        """Verify block-aligned bytes ``buf`` starting at chunk offset ``start``."""
        first = start // self.block
        for k in range(0, len(buf), self.block):
            self.check(first + k // self.block, block_hash(buf[k : k + self.block], self.algo), crcs, rel, index)

    def verify_span(
        self,
        pread: Callable[[int, int], memoryview],
        base: int,
        start: int,
        data: memoryview,
        crcs: list[int],
        nbytes: int,
        rel: str,
        index: MetadataIndex,
    ) -> None:
        """Verify the blocks touched by ``data`` (chunk bytes ``[start, start + len(data))``), reading
        only the parts of the first and last block that lie outside it (``pread(offset, n)``)."""
        end = start + len(data)
        b0, b1 = start // self.block, (max(end, start + 1) - 1) // self.block
        for b in range(b0, b1 + 1):
            bs, be = b * self.block, min((b + 1) * self.block, nbytes)
            a, c = max(bs, start), min(be, end)
            h = HASHES[self.algo]()
            if bs < a:
                h.update(pread(base + bs, a - bs))
            h.update(data[a - start : c - start])
            if c < be:
                h.update(pread(base + c, be - c))
            self.check(b, int(h.intdigest()), crcs, rel, index)

    def check_tile(self, t: int, got: int, sums: list[int], rel: str, index: MetadataIndex) -> None:
        """Check tile ``t``'s checksum (:mod:`ucp_dcp.storage.tiles`)."""
        if t < len(sums) and got == sums[t]:
            return
        raise ChecksumError(
            f"checksum mismatch in {rel}, atom '{index.fqn}' chunk at {list(index.offset or ())}: tile {t} has "
            f"{self.algo} {got:#x}, saved {f'{sums[t]:#x}' if t < len(sums) else 'none'}",
            atom=index.fqn,
            saved=sums[t] if t < len(sums) else None,
            wanted=got,
            hint="the checkpoint file is corrupt (disk, copy or transfer error); restore it from a good copy",
        )

    def check(self, b: int, got: int, crcs: list[int], rel: str, index: MetadataIndex) -> None:
        if b < len(crcs) and got == crcs[b]:
            return
        raise ChecksumError(
            f"checksum mismatch in {rel}, atom '{index.fqn}' chunk at {list(index.offset or ())}: block {b} "
            f"(bytes {b * self.block}.. of the chunk) has {self.algo} {got:#x}, saved "
            f"{f'{crcs[b]:#x}' if b < len(crcs) else 'none'}",
            atom=index.fqn,
            saved=crcs[b] if b < len(crcs) else None,
            wanted=got,
            hint="the checkpoint file is corrupt (disk, copy or transfer error); restore it from a good copy",
        )
