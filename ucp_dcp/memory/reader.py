"""``MemoryReader``: a load from a memory generation spread over hosts, at any layout.

A ``UCPFileSystemReader`` on this host's folder of the generation: the fragments in files this host
holds (its own pieces and the replicas it keeps) are read from host memory with the same ranged,
checksummed reads as from disk; the fragments in files it lacks are read, verified, by a rank of a
host that holds them (:mod:`ucp_dcp.memory.serving`; a fragment that is one contiguous run of a saved
record goes straight from a read-only mapping of the file, verified there, without a scratch copy) and
sent over the process group with the read-once exchange (:mod:`ucp_dcp.storage.exchange`: bounded
waits, a failing server's error sent in place of the bytes). Nothing is read from durable storage.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..errors import CorruptCheckpointError, UCPError
from ..planning.collectives import peer_timeout
from ..storage.commit import Integrity
from ..storage.exchange import Outcome, Payload, drain_only, exchange, exchange_link, size_error
from ..storage.file_ranges import map_window, regular_fd
from ..storage.format import box_grid, item_key
from ..storage.read_job import ReadJob, ReadStats
from ..storage.reader import UCPFileSystemReader
from ..storage.sidecar import decode_sidecar, metadata_from_sidecar, metadata_hash, sidecar_name
from ..storage.transport import Incoming, as_bytes_tensor, local_summary
from .locate import Source
from .serving import ScratchPlanner, ServePlan, ServeRequest, assign_servers
from .store import gen_dir, host_name

__all__ = ["MemoryReader"]


class MemoryReader(UCPFileSystemReader):
    """Reads a memory generation that :func:`ucp_dcp.memory.locate.locate` chose (tier ``memory``).

    Args:
        source: the located generation (its commit, and which hosts hold each file intact).
        root: the memory tier's root.

    Every block read is verified (``verify_checksums`` is not an option here: :func:`ucp_dcp.memory.load`
    relies on the block checksums to find a damaged copy).
    """

    def __init__(self, source: Source, root: str, **kwargs: Any) -> None:
        if source.tier != "memory":
            raise UCPError(f"MemoryReader reads a memory generation, got the {source.tier} tier")
        self.host = host_name()
        super().__init__(gen_dir(root, self.host, source.generation), verify_checksums=True, read_once="off", **kwargs)
        self.source = source
        self.local_files = {f for f, hs in source.holders.items() if self.host in hs}
        """Data files this host holds intact (read here); the others are served by peers."""
        self.served_bytes = 0
        """Bytes this rank read for other ranks during the last load."""

    def _open(self) -> tuple[Metadata, Integrity]:
        md_bytes, sidecar = self.source.md, self.source.sidecar
        h = metadata_hash(md_bytes)
        body = decode_sidecar(sidecar, sidecar_name(h))
        if body["metadata"] != {"xxh3_128": h, "bytes": len(md_bytes)}:
            raise CorruptCheckpointError(
                f"memory generation {self.source.generation}: its sidecar describes another .metadata",
                hint="the host copy is damaged; load the durable copy",
            )
        md = metadata_from_sidecar(body, md_bytes, self.trust)
        files = {k: int(v) for k, v in body["files"].items()}
        io = body.get("io") or {}
        return md, Integrity("verified" if io.get("algo") else "none", sidecar_name(h), io.get("algo"), files, [])

    # -- planning: who serves what ---------------------------------------------------------------------

    def _summary(self, plan: LoadPlan, mode: Any) -> Any:
        # never keyed (cached) like a file reader's: who serves what is assigned afresh from the hosts each
        # load (ServeRequest below), and a keyed summary left unanswered would make the next file load re-plan
        return local_summary(plan.items, self._md, mode)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        out = super().prepare_local_plan(plan)  # read-once off: the summary is only this rank's id
        req = ServeRequest(int(out.storage_data.rank))
        for i, item in enumerate(plan.items):
            name = self.storage_data[item.storage_index].relative_path
            if name in self.local_files:
                continue
            req.items.append(item)
            req.positions.append(i)
            req.files.append(name)
            req.sizes.append(self._item_nbytes(item))
        return dataclasses.replace(out, storage_data=req)

    def _item_nbytes(self, item: Any) -> int:
        if item.type == LoadItemType.BYTE_IO:
            return int(self.storage_data[item.storage_index].length)
        dtype, _ = self._chunk_meta[item.storage_index]
        n = 1
        for x in item.lengths:
            n *= int(x)
        return n * dtype.itemsize

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        assert self.source.hosts is not None
        requests = [p.storage_data if isinstance(p.storage_data, ServeRequest) else ServeRequest(-1) for p in plans]
        if any(r.rank < 0 for r in requests):
            raise UCPError("MemoryReader needs every rank's plan to pass through its prepare_local_plan")
        rank_hosts = dict(zip(self.source.hosts.ranks, self.source.hosts.hosts))
        served = assign_servers(requests, self.source.holders, rank_hosts)
        return [dataclasses.replace(p, storage_data=s) for p, s in zip(plans, served)]

    # -- reading ---------------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        kept = self._kept_items
        if kept is not None and len(plan.items) != kept:
            raise UCPError(
                f"{type(planner).__name__}: its plan said it puts its {kept} read item(s) back in finish_plan, "
                f"but read_data got {len(plan.items)}"
            )
        self.stats = ReadStats()
        self._serve_and_read(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _serve_and_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Serve peers and read this rank's own fragments, pipelined: each message a peer needs is read
        and sent in turn (gloo moves it while the next is read), then this rank reads its own fragments
        while those transfers finish, then takes what peers send it. Raises the true cause of any
        failure (as the read-once protocol does)."""
        t0 = time.perf_counter()
        sp = plan.storage_data if isinstance(plan.storage_data, ServePlan) else ServePlan()
        error: BaseException | None = None
        job: ReadJob | None = None
        serving: list[ReadJob] = []
        self.served_bytes = 0
        recv_pos = {p for msgs in sp.recv.values() for msg in msgs for p in msg}
        incoming: dict[int, list[Incoming]] = {}
        try:
            job = self._job(plan, planner, set(), self.stats)
            incoming = {src: [job.incoming(m) for m in msgs] for src, msgs in sp.recv.items()}
        except Exception as e:  # sent to every rank waiting for this one's bytes
            error = e
            incoming = {src: [drain_only() for _ in msgs] for src, msgs in sp.recv.items()}

        def serve(msg: list) -> torch.Tensor:
            views = []
            for it in msg:  # every fragment a contiguous run: sent from the mappings (packed if several)
                v = self._serve_mapped(it)
                if v is None:
                    break
                views.append(v)
            if len(views) == len(msg):
                out = _from_mapping(views[0]) if len(views) == 1 else as_bytes_tensor(views)
                self.served_bytes += int(out.numel())
                return out
            sj = self._job(LoadPlan(msg), ScratchPlanner(self._chunk_meta), set(range(len(msg))), self.stats)
            serving.append(sj)
            self._read_local(sj, set())
            out = as_bytes_tensor([sj.keep[j] for j in range(len(msg))])
            self.served_bytes += int(out.numel())
            return out

        sends: dict[int, list[Payload]] = {
            dst: [functools.partial(serve, msg) for msg in msgs] for dst, msgs in sorted(sp.serve.items())
        }
        own = functools.partial(self._read_local, job, recv_pos) if job is not None else None
        if len(sp.members) > 1:
            with exchange_link(sp.members, sp.members) as (watch, group):
                out = exchange(sends, incoming, error, group, watch, peer_timeout(), meanwhile=own)
        else:  # nothing crosses hosts: this rank's own reads only
            out = Outcome()
            if own is not None:
                try:
                    own()
                except Exception as e:  # noqa: BLE001 (raised below, as the exchange's would be)
                    out.error = e
        for j in (job, *serving):
            if j is not None and j.pool is not None:
                j.pool.drain()
        self.stats.seconds = time.perf_counter() - t0
        if error is not None or out.error is not None:
            raise error or out.error  # type: ignore[misc]
        if out.peers:
            raise out.peers[0]
        if out.bad_size:
            raise size_error(out.bad_size)

    def _serve_mapped(self, item: ReadItem) -> np.ndarray | None:
        """The bytes of a fragment that is one contiguous run of a record in this host's store, as a
        view of a read-only mapping of the file (no scratch, no copy). The checksum blocks it touches
        are verified from the mapping first. None when the fragment is not such a run (the scratch read
        serves it, with the same checks and errors)."""
        if item.type != LoadItemType.TENSOR or not self._crc:
            return None
        info = self.storage_data[item.storage_index]
        crcs = self._sums(item.storage_index)
        if info.transform_descriptors or not crcs:
            return None
        rel = info.relative_path
        with self._open_file(rel) as f:
            fd = regular_fd(f)
            record = self._record(f, item.storage_index, info)
            if fd is None or record is None or not record.contiguous:
                return None
            grid = box_grid(record.shape, record.itemsize, item.storage_offsets, item.lengths)
            base = int(info.offset) + record.data_offset
            if grid.nruns != 1 or base + record.nbytes > os.fstat(fd).st_size:
                return None  # strided, or a short file: the read path names what is wrong
            B = crcs.block  # the record's own block (the table's for a checkpoint written before they had one)
            lo, hi = grid.first // B * B, min(record.nbytes, -(-grid.end // B) * B)
            window = map_window(fd, base + lo, hi - lo)
        self._checker.verify(window.data, lo, crcs, rel, item.storage_index)
        with self._lock:
            self.stats.bytes_read += hi - lo
            self.stats.ranges += 1
            self.stats.items.append(item_key(item.storage_index))
        return window[grid.first - lo : grid.end - lo]


def _from_mapping(view: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only mapping (gloo only reads what it sends; torch warns it is not writable)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(view)
