"""Verifying checkpoint bytes against the I/O table's checksums, one block at a time (each record's own block)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import ChecksumError
from .format import HASHES, BlockSums, block_checksums, digest_name

__all__ = ["BlockChecker"]


@dataclass(frozen=True)
class BlockChecker:
    """Checks bytes of a saved chunk against its block checksums (a :class:`~ucp_dcp.storage.format.BlockSums`
    from the I/O table: each record carries the block its sums cover)."""

    algo: str
    """Hash name (a key of :data:`ucp_dcp.storage.format.HASHES`)."""

    def verify(self, buf: memoryview, start: int, crcs: BlockSums, rel: str, index: MetadataIndex) -> None:
        """Verify block-aligned bytes ``buf`` starting at chunk offset ``start``."""
        B = crcs.block
        got = block_checksums(buf, B, self.algo) if len(buf) else []
        for k, h in enumerate(got):
            self.check(start // B + k, h, crcs, rel, index)

    def verify_span(
        self,
        pread: Callable[[int, int], memoryview],
        base: int,
        start: int,
        data: memoryview,
        crcs: BlockSums,
        nbytes: int,
        rel: str,
        index: MetadataIndex,
    ) -> None:
        """Verify the blocks touched by ``data`` (chunk bytes ``[start, start + len(data))``), reading
        only the parts of the first and last block that lie outside it (``pread(offset, n)``)."""
        B = crcs.block
        end = start + len(data)
        b0, b1 = start // B, (max(end, start + 1) - 1) // B

        def edge(b: int) -> None:  # a block that may stick out of ``data``: its outside bytes are read
            bs, be = crcs.span(b, nbytes)
            a, c = max(bs, start), min(be, end)
            h = HASHES[self.algo]()
            if bs < a:
                h.update(pread(base + bs, a - bs))
            h.update(data[a - start : c - start])
            if c < be:
                h.update(pread(base + c, be - c))
            self.check(b, int(h.intdigest()), crcs, rel, index)

        edge(b0)
        if b1 - b0 > 1:  # the blocks strictly inside ``data``: hashed straight from it, one call per block
            inner = data[(b0 + 1) * B - start : b1 * B - start]
            for k, got in enumerate(block_checksums(inner, B, self.algo)):
                self.check(b0 + 1 + k, got, crcs, rel, index)
        if b1 != b0:
            edge(b1)

    def check_tile(self, t: int, got: int, sums: list[int], rel: str, index: MetadataIndex) -> None:
        """Check tile ``t``'s checksum (:mod:`ucp_dcp.storage.tiles`)."""
        if t < len(sums) and got == sums[t]:
            return
        raise ChecksumError(
            f"checksum mismatch in {rel}, atom '{index.fqn}' chunk at {list(index.offset or ())}: tile {t} has "
            f"{digest_name(self.algo)} {got:#x}, saved {f'{sums[t]:#x}' if t < len(sums) else 'none'}",
            atom=index.fqn,
            saved=sums[t] if t < len(sums) else None,
            wanted=got,
            hint="the checkpoint file is corrupt (disk, copy or transfer error); restore it from a good copy",
        )

    def check(self, b: int, got: int, crcs: BlockSums, rel: str, index: MetadataIndex) -> None:
        sums = crcs.sums
        if b < len(sums) and got == sums[b]:
            return
        raise ChecksumError(
            f"checksum mismatch in {rel}, atom '{index.fqn}' chunk at {list(index.offset or ())}: block {b} "
            f"(bytes {b * crcs.block}.. of the chunk) has {digest_name(self.algo)} {got:#x}, saved "
            f"{f'{sums[b]:#x}' if b < len(sums) else 'none'}",
            atom=index.fqn,
            saved=sums[b] if b < len(sums) else None,
            wanted=got,
            hint="the checkpoint file is corrupt (disk, copy or transfer error); restore it from a good copy",
        )
