"""``UCPFileSystemReader``: reads only the bytes each rank needs, each file once, in offset order.

DCP's ``FileSystemReader`` deserializes a whole saved chunk for every read item and narrows it, so
resharding reads several times the needed bytes. Here every read item becomes byte runs of its
chunk (see :mod:`ucp_dcp.storage.format`); the runs of all items of a chunk are merged (a chunk feeding
several target boxes is read once), widened to whole checksum blocks when verifying, and read with
one open file per thread, in offset order. A single contiguous run of matching dtype lands directly
in the target tensor; anything else goes through a buffer of at most one chunk's needed bytes
(:mod:`ucp_dcp.storage.read_job`: where the bytes of one read go). Pieces the coordinator marked as shared
are read by one rank and sent to the others (:mod:`ucp_dcp.storage.transport`). Items this reader cannot
read by ranges (stream transforms, foreign records) fall back to DCP's whole-item path. Device targets
(CUDA tensors) are reached through bounded host staging buffers and non-blocking copies
(:mod:`ucp_dcp.storage.staging`).

The class's sections follow DCP's calls, in their order:

* ``read_metadata``: the checkpoint opened without running code from it (the JSON sidecar, or an allow-list
  unpickler), its integrity known;
* ``set_up_storage_reader``: the I/O table (checksum algorithm, blocks, records) read once per load;
* ``prepare_local_plan`` / ``prepare_global_plan``: read-once, each rank's summary of its reads and the
  coordinator's answer (keyed when plans are cached: the last section, the reader's side of the load-plan
  cache);
* ``read_data``: every step inside one failure protocol. Whatever fails on a rank -- building the read job,
  its own reads, packing what it sends, working out where received bytes go, the side group -- the rank
  still takes part in the exchange (:mod:`ucp_dcp.storage.exchange`): it sends its error to every rank
  waiting for bytes from it, and receives (into scratch memory) every message meant for it. Then it raises
  its own error; a rank that failed only because another did raises that rank's error
  (:class:`~ucp_dcp.errors.PeerFailedError`: the rank and the cause in one line, an instance of the cause's
  class). A rank that died or froze is named by the gates of the call's watch
  (:mod:`ucp_dcp.planning.checkpoint_group`), not by a collective timing out. Each of :data:`READ_STEPS` is a
  fault point (:mod:`ucp_dcp.planning.faults`): a test's hook can make a rank fail there (``make chaos``
  raises, kills or stops one rank at each);
* the rank's own reads, one file at a time: read items grouped by saved chunk and by file, a file's chunks
  in offset order; a tensor chunk's byte runs straight into the target when they are one contiguous run of
  matching dtype, else through a buffer, from a read-only mapping of the file when it is local
  (:func:`~ucp_dcp.storage.file_ranges.regular_fd`) or by ranged reads; objects whole, checked against their
  checksum as stored, then decoded through their stream transforms (DCP's ``_extension_registry``) when
  delivered.

Kept in one module (about 1,200 lines): one reader, whose steps hand a load's state to each other in DCP's
order, and whose chunk reads (direct, union, mapped, tiled, fallback) share its verification state. Readers
of other formats (:mod:`ucp_dcp.sources`, :mod:`ucp_dcp.memory.reader`) subclass it and override its
opening (``_open``), records (``_record``) and reads (``_read_chunk``, ``_read_local``).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._compat import _create_file_view, fsspec_filesystem, narrow_tensor_by_index
from ..errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    MissingFileError,
    TruncatedFileError,
    UCPError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)
from ..planning import device as _device
from ..planning import faults, plan_cache
from ..planning.checkpoint_group import mark
from ..planning.collectives import peer_timeout
from ..planning.device import StagingMode, needs_staging, split_reads, staging_forced
from ..planning.faults import fault_point
from ..planning.handshake import ReadOnceRequest
from ..planning.opened import UnopenedMetadata, checked, raise_if_unopened
from ..planning.payloads import Compact, ReadOnceMode
from ..planning.plan_cache import ENTRIES, CachedLoadPlan, PlanCacheMissError, ProcessCache, plan_key_of
from ..progress import CallProgress
from .commit import Integrity, open_checkpoint
from .exchange import Outcome, drain_only, exchange, exchange_link, size_error
from .file_ranges import (
    REMOTE_GAP,
    STORE_REQUESTS_PER_THREAD,
    WINDOW,
    StoreRanges,
    coalesce_within,
    gather_runs,
    map_window,
    reading_threads,
    readinto,
    regular_fd,
    split_work,
)
from .format import (
    BLOCK,
    HASHES,
    IO_KEY,
    NO_SUMS,
    BlockChecker,
    BlockSums,
    BoxGrid,
    TensorRecord,
    block_hash,
    blocks_touching,
    box_grid,
    check_tables,
    chunk_meta,
    entry_sums,
    gather_grid,
    item_key,
    merge_intervals,
    parse_tensor_record,
    split_grid,
)
from .object_prefetch import prefetch_batches
from .object_store import OBJECT_PROTOCOLS, ObjectStore, object_protocol
from .object_streams import ObjectSizes, RangedObjectFile
from .read_job import ReadJob, ReadStats, items_nbytes
from .staging import BUFFERS_PER_THREAD
from .tiled_read import plan_tiled, read_tiled, read_tiled_remote
from .tiles import saved_tile_grid
from .transport import (
    READ_ONCE_MODES,
    Incoming,
    ReadSummary,
    TransportPlan,
    as_bytes_tensor,
    local_summary,
    plan_transport,
)

__all__ = [
    "UCPFileSystemReader",
    "ReadStats",
    "READ_STEPS",
    "KeyedSummary",
    "KeyedTransport",
    "ReaderEntry",
    "Pending",
    "keyed_summary",
    "keyed_answers",
    "summaries",
    "cached_summary",
    "resolved_answer",
]

READ_STEPS = ("job", "read", "pack", "incoming", "group", "deliver")
"""The steps of ``read_data`` a fault can be injected at (in order): the read job built, this rank's own reads,
the messages it sends packed, where the ones it receives go, the exchange's group, a received message
delivered."""


@dataclass
class _Chunk:
    """One saved chunk and the local read items it feeds."""

    index: MetadataIndex
    info: Any
    record: TensorRecord | None
    items: list[ReadItem] = field(default_factory=list)


class UCPFileSystemReader(FileSystemReader):
    """Ranged, checksummed, read-once ``StorageReader`` for DCP checkpoints (local or fsspec paths).

    Opening a checkpoint never runs code from it: the metadata is rebuilt from its JSON sidecar
    (checked against the ``.metadata`` bytes and its own hash), or, for checkpoints without one,
    unpickled with an allow-list of DCP's metadata types (:mod:`ucp_dcp.storage.sidecar`).

    The positional parameters are ``FileSystemReader``'s, in its order (a drop-in); ucp_dcp's own
    options are keyword-only after them.

    Works with any load planner (DCP's reads the way DCP's reader does, plus read-once). A planner whose
    plan payload is a :class:`~ucp_dcp.planning.handshake.ReadOnceRequest` (``UCPLoadPlanner``) chooses the
    read-once mode and keeps its items out of the gathered plan; one that then hands ``read_data`` fewer
    items than it planned is refused, naming the pair.

    Args:
        path: checkpoint folder or fsspec URL.
        _extension_registry: as in DCP: the stream transforms items written with them are decoded
            by, tensors and objects alike (such tensor items are read whole, DCP's way; an object's
            checksum, when it has one, is checked over its bytes as stored, before decoding).
        thread_count: reading threads of this rank; None (the default): from the machine, the cores
            this process may use shared among its host's ranks, 2 to 16
            (:func:`~ucp_dcp.storage.file_ranges.reading_threads`). A rank's files, and runs of whole
            chunks of a large file, are read concurrently.
        verify_checksums: verify the checksum of every block (1 KiB to 1 MiB, each record's own) and
            object read (when the checkpoint has them).
        trust: unpickle a checkpoint's metadata without the allow-list (only for checkpoints from a
            source you trust whose metadata holds other types).
        staging: ``"auto"``: stage only non-CPU targets through host buffers; ``"always"``: CPU
            targets too (exercises the device path without a GPU). None: ``$UCP_DCP_STAGING``.
        storage_options: for an URL, fsspec's options (endpoint, credentials); None: the client's own
            configuration (``AWS_*`` environment variables, ...). On an object store every read is a
            ranged GET of exactly the bytes needed, a large one cut into pieces fetched concurrently,
            and the default ``thread_count`` is :data:`~ucp_dcp.storage.file_ranges.STORE_REQUESTS_PER_THREAD`
            times the local one (a request waits on a round trip, not on a core).
        store_ranges: on an object store, how strided reads (a column slice of row-sharded chunks: a
            tensor-parallel dim change) become ranged GETs. ``"few"`` (the default): gaps under 1 MiB are
            fetched too, a request being worth about that many bytes on a store, so a slice of narrow rows
            reads whole rows in a few requests (up to 1/slice-fraction of the bytes); ``"exact"``: the bytes
            needed (verified by tile sums), a request per saved row when rows are narrow. ``ucp_dcp plan
            --request-rate`` counts both.
        read_once: who receives saved bytes several ranks need, read by one rank the coordinator
            picks: ``"hosts"`` (only ranks on other hosts than the reader: the reader's host's page
            cache serves its neighbours), ``"ranks"`` (every other rank), ``"off"`` (every rank
            reads what it needs). None: the load planner's ``read_once`` (``UCPLoadPlanner``'s
            default ``"hosts"``). The host is ``socket.gethostname()`` or ``$UCP_DCP_HOST``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry: Any = None,
        *,
        thread_count: int | None = None,
        verify_checksums: bool = True,
        trust: bool = False,
        staging: StagingMode | None = None,
        read_once: ReadOnceMode | None = None,
        storage_options: dict[str, Any] | None = None,
        store_ranges: StoreRanges = "few",
    ) -> None:
        super().__init__(path, _extension_registry)
        if store_ranges not in get_args(StoreRanges):
            raise InvalidArgumentError(f"store_ranges={store_ranges!r}: expected one of {get_args(StoreRanges)}")
        self.store_ranges = store_ranges
        self.store_gap = REMOTE_GAP if store_ranges == "few" else 0
        """Gaps a strided read on a store fetches too (0, ``"exact"``: only the bytes needed, within 2 %)."""
        self.storage_options = storage_options
        self.store: ObjectStore | None = None
        """The object store the checkpoint is read from (None: a local folder or another fsspec file system)."""
        if "://" in str(path):
            self._use_url(str(path))
        if thread_count is not None and (not isinstance(thread_count, int) or isinstance(thread_count, bool)):
            raise InvalidArgumentError(f"thread_count must be an int or None, got {thread_count!r}")
        if thread_count is None:  # a request to a store waits on a round trip: several per core
            thread_count = reading_threads() * (STORE_REQUESTS_PER_THREAD if self.store is not None else 1)
        self.thread_count = max(1, thread_count)
        self.verify_checksums = verify_checksums
        self.trust = trust
        if read_once is not None and read_once not in READ_ONCE_MODES:
            raise InvalidArgumentError(f"read_once={read_once!r}: expected one of {READ_ONCE_MODES}")
        self.read_once = read_once
        self._forced = staging_forced(staging)
        self.stage_bytes = _device.STAGE_BYTES
        """Size of a staging buffer (and the largest item read into one)."""
        self.stats = ReadStats()
        self.progress: CallProgress | None = None
        """The call's progress (``ucp_dcp.load`` sets it): the reader names its phases and, on the coordinator,
        the job's bytes. None: ``read_data`` shows its reading alone."""
        self._kept_items: int | None = None
        """Read items a planner that keeps them (:class:`ReadOnceRequest`) planned on this rank."""
        self._keyed: Pending | None = None
        """A load whose summary was keyed (cached plans): what its answer is resolved with in ``read_data``."""
        self.integrity: Integrity | None = None
        """How far the opened checkpoint can be verified (set by ``read_metadata``)."""
        self._object_sizes = ObjectSizes()
        """Sizes of the objects this reader asked the store for (one HEAD each per load)."""
        self._opened: tuple[str, Metadata] | None = None
        """``(path, metadata)`` opened by :meth:`metadata_for_load` for the next ``read_metadata``."""

    def _use_url(self, url: str) -> None:
        self.fs = fsspec_filesystem()()
        self.path = self.fs.init_path(url, **(self.storage_options or {}))
        if object_protocol(url) in OBJECT_PROTOCOLS:
            self.store = ObjectStore(url, self.storage_options)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        # DCP's reset (a new load id, no storage data) without a path: it would take a URL for a local one
        super().reset(None)
        self._object_sizes = ObjectSizes()  # an object's size is known for one load: it may be rewritten after
        if checkpoint_id and "://" in str(checkpoint_id):
            self._use_url(str(checkpoint_id))
        elif checkpoint_id:
            self.store = None
            super().reset(checkpoint_id)

    # -- opening: read_metadata ------------------------------------------------------------------------------------

    def _open(self) -> tuple[Metadata, Integrity]:
        """The checkpoint's metadata and how far it can be verified (readers of other formats
        override this and inherit the error handling of :meth:`read_metadata`)."""
        # on a store, no listing per rank: strays are inspect's business (one LIST request saved per rank)
        return open_checkpoint(self.fs, self.path, trust=self.trust, list_strays=self.store is None)

    def metadata_for_load(self) -> Metadata:
        """Open the checkpoint now for the load about to run: the next :meth:`read_metadata` (DCP's, in
        ``dcp.load``) hands back this opening instead of reading and verifying ``.metadata`` again, so a
        caller's checks before the load (the torchtitan manager's dataloader policy) cost no second open."""
        md = self.read_metadata()
        self._opened = (str(self.path), md)
        return md

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        opened, self._opened = self._opened, None
        if opened is not None and opened[0] == str(self.path):  # reset() to another folder: open that one
            md = opened[1]
            md.storage_meta = md.storage_meta or StorageMeta()
            md.storage_meta.load_id = self.load_id  # dcp.load's reset() drew a new load id
            return md
        try:
            md, self.integrity = self._open()
        except UCPError as e:
            # dcp.load turns read_metadata's exceptions into a bare AssertionError string; hand back
            # an empty Metadata carrying the error, raised by set_up_storage_reader / the planner
            self.integrity = None
            return UnopenedMetadata(state_dict_metadata={}, storage_data={}, error=e)
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        # its integrity is seen by UCPLoadPlanner; the hash of its bytes keys cached load plans
        return checked(md, self.integrity.status, self.integrity.metadata_hash or self.integrity.sidecar)

    # -- set_up_storage_reader -------------------------------------------------------------------------------------

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        mark("load", "planning")  # DCP's local planning step starts here, before the planner's
        if self.progress is not None:
            self.progress.phase("planning")  # a load planned again (a cached plan that missed) plans here again
        fault_point("load-plan")
        raise_if_unopened(metadata)  # read_metadata could not raise inside dcp.load: its error is raised here
        self._kept_items = None
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        check_tables(metadata)  # the storage entries and the I/O table agree before any byte is read by them
        if self.integrity is None:  # metadata handed in by the caller, not read here
            self.integrity = Integrity(
                "partial" if (self.storage_data.get(MetadataIndex(IO_KEY)) or {}).get("algo") else "none"
            )
        if is_coordinator and self.integrity.status != "verified" and self.verify_checksums:
            warnings.warn(
                _UNVERIFIED[self.integrity.status].format(path=self.path), UnverifiedCheckpointWarning, stacklevel=2
            )
        self._io = self.storage_data.get(MetadataIndex(IO_KEY)) or {}
        algo = self._io.get("algo")
        # an algorithm this version does not know (a newer writer's) reads unverified, with a warning: never a
        # false checksum error
        self._algo = algo if algo in HASHES else None
        if algo is not None and self._algo is None and self.verify_checksums:
            warnings.warn(
                f"checkpoint checksums use '{algo}', which this ucp_dcp cannot verify: reading "
                "without verification (upgrade ucp_dcp to verify them)",
                stacklevel=2,
            )
        self._crc = self._io.get("items", {}) if self._algo else {}
        # the table's block: every record's of a table up to version 3, objects' since (a tensor record of
        # version 4 carries its own: ``entry_sums``)
        self._block = int(self._io.get("block", BLOCK))
        self._checker = BlockChecker(self._algo or "")
        self._records: dict[MetadataIndex, TensorRecord | None] = {}
        """Each chunk's record (where its data starts, its layout), found once per load: file threads share it."""
        self._lock = threading.Lock()
        """The file threads' lock over :attr:`_records` and :attr:`stats`."""
        self._chunk_meta = chunk_meta(metadata)
        self._md = metadata

    # -- planning: read-once (prepare_local_plan, then prepare_global_plan on the coordinator) ---------------------

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Summarize this rank's reads for read-once (keys and sizes, not items). A planner that
        puts its items back in ``finish_plan`` (``LoadPlanPayload.keeps_items``) gets them left out
        of the gathered plan, so planning stays O(summary) per rank."""
        pd = plan.planner_data
        request = pd if isinstance(pd, ReadOnceRequest) else None  # other planners: DCP's contract only
        mode = self.read_once or (request.read_once if request is not None else None) or "hosts"
        if mode not in READ_ONCE_MODES:
            raise UCPError(f"read_once={mode!r}: expected one of {READ_ONCE_MODES}")
        keeps = request is not None and request.keeps_items
        # a planner that said it keeps its items must hand them all to read_data (else nothing is read)
        self._kept_items = len(plan.items) if keeps else None
        return LoadPlan([] if keeps else plan.items, storage_data=self._summary(plan, mode), planner_data=pd)

    def _summary(self, plan: LoadPlan, mode: ReadOnceMode) -> ReadSummary | KeyedSummary:
        """This rank's read-once summary (:func:`~ucp_dcp.storage.transport.local_summary`); keyed when the
        planner's plan is cached (:func:`keyed_summary`), and the key kept until
        ``read_data`` gets the coordinator's answer. Readers whose answers are not cached override it."""
        summary, self._keyed = keyed_summary(plan, self._md, mode, type(self))
        return summary

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Pick one reader for every piece several ranks need (see :mod:`ucp_dcp.storage.transport`); keyed
        summaries (cached plans) get the cached answers (:func:`keyed_answers`)."""
        answers = keyed_answers(plans, self._plan_transport)
        if self.progress is not None:  # every rank's summary gives the sizes of its reads: the job's bytes
            self.progress.job(_job_bytes(plans), len(plans))
        return answers

    def _plan_transport(self, summaries: list[ReadSummary | None]) -> list[TransportPlan]:
        """The coordinator's answers to every rank's summary (:func:`~ucp_dcp.storage.transport.plan_transport`),
        each naming who loads: the ranks the exchange's gates wait for (:mod:`ucp_dcp.planning.checkpoint_group`),
        unknown (None) when some rank's reader sent no summary."""
        ranks = [int(s.rank) for s in summaries if s is not None]
        members = ranks if len(ranks) == len(summaries) else None
        return [dataclasses.replace(t, members=members) for t in plan_transport(summaries)]

    # -- read_data: every step inside one failure protocol ---------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items and exchange the shared ones (:meth:`_read_and_exchange`), the reading shown
        as the call's progress; done when it returns (the future is set: DCP waits on nothing more)."""
        kept = self._kept_items
        # a planner that keeps its items (prepare_local_plan left them out of the gather) must hand back every
        # one: fewer would leave targets unread without an error
        if kept is not None and len(plan.items) != kept:
            raise UCPError(
                f"{type(planner).__name__} with {type(self).__name__}: the planner's plan said it puts its {kept} "
                f"read item(s) back in finish_plan (keeps_items), but read_data got {len(plan.items)}",
                hint="a planner whose LoadPlan.planner_data has keeps_items=True must return its own read items "
                "from finish_plan (UCPLoadPlanner does)",
            )
        self.stats = ReadStats()
        # a keyed answer (cached plans) resolved to the transport plan it stands for, and cached for next time
        pending, self._keyed = self._keyed, None
        plan = resolved_answer(plan, pending, self.stats, type(self).__name__)
        mark("load", "reading")
        stats = self.stats
        # under ucp_dcp.load the call's progress is entered by the call; a bare dcp.load shows this read alone
        progress = self.progress or CallProgress("load", "reading")
        with progress if self.progress is None else nullcontext():
            # counted: the bytes of this rank's read items that reached their targets (from storage or other ranks)
            progress.counting(
                "reading", items_nbytes(plan.items, self._chunk_meta, self.storage_data), lambda: stats.bytes_loaded
            )
            self._read_and_exchange(plan, planner)  # every step inside the failure protocol
        if self.progress is not None:
            self.progress.phase("finishing")  # DCP's last collective: every rank's reads done
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _job(self, plan: LoadPlan, planner: Any, send: set[int], stats: ReadStats) -> ReadJob:
        """The state of one read of ``plan``'s items: where their bytes go, and the pieces at positions ``send``
        kept for the ranks they are sent to. ``planner``: the load's (DCP's ``LoadPlanner`` interface), or one
        that only resolves targets (the memory tier serving others' fragments:
        :class:`~ucp_dcp.memory.serving.ScratchPlanner`)."""
        return ReadJob(
            plan,
            planner,
            send,
            chunk_meta=self._chunk_meta,
            storage_data=self.storage_data,
            forced=self._forced,
            stage_bytes=self.stage_bytes,
            buffers=BUFFERS_PER_THREAD * max(1, self.thread_count),
            transforms=self.transforms,
            stats=stats,
        )

    def _read_and_exchange(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read this rank's items, exchange the shared ones, raise the true cause of any failure. Every step
        that can fail keeps its error instead of raising it, so the rank still sends (its error in place of
        its data) and drains every message meant for it: no peer is left waiting for it."""
        t0 = time.perf_counter()
        # another reader's plan, or none given: this rank reads everything itself and exchanges nothing
        transport = plan.storage_data if isinstance(plan.storage_data, TransportPlan) else TransportPlan()
        stats = self.stats
        error: BaseException | None = None
        job: ReadJob | None = None
        try:
            recv_items = {int(i) for msgs in transport.recv.values() for pieces in msgs for i in pieces}
            send_items = {int(i) for pieces, _ in transport.send for i in pieces}
            fault_point("job")
            job = self._job(plan, planner, send_items, stats)
            fault_point("read")
            self._read_local(job, recv_items)  # the pieces other ranks send this one are not read here
        except Exception as e:  # checksum, missing file, I/O, ...: the consumers are told below
            error = e
        # every message this rank owes is posted, with data or with its error: one slot per (consumer, bundle)
        sends: dict[int, list[torch.Tensor | None]] = {}
        for _, dsts in transport.send:
            for dst in dsts.tolist():
                sends.setdefault(dst, []).append(None)
        try:
            fault_point("pack")
            at = dict.fromkeys(sends, 0)
            kept = job.keep if error is None and job is not None else {}
            for pieces, dsts in transport.send if error is None else ():
                payload = as_bytes_tensor([kept[int(i)] for i in pieces])  # one buffer, shared by its consumers
                for dst in dsts.tolist():
                    sends[dst][at[dst]] = payload
                    at[dst] += 1
        except Exception as e:  # kept, not raised: this rank still drains its peers' messages, then raises it
            error = error or e
        incoming = self._incoming(job, transport, error)
        if isinstance(incoming, BaseException):  # where received bytes go is unknown: drained into scratch
            error, incoming = error or incoming, {s: [drain_only() for _ in m] for s, m in transport.recv.items()}
        if job is not None and error is None and faults.installed():  # "deliver" is a step inside each message
            incoming = {s: [_faulty(m) for m in msgs] for s, msgs in incoming.items()}
        out = Outcome()
        if transport.ranks:  # somebody exchanges (the same answer on every rank: the coordinator's)
            with exchange_link(transport.members or transport.ranks, transport.ranks) as (watch, group):
                try:
                    fault_point("group")
                except Exception as e:  # sent in place of this rank's data
                    error = error or e
                out = exchange(sends, incoming, error, group, watch, peer_timeout())
        if job is not None and job.pool is not None:  # the one wait for device copies in flight
            job.pool.drain()
            stats.staged_bytes = job.pool.stats.staged_bytes
            stats.staging_buffers = job.pool.stats.allocated
            stats.staging_waits = job.pool.stats.waits
        stats.seconds = time.perf_counter() - t0
        # this rank's own failure first; else the first peer's (its cause, naming it); else a plan disagreement
        if error is not None or out.error is not None:
            raise error or out.error  # type: ignore[misc]
        if out.peers:
            raise out.peers[0]
        if out.bad_size:
            raise size_error(out.bad_size)

    @staticmethod
    def _incoming(
        job: ReadJob | None, transport: TransportPlan, error: BaseException | None
    ) -> dict[int, list[Incoming]] | BaseException:
        """Where each expected message goes; scratch only when this rank already failed (its targets may be
        half written: nothing more is delivered into them)."""
        if job is None or error is not None:
            return {src: [drain_only() for _ in msgs] for src, msgs in transport.recv.items()}
        try:
            fault_point("incoming")
            return {src: [job.incoming(p.tolist()) for p in msgs] for src, msgs in transport.recv.items()}
        except Exception as e:  # handed back: the caller drains the messages into scratch, then raises it
            return e

    # -- this rank's own reads: its files side by side, each file's chunks in offset order -------------------------

    def _read_local(self, job: ReadJob, skip: set[int]) -> None:
        """Read every item not received from another rank: files, and runs of whole chunks of a
        large file, in parallel; chunks of a run in offset order; objects are delivered on this
        thread (planner sinks are not locked)."""
        files = sorted(self._by_file(self._local_items(job, skip)).items())
        self.stats.files = len(files)
        for _, cs in files:  # sorted before the cut: a run of a file's chunks is a stretch of the file
            cs.sort(key=lambda c: self.storage_data[c.index].offset)
        # a file per task, and a large file cut into runs of whole chunks, so threads share the bytes evenly
        work = split_work(files, self.thread_count, lambda c: int(self.storage_data[c.index].length))
        self.stats.tasks = len(work)
        if self.thread_count > 1 and len(work) > 1:
            with ThreadPoolExecutor(min(self.thread_count, len(work))) as pool:
                for fut in [pool.submit(self._read_file, job, rel, cs) for rel, cs in work]:
                    fut.result()
        else:
            for rel, cs in work:
                self._read_file(job, rel, cs)
        for item, data in job.objects:
            job.deliver(item, data, None)

    def _local_items(self, job: ReadJob, skip: set[int]) -> list[ReadItem]:
        """The items this rank reads itself; a large item for a staged target (planners other than
        ours do not cut them) becomes sub-boxes that fit a staging buffer."""
        out: list[ReadItem] = []
        for i, item in enumerate(job.plan.items):
            if i in skip:
                continue
            # objects, and pieces kept whole for the ranks they are sent to, are never cut
            if item.type == LoadItemType.BYTE_IO or i in job.send or job.item_nbytes(item) <= self.stage_bytes:
                out.append(item)
                continue
            staged = lambda it: needs_staging(job.planner.resolve_tensor(it), self._forced)  # noqa: E731
            for sub in split_reads([item], job.itemsize, staged, self.stage_bytes):
                job.positions[id(sub)] = i  # a sub-box counts as its item (the exchange's positions)
                out.append(sub)
        return out

    def _by_file(self, items: list[ReadItem]) -> dict[str, list[_Chunk]]:
        """Items grouped by saved chunk (a chunk feeding several boxes is one read), by file."""
        chunks: dict[MetadataIndex, _Chunk] = {}
        by_file: dict[str, list[_Chunk]] = defaultdict(list)
        for item in items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                by_file[info.relative_path].append(_Chunk(item.storage_index, None, None, [item]))
                continue
            c = chunks.get(item.storage_index)
            if c is None:
                c = chunks[item.storage_index] = _Chunk(item.storage_index, info, None)
                by_file[info.relative_path].append(c)
            c.items.append(item)
        return by_file

    def _read_file(self, job: ReadJob, rel: str, cs: list[_Chunk]) -> None:
        """Read chunks ``cs`` of file ``rel`` through one open stream, in offset order (a thread's task)."""
        cs.sort(key=lambda c: self.storage_data[c.index].offset)
        atoms = sorted({c.index.fqn for c in cs})
        try:
            with self._open_file(rel) as f:
                self._check_size(f, rel, atoms)
                # an object on a store: the small items' bytes in a few requests (ucp_dcp.storage.object_prefetch)
                remote = isinstance(f, RangedObjectFile)
                batches, of = prefetch_batches(cs, lambda c: self._whole_span(f, c)) if remote else ([], {})
                held = -1
                for c in cs:
                    if of.get(id(c), held) != held:  # the first chunk of the next batch: fetch the batch now
                        held = of[id(c)]
                        f.prefetch(batches[held])
                    if c.info is None:
                        self._read_object(f, rel, c, job)
                    else:
                        self._read_chunk(f, rel, c, job)
        except FileNotFoundError as e:
            if isinstance(e, UCPError):  # already ours (it names the file and atom)
                raise
            raise MissingFileError(
                f"checkpoint file {rel} is missing from {self.path} (it holds {_names(atoms)})",
                atom=atoms[0],
                saved=rel,
                hint="the checkpoint is incomplete (a partial copy?); copy the whole folder again",
            ) from None

    def _whole_span(self, f: Any, c: _Chunk) -> tuple[int, int] | None:
        """The bytes chunk ``c`` needs when they are one span known without reading: an object's record, or
        a tensor whose every item takes it whole (its data offset from the I/O table). None otherwise."""
        info = self.storage_data[c.index]
        if c.info is None:
            return int(info.offset), int(info.length)
        entry = self._io.get("items", {}).get(item_key(c.index))
        if info.transform_descriptors or entry is None or entry[0] < 0 or c.index not in self._chunk_meta:
            return None
        sizes = list(self._chunk_meta[c.index][1])
        if not all(not any(it.storage_offsets) and list(it.lengths) == sizes for it in c.items):
            return None
        record = self._record(f, c.index, info)  # from the I/O table: no read
        return (int(info.offset + record.data_offset), int(record.nbytes)) if record is not None else None

    def _open_file(self, rel: str) -> Any:
        """A read stream of the checkpoint file ``rel``: through DCP's file system, or on an object store exact
        ranged GETs, no read-ahead."""
        if self.store is None:
            return self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb")
        # the caller checks the object's size against the record: one HEAD per object and load, however many
        # of the rank's read tasks open it
        return self.store.open_read(self.store.join(rel), known=self._object_sizes)

    # -- one chunk: direct, union, mapped, tiled or DCP's whole-item read ------------------------------------------

    def _read_object(self, f: Any, rel: str, c: _Chunk, job: ReadJob) -> None:
        """An object item: its stored bytes whole, checked against its checksum, delivered later on the calling
        thread (planner sinks are not locked)."""
        info = self.storage_data[c.index]
        data = self._pread(f, info.offset, info.length, c.index)
        entry = self._crc.get(item_key(c.index)) if self.verify_checksums else None
        if entry is not None:
            self._checker.verify(data, 0, entry_sums(entry, self._block, c.index), rel, c.index)
        elif self.verify_checksums and self._crc and int(self._io.get("version", 1)) >= 2:
            # since table version 2 every object has its checksum: one missing is a damaged table
            raise CorruptCheckpointError(
                f"object '{c.index.fqn}' has no checksum in the checkpoint's I/O table",
                atom=c.index.fqn,
                hint="the checkpoint's tables are damaged",
            )
        # verified as stored (the writer's checksum covers the file's bytes); kept and sent as stored too, each
        # rank undoing the item's stream transforms when it delivers the object (ReadJob.decoded)
        job.keep_if_sent(c.items[0], data)
        with self._lock:
            job.objects.append((c.items[0], data))

    def _read_chunk(self, f: Any, rel: str, c: _Chunk, job: ReadJob) -> None:
        """The boxes of one saved chunk: strided boxes of a local file through a mapped window,
        disjoint ones straight into their destinations, overlapping ones as one union."""
        info = self.storage_data[c.index]
        record = self._record(f, c.index, info)
        # no byte layout known (a record another writer laid out otherwise, a stream transform): DCP's way
        if record is None or not record.contiguous or info.transform_descriptors:
            self._fallback(f, c, info, job)
            return
        grids = {
            id(item): box_grid(record.shape, record.itemsize, item.storage_offsets, item.lengths) for item in c.items
        }
        crcs = self._sums(c.index) if self.verify_checksums else NO_SUMS
        base = info.offset + record.data_offset
        fd = regular_fd(f)
        if fd is not None and any(g.nruns > 1 for g in grids.values()):  # strided, local: mapped, not a call a run
            self._read_mapped(fd, rel, c, grids, base, record, crcs, job)
            return
        runs = {k: (g.starts(), g.run) for k, g in grids.items()}
        total = sum(g.nbytes for g in grids.values())
        starts = np.concatenate([st for st, _ in runs.values()])
        lens = np.concatenate([np.full(len(st), n, dtype=np.int64) for st, n in runs.values()])
        if isinstance(f, RangedObjectFile) and any(g.nruns > 1 for g in grids.values()):
            # a remote file: a request per run costs a round trip each; runs are joined across their smallest
            # gaps within REMOTE_WASTE of the bytes needed. Boxes taking whole dims >= 2 of a chunk with tile
            # sums are verified by their tiles (exact bytes), others by whole checksum blocks.
            if crcs and self._read_tiles(f, rel, c, base, record, job):
                return
            merged = merge_intervals(starts, lens)
            self._read_union(f, rel, c, runs, coalesce_within(merged, gap=self.store_gap), base, record, crcs, job)
            return
        intervals = merge_intervals(starts, lens) if len(c.items) > 1 or crcs else None
        disjoint = intervals is None or sum(n for _, n in intervals) == total
        # straight into the targets when no byte is needed twice and each item's blocks can be verified from
        # its own memory (one run); else the union once, verified block by block, then cut per item
        if disjoint and (not crcs or all(len(runs[id(it)][0]) == 1 for it in c.items)):
            self._read_direct(f, rel, c, runs, base, record, crcs, job)
        else:
            self._read_union(f, rel, c, runs, intervals, base, record, crcs, job)

    def _read_direct(
        self,
        f: Any,
        rel: str,
        c: _Chunk,
        runs: dict[int, tuple[np.ndarray, int]],
        base: int,
        record: TensorRecord,
        crcs: BlockSums,
        job: ReadJob,
    ) -> None:
        """Each item's runs straight into its destination; a single-run item verifies the blocks it
        touches from that memory, reading only their edges."""
        for item in c.items:
            st, n = runs[id(item)]
            target, mv = job.destination(item, record, len(st) * n)
            self._pread_runs(f, base, st, n, mv, c.index)
            if crcs:
                self._checker.verify_span(
                    lambda off, n: self._pread(f, off, n, c.index),
                    base,
                    int(st[0]),
                    mv,
                    crcs,
                    record.nbytes,
                    rel,
                    c.index,
                )
            job.finish(item, target, mv, record)

    def _read_union(
        self,
        f: Any,
        rel: str,
        c: _Chunk,
        runs: dict[int, tuple[np.ndarray, int]],
        intervals: list[tuple[int, int]],
        base: int,
        record: TensorRecord,
        crcs: BlockSums,
        job: ReadJob,
    ) -> None:
        """Items sharing bytes, or runs to verify: the union read once (whole checksum blocks)."""
        if crcs:
            intervals = blocks_touching(intervals, record.nbytes, crcs.block)
        buffers = []
        fetched = None
        if isinstance(f, RangedObjectFile) and len(intervals) > 1:  # all in flight at once: a round trip, not n
            fetched = f.read_ranges([(base + s, n) for s, n in intervals])
            for (_, n), data in zip(intervals, fetched):
                if len(data) != n:
                    raise TruncatedFileError(
                        f"checkpoint file {rel} ended early reading '{c.index.fqn}': the file is truncated",
                        atom=c.index.fqn,
                        hint="restore the file from a good copy",
                    )
                self._note(c.index, n)
        for k, (start, length) in enumerate(intervals):
            buf = memoryview(fetched[k]) if fetched is not None else self._pread(f, base + start, length, c.index)
            if crcs:
                self._checker.verify(buf, start, crcs, rel, c.index)
            buffers.append((start, buf))
        bstarts = [b[0] for b in buffers]
        for item in c.items:
            st, n = runs[id(item)]
            data = gather_runs(buffers, bstarts, st, n)
            job.keep_if_sent(item, data)
            job.deliver(item, data, record.dtype)

    def _read_mapped(
        self,
        fd: int,
        rel: str,
        c: _Chunk,
        grids: dict[int, BoxGrid],
        base: int,
        record: TensorRecord,
        crcs: BlockSums,
        job: ReadJob,
    ) -> None:
        """Strided boxes of a local file: map a bounded window of the chunk at a time and copy the
        runs out with one strided copy (a syscall per run costs more than the bytes). Blocks the
        window touches are verified once each, from the mapping."""
        size = os.fstat(fd).st_size
        if base + record.nbytes > size:
            raise TruncatedFileError(
                f"checkpoint file {rel} ends at byte {size}, before the data of '{c.index.fqn}' "
                f"(needed up to {base + record.nbytes}): the file is truncated",
                atom=c.index.fqn,
                hint="the checkpoint is incomplete or damaged; restore the file from a good copy",
            )
        if crcs and self._read_tiles(fd, rel, c, base, record, job):
            return
        B = crcs.block
        verified: set[int] = set()
        for item in c.items:
            g = grids[id(item)]
            target, mv = job.destination(item, record, g.nbytes)
            out = np.frombuffer(mv, dtype=np.uint8) if g.nbytes else np.empty(0, dtype=np.uint8)
            done = 0
            for piece in split_grid(g, WINDOW):
                lo, hi = piece.first, piece.end
                if crcs:  # widened to whole blocks: a block is verified whole, once, whichever item needs it
                    lo, hi = lo // B * B, min(record.nbytes, -(-hi // B) * B)
                window = map_window(fd, base + lo, hi - lo)
                for b in range(lo // B, -(-hi // B)) if crcs else ():
                    if b not in verified:
                        blk = window[b * B - lo : min((b + 1) * B, record.nbytes) - lo]
                        self._checker.check(b, block_hash(blk, self._algo), crcs, rel, c.index)
                        verified.add(b)
                gather_grid(window, lo, piece, out[done : done + piece.nbytes])
                done += piece.nbytes
                del window  # unmapped now, not at some later collection: one bounded window at a time
            job.finish(item, target, mv, record)
        if crcs:
            nbytes = sum(min((b + 1) * B, record.nbytes) - b * B for b in verified)
        elif len(c.items) == 1:
            nbytes = next(iter(grids.values())).nbytes
        else:
            gs = list(grids.values())
            merged = merge_intervals(
                np.concatenate([g.starts() for g in gs]),
                np.concatenate([np.full(g.nruns, g.run, dtype=np.int64) for g in gs]),
            )
            nbytes = sum(n for _, n in merged)
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.ranges += 1
            self.stats.items.append(item_key(c.index))

    def _read_tiles(self, src: Any, rel: str, c: _Chunk, base: int, record: TensorRecord, job: ReadJob) -> bool:
        """Strided boxes verified by the chunk's tile sums (reading the tiles they touch, not whole
        checksum blocks), from a local file's descriptor or an object (:class:`RangedObjectFile`);
        False when the chunk has none or a box does not take whole dims >= 2."""
        entry = self._crc.get(item_key(c.index))
        tiles = entry[3] if entry is not None and len(entry) > 3 else None
        if not tiles:
            return False
        grid = saved_tile_grid(tiles, record.shape, record.itemsize, c.index)
        boxes = plan_tiled(grid, record.shape, [(it.storage_offsets, it.lengths) for it in c.items])
        if boxes is None:
            return False
        sums, nbytes, requests = tiles[2], 0, 0
        verified: set[int] = set()
        algo = HASHES[self._algo or ""]

        def check(t: int, got: int) -> None:
            self._checker.check_tile(t, got, sums, rel, c.index)

        for item, box in zip(c.items, boxes):
            n = math.prod(box.sizes) * record.itemsize
            target, mv = job.destination(item, record, n)
            out = np.frombuffer(mv, dtype=np.uint8) if n else np.empty(0, dtype=np.uint8)
            if isinstance(src, RangedObjectFile):
                got, reqs = read_tiled_remote(
                    src.read_ranges,
                    base,
                    record.shape,
                    record.itemsize,
                    grid,
                    box,
                    out,
                    verified,
                    check,
                    algo,
                    self.store_gap,
                )
                nbytes, requests = nbytes + got, requests + reqs
            else:
                nbytes += read_tiled(src, base, record.shape, record.itemsize, grid, box, out, verified, check, algo)
                requests += 1
            job.finish(item, target, mv, record)
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.ranges += requests
            self.stats.items.append(item_key(c.index))
        return True

    def _fallback(self, f: Any, c: _Chunk, info: Any, job: ReadJob) -> None:
        """DCP's path: deserialize the whole item, then narrow."""
        self.stats.fallbacks += 1
        raw = self._pread(f, info.offset, info.length, c.index)
        stream = self.transforms.transform_load_stream(c.items[0], info.transform_descriptors or (), io.BytesIO(raw))
        data = stream.read() if not stream.seekable() else stream
        try:
            tensor = torch.load(
                data if isinstance(data, io.IOBase) else io.BytesIO(data), map_location="cpu", weights_only=True
            )
        except pickle.UnpicklingError:
            raise UnsafeCheckpointError(
                f"the record of '{c.index.fqn}' chunk {list(c.index.offset or ())} in {info.relative_path} is not a "
                "plain tensor: decoding it could run code",
                atom=c.index.fqn,
                hint="the checkpoint was crafted or damaged; do not load it",
            ) from None
        except Exception as e:  # the bytes are untrusted: any parser failure is damage, re-raised as that
            raise CorruptCheckpointError(
                f"the record of '{c.index.fqn}' chunk {list(c.index.offset or ())} in {info.relative_path} does not "
                f"parse ({type(e).__name__}: {e})",
                atom=c.index.fqn,
                hint="the checkpoint file is damaged; restore it from a good copy",
            ) from None
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(
                f"the record of '{c.index.fqn}' holds a {type(tensor).__name__}, not a tensor", atom=c.index.fqn
            )
        for item in c.items:
            # a conjugate or negative view (stock DCP saves them as such): its values, not its memory
            piece = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths).resolve_conj().resolve_neg()
            piece = piece.contiguous()
            job.keep_if_sent(item, memoryview(bytearray(piece.view(-1).view(torch.uint8).numpy().tobytes())))
            job.deliver(item, memoryview(piece.view(-1).view(torch.uint8).numpy()), piece.dtype)

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _check_size(self, f: Any, rel: str, atoms: list[str]) -> None:
        """A file must have the size it was written with (known from a verified sidecar)."""
        want = (self.integrity.files or {}).get(rel) if self.integrity is not None else None
        if want is None:
            return
        try:
            have = os.fstat(f.fileno()).st_size
        except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
            have = getattr(f, "size", None)
        if have is not None and have != want:
            raise TruncatedFileError(
                f"checkpoint file {rel} has {have} bytes, {want} were written: the file is "
                f"{'truncated' if have < want else 'longer than written'} (it holds {_names(atoms)})",
                atom=atoms[0],
                saved=want,
                wanted=have,
                hint="the checkpoint is damaged (an interrupted copy?); restore the file from a good copy",
            )

    def _sums(self, index: MetadataIndex) -> BlockSums:
        """The saved chunk's block sums with their block (:data:`NO_SUMS` when it has none)."""
        return entry_sums(self._crc.get(item_key(index)), self._block, index)

    def _record(self, f: Any, index: MetadataIndex, info: Any) -> TensorRecord | None:
        with self._lock:
            if index in self._records:
                return self._records[index]
        entry = self._io.get("items", {}).get(item_key(index))
        rec: TensorRecord | None = None
        if entry is not None and entry[0] >= 0 and index in self._chunk_meta:
            dtype, sizes = self._chunk_meta[index]  # our writer: compact row-major, offset recorded
            rec = TensorRecord(entry[0], dtype, sizes, True)
        elif not info.transform_descriptors:  # another writer: read the item's zip directory
            rec = parse_tensor_record(_create_file_view(f, info.offset, info.length))
            with self._lock:
                self.stats.ranges += 1
        with self._lock:
            self._records[index] = rec
        return rec

    def _pread_runs(
        self, f: Any, base: int, starts: np.ndarray, run: int, out: memoryview, index: MetadataIndex
    ) -> None:
        """Read equal-length runs at ``base + starts`` into consecutive parts of ``out``."""
        if len(starts) == 1 or not hasattr(f, "fileno") or isinstance(f, RangedObjectFile):
            for k, s0 in enumerate(starts.tolist()):
                self._pread_into(f, base + s0, out[k * run : (k + 1) * run], index)
            return
        fd = f.fileno()
        pos = 0
        for s0 in (starts + base).tolist():
            got = os.preadv(fd, [out[pos : pos + run]], s0)
            if got != run:
                self._pread_into(f, s0, out[pos : pos + run], index)  # short read: finish the slow way
                got = run
                with self._lock:
                    self.stats.bytes_read -= run
                    self.stats.ranges -= 1
            pos += got
        with self._lock:
            self.stats.bytes_read += pos
            self.stats.ranges += len(starts)
            self.stats.items.append(item_key(index))

    def _pread(self, f: Any, offset: int, length: int, index: MetadataIndex) -> memoryview:
        buf = bytearray(length)
        self._pread_into(f, offset, memoryview(buf), index)
        return memoryview(buf)

    def _pread_into(self, f: Any, offset: int, out: memoryview, index: MetadataIndex) -> None:
        f.seek(offset)
        n = f.readinto(out) if hasattr(f, "readinto") else readinto(f, out)
        while n is not None and n < len(out):  # short reads (pipes, remote files)
            more = f.readinto(out[n:]) if hasattr(f, "readinto") else readinto(f, out[n:])
            if not more:
                raise TruncatedFileError(
                    f"checkpoint file ended early reading '{index.fqn}': the file is truncated",
                    atom=index.fqn,
                    hint="restore the file from a good copy",
                )
            n += more
        self._note(index, len(out))

    def _note(self, index: MetadataIndex, nbytes: int) -> None:
        with self._lock:
            self.stats.bytes_read += int(nbytes)
            self.stats.ranges += 1
            self.stats.items.append(item_key(index))


# -- the reader's side of the load-plan cache: keyed summaries and answers -----------------------------------------
# The reader's side of the load-plan cache (``cache_plans=True``, :mod:`ucp_dcp.planning.plan_cache`): its wire
# types, what this process keeps, and the steps :class:`~ucp_dcp.storage.reader.UCPFileSystemReader` takes.
#
# A load planner whose plan is cached (``UCPLoadPlanner(cache_plans=True)``) puts its plan key in
# ``planner_data``; the reader then keys its read-once summary (:func:`keyed_summary`, :class:`KeyedSummary`):
# the key alone when this process sent the summary to a coordinator in an earlier, finished load. The
# coordinator keeps summaries and its read-once answers by key (:func:`keyed_answers`); it answers a rank that
# holds the very answer with a marker (:class:`KeyedTransport` without a plan), which ``read_data`` resolves
# from this process's cache (:func:`resolved_answer`).
#
# The caches are :class:`~ucp_dcp.planning.plan_cache.ProcessCache` s, so ``plan_cache.clear()`` empties them
# with the planner's; the counters and the markers of unfinished loads are the plan cache's too.
# Wire types.


@dataclass(frozen=True)
class KeyedSummary(Compact):
    """A loading rank's ``LoadPlan.storage_data`` when plans are cached: its read-once summary and the key
    it is cached under, or only the key (the coordinator holds the summary)."""

    key: bytes
    """The reader's key: the plan key, the read-once mode, the global rank and the host."""
    summary: ReadSummary | None = None
    """The summary; None: the coordinator's cached one for ``key``."""
    last: bytes | None = None
    """The global key of the answer this rank holds for ``key`` (the coordinator then answers with a marker)."""


@dataclass(frozen=True)
class KeyedTransport(Compact):
    """The coordinator's read-once answer to a rank that sent a :class:`KeyedSummary`."""

    key: bytes | None
    """The global key (of every rank's reader key, in plan order); None when some rank's plan was not keyed."""
    plan: TransportPlan | None = None
    """The answer; None: the one the rank holds for ``key`` (its ``KeyedSummary.last``)."""


# What each side keeps.


@dataclass
class ReaderEntry:
    """A rank's read-once side: the coordinator's last answer for this reader key."""

    answer_key: bytes | None
    """Its global key (None: the answer was not keyed)."""
    transport: TransportPlan | None
    """The answer."""


@dataclass(frozen=True)
class Pending:
    """A load whose summary was keyed, from ``prepare_local_plan`` until the coordinator's answer arrives."""

    key: bytes
    """The reader key."""
    entry: ReaderEntry | None
    """What this process holds under it (None: nothing, the summary went whole)."""
    plan_cached: bool
    """The planner's plan was cached too (its ``planner_data`` is a marker)."""


_READER: ProcessCache[ReaderEntry] = ProcessCache()
"""A rank's side: reader key -> the coordinator's last answer."""
_SUMMARIES: ProcessCache[ReadSummary] = ProcessCache()
"""The coordinator's: reader key -> the summary a rank sent under it."""
_TRANSPORTS: ProcessCache[list[TransportPlan]] = ProcessCache()
"""The coordinator's: global key (every rank's reader key) -> its answers, in plan order."""


# Prepare_local_plan: a rank's summary.


def keyed_summary(
    plan: LoadPlan, md: Metadata, mode: ReadOnceMode, reader: type
) -> tuple[ReadSummary | KeyedSummary, Pending | None]:
    """This rank's read-once summary, and what the load keeps for its answer; a planner's cached plan (its
    key in ``planner_data``) gets a keyed one: only the key when this process sent its summary to a
    coordinator before. ``reader``: the reader's class (part of the key)."""
    plan_key = plan_key_of(plan.planner_data)
    if plan_key is None:  # another planner, or a plan not cached: the summary as DCP's gather carries it
        return local_summary(plan.items, md, mode), None
    key = plan_cache.reader_key(plan_key, reader, mode)
    # after a load of this process that failed before its answer, the coordinator may lack what it sent:
    # send the summary whole once (begin says so)
    entry = _READER.use(key) if plan_cache.begin("reader") else None
    pending = Pending(key, entry, isinstance(plan.planner_data, CachedLoadPlan))
    plan_cache.count("reader_hit" if entry is not None else "reader_miss")
    if entry is not None:
        return KeyedSummary(key, None, entry.answer_key), pending
    return KeyedSummary(key, local_summary(plan.items, md, mode)), pending


# Prepare_global_plan: the coordinator's answers.


def keyed_answers(
    plans: list[LoadPlan], plan_transport: Callable[[list[ReadSummary | None]], list[TransportPlan]]
) -> list[LoadPlan]:
    """The coordinator's read-once answers (``plan_transport`` of every rank's summary): for the same reader
    keys on every rank the cached ones, and a marker for a rank that holds its own."""
    keyed = [p.storage_data if isinstance(p.storage_data, KeyedSummary) else None for p in plans]
    keys = [k.key for k in keyed if k is not None]
    # the answers depend on every rank's summary: keyed only when every rank's is
    gkey = plan_cache.digest(b"ucp-load-transport-1", *keys) if len(keys) == len(plans) else None
    transports = None
    if gkey is not None:
        transports = _TRANSPORTS.use(gkey)
        plan_cache.count("transport_reused" if transports is not None else "transport_planned")
    if transports is None:
        transports = plan_transport(summaries(plans))
        if gkey is not None:
            _TRANSPORTS.keep(gkey, transports, ENTRIES)
    else:  # not read, but used: kept as recent as the answers they gave
        for key in keys:
            _SUMMARIES.use(key)
    out = []
    for p, k, t in zip(plans, keyed, transports):
        answer: Any = t
        if k is not None:  # a rank that holds this very answer gets a marker of it
            answer = KeyedTransport(gkey, None if gkey is not None and k.last == gkey else t)
        out.append(dataclasses.replace(p, storage_data=answer))
    return out


def summaries(plans: list[LoadPlan]) -> list[ReadSummary | None]:
    """Every rank's summary: a keyed one's from the cache, where the coordinator keeps the others (None: a
    rank whose reader sent none, another reader's plan)."""
    out: list[ReadSummary | None] = []
    for rank, p in enumerate(plans):
        sd = p.storage_data
        if isinstance(sd, KeyedSummary):
            if sd.summary is None:
                sd = cached_summary(sd.key, rank)
            else:
                _SUMMARIES.keep(sd.key, sd.summary, plan_cache.coordinator_entries(len(plans)))
                sd = sd.summary
        out.append(sd if isinstance(sd, ReadSummary) else None)
    return out


def cached_summary(key: bytes, rank: int) -> ReadSummary:
    """The summary rank ``rank`` sent under ``key`` in an earlier load (:class:`PlanCacheMissError`: not held)."""
    found = _SUMMARIES.use(key)
    if found is None:
        raise PlanCacheMissError.of_marker(rank, "read-once summary")
    return found


# Read_data: the answer resolved.


def resolved_answer(plan: LoadPlan, pending: Pending | None, stats: ReadStats, reader: str) -> LoadPlan:
    """The plan with the coordinator's read-once answer: a keyed one resolved (a marker: the answer this
    rank holds) and cached for the next load; ``stats`` told whether the plans were cached. ``pending``: what
    :func:`keyed_summary` kept for this load; ``reader``: the reader's class name (for the error)."""
    answer = plan.storage_data
    if not isinstance(answer, KeyedTransport):
        return plan
    if pending is None:
        raise UCPError(
            f"{reader}.read_data was given a keyed read-once answer for a plan this reader did "
            "not key in prepare_local_plan",
            hint="let dcp.load drive the reader: prepare_local_plan, the coordinator's prepare_global_plan, "
            "then read_data with the plan it answered",
        )
    transport = answer.plan
    if transport is None:
        if pending.entry is None or pending.entry.answer_key != answer.key:
            raise UCPError(
                "the coordinator answered this rank with its cached read-once plan, which this process does not hold",
                hint="load again with cache_plans=False, or call ucp_dcp.planning.plan_cache.clear() on every rank",
            )
        transport = pending.entry.transport
    # the answer arrived: the coordinator holds this rank's summary under its key from now on
    _READER.keep(pending.key, ReaderEntry(answer.key, transport), ENTRIES)
    plan_cache.finish("reader")
    stats.plan_cached = pending.plan_cached and pending.entry is not None
    stats.global_plan_cached = answer.plan is None
    return dataclasses.replace(plan, storage_data=transport)


def _faulty(msg: Incoming) -> Incoming:
    """``msg`` with the ``deliver`` fault point before its delivery (only when a test's hook is installed)."""

    def deliver(buf: torch.Tensor) -> None:
        fault_point("deliver")
        msg.deliver(buf)

    return Incoming(msg.nbytes, msg.buffer, deliver)


def _job_bytes(plans: list[LoadPlan]) -> int | None:
    """The bytes every loading rank's reads need, from their read-once summaries (a keyed summary's from the
    coordinator's cache); None when a rank sent no sizes (``read_once="off"``, another reader's plan)."""
    total = 0
    for rank, p in enumerate(plans):
        sd = p.storage_data
        if isinstance(sd, KeyedSummary):
            try:
                sd = sd.summary if sd.summary is not None else cached_summary(sd.key, rank)
            except UCPError:
                return None
        if not isinstance(sd, ReadSummary) or sd.sizes is None:
            return None
        total += int(sd.sizes.sum())
    return total


def _names(atoms: list[str]) -> str:
    return ", ".join(f"'{a}'" for a in atoms[:3]) + (f" and {len(atoms) - 3} more" if len(atoms) > 3 else "")


_UNVERIFIED = {
    "none": "checkpoint {path} has no checksums: nothing this load reads is verified. Save with "
    "ucp_dcp.save(...) or storage_writer=UCPFileSystemWriter(path) to get them (and an atomic commit).",
    "partial": "checkpoint {path} was written by an older ucp_dcp: tensor data is verified, its metadata "
    "and non-tensor values are not. Save it again with this version to protect them.",
}
