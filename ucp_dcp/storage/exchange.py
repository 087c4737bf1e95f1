"""The read-once exchange with failures: every message posted is matched, every wait is bounded.

Each bundle is one point-to-point message per consumer: an int64 header ``(status, nbytes)``,
then ``nbytes`` of payload, tagged by its position among the pair's messages. A sender that
failed sends ``status = 1`` and, as payload, its error (:func:`ucp_dcp.errors.wire_error`), so the
consumer raises the true cause, naming the sender. A consumer that fails while taking a message
(e.g. a dtype conversion that would overflow) keeps receiving the rest into scratch memory, so
no sender is left blocked, and raises its own error afterwards.

Waits: every rank of the load passes a gate of the call's watch (:mod:`ucp_dcp.planning.checkpoint_group`) before it
posts anything, so every sender and consumer is known to be there, and another once its receives are over,
before it waits for its sends: so each transfer's wait can be bounded by the peer timeout (gloo closes the
pair on a timeout, so the other side fails at once too), and a rank that died or froze anywhere in its read
is named by the gate that waits for it. A transfer that fails is this rank's failure at the second gate,
which ends the call with the lost rank's name.

Pipelining: a payload may be a function that reads it when its turn comes (the memory tier's
servers read message ``k + 1`` while ``k`` is on the wire), and ``meanwhile`` runs after every send
is posted and before the receives (a rank's own reads, overlapping its transfers). A lazily read
message is announced before it is read, so its consumer's wait includes one message's read: far
below the peer timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .._compat import default_group, group_timeout
from ..errors import PeerFailedError, PeerLostError, UCPError, error_from_wire, peer_lost, wire_error
from ..planning.checkpoint_group import Watch, current
from ..planning.collectives import p2p_group
from .transport import Incoming

__all__ = ["Outcome", "Payload", "exchange", "exchange_link", "drain_only"]

Payload = torch.Tensor | None | Callable[[], torch.Tensor]
"""One message's bytes: a uint8 tensor, None (nothing: this rank failed), or a function reading them."""


def drain_only() -> Incoming:
    """A message this rank cannot take (it failed before it could say where): received into
    scratch memory, whatever its size, and dropped."""
    return Incoming(-1, lambda: torch.empty(0, dtype=torch.uint8), lambda buf: None)


@dataclass
class Outcome:
    """How the exchange ended for this rank."""

    error: BaseException | None = None
    """This rank's own failure during the exchange (reading a lazy payload, ``meanwhile``, taking a
    message), if any."""
    peers: list[PeerFailedError] = field(default_factory=list)
    """Failures of other ranks this rank learned of (their causes, or that they were lost)."""
    bad_size: tuple[int, int, int] | None = None


class _Exchange:
    def __init__(self, group: dist.ProcessGroup | None, timeout: float) -> None:
        self.group = group
        self.timeout = timedelta(seconds=timeout)
        self.out = Outcome()
        self.gone: set[int] = set()
        self.failure: PeerLostError | None = None
        """The first transfer that failed here: this rank arrives failing at the gate after the receives."""

    def lose(self, r: int, exc: BaseException) -> None:
        """Rank ``r``'s pair failed (its process died, or a wait timed out): skip what is left with it."""
        if r in self.gone:
            return
        self.gone.add(r)
        if self.failure is None:
            self.failure = exc if isinstance(exc, PeerLostError) else peer_lost(r, _short(exc))

    def wait(self, work: dist.Work | None) -> None:
        # bounded: the gate before the exchange saw every rank there, so a wait this long is a lost peer
        if work is not None:  # None: not a member of the group, nothing was posted
            work.wait(timeout=self.timeout)

    def recv(self, src: int, k: int, nbytes: int, into: torch.Tensor | None = None) -> torch.Tensor:
        buf = into if into is not None else torch.empty(nbytes, dtype=torch.uint8)
        self.wait(dist.irecv(buf, src, group=self.group, tag=2 * k + 1))
        return buf

    def take(self, src: int, msgs: list[Incoming]) -> None:
        """Receive every message of ``src``, in order."""
        try:
            for k, msg in enumerate(msgs):
                header = torch.empty(2, dtype=torch.int64)
                self.wait(dist.irecv(header, src, group=self.group, tag=2 * k))
                status, nbytes = (int(x) for x in header)
                if status != 0:
                    cause = self.recv(src, k, nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
                    if not any(p.rank == src for p in self.out.peers):
                        self.out.peers.append(error_from_wire(src, cause.numpy().tobytes()))
                    continue
                drain = self.out.error is not None or msg.nbytes < 0
                if not drain and nbytes != msg.nbytes:
                    self.out.bad_size = self.out.bad_size or (src, nbytes, msg.nbytes)
                    drain = True
                if drain:  # matched anyway: the sender waits for it
                    if nbytes:
                        self.recv(src, k, nbytes)
                    continue
                buf = msg.buffer() if nbytes else torch.empty(0, dtype=torch.uint8)
                if nbytes:
                    self.recv(src, k, nbytes, into=buf)
                try:
                    msg.deliver(buf)
                except Exception as e:  # this rank's own failure: keep draining, raise it after
                    self.out.error = e
        except RuntimeError as e:  # the pair failed: dead peer, or a timed-out wait
            self.lose(src, e)


_OWN: dict[tuple[int, ...], tuple[object, Watch]] = {}
"""``members -> (default group, watch)``: the watches of exchanges outside a guarded call, one per member set
(each holds one store connection, kept)."""


@contextlib.contextmanager
def exchange_link(members: list[int], ranks: list[int] | None) -> Iterator[tuple[Watch, dist.ProcessGroup | None]]:
    """The watch whose gates an exchange among the load's ``members`` passes, and the group its transfers
    take: the call's own watch and checkpoint group under ``ucp_dcp.load`` (one watch, one sequence of
    gates); else -- ``dcp.load`` with ucp_dcp's reader on the caller's group -- a watch of its own for this
    read (it ends with the read) and the point-to-point group over ``ranks``."""
    w = current()
    if w is not None and w.group is not None and sorted(w.members) == sorted(members):
        yield w, w.group
        return
    key = tuple(sorted(members))
    hit = _OWN.get(key)
    if hit is None or hit[0] is not default_group():
        name = "read-once-" + hashlib.sha1(str(key).encode()).hexdigest()[:12]
        limit = group_timeout(default_group())
        me = key.index(dist.get_rank())
        hit = _OWN[key] = (default_group(), Watch(name, list(key), me, limit.total_seconds() if limit else 1800.0))
    with hit[1].running("load"):
        yield hit[1], p2p_group(ranks)


def exchange(
    sends: Mapping[int, Sequence[Payload]],
    recvs: dict[int, list[Incoming]],
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    watch: Watch,
    timeout: float,
    meanwhile: Callable[[], None] | None = None,
) -> Outcome:
    """Send every ``sends[dst]`` message and receive every ``recvs[src]`` message (global ranks, on
    ``group``; None: the default group), delivering each as it arrives. With ``error`` (this rank
    failed before the exchange) every send carries that error instead of data; a lazy payload that
    fails carries its error, and so does every later one. ``meanwhile`` runs once the sends are
    posted, before the receives; its failure (or a lazy payload's) is :attr:`Outcome.error`."""
    ex = _Exchange(group, timeout)
    cause = torch.frombuffer(bytearray(wire_error(error).encode()), dtype=torch.uint8) if error is not None else None
    # every rank is here (its own reads done, or failed: then it sends its error) before anything is posted
    watch.gate("load: read-once exchange")
    posted: dict[int, list[dist.Work | None]] = {}
    keep: list[torch.Tensor] = []
    for dst in sorted(sends):
        try:
            for k, data in enumerate(sends[dst]):
                if cause is None and callable(data):
                    try:
                        data = data()
                    except Exception as e:  # sent in place of this message and the rest
                        ex.out.error = e
                        cause = torch.frombuffer(bytearray(wire_error(e).encode()), dtype=torch.uint8)
                payload = cause if cause is not None else data
                assert payload is None or isinstance(payload, torch.Tensor)
                n = payload.numel() if payload is not None else 0
                header = torch.tensor([1 if cause is not None else 0, n], dtype=torch.int64)
                keep.append(header)
                posted.setdefault(dst, []).append(dist.isend(header, dst, group=group, tag=2 * k))
                if payload is not None and n:
                    keep.append(payload)
                    posted[dst].append(dist.isend(payload, dst, group=group, tag=2 * k + 1))
        except RuntimeError as e:  # the pair is already closed: the consumer died
            ex.lose(dst, e)
    if meanwhile is not None and ex.out.error is None:
        try:
            meanwhile()
        except Exception as e:  # raised after the exchange; what arrives is drained, not delivered
            ex.out.error = e
    for src in sorted(recvs):
        ex.take(src, recvs[src])
    # every consumer has taken its messages before a sender waits on its sends (a rank still reading its
    # own fragments, the memory tier's ``meanwhile``, is waited for here, at the gate, not by gloo)
    watch.gate("load: read-once exchange, received", error=ex.failure)
    for dst in sorted(posted):
        try:
            for w in posted[dst]:
                ex.wait(w)
        except RuntimeError as e:  # a consumer that took everything: its pair failed after; name it
            ex.out.peers.append(peer_lost(dst, _short(e)))
    return ex.out


def size_error(bad: tuple[int, int, int]) -> UCPError:
    src, got, expect = bad
    return UCPError(
        f"rank {src} sent {got} bytes of shared checkpoint data, expected {expect}",
        hint="the ranks disagree on the load plan; this is a bug, please report it",
    )


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "]" in text and text.startswith("["):  # gloo's "[file:line] message"
        text = text.split("]", 1)[1].strip()
    return text[:160]
