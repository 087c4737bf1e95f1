"""``MemoryTier``: save into host memory, replicate to other hosts and drain to disk in the background.

``tier.save(state_dict)`` is a collective ``dcp.save`` with ``UCPSavePlanner`` and
``UCPFileSystemWriter`` into this host's memory folder (:mod:`ucp_dcp.memory.store`), committed there
with the same integrity sidecar and ``.metadata`` rename as on disk. The first save runs it in the
caller (its planning errors raise there); later saves (``staging="buffered"``, the default) block only
for the copy of the state into host buffers kept between saves (:mod:`ucp_dcp.memory.staging`) and run
the ``dcp.save`` of that copy in the background; such a save waits only for the buffers (the previous
copy written into the store), not for the previous generation's replication or drain, so up to two
generations are in flight. The background thread, on the tier's own groups, then
publishes the commit to every host, copies every host's pieces to ``replicas``
other hosts (:mod:`ucp_dcp.memory.replicate`), writes the completion marker, and drains every
``drain_every``-th complete generation to ``durable`` (:mod:`ucp_dcp.memory.drain`).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import InvalidArgumentError, PeerFailedError, PeerLostError, UCPError, peer_class, peer_lost, ucp_errors
from ..planning.checkpoint_group import CheckpointGroup, dcp_group, guarded, private_group
from ..planning.collectives import peer_timeout
from ..planning.save_planner import UCPSavePlanner
from ..storage.writer import UCPFileSystemWriter
from .drain import DrainLayout, DrainTarget, commit_drain, drain_files, drain_wanted, durable_generations
from .hosts import HostMap, gather_hosts, replica_hosts
from .replicate import Generation, mark_complete, publish_commit, replicate
from .staging import Stager
from .store import default_root, gen_dir, generations, host_name

__all__ = ["MemoryTier", "GenerationStatus", "FaultStep", "Staging", "MemoryTierWarning", "MemoryFault"]

Staging = Literal["buffered", "direct"]
"""How a memory save after the first blocks the caller: ``buffered``, for one copy into host buffers kept
between saves (one state-sized copy per rank held by the tier), the planning and the write into the store
in the background; ``direct``, for the whole ``dcp.save`` into the store (no buffers kept)."""

FaultStep = Literal["copy", "replicate", "complete", "drain"]
"""Where a test makes the job die (every rank stops there): during the write into host memory (data
written, not committed; in the caller for a tier's first save or ``staging="direct"``, else in the
background), during replication (replicas sent, no marker), right after the completion marker (not
drained), during the drain (durable files copied, not committed)."""


class MemoryTierWarning(UserWarning):
    """A memory generation could not be completed or drained (training goes on; the last complete one stays)."""


def _lost(rank: int, why: str) -> PeerLostError:
    """A replica transfer with ``rank`` failed or timed out: this rank's failure at the call's next gate,
    which ends it on every rank with the lost rank's name (:mod:`ucp_dcp.planning.checkpoint_group`)."""
    return peer_lost(rank, why, during="memory replication")


class MemoryFault(UCPError):
    """The stop a test asked for (``fault=``): the job 'dies' at that step."""


@peer_class  # beside its cause: ucp_dcp.errors, the lowest layer, cannot import this module
class PeerMemoryFault(PeerFailedError, MemoryFault):
    """Another rank's :class:`MemoryFault`."""


@dataclasses.dataclass
class GenerationStatus:
    """How the background work of one memory save ended (on this rank)."""

    gen: int
    """Generation number."""
    complete: bool = False
    """Every piece has its replicas and every host its completion marker."""
    drained: bool = False
    """The durable copy is committed."""
    error: BaseException | None = None
    """Why it is not complete / not drained."""
    seconds: float = 0.0
    """Background time (publish, replicate, mark, drain)."""
    note: str = ""
    """Why a complete generation was not drained although a drain was due (its folder was a checkpoint)."""


class _Writer(UCPFileSystemWriter):
    """The memory writer: tmpfs needs no fsync; ``fault="copy"`` dies before the commit."""

    def __init__(self, path: str, fault: str | None) -> None:
        super().__init__(path, sync_files=False)
        self.fault = fault

    def finish(self, metadata: Any, results: Any) -> None:
        if self.fault == "copy":
            raise MemoryFault("fault injected during the host copy (data files written, nothing committed)")
        super().finish(metadata, results)


@dataclasses.dataclass
class _Staged:
    """A save whose ``dcp.save`` the background runs: the staged copy and what writes it."""

    state_dict: dict
    """The copy in the stager's buffers."""
    writer: _Writer
    """Into the generation's folder of this host's store."""
    planner: Any
    """The caller's save planner (or the default)."""


class MemoryTier:
    """A checkpoint tier in host memory that survives process crashes and, with ``replicas >= 1``,
    the loss of any ``replicas`` hosts; loads reshard from it at any layout (:func:`ucp_dcp.memory.load`).

    Collective to create (over ``process_group``: it gathers the hosts and creates its own gloo group).

    Args:
        root: the memory store (default ``$UCP_DCP_SHM_ROOT`` or ``/dev/shm/ucp_dcp``); each host keeps
            its own folder under it.
        durable: folder (or object-store URL) the complete generations are drained to; None: none.
        drain_layout: the durable folders' names (:data:`~ucp_dcp.memory.drain.DrainLayout`): ``gen``,
            ``<durable>/gen-<n>``; ``step``, ``<durable>/step-<step>`` (torchtitan's step folders).
        replicas: k, copies of each host's pieces on other hosts (cut to the other hosts there are).
        drain_every: drain every n-th generation (1: each).
        keep_durable: durable generations kept (the newest).
        process_group: the job's group (None: the default group).
        fault: testing only: the step at which every rank stops (:data:`FaultStep`).
        control_group: run the tier's collectives on control groups (:mod:`ucp_dcp.planning.control_group`):
            a rank that dies or freezes during a save, its replication or its drain ends every other rank
            with a ``PeerLostError`` within ``UCP_DCP_PEER_TIMEOUT_S``. None: ``$UCP_DCP_CONTROL_GROUP`` (on).
        staging: what a save after the first blocks for (:data:`Staging`).
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        *,
        durable: str | os.PathLike | None = None,
        drain_layout: DrainLayout = "gen",
        replicas: int = 1,
        drain_every: int = 1,
        keep_durable: int = 2,
        process_group: dist.ProcessGroup | None = None,
        fault: FaultStep | None = None,
        control_group: bool | None = None,
        staging: Staging = "buffered",
    ) -> None:
        if staging not in ("buffered", "direct"):
            raise InvalidArgumentError(f"staging must be 'buffered' or 'direct', got {staging!r}")
        if drain_every < 1 or keep_durable < 1:
            raise InvalidArgumentError(f"drain_every and keep_durable must be >= 1, got {drain_every}, {keep_durable}")
        self.root = str(root) if root is not None else default_root()
        self.durable = str(durable) if durable is not None else None
        self.target = DrainTarget(self.durable, drain_layout) if self.durable is not None else None
        self.group = process_group
        self.control = control_group
        # the foreground's collectives (these, DCP's in save) on the checkpoint group DCP gets; the
        # background's object collectives on a checkpoint group of its own (one group is one sequence of
        # ops), its file transfers on a plain gloo group
        fg = dcp_group(process_group, control_group)
        self.hosts: HostMap = gather_hosts(fg)
        self.replicas = len(next(iter(replica_hosts(self.hosts.names, replicas).values())))
        self.drain_every = drain_every
        self.keep_durable = keep_durable
        self.fault = fault
        self.staging = staging
        self._stager = Stager()
        self._saves = 0
        self._bg = dist.new_group(
            ranks=self.hosts.ranks, backend="gloo", timeout=timedelta(seconds=max(60.0, peer_timeout()))
        )
        self._ctl: dist.ProcessGroup = self._bg
        if isinstance(fg, CheckpointGroup):
            self._ctl = private_group(self.hosts.ranks, process_group)
        self.broken: BaseException | None = None
        """A peer lost in the background work: the tier's groups are spent, every later save raises it."""
        # numbering continues after whatever generation any host or the durable folder holds
        mine = max([0, *generations(self.root, host_name()), *durable_generations(self.durable)])
        got: list = [None] * len(self.hosts.ranks)
        dist.all_gather_object(got, mine, group=fg)
        self.next_gen = max(got) + 1
        self.blocked_s = 0.0
        """Seconds the last :meth:`save` blocked the caller."""
        self.statuses: list[GenerationStatus] = []
        """The background outcome of every save, in order."""
        self.waited_s = 0.0
        """Seconds the last :meth:`save` waited for earlier saves' background work before it began."""
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._pending: list[int | None] = []  # the steps of the saves whose background work is not done
        self._staged_unwritten = False  # the staging buffers hold a copy the background has not written yet
        self._thread = threading.Thread(target=self._work, name="ucp-memory-tier", daemon=True)
        self._thread.start()

    # -- foreground ------------------------------------------------------------------------------------

    def save(self, state_dict: dict, *, planner: Any = None, step: int | None = None, drain: bool = True) -> int:
        """Copy ``state_dict`` into host memory and commit it there (collective); replication and the
        drain follow in the background (``drain=False``: not this one, whatever ``drain_every`` says).

        With ``staging="buffered"`` every save after the first returns once the state is copied into the
        staging buffers: its commit, like its replication, is the background's, and a failure there is
        the generation's ``status.error`` (and a :class:`MemoryTierWarning`), never a loadable
        generation. Such a save waits only until the buffers are free (the previous staged copy is
        written into the store); the previous generation's replication and drain may still run, so two
        generations are in flight (the new one's write queued behind the other's completion). A save
        that writes in the caller (the first, or ``staging="direct"``) waits for all background work
        first. :attr:`waited_s` says how long a save waited, :attr:`blocked_s` how long it took then.
        Returns the generation number."""
        staged_save = self.staging == "buffered" and self._saves > 0  # the same decision on every rank
        t_wait = time.perf_counter()
        with self._lock:
            self._lock.wait_for(
                (lambda: not self._staged_unwritten or self.broken is not None) if staged_save else self._idle
            )
        self.waited_s = time.perf_counter() - t_wait
        if self.broken is not None:
            raise self.broken
        gen = self.next_gen
        self.next_gen += 1
        t0 = time.perf_counter()
        writer = _Writer(gen_dir(self.root, host_name(), gen), self.fault)
        planner = planner if planner is not None else UCPSavePlanner(replica_digests="writer")
        staged = None
        if staged_save:  # no collective: the copy is this rank's own
            staged = _Staged(self._stager.stage(state_dict), writer, planner)
        else:
            with ucp_errors(), guarded(self.group, self.control, "memory save") as group:
                dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group)
        self._saves += 1
        self.blocked_s = time.perf_counter() - t0
        with self._lock:
            self._pending.append(step)
            self._staged_unwritten = staged is not None
        # the fault as set for this save (a test sets it per save; two generations may be in flight)
        self._queue.put((Generation(gen, self.root, self.hosts, self.replicas, step, drain=drain), staged, self.fault))
        return gen

    @property
    def staged_bytes(self) -> int:
        """Host memory this rank's staging buffers hold between saves (0 with ``staging="direct"``)."""
        return self._stager.bytes

    @property
    def busy_steps(self) -> list[int | None]:
        """The steps of the saves whose background work (write, replication, drain) is not done, oldest
        first (at most two); empty when idle."""
        with self._lock:
            return list(self._pending)

    def _idle(self) -> bool:
        return not self._pending

    def wait(self) -> GenerationStatus | None:
        """Wait for the background work of every save so far; the last one's status (None before any save)."""
        with self._lock:
            self._lock.wait_for(self._idle)
        return self.statuses[-1] if self.statuses else None

    def close(self) -> None:
        """Finish the background work and stop the thread (the memory generations stay)."""
        self.wait()
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> MemoryTier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- background ------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            g, staged, fault = item
            status = GenerationStatus(g.gen)
            t0 = time.perf_counter()
            try:
                try:
                    if self.broken is not None:  # queued behind a generation that lost a peer: the groups are spent
                        raise self.broken
                    if staged is not None:
                        self._write(staged)
                finally:
                    if staged is not None:
                        with self._lock:  # the buffers are free for the next save's copy
                            self._staged_unwritten = False
                            self._lock.notify_all()
                self._complete(g, status, fault)
            except BaseException as e:  # noqa: BLE001 (reported through the status and a warning)
                status.error = e
                if isinstance(e, PeerLostError):
                    self.broken = e
                if not isinstance(e, MemoryFault):
                    warnings.warn(
                        f"memory generation {g.gen}: {type(e).__name__}: {e}", MemoryTierWarning, stacklevel=1
                    )
            status.seconds = time.perf_counter() - t0
            with self._lock:
                self.statuses.append(status)
                self._pending.pop(0)
                self._lock.notify_all()

    def _write(self, staged: _Staged) -> None:
        """The staged copy's ``dcp.save`` into this host's store, on the background's group."""
        # the background's own group as it is (False: never swapped for the checkpoint group DCP gets in the
        # foreground, whose sequence of ops this thread must not share); a checkpoint group is watched
        with ucp_errors(), guarded(self._ctl, False, "memory save") as group:
            dcp.save(staged.state_dict, storage_writer=staged.writer, planner=staged.planner, process_group=group)

    def _complete(self, g: Generation, status: GenerationStatus, fault: FaultStep | None) -> None:
        # one call of the background's watch: its collectives gated, a lost peer named by every rank
        with guarded(self._ctl, False, "memory replication"):
            self._replicate(g, status, fault)

    def _replicate(self, g: Generation, status: GenerationStatus, fault: FaultStep | None) -> None:
        ctl = self._ctl
        watch = _lost if isinstance(ctl, CheckpointGroup) else None
        publish_commit(g, ctl)
        own: dict = {}
        failed: BaseException | None = None
        try:
            own = replicate(g, self._bg, watch)
        except PeerLostError:
            raise  # the groups are spent: nothing more to agree on
        except Exception as e:  # noqa: BLE001 (agreed in mark_complete: every rank learns it)
            failed = e
        if fault == "replicate":
            raise MemoryFault("fault injected during replication (replicas sent, no completion marker)")
        try:
            status.complete = mark_complete(g, ctl, failed, own)
        except PeerLostError:
            raise
        except Exception as e:  # noqa: BLE001 (a rank's replication failed: every rank reports it)
            status.error = e
            warnings.warn(f"memory generation {g.gen} is incomplete: {e}", MemoryTierWarning, stacklevel=1)
            return
        if fault == "complete":
            raise MemoryFault("fault injected after the completion marker (not drained)")
        if self.target is None or not g.drain or g.gen % self.drain_every:
            return
        if not drain_wanted(g, self.target, ctl):
            status.note = f"not drained: {self.target.folder(g)} is already a committed checkpoint"
            return
        drain_failed: BaseException | None = None
        try:
            drain_files(g, self.target)
        except Exception as e:  # noqa: BLE001 (the ranks agree on the outcome before any commit)
            drain_failed = e
        if fault == "drain":
            raise MemoryFault("fault injected during the drain (durable files copied, not committed)")
        if not commit_drain(g, self.target, ctl, self.keep_durable, drain_failed is None):
            raise drain_failed or UCPError(f"memory generation {g.gen}: another rank's drain failed (not committed)")
        status.drained = True
