"""The process group DCP's collectives run on: gloo, each collective behind a gate of the call's watch.

``ucp_dcp.save``/``load``, the torchtitan manager and the memory tier give DCP a *checkpoint group* by
default: a group over the caller's ranks whose collectives run on a gloo backend of its own, created once
per default group and member set (and again after a call that failed: gloo cannot be aborted, and a group
that timed out is dead). Nothing of its collectives' data goes through the store.

What makes it bound failures is the gate before each of its collectives (:class:`~ucp_dcp.planning.checkpoint_group.Watch`):
every member is known to be there before gloo is asked to move anything, so the gloo backend's timeout can be
the peer timeout (``UCP_DCP_PEER_TIMEOUT_S``), not the caller's (often 30 minutes), and a rank that is merely slow
-- the coordinator planning a 4,096-rank save, a rank writing a large shard -- keeps the others waiting at a
gate, where its beat shows it is alive, not inside gloo. A rank that dies or freezes is found at the gate by its
beat; one that dies inside a collective closes its gloo pairs (its peers fail at once), one that freezes there
makes the op time out after the peer timeout (gloo then closes that rank's pairs, so its peers fail too); both
then end at the next gate with the lost rank's name.

It is a Python ``ProcessGroup`` because c10d has no hook before a collective; each op calls the gate and hands
the tensors to gloo's own backend (``ProcessGroupGloo``) unchanged. ``control_group=False`` (or
``UCP_DCP_CONTROL_GROUP=off``) gives DCP the caller's group instead: stock DCP's behaviour, a lost rank then
waits out that group's timeout.

The module reads in call order: the group and its entry (:func:`guarded`), then the watch its gates belong to
(the one liveness mechanism of save, load, the read-once exchange and the memory tier), then the threads the
watch starts and how they end at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import settings
from .._compat import (
    allgather_into,
    default_group,
    default_store,
    gc_paused,
    group_registered,
    group_timeout,
    set_backend_timeout,
)
from ..errors import PeerLostError, UCPError, error_from_wire, peer_lost, wire_error
from .collectives import peer_timeout

__all__ = [
    "BACKEND",
    "BEAT_ENV",
    "CONTROL_ENV",
    "CheckpointGroup",
    "EXCHANGE_GATES",
    "GATES",
    "StoppableThread",
    "Watch",
    "beat_s",
    "call_requests",
    "checkpoint_group",
    "current",
    "dcp_group",
    "enabled",
    "guarded",
    "mark",
    "private_group",
    "stop_at_exit",
]

BACKEND = "ucp_dcp_gated_gloo"
CONTROL_ENV = settings.ENV["control_group"]
"""``off`` (or ``0``): ``ucp_dcp.save``/``load`` and the torchtitan manager give DCP the caller's group."""
DEFAULT_WAIT_S = 1800.0
"""How long a gate waits for a rank that never arrives but whose beat moves, when the caller's group says
nothing: c10d's default collective timeout."""


GATES = {"save": 5, "load": 4}
"""Gates per call: DCP's collectives of a ``dcp.save`` (nine, the pickled bytes of each object collective riding
on its sizes' gate: :meth:`CheckpointGroup._run`) and of a ``dcp.load`` (in torch 2.11-2.15). CI's plan tier
checks them against real calls (``recipes/scale.py --check-counts``)."""
EXCHANGE_GATES = 2
"""The read-once exchange's gates, in a load where ranks send each other bytes (ready, received)."""


def call_requests(size: int, gates: int) -> dict[str, int]:
    """The store requests a call of ``size`` ranks through ``gates`` gates makes at its gates, by kind, as the
    store's wire sees them (a blocking ``get`` is a WAIT, then a GET): per gate one arrival and one wait per
    rank, one verdict; one ``left`` per rank on the way out. Besides these, per rank one beat per gate and step
    and one per ``beat_s`` without either (a tenth of the peer timeout), and, while they wait, the coordinator's scan of every beat and its deputy's
    of the coordinator's once a second (:class:`~ucp_dcp.planning.checkpoint_group.Watch`): ``ucp_dcp plan`` prints them
    and CI's plan tier compares them with a real call's."""
    return {
        "arrivals (add)": gates * size,
        "waits (wait + get)": 2 * gates * size,
        "verdicts (compare_set)": gates,
        "leaving (add)": size,
    }


class CheckpointGroup(dist.ProcessGroup):
    """A process group over ``members`` (global ranks) whose collectives are ``gloo``'s, each behind a gate of
    :attr:`watch`; point-to-point ops (the read-once exchange) go straight to gloo."""

    def __init__(
        self, gloo: Any, rank: int, size: int, members: list[int], c10d_name: str, name: str, wait_limit: float
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload, as torch's own Python groups
        self.gloo = gloo
        self.members = list(members)
        self.c10d_name = c10d_name
        """The name c10d registered it under (this rank's: it may differ between members)."""
        self.key = name
        """Its name on every member: its gloo rendezvous prefix and its watch's keys (:func:`_new`)."""
        self.watch = Watch(name, self.members, rank, wait_limit)
        self.watch.group = self
        self.spent = False
        """A call on it failed: gloo may hold a broken pair, so the next call gets a new group."""
        self.rendezvous: Any = None
        """The store prefix gloo's rendezvous met under (:func:`_create`), until this member's key there is
        removed (:meth:`forget_rendezvous`)."""

    def forget_rendezvous(self) -> None:
        """Remove this member's gloo rendezvous key, once a gate of a call has opened.

        Gloo's full-mesh rendezvous leaves one key per member (its addresses); c10d's own groups leave them
        for the job's life, and a checkpoint group made again after each failed call would add N more each
        time. A member may not remove its key when its own group creation returns: a peer whose pair to it
        was accepted may still be about to read it. Once a gate opened, every member has finished creating
        the group, so nobody reads the keys again; each member removes its own (one request, once a group)."""
        if self.rendezvous is None or not self.watch.opened:
            return
        store, self.rendezvous = self.rendezvous, None
        # ProcessGroupGloo made without options has one device, whose rendezvous keys are
        # "<device index>/<group rank>" under the store it was given
        with contextlib.suppress(RuntimeError, OSError):  # the store is gone: nothing left to remove
            store.delete_key(f"0/{self.rank()}")

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]  # c10d reads it from a backend, and this group has none
        # c10d's own name: destroy_process_group unregisters the group by it
        return self.c10d_name

    def _run(self, kind: str, op: Any, *tensors: Any) -> Any:
        """Gloo's op ``op()`` behind the gate; a collective outside a call (the memory tier's set-up) is a
        call of its own, the op waited for inside it so that a failure there is judged there.

        The bytes of an object collective (uint8 tensors: a pickle) follow, on every rank at once, the op
        that told their sizes (int64), which passed a gate: that gate covers them, so DCP's nine
        collectives of a save pass five gates. Anything else (sizes, barriers, reductions) has its own."""
        w = self.watch
        if w.active:
            if not _pickled_bytes(tensors):
                w.gate(f"{w.step.split(':', 1)[0]}: {kind} (DCP's collectives)")
            return op()
        try:
            with w.running(f"collective {kind}"):
                w.gate(f"collective {kind}")
                work = op()
                work.wait()
                return work
        except BaseException:  # any failure (a lost peer, Ctrl-C) leaves gloo's op sequence unknown: never reuse
            self.spent = True
            raise

    # -- the collectives DCP's object collectives are made of: gate, then gloo's op ---------------------------

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        return self._run(
            "allgather", lambda: self.gloo.allgather(output_tensors, input_tensors, *_opts(opts)), input_tensors
        )

    def all_gather_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None) -> Any:
        """Into one tensor (what torch 2.15's ``all_gather_object`` calls): gloo's ``_allgather_base``."""
        return self._run(
            "allgather", lambda: allgather_into(self.gloo, output_tensor, input_tensor, *_opts(opts)), input_tensor
        )

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the overload c10d calls
        return self._run("allreduce", lambda: self.gloo.allreduce(tensors, *_opts(opts)))

    def barrier(self, opts: Any = None) -> Any:
        return self._run("barrier", lambda: self.gloo.barrier(*_opts(opts)))

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the overload c10d calls
        return self._run("broadcast", lambda: self.gloo.broadcast(tensors, *_opts(opts)), tensors)

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the overload c10d calls
        return self._run("gather", lambda: self.gloo.gather(output_tensors, input_tensors, *_opts(opts)), input_tensors)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the overload c10d calls
        return self._run(
            "scatter", lambda: self.gloo.scatter(output_tensors, input_tensors, *_opts(opts)), output_tensors
        )

    # -- point to point: the read-once exchange gates its own transfers ---------------------------------------

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        return self.gloo.send(tensors, dst, tag)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        return self.gloo.recv(tensors, src, tag)


def _pickled_bytes(tensors: tuple) -> bool:
    """Whether an op moves only uint8 tensors: the pickled bytes of an object collective."""
    flat: list = []
    todo = list(tensors)
    while todo:
        t = todo.pop()
        if isinstance(t, torch.Tensor):
            flat.append(t)
        elif isinstance(t, (list, tuple)):
            todo.extend(t)
    return bool(flat) and all(t.dtype == torch.uint8 for t in flat)


def _opts(opts: Any) -> tuple:
    return () if opts is None else (opts,)


def _create(opts: Any, name: str | None = None) -> CheckpointGroup:
    """c10d's creator for :data:`BACKEND`: gloo's backend over the group's own store prefix (what ``new_group``
    would build for ``backend="gloo"``), with the peer timeout, behind the gates. ``name``: the making's name
    (:func:`_new`), which c10d hands over as the group's ``pg_options``."""
    if not isinstance(name, str):
        raise TypeError(f"a {BACKEND} group is made by ucp_dcp's checkpoint_group(), not new_group(backend=...)")
    wait = opts.timeout.total_seconds() if opts.timeout is not None else DEFAULT_WAIT_S
    # gloo's rendezvous goes under a prefix of this making (:func:`_new`) on the job's store, not under
    # c10d's: c10d names a locally synchronized group by a hash of its ranks *and of how many groups this
    # process holds*, which differs between ranks as soon as one of them made a group the others are not in
    # (``new_group([0])``): its members would meet at different prefixes and wait forever.
    ranks = list(opts.global_ranks_in_group)
    store = dist.PrefixStore(f"checkpoint_group/{name}/", default_store())
    # the members connect under the caller's timeout (they reach their first call when they do: a rank may
    # still be writing); the ops run under the peer timeout (behind a gate, every member is there)
    gloo = dist.ProcessGroupGloo(store, opts.group_rank, opts.group_size, timedelta(seconds=wait))
    set_backend_timeout(gloo, timedelta(seconds=peer_timeout()))
    # the watch's keys are named the same way, for the same reason
    group = CheckpointGroup(gloo, opts.group_rank, opts.group_size, ranks, opts.group_id, name, wait)
    group.rendezvous = store
    return group


def _register() -> None:
    if not hasattr(dist.Backend, BACKEND.upper()):  # what register_backend sets
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def _new(members: list[int], like: dist.ProcessGroup | None) -> CheckpointGroup:
    """Make a checkpoint group over ``members``; its members call this together.

    Its name (its gloo rendezvous prefix and its watch's keys) is the members' hash and the number of this
    making, counted in the job's store: every member adds one per making and they make them in the same
    order, so the ``k``-th ``size`` adds are the ``k``-th making on all of them (a member's add for the next
    making comes after it met every other member in this one). A group made again after a failed call gets
    a new name (the last one's addresses are still in the store), and so does one made by a process whose
    memory is new but whose store is not (a job re-initialized over the same store)."""
    _register()
    timeout = group_timeout(like or default_group())  # the caller's bound for a rank that never arrives
    key = sorted(members)
    digest = hashlib.sha1(",".join(map(str, key)).encode(), usedforsecurity=False).hexdigest()[:16]
    making = (default_store().add(f"checkpoint_group/{digest}/made", 1) - 1) // len(key)
    name = f"{digest}.{making}"  # to _create: c10d passes a custom backend's pg_options to its creator as they are
    return dist.new_group(ranks=key, backend=BACKEND, use_local_synchronization=True, timeout=timeout, pg_options=name)


_GROUPS: dict[tuple[int, ...], tuple[object, CheckpointGroup]] = {}
"""``members -> (default group, checkpoint group)``: an entry serves only while its default group is the
current one, its group is registered (a destroyed and re-initialized job gets a new group) and not spent."""


def checkpoint_group(members: list[int], like: dist.ProcessGroup | None = None) -> CheckpointGroup:
    """The checkpoint group over ``members`` (global ranks, this rank among them), created on first use per
    default group, and anew after a failed call. Every member calls this in the same order (group creation
    synchronizes the members, as DCP's collectives do)."""
    key = tuple(sorted(members))
    current = default_group()
    hit = _GROUPS.get(key)
    if hit is None or hit[0] is not current or not group_registered(hit[1]) or hit[1].spent:
        if hit is not None and group_registered(hit[1]):
            with contextlib.suppress(Exception):  # a spent group: its gloo pairs may be broken already
                dist.destroy_process_group(hit[1])
        hit = _GROUPS[key] = (current, _new(list(key), like))
    return hit[1]


def private_group(members: list[int], like: dist.ProcessGroup | None = None) -> CheckpointGroup:
    """A checkpoint group over ``members`` of its own, not the one :func:`checkpoint_group` hands DCP: for a
    thread whose collectives run beside the caller's (the memory tier's background work: one group is one
    sequence of ops). Every member creates it at the same point of its sequence of group creations."""
    return _new(members, like)


def enabled(choice: bool | None = None) -> bool:
    """Whether to use the checkpoint group: ``choice`` if given, else ``$UCP_DCP_CONTROL_GROUP`` (on)."""
    return settings.control_group(choice)


def dcp_group(process_group: dist.ProcessGroup | None, choice: bool | None = None) -> dist.ProcessGroup | None:
    """The process group to give DCP for a save or load over ``process_group`` (None: the world): the
    checkpoint group over its ranks, or ``process_group`` itself when it is off, outside a process group, or
    for one rank."""
    if not enabled(choice) or not dist.is_initialized() or isinstance(process_group, CheckpointGroup):
        return process_group
    ranks = dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD)
    if len(ranks) < 2:
        return process_group
    return checkpoint_group(ranks, process_group)


@contextlib.contextmanager
def guarded(
    process_group: dist.ProcessGroup | None = None, choice: bool | None = None, what: str = "checkpoint call"
) -> Iterator[dist.ProcessGroup | None]:
    """``with ucp_dcp.control_group() as pg: dcp.save(..., process_group=pg)``: one call on the checkpoint
    group over ``process_group``'s ranks (:func:`dcp_group`), watched while it runs. A call that raised leaves
    the group spent: the next one gets a new group (every rank raised, so every rank does so).

    On the main thread the call also runs with Python's automatic garbage collection paused, as DCP's
    ``get_state_dict``/``set_state_dict`` do: a call allocates tens of thousands of short-lived objects (the
    checkpoint's metadata, the plans), enough to trigger a full collection of the whole heap now and then --
    0.25 s of CPU at 16 ranks of ``make scale``, 1-2 s of wall time on a busy host -- and a collection on one
    rank holds every other rank at the next collective. Paused, those objects die by reference count at the
    end of the call and never count towards one. A background call (the memory tier's, an async save's)
    leaves it alone: the pause is process-wide and would hold the training thread's collections too."""
    paused = gc_paused() if threading.current_thread() is threading.main_thread() else contextlib.nullcontext()
    with paused:
        group = dcp_group(process_group, choice)
        if not isinstance(group, CheckpointGroup):
            yield group
            return
        if group.watch.active:  # inside a call on it already (a load inside the memory tier's): one watch, one call
            yield group
            return
        try:
            with group.watch.running(what):
                yield group
        except BaseException:  # re-raised; the group's members may stand at different ops: a new group next call
            group.spent = True
            raise
        finally:
            group.forget_rendezvous()  # a group's first call that opened a gate, also one that failed later


# -- the watch: is every rank of this call still there? ----------------------------------------------------------
# Is every rank of this checkpoint call still there? One watch per checkpoint group, O(1) store requests per rank.
#
# DCP's collectives run on gloo (the group above). On its own, gloo cannot tell a rank
# that is slow (planning a 4,096-rank load, writing a large shard) from one that died or froze: either it waits
# out a long timeout, or a short one fails slow ranks. So each collective of a call is preceded by a *gate*
# through the job's store, where waiting is cheap and a loss can be told apart from slowness:
#
# * **beats**: while a call runs (never between calls) each rank sets one key, ``b/<rank>``, at each gate and
#   step, and from a thread whenever it said nothing for ``beat_s`` seconds (a tenth of the peer timeout): its
#   beat count, the gate it last reached and its step;
# * **arrival**: at gate ``k`` a rank writes its beat (now saying ``k``) and adds 1 to ``a/<k>``; the rank
#   whose add completes the count sets ``g/<k>`` to ``go``;
# * **waiting**: every rank blocks on one key, ``g/<k>`` (a ``get`` the store answers when the key is set:
#   no polling). Two ranks also *watch* while they wait, from their beat thread: the coordinator (group rank
#   0) reads the beats of the ranks not yet there once a second, its deputy (group rank 1) the
#   coordinator's. A beat that stood still for the peer timeout is a *lost* rank (its process died or froze;
#   a slow rank's beat thread keeps beating); the watcher then sets ``g/<k>`` to the loss, once, and every
#   rank waiting there is released with it;
# * **failing**: a rank whose collective failed (gloo closes a pair when a peer dies, and fails an op
#   after the group's short timeout) arrives at the next gate *failing*: that gate never opens; it ends
#   with the lost rank the watchers find, or, once every rank has arrived, with the lowest failing rank's
#   error. A rank that leaves a call with an error it alone had publishes it on the next gate;
# * **the end**: every rank removes its beat and adds 1 to ``left``; the last one removes the gates' keys and the
#   lost ranks' beats (a few keys, at any N). A finished or failed call leaves nothing in the store, and nothing
#   of it in this process.
#
# So per collective a rank makes about three store requests (its beat, the add, the get), and, per ``beat_s`` of a
# call without a gate, one more beat; the two watchers, while they wait, one scan a second: O(N) for the job,
# O(1) per rank. (A beat a tenth of the timeout apart keeps a live rank's beat moving well inside the timeout;
# beating twice a second made a rank's requests grow with the length of its call: 8,192 writes a second at
# 4,096 ranks.)
#
# Each watch holds one store connection of its own, opened on its first call and kept, for the gates' blocking
# ``get``: a wait there must not hold up the job's own connection, which the beat thread uses (its requests never
# block) as do NCCL's monitor threads.
#
# Kept in one module (just over 400 lines): the beats, the gates, the watchers' scans and the verdicts read and
# write one call's state (its sequence of gates, its loss, its keys); split, each part would reach into the others.


BEAT_ENV = settings.ENV["beat_s"]
SCAN_S = 1.0
"""How often a watcher reads the beats of the ranks a gate still waits for."""
GO = b"go"


beat_s = settings.beat_s
"""Seconds a rank may say nothing before its thread beats (``$UCP_DCP_BEAT_S``; default a tenth of the peer
timeout, 3 s at its default of 30 s): a call shorter than this beats at its gates and steps only."""


_LOCAL = threading.local()


def current() -> Watch | None:
    """The watch of the checkpoint call this thread runs (None outside one): the read-once exchange
    gates its transfers on it."""
    return getattr(_LOCAL, "watch", None)


def mark(call: str, step: str) -> None:
    """Name the step of ``call`` (``save``, ``load``) this thread has reached, in a beat at once: a peer that
    finds this rank lost names its last step (a few marks per call: O(1) requests per rank)."""
    w = current()
    if w is not None:
        w.step = f"{call}: {step}"
        try:
            w._beat()
        except (RuntimeError, OSError):  # the store is gone: the next gate says so, without asking it again
            w.store_gone = True


def _job_store() -> Any:
    """The job's store under the default group's prefixes (c10d's own client of it)."""
    base = default_store()
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    return base


def _connection(base: Any, timeout: float) -> Any:
    """A connection of its own to the job's store ``base`` (a TCPStore client like c10d's). Stores without
    clients (FileStore, HashStore) are used as they are."""
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(base.host, base.port, is_master=False, timeout=timedelta(seconds=timeout))
    return base


class Watch:
    """The liveness of one checkpoint group's calls (``members``: global ranks; ``me``: this rank's
    position among them). ``name`` is the group's, the same on every member; ``wait_limit``: seconds a
    rank whose beat moves, or that never began, may keep a gate waiting (the caller's group timeout:
    what DCP itself would have waited)."""

    def __init__(self, name: str, members: list[int], me: int, wait_limit: float, store: Any = None) -> None:
        self.name = name
        self.members = list(members)
        self.me = me
        self.size = len(members)
        self.wait_limit = wait_limit
        self.timeout = peer_timeout()
        self.calls = 0
        self.active = False
        self.step = ""
        self._outer: Watch | None = None
        self.group: Any = None
        """The checkpoint group this watch gates (None for an exchange's own watch)."""
        self._store: Any = store  # the gates' connection; None: one of its own, opened on the first call
        self._shared: Any = store  # the beat thread's: the job's own (c10d's) connection
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the beat thread and a gate both write this rank's beat
        self._said = 0.0  # when this rank last beat (monotonic): the thread beats only after beat_s of silence
        self._reset()

    # -- a call ------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self.seq = 0
        self.beats = 0
        self.failing: str = ""  # this rank's error, on the wire, once a collective of the call failed here
        self.verdict: BaseException | None = None
        self.lost: list[int] = []
        self.seen: dict[int, tuple[bytes, float]] = {}  # a watcher's last view of each beat, and since when
        self.waiting: tuple[int, float] | None = None  # (gate, since when) while this rank waits at one
        self._other_seen = False  # the watcher's beat was seen in this call (so its absence means the call ended)
        self.opened = False  # a gate of this call opened: every member had made the group and reached it
        self.orphan = False  # the call ended without this rank: the keys it makes now are its own to remove
        self.store_gone = False  # the store stopped answering: no more requests (each failed one logs a C++ trace)

    @property
    def thread(self) -> threading.Thread | None:  # StoppableThread below
        return self._thread

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def running(self, what: str) -> Iterator[Watch]:
        """One call: beats from now until it ends; it raises what :meth:`end` says of its error."""
        self.begin(what)
        try:
            yield self
        except BaseException as e:  # every way out ends the call for the peers too; what is raised is re-raised
            out = self.end(e)
            if out is e or out is None:
                raise
            raise out from None  # the verdict names the rank at fault; the symptom here is in its message
        self.end(None)

    def begin(self, what: str) -> None:
        if self.active:
            raise UCPError(
                f"a checkpoint call on this group began while another ({self.step}) runs",
                hint="run one save or load at a time per process group (async saves take a group of their own)",
            )
        if self._store is None:
            # its waits are bounded by the gates' own logic; the connection's timeout only ends a wait
            # on a store that stopped answering
            self._shared = _job_store()
            self._store = _connection(self._shared, self.wait_limit + self.timeout)
        self._reset()
        self.calls += 1
        self.prefix = f"ucp_dcp/{self.name}/{self.calls}/"
        self.step = f"{what}: start"
        self.active = True
        self._outer = current()  # an exchange's own watch inside another call's: put the other back after
        _LOCAL.watch = self
        try:
            self._beat()  # the beat key exists before this rank reaches any gate: watchers read it there
        except (RuntimeError, OSError) as e:
            self.active = False
            _LOCAL.watch = self._outer
            raise self._store_error(e) from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucp-dcp-beat", daemon=True)
        self._thread.start()
        stop_at_exit(self)  # a beat in a C++ store call while Python finalizes aborted the process

    def end(self, error: BaseException | None) -> BaseException | None:
        """The call is over here: the error to raise for ``error`` (the call's verdict when this rank's
        own collective failed), the beats stopped, and the call's keys removed by the last rank out."""
        out = error
        if isinstance(error, Exception) and self.verdict is None and not _everyones(error) and not self.store_gone:
            # this rank alone saw it (a gloo error, a failure outside DCP's wrapped steps): the others
            # wait at the next gate, or will; arriving there failing ends the call with the true cause
            try:
                self.gate(f"{self.step.split(':', 1)[0]}: after a failure", error)
            except BaseException as verdict:  # noqa: BLE001 (it is what this rank raises)
                out = verdict
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        _LOCAL.watch = self._outer
        self.active = False
        with contextlib.suppress(RuntimeError, OSError):  # the store is gone: nothing left to clean
            if self.orphan and not self.store_gone:  # what it made after the others left
                for key in [f"b/{self.me}", f"a/{self.seq}", f"g/{self.seq}"]:
                    self._req("delete_key", key)
            elif not self.store_gone:
                # each rank removes its own beat (its thread has stopped), so the last one out removes O(1)
                # keys, not N: a watcher reads a missing beat as "not begun", never as a loss
                self._req("delete_key", f"b/{self.me}")
                if self._req("add", "left", 1) != self.size - len(self.lost):
                    return out
                keys = [f"b/{r}" for r in self.lost] + ["left"]  # a lost rank never removed its own
                for k in range(max(1, self.seq - 2), self.seq + 3):  # ranks are at most a gate apart
                    keys += [f"a/{k}", f"g/{k}"]
                for key in keys:
                    self._req("delete_key", key)
        return out

    # -- beats -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        # one thread for both jobs: it wakes at the shorter of the two periods, beats only when this rank said
        # nothing for beat_s (a gate's or a step's beat counts), and scans once a second while a gate waits
        every = beat_s()
        scanned = time.monotonic()
        while not self._stop.wait(min(every, SCAN_S)):
            try:
                if time.monotonic() - self._said >= every:
                    self._beat(shared=True)
                waiting = self.waiting
                if waiting is not None and time.monotonic() - scanned >= SCAN_S:
                    scanned = time.monotonic()
                    k, since = waiting
                    verdict = self._scan(k, scanned - since) if self.me in (0, 1) else None
                    verdict = verdict or self._orphaned()
                    if verdict is not None:  # the gate's waiters, this rank's main thread among them, are released
                        self._set_if_unset(f"g/{k}", verdict, shared=True)
            except (RuntimeError, OSError):  # the store is gone (the job is being torn down): the gate says so
                return

    def _beat(self, flag: str = "", why: str = "", shared: bool = False) -> None:
        if self.store_gone:
            raise RuntimeError("the job's store stopped answering")
        with self._lock:  # one beat at a time from either connection: the store sees them in order
            self.beats += 1
            flag = flag or ("x" if self.failing else "")
            why = why or self.failing
            value = f"{self.beats}|{self.seq}|{flag}|{why or self.step}"
            self._req("set", f"b/{self.me}", value, shared=shared)
            self._said = time.monotonic()

    # -- gates -------------------------------------------------------------------------------------------

    def gate(self, what: str, error: BaseException | None = None) -> None:
        """Wait until every member reached this point (the next collective), or raise what ended the call.
        ``error``: this rank failed (its collective raised): it arrives failing, and the call ends with
        the loss the watchers find or, if every rank arrives, the lowest failing rank's error."""
        if self.verdict is not None:
            raise self.verdict
        if error is not None and not self.failing:
            self.failing = wire_error(error)
        self.seq += 1
        k = self.seq
        self.step = what
        try:
            self._beat()  # says "at gate k" before the add: a watcher never judges a rank that has arrived
            n = self._req("add", f"a/{k}", 1 + (self.size if self.failing else 0))
            if n % self.size == 0:  # the last to arrive (a failing arrival adds size + 1: see the module doc)
                self._open(k, n)
            self.waiting = (k, time.monotonic())  # a watcher's beat thread reads the others' beats meanwhile
            value = self._req("get", f"g/{k}")
        except (RuntimeError, OSError) as e:  # the store's host is gone (a plain launch: rank 0's process)
            self.verdict = self._store_error(e)
            raise self.verdict from None
        finally:
            self.waiting = None
        if value == GO and not self.failing:
            self.opened = True
            self._other_seen = True  # every member had begun: a watcher's beat missing later means the call ended
            return
        self.verdict = self._judge(value, error)
        raise self.verdict

    def _open(self, k: int, n: int) -> None:
        """Every member has arrived at gate ``k``: open it (``go``), or, when some arrived failing,
        end the call with the lowest failing rank's error; the keys of gate ``k - 1`` are done with."""
        if n == self.size:
            self._set_if_unset(f"g/{k}", GO)
        else:
            beats = self._beats()
            r = min(r for r, b in beats.items() if b[2] == "x")
            self._set_if_unset(f"g/{k}", self._failure(r, beats[r][3]))
        if k > 1:
            self._req("delete_key", f"a/{k - 1}")
            self._req("delete_key", f"g/{k - 1}")

    def _scan(self, k: int, waited: float) -> bytes | None:
        """The coordinator reads the beats of every rank; its deputy the coordinator's. A verdict when one of
        those not yet at gate ``k`` left the call with an error, stood still for the peer timeout, or kept
        the gate waiting longer than the caller's group timeout."""
        ranks = range(self.size) if self.me == 0 else [0]
        beats = self._beats(ranks, shared=True)
        now = time.monotonic()
        for r in ranks:
            if r == self.me:
                continue
            b = beats.get(r)
            if b is not None and b[1] >= k:
                continue  # there (its beat may stand still now: it waits on the gate, its beat behind it)
            if b is not None and b[2] == "x":
                return self._failure(r, b[3])
            raw = b[4] if b is not None else b""
            last = self.seen.get(r)
            if last is None or last[0] != raw:
                self.seen[r] = (raw, now)
                still = 0.0
            else:
                still = now - last[1]
            step = b[3] if b is not None else ""
            if b is not None and still > self.timeout:
                return self._loss(r, f"no heartbeat for {still:.1f} s (its last step: {step or 'start'})")
            if waited > self.wait_limit:
                why = "it never began this call" if b is None else f"its heartbeat moves (its step: {step})"
                return self._loss(
                    r, f"it did not reach the collective within the group's timeout ({self.wait_limit:.0f} s; {why})"
                )
        return None

    def _orphaned(self) -> bytes | None:
        """A verdict when the call ended without this rank: the others found it lost (a freeze longer than the
        peer timeout, then it resumed) and the last of them removed the call's keys, the watcher's beat too."""
        other = f"b/{1 if self.me == 0 else 0}"
        if self._req("check", [other], shared=True):
            self._other_seen = True
            return None
        if not self._other_seen:  # the watcher has not begun this call yet
            return None
        self.orphan = True
        return self._loss(
            self.me,
            "the others ended this call without it (they found it lost: it stood still "
            "for longer than the peer timeout)",
        )

    def _beats(self, ranks: Any = None, shared: bool = False) -> dict[int, tuple[int, int, str, str, bytes]]:
        """``rank -> (count, gate, flag, step or error, raw)`` for the beats that exist (one multi_get
        when they all do; a rank that has not begun has none)."""
        ranks = list(range(self.size) if ranks is None else ranks)
        keys = [f"b/{r}" for r in ranks]
        if self._req("check", keys, shared=shared):
            raws = self._req("multi_get", keys, shared=shared)
        else:
            raws = [
                self._req("get", key, shared=shared) if self._req("check", [key], shared=shared) else None
                for key in keys
            ]
        out = {}
        for r, raw in zip(ranks, raws):
            if raw is None:
                continue
            n, seq, flag, rest = bytes(raw).decode(errors="replace").split("|", 3)
            out[r] = (int(n), int(seq), flag, rest, bytes(raw))
        return out

    # -- verdicts ----------------------------------------------------------------------------------------

    def _loss(self, r: int, why: str) -> bytes:
        return json.dumps({"lost": [r], "why": why, "by": self.members[self.me]}).encode()

    def _failure(self, r: int, wired: str) -> bytes:
        return json.dumps({"failed": r, "error": wired}).encode()

    def _judge(self, value: bytes, error: BaseException | None) -> BaseException:
        """The error this rank raises for the verdict ``value`` of a gate."""
        try:
            v = json.loads(bytes(value).decode())
        except ValueError:
            v = {"failed": self.me, "error": self.failing or "{}"}
        if "lost" in v:
            self.lost = [int(r) for r in v["lost"]]
            r = self.lost[0]
            during = self.step.split(":", 1)[0] or "a checkpoint call"
            return peer_lost(self.members[r], f"{v['why']} (seen by rank {v['by']})", during=f"a {during}")
        r = int(v["failed"])
        if error is not None:
            return error  # this rank failed too: its own failure, in full (every rank of an agreed failure)
        return error_from_wire(self.members[r], str(v["error"]).encode())

    def _store_error(self, e: BaseException) -> PeerLostError:
        """The store stopped answering a wait: under a plain launch it lives in the coordinator's process."""
        self.store_gone = True
        return peer_lost(
            self.members[0],
            f"the job's store stopped answering at {self.step} ({str(e).splitlines()[0][:160]}); under a "
            "plain launch it runs in that rank's process",
            during="a checkpoint call",
        )

    # -- the store ---------------------------------------------------------------------------------------

    def _set_if_unset(self, key: str, value: bytes, shared: bool = False) -> None:
        # one verdict per gate: whoever sets it first (the last arrival's "go", a watcher's loss) wins
        self._req("compare_set", key, "", value, shared=shared)

    def _req(self, op: str, key: Any, *args: Any, shared: bool = False) -> Any:
        """One request under this call's prefix: on the gates' own connection, or (``shared``: the beat
        thread's) the job's."""
        store = self._shared if shared else self._store
        if isinstance(key, list):
            return getattr(store, op)([self.prefix + k for k in key], *args)
        return getattr(store, op)(self.prefix + key, *args)


def _everyones(error: BaseException) -> bool:
    """Whether every rank raises ``error`` too: DCP's wrapper of the per-rank failures its collectives carried
    needs no telling (a gate's verdict neither: :attr:`Watch.verdict`). Anything else -- a gloo error, a peer
    this rank found lost in a transfer, an error of this rank alone -- is taken to the next gate."""
    return hasattr(error, "failures")


# -- our threads at interpreter exit -------------------------------------------------------------------------------
# Our daemon threads ended before the interpreter finalizes.
#
# A thread that takes the GIL back while Python finalizes is ended by ``pthread_exit``; when that happens on the
# way out of a C++ call, the forced unwind through C++ frames ends in ``std::terminate`` ("terminate called
# without an active exception", SIGABRT) after all work had succeeded. The quickstart's abort at exit was gloo's
# worker thread doing exactly that (its fix: a barrier as the last collective, ``docs/examples/quickstart.py``);
# the control group's heartbeat thread sits in ``TCPStore.set``, a C++ call that releases the GIL, twice a second,
# so it could do the same. An ``atexit`` handler runs before finalization, while such threads can still finish
# their call: it stops and joins them.


class StoppableThread(Protocol):
    """What :func:`stop_at_exit` needs of an owner of a daemon thread."""

    def stop(self) -> None: ...

    @property
    def thread(self) -> threading.Thread | None: ...


_OWNERS: weakref.WeakSet[StoppableThread] = weakref.WeakSet()
JOIN_S = 2.0
"""How long the exit waits for each thread (a store call that hangs must not hang the exit)."""


def stop_at_exit(owner: StoppableThread) -> None:
    """Stop ``owner`` (``owner.stop()``) and join its thread when the interpreter exits, if it still runs."""
    _OWNERS.add(owner)


@atexit.register
def _stop_all() -> None:
    owners = list(_OWNERS)
    for o in owners:
        o.stop()
    for o in owners:
        t = o.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=JOIN_S)
