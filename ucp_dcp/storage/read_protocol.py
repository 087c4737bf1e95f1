"""``UCPFileSystemReader.read_data``: every step inside one failure protocol.

Whatever fails on a rank -- building the read job, its own reads, packing what it sends, working
out where received bytes go, the side group -- the rank still takes part in the exchange: it sends
its error to every rank waiting for bytes from it, and receives (into scratch memory) every message
meant for it. Then it raises its own error; a rank that failed only because another did raises
that rank's error (:class:`~ucp_dcp.errors.PeerFailedError`: the rank and the cause in one
line, an instance of the cause's class). A rank that died or froze is named by the gates of the call's watch
(:mod:`ucp_dcp.planning.watch`), not by a collective timing out.

Each of :data:`STEPS` is a fault point (:mod:`ucp_dcp.planning.faults`): a test's hook can make a rank fail
there (``make chaos`` raises, kills or stops one rank at each).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ..planning import faults
from ..planning.collectives import peer_timeout
from ..planning.faults import FaultInjected, fault_point
from ..planning.payloads import TransportPlan
from .exchange import Outcome, drain_only, exchange, exchange_link, size_error
from .read_job import ReadJob
from .staging import BUFFERS_PER_THREAD
from .transport import Incoming, as_bytes_tensor

__all__ = ["STEPS", "FaultInjected", "read_data", "fault_point"]

STEPS = ("job", "read", "pack", "incoming", "group", "deliver")
"""The steps of ``read_data`` a fault can be injected at (in order)."""


def read_data(reader: Any, plan: LoadPlan, planner: LoadPlanner) -> None:
    """Read this rank's items, exchange the shared ones, raise the true cause of any failure.
    ``reader``: the :class:`~ucp_dcp.storage.reader.UCPFileSystemReader` (not imported: it imports this)."""
    t0 = time.perf_counter()
    transport = plan.storage_data if isinstance(plan.storage_data, TransportPlan) else TransportPlan()
    stats = reader.stats
    error: BaseException | None = None
    job: ReadJob | None = None
    try:
        recv_items = {int(i) for msgs in transport.recv.values() for pieces in msgs for i in pieces}
        send_items = {int(i) for pieces, _ in transport.send for i in pieces}
        fault_point("job")
        job = ReadJob(
            plan,
            planner,
            send_items,
            chunk_meta=reader._chunk_meta,
            storage_data=reader.storage_data,
            forced=reader._forced,
            stage_bytes=reader.stage_bytes,
            buffers=BUFFERS_PER_THREAD * max(1, reader.thread_count),
            transforms=getattr(reader, "transforms", None),
            stats=stats,
        )
        fault_point("read")
        reader._read_local(job, recv_items)
    except Exception as e:  # checksum, missing file, I/O, ...: the consumers are told below
        error = e
    sends: dict[int, list[torch.Tensor | None]] = {}
    for _, dsts in transport.send:  # every message is sent, with data or with this rank's error
        for dst in dsts.tolist():
            sends.setdefault(dst, []).append(None)
    try:
        fault_point("pack")
        at = dict.fromkeys(sends, 0)
        kept = job.keep if error is None and job is not None else {}
        for pieces, dsts in transport.send if error is None else ():
            payload = as_bytes_tensor([kept[int(i)] for i in pieces])  # shared by its consumers
            for dst in dsts.tolist():
                sends[dst][at[dst]] = payload
                at[dst] += 1
    except Exception as e:  # kept, not raised: this rank still drains its peers' messages, then raises it
        error = error or e
    incoming = _incoming(job, transport, error)
    if isinstance(incoming, BaseException):
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
    if error is not None or out.error is not None:
        raise error or out.error  # type: ignore[misc]
    if out.peers:
        raise out.peers[0]
    if out.bad_size:
        raise size_error(out.bad_size)


def _incoming(
    job: ReadJob | None, transport: TransportPlan, error: BaseException | None
) -> dict[int, list[Incoming]] | BaseException:
    """Where each expected message goes; scratch only when this rank already failed."""
    if job is None or error is not None:
        return {src: [drain_only() for _ in msgs] for src, msgs in transport.recv.items()}
    try:
        fault_point("incoming")
        return {src: [job.incoming(p.tolist()) for p in msgs] for src, msgs in transport.recv.items()}
    except Exception as e:  # handed back: the caller drains the messages into scratch, then raises it
        return e


def _faulty(msg: Incoming) -> Incoming:
    def deliver(buf: torch.Tensor) -> None:
        fault_point("deliver")
        msg.deliver(buf)

    return Incoming(msg.nbytes, msg.buffer, deliver)
