"""The process group DCP's collectives run on: gloo, each collective behind a gate of the call's watch.

``ucp_dcp.save``/``load``, the torchtitan manager and the memory tier give DCP a *checkpoint group* by
default: a group over the caller's ranks whose collectives run on a gloo backend of its own, created once
per default group and member set (and again after a call that failed: gloo cannot be aborted, and a group
that timed out is dead). Nothing of its collectives' data goes through the store.

What makes it bound failures is the gate before each of its collectives (:class:`~ucp_dcp.planning.watch.Watch`):
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
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

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
from .collectives import peer_timeout
from .watch import Watch

__all__ = ["BACKEND", "CONTROL_ENV", "CheckpointGroup", "checkpoint_group", "dcp_group", "enabled", "guarded"]
__all__ += ["private_group", "GATES", "EXCHANGE_GATES", "call_requests"]

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
    of the coordinator's once a second (:class:`~ucp_dcp.planning.watch.Watch`): ``ucp_dcp plan`` prints them
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
