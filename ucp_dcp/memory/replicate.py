"""Completing a memory generation in the background: its commit on every host, every host's pieces
copied to ``k`` other hosts, then the completion marker.

Runs on the tier's own gloo group (never the training group, so it overlaps training collectives
safely) and in the same order on every rank. Each step fails as a whole: a rank that fails (a replica
whose bytes arrive damaged, a full ``/dev/shm``) makes every rank skip the marker, so the generation
stays incomplete and is never loaded; the previous complete generation is kept until a newer one is
complete.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import xxhash

from ..errors import CorruptCheckpointError, UCPError
from ..storage.commit import commit
from ..storage.sidecar import decode_sidecar, metadata_hash, sidecar_name
from .hosts import HostMap, replica_hosts
from .marker import Marker, file_hash, write_marker
from .store import gen_dir, generations, read_commit, remove_generation

__all__ = ["Generation", "publish_commit", "replicate", "mark_complete", "writer_rank"]


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


def publish_commit(g: Generation, group: dist.ProcessGroup) -> None:
    """The coordinator's ``.metadata`` and sidecar to every rank; each host's leader commits them into
    its own folder (the same atomic rename as on disk)."""
    me = dist.get_rank()
    box: list = [None]
    if me == g.hosts.ranks[0]:
        got = read_commit(g.folder(g.hosts.host_of(me)))
        if got is None:
            raise UCPError(f"memory generation {g.gen}: the save reported success but left no commit")
        box = [got]
    dist.broadcast_object_list(box, src=g.hosts.ranks[0], group=group)
    g.md, g.sidecar = box[0]
    body = decode_sidecar(g.sidecar, sidecar_name(metadata_hash(g.md)))
    g.files = {str(k): int(v) for k, v in body["files"].items()}
    host = g.hosts.host_of(me)
    if me == g.hosts.leader(host) and me != g.hosts.ranks[0]:
        os.makedirs(g.folder(host), exist_ok=True)
        commit(g.folder(host), g.md, g.sidecar, set(g.files), sync=False)


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


def replicate(g: Generation, group: dist.ProcessGroup) -> dict[str, tuple[int, str]]:
    """Copy this rank's data files to their replica hosts and take the files other ranks send here;
    every replica is checked against its writer's XXH3-128 before it is renamed into place. Returns
    this rank's own files' ``(size, hash)``."""
    me = dist.get_rank()
    here = g.folder(g.hosts.host_of(me))
    sends, recvs = _send_plan(g)
    own = {n: (g.files[n], file_hash(os.path.join(here, n))) for n in sorted(g.files) if writer_rank(n, g.hosts) == me}
    failure: list[BaseException] = []

    def send_all() -> None:  # one file in flight per direction: memory stays bounded by a file
        counts: dict[int, int] = {}
        try:
            for dst, name in sends:
                k = counts.get(dst, 0)
                counts[dst] = k + 1
                size, digest = own[name]
                header = torch.tensor([size, *_halves(digest)], dtype=torch.int64)
                _wait(dist.isend(header, dst, group=group, tag=2 * k))
                if size:
                    data = torch.from_file(os.path.join(here, name), shared=False, size=size, dtype=torch.uint8)
                    _wait(dist.isend(data, dst, group=group, tag=2 * k + 1))
        except BaseException as e:  # noqa: BLE001 (surfaced on the calling thread)
            failure.append(e)

    sender = threading.Thread(target=send_all, name="ucp-memory-send", daemon=True)
    sender.start()
    counts: dict[int, int] = {}
    bad: list[str] = []
    for src, name in recvs:
        k = counts.get(src, 0)
        counts[src] = k + 1
        header, buf = _recv_file(g, src, name, k, group)
        size = int(header[0])
        got = xxhash.xxh3_128_hexdigest(buf.numpy().data) if size else xxhash.xxh3_128_hexdigest(b"")
        if size != g.files[name] or _halves(got) != [int(header[1]), int(header[2])]:
            bad.append(name)  # matched anyway, so the sender is not left waiting
            continue
        tmp = os.path.join(here, f".{name}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "wb") as f:
            f.write(buf.numpy().tobytes())
        os.replace(tmp, os.path.join(here, name))
    sender.join()
    if failure:
        raise failure[0]
    if bad:
        raise CorruptCheckpointError(
            f"memory generation {g.gen}: {len(bad)} replica(s) arrived damaged ({', '.join(bad[:3])}): their bytes "
            "do not hash to what their writer sent",
            saved=bad,
            hint="the generation stays incomplete (never loaded); the previous complete one is kept",
        )
    return own


def _recv_file(
    g: Generation, src: int, name: str, k: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k``-th file ``src`` sends this rank: its header ``(size, hash halves)`` and its bytes, as they
    arrived (unchecked; tests damage them here, as a faulty link would)."""
    header = torch.empty(3, dtype=torch.int64)
    _wait(dist.irecv(header, src, group=group, tag=2 * k))
    buf = torch.empty(int(header[0]), dtype=torch.uint8)
    if buf.numel():
        _wait(dist.irecv(buf, src, group=group, tag=2 * k + 1))
    return header, buf


def _wait(work: dist.Work | None) -> None:
    if work is not None:  # None only for a rank outside the group, which the plan never addresses
        work.wait()


def _halves(hexdigest: str) -> list[int]:
    """A 128-bit hex digest as two signed int64 (gloo carries int64 headers)."""
    v = int(hexdigest, 16)
    return [int.from_bytes(((v >> s) & (2**64 - 1)).to_bytes(8, "little"), "little", signed=True) for s in (64, 0)]


def mark_complete(g: Generation, group: dist.ProcessGroup, ok: bool, own: dict[str, tuple[int, str]]) -> bool:
    """Every rank says whether its replication succeeded; only if all did, each host's leader writes the
    completion marker, and older generations on its host are dropped. Returns whether it is complete."""
    got: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, (ok, own), group=group)
    if not all(o for o, _ in got):
        return False
    for _, files in got:
        g.hashes.update(files)
    ring = replica_hosts(g.hosts.names, g.replicas)
    holders = {n: [g.hosts.host_of(writer_rank(n, g.hosts))] for n in g.files}
    for hs in holders.values():
        hs.extend(ring[hs[0]])
    marker = Marker(g.gen, metadata_hash(g.md), dict(g.hashes), holders, len(next(iter(ring.values()), [])), g.step)
    me = dist.get_rank()
    host = g.hosts.host_of(me)
    if me == g.hosts.leader(host):
        write_marker(g.folder(host), marker)
    dist.barrier(group=group)  # every marker is written before any host drops its older generations
    if me == g.hosts.leader(host):
        for old in generations(g.root, host):
            if old < g.gen:
                remove_generation(g.root, host, old)
    return True
