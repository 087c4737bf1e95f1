"""Completing a memory generation in the background: its commit on every host, every host's pieces
copied to ``k`` other hosts, then the completion marker.

Runs on the tier's own groups (never the training group, so it overlaps training collectives safely:
a control group for the small collectives, gloo for the files) and in the same order on every rank.
Each step fails as a whole: a rank that fails (a file it cannot read, a replica whose bytes arrive
damaged, a full ``/dev/shm``) still makes every planned transfer, and the ranks then agree on the
outcome, so every rank skips the marker, naming the failed rank; the generation stays incomplete and
is never loaded; the previous complete generation is kept until a newer one is complete. A peer that
dies or freezes ends every rank's step with a ``PeerLostError`` within the peer timeout.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import xxhash

from ..errors import CorruptCheckpointError, PeerFailedError, PeerLostError, UCPError, peer_class
from ..planning.collectives import peer_timeout
from ..storage.commit import commit
from ..storage.sidecar import decode_sidecar, metadata_hash, sidecar_name
from .hosts import HostMap, replica_hosts
from .marker import Marker, file_hash, write_marker
from .store import gen_dir, generations, read_commit, remove_generation

__all__ = ["Generation", "Watch", "agree", "publish_commit", "replicate", "mark_complete", "writer_rank"]


@dataclass
class Generation:
    """One memory save, as the background steps see it."""

    gen: int
    """Generation number."""
    root: str
    """The memory tier's root."""
    hosts: HostMap
    """The saving job's ranks and hosts."""
    replicas: int
    """k: copies of each piece on other hosts."""
    step: int | None = None
    """The caller's training step, recorded in the marker."""
    drain: bool = True
    """Drain it to the durable target when its turn comes (the manager says no for a step it saved durably)."""
    md: bytes = b""
    """The committed ``.metadata`` (after :func:`publish_commit`)."""
    sidecar: bytes = b""
    """Its integrity sidecar."""
    files: dict[str, int] = field(default_factory=dict)
    """Every data file of the generation and its size (from the sidecar)."""
    hashes: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Every data file: (size, XXH3-128), known after :func:`replicate`."""

    def folder(self, host: str) -> str:
        return gen_dir(self.root, host, self.gen)


def writer_rank(name: str, hosts: HostMap) -> int:
    """Global rank that wrote a data file (``__<plan index>_...``: the index is the rank's place in the group)."""
    return hosts.ranks[int(name[2:].split("_", 1)[0])]


Watch = Callable[[int, str], PeerLostError]
"""``watch(rank, why)``: the error for a transfer with ``rank`` that failed or timed out; raised, it is this
rank's failure at the next gate of the background's watch (:mod:`ucp_dcp.planning.checkpoint_group`)."""


def agree(group: dist.ProcessGroup, g: Generation, step: str, error: BaseException | None) -> None:
    """Collective: every rank says whether its part of ``step`` succeeded; all raise when one did not,
    this rank its own error, the others a :class:`~ucp_dcp.errors.UCPError` naming the rank and cause."""
    got: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(r, why) for r, why in zip(g.hosts.ranks, got) if why is not None]
    if failed:
        r, why = failed[0]
        raise UCPError(f"memory generation {g.gen}: rank {r} failed during the {step}: {why}")


def publish_commit(g: Generation, group: dist.ProcessGroup) -> None:
    """The coordinator's ``.metadata`` and sidecar to every rank; each host's leader commits them into
    its own folder (the same atomic rename as on disk). A failure on any rank ends every rank's step."""
    me = dist.get_rank()
    box: list = [None]
    error: BaseException | None = None
    if me == g.hosts.ranks[0]:
        got = read_commit(g.folder(g.hosts.host_of(me)))
        if got is None:
            error = UCPError(f"memory generation {g.gen}: the save reported success but left no commit")
        box = [got if got is not None else f"rank {me}: {error}"]
    dist.broadcast_object_list(box, src=g.hosts.ranks[0], group=group)
    if error is not None:
        raise error
    if isinstance(box[0], str):
        raise UCPError(f"memory generation {g.gen}: the coordinator could not publish the commit ({box[0]})")
    g.md, g.sidecar = box[0]
    try:
        body = decode_sidecar(g.sidecar, sidecar_name(metadata_hash(g.md)))
        g.files = {str(k): int(v) for k, v in body["files"].items()}
        host = g.hosts.host_of(me)
        if me == g.hosts.leader(host) and me != g.hosts.ranks[0]:
            os.makedirs(g.folder(host), exist_ok=True)
            commit(g.folder(host), g.md, g.sidecar, set(g.files), sync=False)
    except Exception as e:  # noqa: BLE001 (agreed below: every rank ends the step)
        error = e
    agree(group, g, "publish of the commit", error)


class PeerCausedError(UCPError):
    """This rank's replication failed because a peer's did (a file its writer could not read)."""


@peer_class  # beside its cause: ucp_dcp.errors, the lowest layer, cannot import this module
class PeerPeerCausedError(PeerFailedError, PeerCausedError):
    """Another rank's :class:`PeerCausedError` (still derived from a peer's failure: ``mark_complete``)."""


def _send_plan(g: Generation) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """This rank's ``(dst, file)`` sends and ``(src, file)`` receives, in the order both sides use."""
    me = dist.get_rank()
    ring = replica_hosts(g.hosts.names, g.replicas)
    sends, recvs = [], []
    for name in sorted(g.files):
        w = writer_rank(name, g.hosts)
        for host in ring[g.hosts.host_of(w)]:
            dst = g.hosts.replica_rank(w, host)
            if w == me:
                sends.append((dst, name))
            if dst == me:
                recvs.append((w, name))
    return sorted(sends), sorted(recvs)


def _read_file(path: str, size: int) -> torch.Tensor:
    """A data file's bytes, to send (tests make one rank's read fail here)."""
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


def replicate(g: Generation, group: dist.ProcessGroup, watch: Watch | None = None) -> dict[str, tuple[int, str]]:
    """Copy this rank's data files to their replica hosts and take the files other ranks send here;
    every replica is checked against its writer's XXH3-128 before it is renamed into place. Returns
    this rank's own files' ``(size, hash)``.

    Every planned transfer happens whatever fails on either side, so no peer is left waiting: a file
    its writer cannot read goes as a header saying so (size -1), a received file that cannot be
    written is taken and dropped; the failure is raised at the end. Every wait is bounded by ``watch``
    (a peer that died or froze ends it with a ``PeerLostError``)."""
    me = dist.get_rank()
    here = g.folder(g.hosts.host_of(me))
    sends, recvs = _send_plan(g)
    own: dict[str, tuple[int, str]] = {}
    failure: list[BaseException] = []

    def send_all() -> None:  # one file in flight per direction: memory stays bounded by a file
        counts: dict[int, int] = {}
        try:
            for dst, name in sends:
                k = counts.get(dst, 0)
                counts[dst] = k + 1
                data, header = None, torch.tensor([-1, 0, 0], dtype=torch.int64)
                try:  # hashed just before it is sent: a receiver's wait spans one file's read
                    size = g.files[name]
                    if name not in own:
                        own[name] = (size, file_hash(os.path.join(here, name)))
                    data = _read_file(os.path.join(here, name), size) if size else None
                    header = torch.tensor([size, *_halves(own[name][1])], dtype=torch.int64)
                except Exception as e:  # noqa: BLE001 (its receiver is told; raised after)
                    failure.append(e)
                _wait(dist.isend(header, dst, group=group, tag=2 * k), dst, watch)
                if data is not None:
                    _wait(dist.isend(data, dst, group=group, tag=2 * k + 1), dst, watch)
        except BaseException as e:  # noqa: BLE001 (surfaced on the calling thread)
            failure.append(e)

    sender = threading.Thread(target=send_all, name="ucp-memory-send", daemon=True)
    sender.start()
    counts: dict[int, int] = {}
    bad: list[str] = []
    unread: list[str] = []
    try:
        for src, name in recvs:
            k = counts.get(src, 0)
            counts[src] = k + 1
            header, buf = _recv_file(g, src, name, k, group, watch)
            size = int(header[0])
            if size < 0:
                unread.append(f"{name} (rank {src} could not read it)")
                continue
            got = xxhash.xxh3_128_hexdigest(buf.numpy().data) if size else xxhash.xxh3_128_hexdigest(b"")
            if size != g.files[name] or _halves(got) != [int(header[1]), int(header[2])]:
                bad.append(name)  # matched anyway, so the sender is not left waiting
                continue
            try:
                tmp = os.path.join(here, f".{name}.{secrets.token_hex(4)}.tmp")
                with open(tmp, "wb") as f:
                    f.write(buf.numpy().tobytes())
                os.replace(tmp, os.path.join(here, name))
            except OSError as e:  # a full /dev/shm: the next transfers are still taken
                failure.append(e)
    finally:
        sender.join()
    for name in sorted(g.files) if not failure else []:  # own files no replica host takes (k = 0): for the marker
        if writer_rank(name, g.hosts) == me and name not in own:
            own[name] = (g.files[name], file_hash(os.path.join(here, name)))
    if failure:
        raise failure[0]
    if unread:
        raise PeerCausedError(f"memory generation {g.gen}: {len(unread)} replica(s) not sent: {', '.join(unread[:3])}")
    if bad:
        raise CorruptCheckpointError(
            f"memory generation {g.gen}: {len(bad)} replica(s) arrived damaged ({', '.join(bad[:3])}): their bytes "
            "do not hash to what their writer sent",
            saved=bad,
            hint="the generation stays incomplete (never loaded); the previous complete one is kept",
        )
    return own


def _recv_file(
    g: Generation, src: int, name: str, k: int, group: dist.ProcessGroup, watch: Watch | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k``-th file ``src`` sends this rank: its header ``(size, hash halves)`` and its bytes, as they
    arrived (unchecked; tests damage them here, as a faulty link would)."""
    header = torch.empty(3, dtype=torch.int64)
    _wait(dist.irecv(header, src, group=group, tag=2 * k), src, watch)
    buf = torch.empty(max(0, int(header[0])), dtype=torch.uint8)
    if buf.numel():
        _wait(dist.irecv(buf, src, group=group, tag=2 * k + 1), src, watch)
    return header, buf


def _wait(work: dist.Work | None, peer: int, watch: Watch | None) -> None:
    """Until ``work`` completes; with ``watch``, at most the peer timeout (a wait spans one file's hash,
    read and transfer on the peer: far less), then ``peer`` is lost for every member."""
    if work is None:  # only for a rank outside the group, which the plan never addresses
        return
    if watch is None:
        work.wait()
        return
    try:
        work.wait(timeout=timedelta(seconds=peer_timeout()))
    except Exception as e:  # gloo closes the pair on a timeout: the other side fails at once too
        raise watch(peer, f"a replica transfer with it failed or took over {peer_timeout():.0f} s ({e})") from e


def _halves(hexdigest: str) -> list[int]:
    """A 128-bit hex digest as two signed int64 (gloo carries int64 headers)."""
    v = int(hexdigest, 16)
    return [int.from_bytes(((v >> s) & (2**64 - 1)).to_bytes(8, "little"), "little", signed=True) for s in (64, 0)]


def mark_complete(
    g: Generation, group: dist.ProcessGroup, error: BaseException | None, own: dict[str, tuple[int, str]]
) -> bool:
    """Every rank says whether its replication succeeded; only if all did, each host's leader writes the
    completion marker, and, once every marker is written, older generations on its host are dropped.
    Returns whether it is complete; raises (on every rank) the first rank's failure."""
    got: list = [None] * dist.get_world_size(group)
    why = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(got, (why, own, isinstance(error, PeerCausedError)), group=group)
    causes = [(r, why) for r, (why, _, derived) in zip(g.hosts.ranks, got) if why is not None and not derived]
    if error is not None and (not isinstance(error, PeerCausedError) or not causes):
        raise error
    if causes:  # this rank's failure (if any) came from a peer's: name the peer and its cause
        raise UCPError(f"memory generation {g.gen}: rank {causes[0][0]}'s replication failed: {causes[0][1]}")
    if error is not None:
        raise error
    for _, files, _ in got:
        g.hashes.update(files)
    ring = replica_hosts(g.hosts.names, g.replicas)
    holders = {n: [g.hosts.host_of(writer_rank(n, g.hosts))] for n in g.files}
    for hs in holders.values():
        hs.extend(ring[hs[0]])
    marker = Marker(g.gen, metadata_hash(g.md), dict(g.hashes), holders, len(next(iter(ring.values()), [])), g.step)
    me = dist.get_rank()
    host = g.hosts.host_of(me)
    wrote: BaseException | None = None
    if me == g.hosts.leader(host):
        try:
            write_marker(g.folder(host), marker)
        except Exception as e:  # noqa: BLE001 (agreed below)
            wrote = e
    agree(group, g, "completion marker", wrote)  # every marker is written before any host drops its older generations
    if me == g.hosts.leader(host):
        for old in generations(g.root, host):
            if old < g.gen:
                remove_generation(g.root, host, old)
    return True
