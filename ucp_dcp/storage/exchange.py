"""The read-once exchange with failures: every message posted is matched, every wait is bounded.

Each bundle is one point-to-point message per consumer: an int64 header ``(status, nbytes)``,
then ``nbytes`` of payload, tagged by its position among the pair's messages. A sender that
failed sends ``status = 1`` and, as payload, its error (:func:`ucp_dcp.storage.peer_wire.wire`), so the
consumer raises the true cause, naming the sender. A consumer that fails while taking a message
(e.g. a dtype conversion that would overflow) keeps receiving the rest into scratch memory, so
no sender is left blocked, and raises its own error afterwards.

Waits: a consumer posts its receives from ``src`` once ``src`` announced (in the store) that it is
sending, and a sender waits for its sends once the consumer announced its receives are over; both
ask :class:`~ucp_dcp.storage.liveness.Liveness` while waiting, so a slow rank is waited for and a
dead one is named. The transfer itself is bounded by the peer timeout (gloo closes the pair on a
timeout, so the other side fails at once too).

Pipelining: a payload may be a function that reads it when its turn comes (the memory tier's
servers read message ``k + 1`` while ``k`` is on the wire), and ``meanwhile`` runs after every send
is posted and before the receives (a rank's own reads, overlapping its transfers). A lazily read
message is announced before it is read, so its consumer's wait includes one message's read: far
below the peer timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import PeerFailedError, PeerLostError, UCPError
from .liveness import Liveness
from .peer_wire import from_wire, wire
from .transport import Incoming

__all__ = ["Outcome", "Payload", "exchange", "drain_only"]

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
    def __init__(self, group: dist.ProcessGroup | None, live: Liveness, timeout: float) -> None:
        self.group = group
        self.live = live
        self.timeout = timedelta(seconds=timeout)
        self.out = Outcome()
        self.gone: set[int] = set()

    def lose(self, r: int, exc: BaseException) -> None:
        """Rank ``r``'s pair failed (its process died, or a wait timed out): skip what is left with it."""
        if r in self.gone:
            return
        self.gone.add(r)
        if not any(p.rank == r for p in self.out.peers):
            err = exc if isinstance(exc, PeerLostError) else self.live.lost(r, _short(exc))
            self.out.peers.append(err)

    def wait(self, work: dist.Work | None) -> None:
        # bounded only when the store says the other side is there (else a slow reader would time out)
        if work is None:  # not a member of the group: nothing was posted
            return
        if self.live.active:
            work.wait(timeout=self.timeout)
        else:
            work.wait()

    def recv(self, src: int, k: int, nbytes: int, into: torch.Tensor | None = None) -> torch.Tensor:
        buf = into if into is not None else torch.empty(nbytes, dtype=torch.uint8)
        self.wait(dist.irecv(buf, src, group=self.group, tag=2 * k + 1))
        return buf

    def take(self, src: int, msgs: list[Incoming]) -> None:
        """Receive every message of ``src``, in order."""
        try:
            self.live.wait_for("ready", [src])
        except PeerLostError as e:
            self.lose(src, e)
            return
        try:
            for k, msg in enumerate(msgs):
                header = torch.empty(2, dtype=torch.int64)
                self.wait(dist.irecv(header, src, group=self.group, tag=2 * k))
                status, nbytes = (int(x) for x in header)
                if status != 0:
                    cause = self.recv(src, k, nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
                    if not any(p.rank == src for p in self.out.peers):
                        self.out.peers.append(from_wire(src, cause.numpy().tobytes()))
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


def exchange(
    sends: Mapping[int, Sequence[Payload]],
    recvs: dict[int, list[Incoming]],
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    live: Liveness,
    timeout: float,
    meanwhile: Callable[[], None] | None = None,
) -> Outcome:
    """Send every ``sends[dst]`` message and receive every ``recvs[src]`` message (global ranks, on
    ``group``; None: the default group), delivering each as it arrives. With ``error`` (this rank
    failed before the exchange) every send carries that error instead of data; a lazy payload that
    fails carries its error, and so does every later one. ``meanwhile`` runs once the sends are
    posted, before the receives; its failure (or a lazy payload's) is :attr:`Outcome.error`."""
    ex = _Exchange(group, live, timeout)
    cause = torch.frombuffer(bytearray(wire(error)), dtype=torch.uint8) if error is not None else None
    live.announce("ready")
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
                        cause = torch.frombuffer(bytearray(wire(e)), dtype=torch.uint8)
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
    live.announce("received")
    for dst in sorted(posted):
        if dst in ex.gone:
            continue
        try:
            live.wait_for("received", [dst])
            for w in posted[dst]:
                ex.wait(w)
        except (RuntimeError, PeerLostError) as e:
            ex.lose(dst, e)
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
