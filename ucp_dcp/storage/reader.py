"""``UCPFileSystemReader``: reads only the bytes each rank needs, each file once, in offset order.

DCP's ``FileSystemReader`` deserializes a whole saved chunk for every read item and narrows it, so
resharding reads several times the needed bytes. Here every read item becomes byte runs of its
chunk (see :mod:`ucp_dcp.storage.format`); the runs of all items of a chunk are merged (a chunk feeding
several target boxes is read once), widened to whole checksum blocks when verifying, and read with
one open file per thread, in offset order. A single contiguous run of matching dtype lands directly
in the target tensor; anything else goes through a buffer of at most one chunk's needed bytes.
Pieces the coordinator marked as shared are read by one rank and sent to the others
(:mod:`ucp_dcp.storage.transport`). Items this reader cannot read by ranges (stream transforms, foreign
records) fall back to DCP's whole-item path. Device targets (CUDA tensors) are reached through
bounded host staging buffers and non-blocking copies (:mod:`ucp_dcp.storage.staging`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, get_args

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._compat import fsspec_filesystem
from ..errors import InvalidArgumentError, UCPError, UnverifiedCheckpointWarning
from ..planning import device as _device
from ..planning import plan_cache
from ..planning.device import StagingMode, needs_staging, split_reads, staging_forced
from ..planning.faults import fault_point
from ..planning.handshake import ReadOnceRequest
from ..planning.opened import UnopenedMetadata, checked, raise_if_unopened
from ..planning.payloads import ReadOnceMode, ReadSummary, TransportPlan
from ..planning.plan_cache import KeyedSummary
from ..planning.watch import mark
from ..progress import CallProgress
from . import read_protocol
from .checksums import BlockChecker
from .chunk_reads import ChunkReads
from .commit import Integrity, open_checkpoint
from .file_ranges import REMOTE_GAP, StoreRanges
from .format import BLOCK, HASHES, IO_KEY, TensorRecord, check_tables, chunk_meta
from .keyed_plans import KeyedReadPlans
from .object_store import OBJECT_PROTOCOLS, ObjectStore, object_protocol
from .object_streams import ObjectSizes
from .read_job import ReadJob, ReadStats, items_nbytes
from .threads import STORE_REQUESTS_PER_THREAD, reading_threads, split_work
from .transport import READ_ONCE_MODES, plan_transport

__all__ = ["UCPFileSystemReader", "ReadStats"]


class UCPFileSystemReader(KeyedReadPlans, ChunkReads, FileSystemReader):
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
            (:func:`~ucp_dcp.storage.threads.reading_threads`). A rank's files, and runs of whole
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
            and the default ``thread_count`` is :data:`~ucp_dcp.storage.threads.STORE_REQUESTS_PER_THREAD`
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
        super().reset(None)
        self._object_sizes = ObjectSizes()
        if checkpoint_id and "://" in str(checkpoint_id):
            self._use_url(str(checkpoint_id))
        elif checkpoint_id:
            self.store = None
            super().reset(checkpoint_id)

    def _open_file(self, rel: str) -> Any:
        if self.store is None:
            return super()._open_file(rel)
        # exact ranged GETs, no read-ahead; the caller checks the object's size against the record: one HEAD
        # per object and load, however many of the rank's read tasks open it
        return self.store.open_read(self.store.join(rel), known=self._object_sizes)

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

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        mark("load", "planning")  # DCP's local planning step starts here, before the planner's
        if self.progress is not None:
            self.progress.phase("planning")  # a load planned again (a cached plan that missed) plans here again
        fault_point("load-plan")
        raise_if_unopened(metadata)
        self._kept_items = None
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        check_tables(metadata)
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
        self._lock = threading.Lock()
        self._chunk_meta = chunk_meta(metadata)
        self._md = metadata

    # -- planning: read-once ------------------------------------------------------------------------

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

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Pick one reader for every piece several ranks need (see :mod:`ucp_dcp.storage.transport`); keyed
        summaries (cached plans) get the cached answers (:class:`~ucp_dcp.storage.keyed_plans.KeyedReadPlans`)."""
        answers = self._keyed_answers(plans)
        if self.progress is not None:  # every rank's summary gives the sizes of its reads: the job's bytes
            self.progress.job(_job_bytes(plans), len(plans))
        return answers

    def _plan_transport(self, summaries: list[ReadSummary | None]) -> list[TransportPlan]:
        # who loads: the ranks the exchange's gates wait for (ucp_dcp.planning.watch)
        members = [int(s.rank) for s in summaries] if all(s is not None for s in summaries) else None  # type: ignore[union-attr]
        return [dataclasses.replace(t, members=members) for t in plan_transport(summaries)]

    # -- entry point -------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        kept = self._kept_items
        if kept is not None and len(plan.items) != kept:
            raise UCPError(
                f"{type(planner).__name__} with {type(self).__name__}: the planner's plan said it puts its {kept} "
                f"read item(s) back in finish_plan (keeps_items), but read_data got {len(plan.items)}",
                hint="a planner whose LoadPlan.planner_data has keeps_items=True must return its own read items "
                "from finish_plan (UCPLoadPlanner does)",
            )
        self.stats = ReadStats()
        plan = self._answer(plan)
        mark("load", "reading")
        stats = self.stats
        progress = self.progress or CallProgress("load", "reading")
        with progress if self.progress is None else nullcontext():
            # counted: the bytes of this rank's read items that reached their targets (from storage or other ranks)
            progress.counting(
                "reading", items_nbytes(plan.items, self._chunk_meta, self.storage_data), lambda: stats.bytes_loaded
            )
            read_protocol.read_data(self, plan, planner)  # every step inside the failure protocol
        if self.progress is not None:
            self.progress.phase("finishing")  # DCP's last collective: every rank's reads done
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- local reads -------------------------------------------------------------------------------

    def _read_local(self, job: ReadJob, skip: set[int]) -> None:
        """Read every item not received from another rank: files, and runs of whole chunks of a
        large file, in parallel; chunks of a run in offset order; objects are delivered on this
        thread (planner sinks are not locked)."""
        files = sorted(self._by_file(self._local_items(job, skip)).items())
        self.stats.files = len(files)
        for _, cs in files:
            cs.sort(key=lambda c: self.storage_data[c.index].offset)
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
            if item.type == LoadItemType.BYTE_IO or i in job.send or job.item_nbytes(item) <= self.stage_bytes:
                out.append(item)
                continue
            staged = lambda it: needs_staging(job.planner.resolve_tensor(it), self._forced)  # noqa: E731
            for sub in split_reads([item], job.itemsize, staged, self.stage_bytes):
                job.positions[id(sub)] = i
                out.append(sub)
        return out


def _job_bytes(plans: list[LoadPlan]) -> int | None:
    """The bytes every loading rank's reads need, from their read-once summaries (a keyed summary's from the
    coordinator's cache); None when a rank sent no sizes (``read_once="off"``, another reader's plan)."""
    total = 0
    for rank, p in enumerate(plans):
        sd = p.storage_data
        if isinstance(sd, KeyedSummary):
            try:
                sd = sd.summary if sd.summary is not None else plan_cache.cached_summary(sd.key, rank)
            except UCPError:
                return None
        if not isinstance(sd, ReadSummary) or sd.sizes is None:
            return None
        total += int(sd.sizes.sum())
    return total


_UNVERIFIED = {
    "none": "checkpoint {path} has no checksums: nothing this load reads is verified. Save with "
    "ucp_dcp.save(...) or storage_writer=UCPFileSystemWriter(path) to get them (and an atomic commit).",
    "partial": "checkpoint {path} was written by an older ucp_dcp: tensor data is verified, its metadata "
    "and non-tensor values are not. Save it again with this version to protect them.",
}
