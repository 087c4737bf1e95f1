"""Is every rank of this checkpoint call still there? One watch per checkpoint group, O(1) store requests per rank.

DCP's collectives run on gloo (:mod:`ucp_dcp.planning.checkpoint_group`). On its own, gloo cannot tell a rank
that is slow (planning a 4,096-rank load, writing a large shard) from one that died or froze: either it waits
out a long timeout, or a short one fails slow ranks. So each collective of a call is preceded by a *gate*
through the job's store, where waiting is cheap and a loss can be told apart from slowness:

* **beats**: while a call runs (never between calls) each rank sets one key, ``b/<rank>``, at each gate and
  step, and from a thread whenever it said nothing for ``beat_s`` seconds (a tenth of the peer timeout): its
  beat count, the gate it last reached and its step;
* **arrival**: at gate ``k`` a rank writes its beat (now saying ``k``) and adds 1 to ``a/<k>``; the rank
  whose add completes the count sets ``g/<k>`` to ``go``;
* **waiting**: every rank blocks on one key, ``g/<k>`` (a ``get`` the store answers when the key is set:
  no polling). Two ranks also *watch* while they wait, from their beat thread: the coordinator (group rank
  0) reads the beats of the ranks not yet there once a second, its deputy (group rank 1) the
  coordinator's. A beat that stood still for the peer timeout is a *lost* rank (its process died or froze;
  a slow rank's beat thread keeps beating); the watcher then sets ``g/<k>`` to the loss, once, and every
  rank waiting there is released with it;
* **failing**: a rank whose collective failed (gloo closes a pair when a peer dies, and fails an op
  after the group's short timeout) arrives at the next gate *failing*: that gate never opens; it ends
  with the lost rank the watchers find, or, once every rank has arrived, with the lowest failing rank's
  error. A rank that leaves a call with an error it alone had publishes it on the next gate;
* **the end**: every rank removes its beat and adds 1 to ``left``; the last one removes the gates' keys and the
  lost ranks' beats (a few keys, at any N). A finished or failed call leaves nothing in the store, and nothing
  of it in this process.

So per collective a rank makes about three store requests (its beat, the add, the get), and, per ``beat_s`` of a
call without a gate, one more beat; the two watchers, while they wait, one scan a second: O(N) for the job,
O(1) per rank. (A beat a tenth of the timeout apart keeps a live rank's beat moving well inside the timeout;
beating twice a second made a rank's requests grow with the length of its call: 8,192 writes a second at
4,096 ranks.)

Each watch holds one store connection of its own, opened on its first call and kept, for the gates' blocking
``get``: a wait there must not hold up the job's own connection, which the beat thread uses (its requests never
block) as do NCCL's monitor threads.

Kept in one module (just over 400 lines): the beats, the gates, the watchers' scans and the verdicts read and
write one call's state (its sequence of gates, its loss, its keys); split, each part would reach into the others.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import settings
from .._compat import default_store
from ..errors import PeerLostError, UCPError, error_from_wire, peer_lost, wire_error
from .collectives import peer_timeout
from .exit_threads import stop_at_exit

__all__ = ["BEAT_ENV", "Watch", "beat_s", "current", "mark"]

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
    def thread(self) -> threading.Thread | None:  # exit_threads.StoppableThread
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
