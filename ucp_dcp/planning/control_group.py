"""DCP's own collectives through the job's store, so that a rank that dies cannot leave the others waiting.

DCP plans, commits and reports failures with object collectives over the process group it is given.
On gloo a rank that dies or freezes leaves every other rank in such a collective until the process
group's timeout, and nothing can interrupt a pending gloo op. The *control group* is a Python process
group over the same ranks whose ops exchange the (small, CPU) tensors those collectives are made of
through the job's TCPStore, one key prefix per op, polling with backoff, watching the heartbeat each
member beats from a thread every ``UCP_DCP_BEAT_S`` (0.5 s) for as long as its process lives:

* a contribution missing while its rank's heartbeat moves: a slow rank, waited for;
* a heartbeat that stood still for :func:`~ucp_dcp.planning.collectives.peer_timeout` seconds: the
  rank is *lost* (its process died or froze); this rank raises :class:`~ucp_dcp.errors.PeerLostError`
  naming it and the last step it announced, and tells the other members through the store, so
  ranks waiting on someone else end too;
* whatever the heartbeat says, no wait lasts longer than the timeout of the group the caller gave
  (``init_process_group(timeout=...)``: what gloo would have waited): a rank that never reaches the
  collective (it has not reached the save, or raised before it on its own) is then named too.

After a loss the group is spent. ``ucp_dcp.save``/``load`` and the torchtitan manager give it to DCP by
default (``UCP_DCP_CONTROL_GROUP=off`` / ``control_group=False`` keep DCP's group). Keys live in the default
group's store under the members and a generation; each op's keys are removed by its last reader.

Kept in one module (~420 lines): the group's ops and the functions that hand a job its groups share the
registry of live groups and the loss bookkeeping (``_GROUPS``, ``lose``/``publish_lost``); split, each half
would reach into the other's private state.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._compat import completed_work, default_group, default_store, group_registered, group_timeout
from ..errors import PeerLostError, UCPError, peer_lost
from .collectives import peer_timeout
from .exit_threads import stop_at_exit

__all__ = ["BACKEND", "CONTROL_ENV", "ControlGroup", "beat_s", "control_group", "dcp_group", "enabled"]
__all__ += ["controlled", "mark", "private_group", "publish_lost"]

BACKEND = "ucp_dcp_control"
CONTROL_ENV = "UCP_DCP_CONTROL_GROUP"
"""``off`` (or ``0``): ``ucp_dcp.save``/``load`` and the torchtitan manager give DCP the caller's group."""
SCAN_S = 1.0  # how often a waiting rank asks which contributions are missing and reads their heartbeats
MAX_PAUSE_S = 0.02
_STEP = ["", "start"]
"""``[call, step]`` this process last reached (``mark``); every heartbeat carries it."""


def beat_s() -> float:
    """Seconds between heartbeats (``$UCP_DCP_BEAT_S``, default 0.5)."""
    return float(os.environ.get("UCP_DCP_BEAT_S") or 0.5)


def mark(call: str, step: str) -> None:
    """Record that this process reached ``step`` of ``call`` (``save``/``load``) and beat at once: a
    peer that finds this rank lost names the last step it announced."""
    _STEP[0], _STEP[1] = call, step
    for group in _live():
        try:
            group._beat(group.store)
        except Exception:  # the store is gone: the next op says so
            pass


class ControlGroup(dist.ProcessGroup):
    """A process group over ``members`` (global ranks) whose collectives go through ``store`` (:func:`control_group`)."""

    def __init__(
        self, store: Any, rank: int, size: int, timeout: timedelta, members: list[int], name: str = ""
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload, as torch's own Python groups
        self.store = store
        self.members = list(members)
        self.me = rank
        self.timeout = timeout.total_seconds()
        self.seq = 0
        self.name_ = name
        self.registered = False  # once new_group registered it, its heartbeat ends with its registration
        self.lost: PeerLostError | None = None
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._stop = threading.Event()
        try:  # its own connection: the op thread's blocking calls must not delay a beat
            beat_store = store.clone()
        except Exception:  # a store without clone (FileStore, HashStore): one lock per operation
            beat_store = store
        self._count = itertools.count()  # one counter for both threads: next() is atomic under the GIL
        self._beat(beat_store)
        self.thread = threading.Thread(target=self._run, args=(beat_store,), name="ucp-dcp-control", daemon=True)
        self.thread.start()
        stop_at_exit(self)  # a heartbeat still in the store's C++ set at exit aborted the process

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]  # c10d reads it from a backend, and this group has none
        return self.name_

    # -- heartbeat ---------------------------------------------------------------------------------

    def _beat(self, store: Any) -> None:
        store.set(f"ucp/beat/{self.me}", f"{next(self._count)}|" + " ".join(s for s in _STEP if s))

    def _run(self, store: Any) -> None:
        while not self._stop.wait(beat_s()):
            if self.registered and not group_registered(self):  # destroyed: this group is over
                return
            try:
                self._beat(store)
            except Exception:  # the store is gone (job torn down): nothing left to tell
                return

    def stop(self) -> None:
        self._stop.set()

    def lose(self, member: int, why: str) -> PeerLostError:
        """Declare global rank ``member`` lost (a transfer with it beside the group's ops failed or timed
        out): every member's next op raises; returns the error to raise here."""
        return self._fail(self.members.index(member), why)

    # -- waiting -----------------------------------------------------------------------------------

    def _fail(self, g: int, why: str, seen_here: bool = True) -> PeerLostError:
        call = {"save": "a save", "load": "a load"}.get(_STEP[0], "a checkpoint")
        self.lost = peer_lost(self.members[g], why, during=call)
        if seen_here:
            try:  # the other members end too, also those waiting on someone else
                self.store.set("ucp/failed", f"{g}|{why} (seen by rank {self.members[self.me]})")
            except Exception:
                pass
        return self.lost

    def _check_failed(self) -> None:
        if self.store.check(["ucp/failed"]):
            g, _, why = self.store.get("ucp/failed").decode().partition("|")
            raise self._fail(int(g), why, seen_here=False)

    def _check_beat(self, g: int, what: str) -> None:
        key = f"ucp/beat/{g}"
        value = self.store.get(key) if self.store.check([key]) else b""
        now = time.monotonic()
        last = self._seen.get(g)
        if last is None or last[0] != value:
            self._seen[g] = (value, now)
            return
        still = now - last[1]
        if value and still > peer_timeout():
            step = value.decode(errors="replace").partition("|")[2] or "start"
            raise self._fail(g, f"no heartbeat for {still:.1f} s (its last step: {step}); {what}")

    def _wait(self, keys: dict[int, str], what: str) -> None:
        """Until every key exists (``group rank -> key`` of its writer); raise for a lost writer."""
        pending = dict(keys)
        pause, start = 0.0002, time.monotonic()
        looked = start
        try:
            while pending:
                if self.store.check(list(pending.values())):
                    return
                if time.monotonic() - looked >= SCAN_S:
                    pending = {g: k for g, k in pending.items() if not self.store.check([k])}
                    self._check_failed()
                    for g in pending:
                        self._check_beat(g, what)
                    looked = time.monotonic()
                    if pending and looked - start > self.timeout:
                        g = min(pending)
                        alive = "its heartbeat moves" if self._seen.get(g, (b"",))[0] else "it never joined the group"
                        why = f"it did not reach the collective within the group's timeout ({self.timeout:.0f} s; {alive})"
                        raise self._fail(g, f"{why}; {what}")
                time.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE_S)
        except (RuntimeError, OSError) as e:  # the store's host exited: name the rank waited for longest
            if isinstance(e, UCPError):
                raise
            g = min(pending, key=lambda r: self._seen.get(r, (b"", time.monotonic()))[1])
            raise self._fail(g, f"the job's store stopped answering ({e}); {what}", seen_here=False) from e

    def _begin(self, kind: str) -> tuple[str, str]:
        if self.lost is not None:
            raise self.lost
        self.seq += 1
        return f"ucp/{self.seq}/", f"waited in the control group's {kind} #{self.seq} (DCP's collectives)"

    def _take(self, raw: bytes, out: torch.Tensor | None, g: int, kind: str) -> None:
        head, _, data = raw.partition(b"|")
        size = out.numel() * out.element_size() if out is not None else 0
        if head.decode(errors="replace") != kind or len(data) != size:
            raise UCPError(
                f"control group op #{self.seq}: rank {self.members[g]} ran {head.decode(errors='replace')!r} ({len(data)} "
                f"bytes) where this rank ran {kind!r} ({size}): the ranks called DCP's collectives in different orders",
                hint="every rank must make the same save/load calls in the same order",
            )
        if data and out is not None:
            out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(out.dtype).reshape(out.shape))

    def _put(self, key: str, kind: str, t: torch.Tensor | None) -> None:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t is not None else b""
        self.store.set(key, kind.encode() + b"|" + raw)

    def _all(self, kind: str, t: torch.Tensor | None) -> list[bytes]:
        """Every member's contribution to one op, this rank's ``t`` included (allgather's pattern)."""
        prefix, what = self._begin(kind)
        self._put(f"{prefix}{self.me}", kind, t)
        keys = {g: f"{prefix}{g}" for g in range(self.size())}
        self._wait(keys, what)
        got = self.store.multi_get([keys[g] for g in range(self.size())])
        if self.store.add(f"{prefix}read", 1) == self.size():  # the last reader clears the op
            for k in [*keys.values(), f"{prefix}read"]:
                self.store.delete_key(k)
        return got

    # -- the collectives DCP's object collectives are made of ----------------------------------------

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        _single("allgather", output_tensors, input_tensors)
        for g, (raw, out) in enumerate(zip(self._all("allgather", input_tensors[0]), output_tensors[0])):
            self._take(raw, out, g, "allgather")
        return completed_work(output_tensors)

    def all_gather_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None) -> Any:
        """Into one tensor (torch 2.15's ``all_gather_object``): the allgather over its rows."""
        self.allgather([list(output_tensor.chunk(self.size()))], [input_tensor], opts)
        return completed_work(output_tensor)

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the overload c10d calls
        _single("allreduce", tensors)
        t = tensors[0]
        parts = torch.empty((self.size(), *t.shape), dtype=t.dtype)
        for g, raw in enumerate(self._all("allreduce", t)):
            self._take(raw, parts[g], g, "allreduce")
        t.copy_(_reduce(parts, opts))
        return completed_work(tensors)

    def barrier(self, opts: Any = None) -> Any:
        for g, raw in enumerate(self._all("barrier", None)):
            self._take(raw, None, g, "barrier")
        return completed_work(None)

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the overload c10d calls
        _single("gather", input_tensors)
        root = opts.rootRank
        prefix, what = self._begin("gather")
        if self.me != root:
            self._put(f"{prefix}{self.me}", "gather", input_tensors[0])
            return completed_work(output_tensors)
        outs = output_tensors[0]
        keys = {g: f"{prefix}{g}" for g in range(self.size()) if g != root}
        self._wait(keys, what)
        for (g, key), raw in zip(keys.items(), self.store.multi_get(list(keys.values()))):
            self._take(raw, outs[g], g, "gather")
            self.store.delete_key(key)
        outs[root].copy_(input_tensors[0])
        return completed_work(output_tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the overload c10d calls
        _single("broadcast", tensors)
        root = opts.rootRank
        prefix, what = self._begin("broadcast")
        key = f"{prefix}{root}"
        if self.me == root:
            self._put(key, "broadcast", tensors[0])
            return completed_work(tensors)
        self._wait({root: key}, what)
        self._take(self.store.get(key), tensors[0], root, "broadcast")
        if self.store.add(f"{prefix}read", 1) == self.size() - 1:  # the last reader clears the op
            for k in (key, f"{prefix}read"):
                self.store.delete_key(k)
        return completed_work(tensors)

    def settle(self) -> None:
        """The end of a save or load: every member says it is done reading; member 0 waits for them
        (under a plain launch its process hosts the store, and must not exit while a peer still reads
        from it). A member lost now is not this call's error (it completed): the next op names it."""
        prefix, what = self._begin("settle")
        if self.me != 0:
            self.store.set(f"{prefix}{self.me}", "settle|")
            return
        keys = {g: f"{prefix}{g}" for g in range(1, self.size())}
        with contextlib.suppress(PeerLostError):
            self._wait(keys, what)
            for k in keys.values():
                self.store.delete_key(k)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # the overload c10d calls
        _single("scatter", output_tensors)
        root = opts.rootRank
        prefix, what = self._begin("scatter")
        if self.me == root:
            for g, t in enumerate(input_tensors[0]):
                if g != root:
                    self._put(f"{prefix}to{g}", "scatter", t)
            output_tensors[0].copy_(input_tensors[0][root])
            return completed_work(output_tensors)
        key = f"{prefix}to{self.me}"
        self._wait({root: key}, what)
        self._take(self.store.get(key), output_tensors[0], root, "scatter")
        self.store.delete_key(key)
        return completed_work(output_tensors)


def _single(kind: str, *lists: Any) -> None:
    if any(len(x) != 1 for x in lists):
        raise UCPError(f"the control group's {kind} takes one tensor per rank (DCP's collectives do)")


def _reduce(stacked: torch.Tensor, opts: Any) -> torch.Tensor:
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    for name, fn in {"SUM": torch.sum, "PRODUCT": torch.prod, "MAX": torch.amax, "MIN": torch.amin}.items():
        if op == getattr(dist.ReduceOp, name):
            return fn(stacked, dim=0)  # type: ignore[operator]
    raise UCPError(f"the control group's allreduce supports SUM, PRODUCT, MIN and MAX, not {op}")


def controlled(process_group: dist.ProcessGroup | None = None, choice: bool | None = None) -> Any:
    """``with ucp_dcp.control_group() as pg: dcp.save(..., process_group=pg)``: DCP's collectives on the
    control group over ``process_group``'s ranks (:func:`dcp_group`), settled when the call ends."""
    return _Settled(dcp_group(process_group, choice))


class _Settled(contextlib.AbstractContextManager):
    """:meth:`ControlGroup.settle` after the call, also when it raised (DCP raises one failure on every rank)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __enter__(self) -> Any:
        return self.group

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if isinstance(self.group, ControlGroup) and self.group.lost is None:
            with contextlib.suppress(*(() if kind is None else (Exception,))):  # never hides the call's error
                self.group.settle()


def _create(opts: Any, _backend_options: Any = None) -> ControlGroup:
    """Keys under the members and the how-manieth group over them this is, not under c10d's name for it
    (members that created other groups in between disagree on that name: it counts the groups)."""
    ranks, store = list(opts.global_ranks_in_group), default_store()
    at = f"ucp_dcp/ctl/{hashlib.sha1(str(ranks).encode()).hexdigest()[:16]}/"
    store = dist.PrefixStore(f"{at}{(store.add(f'{at}joins', 1) - 1) // len(ranks)}/", store)
    return ControlGroup(store, opts.group_rank, opts.group_size, opts.timeout, ranks, str(opts.group_id))


_GROUPS: dict[tuple[int, ...], tuple[object, ControlGroup]] = {}
"""``members -> (default group, control group)``: an entry serves only while its default group is the
current one and its group is registered (a destroyed and re-initialized job gets a new group)."""


def _register() -> None:
    if not hasattr(dist.Backend, BACKEND.upper()):  # what register_backend sets
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def private_group(members: list[int], like: dist.ProcessGroup | None = None) -> ControlGroup:
    """A control group over ``members`` of its own, not the one :func:`control_group` hands DCP: for a
    thread whose collectives run beside the caller's (the memory tier's background work; one group is
    one sequence of ops). Every member creates it at the same point of its sequence of group creations."""
    _register()
    timeout = group_timeout(like or default_group())
    group = dist.new_group(ranks=sorted(members), backend=BACKEND, use_local_synchronization=True, timeout=timeout)
    group.registered = True
    return group


def control_group(members: list[int], like: dist.ProcessGroup | None = None) -> ControlGroup:
    """The control group over ``members`` (global ranks, this rank among them), created on first use
    per default group with the timeout of ``like`` (None: the default group). Every member calls this
    in the same order (as DCP's collectives require)."""
    _register()
    key = tuple(sorted(members))
    current = default_group()
    hit = _GROUPS.get(key)
    if hit is None or hit[0] is not current or not group_registered(hit[1]):
        if hit is not None:
            hit[1].stop()
        timeout = group_timeout(like or current)  # the caller's bound, not new_group's default (30 min)
        group = dist.new_group(ranks=list(key), backend=BACKEND, use_local_synchronization=True, timeout=timeout)
        group.registered = True
        hit = _GROUPS[key] = (current, group)
    return hit[1]


def _live() -> list[ControlGroup]:
    current = default_group() if dist.is_initialized() else None
    return [group for owner, group in list(_GROUPS.values()) if owner is current and group.lost is None]


def enabled(choice: bool | None = None) -> bool:
    """Whether to use the control group: ``choice`` if given, else ``$UCP_DCP_CONTROL_GROUP`` (on)."""
    return choice if choice is not None else os.environ.get(CONTROL_ENV, "on").lower() not in ("off", "0", "false")


def dcp_group(process_group: dist.ProcessGroup | None, choice: bool | None = None) -> dist.ProcessGroup | None:
    """The process group to give DCP for a save or load over ``process_group`` (None: the world): the
    control group over its ranks, or ``process_group`` itself when the control group is off, outside
    a process group, or for one rank."""
    if not enabled(choice) or not dist.is_initialized() or isinstance(process_group, ControlGroup):
        return process_group
    ranks = dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD)
    if len(ranks) < 2:
        return process_group
    return control_group(ranks, process_group)


def publish_lost(err: PeerLostError) -> None:
    """Tell the members of every live control group holding ``err``'s rank that it is lost (a loss
    found elsewhere, e.g. by the read-once exchange): their next wait raises at once."""
    for group in _live():
        if err.rank in group.members:
            try:
                group.store.set("ucp/failed", f"{group.members.index(err.rank)}|{err.message.partition(': ')[2]}")
            except Exception:
                pass
