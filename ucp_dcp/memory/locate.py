"""Finding the freshest complete checkpoint a restarted job can load: a memory generation every piece
of which some surviving host holds intact, or else the durable copy.

Before a load every host's leader checks what its host holds (:func:`inspect_host`: commit, marker,
and each data file's size against the marker, so a missing or cut replica is found here; with
``verify``, each file's XXH3-128 too, as :func:`ucp_dcp.memory.load` asks after a copy was found
damaged during a load), the ranks gather that, and every rank makes the same choice (:func:`choose`).
Nothing incomplete is ever chosen: a generation without a valid marker, or with a piece no surviving
host holds, is passed over, with the reason kept in :attr:`Source.notes`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UCPError
from ..storage.sidecar import metadata_hash
from .drain import durable_dir, durable_generations
from .hosts import HostMap, gather_hosts
from .marker import file_hash, read_marker
from .store import HostHolding, data_files, gen_dir, generations, host_name, read_commit

__all__ = ["Tier", "Source", "inspect_host", "choose", "locate"]

Tier = Literal["memory", "durable"]


@dataclass
class Source:
    """Where a load reads from."""

    tier: Tier
    """``memory``: the hosts' memory stores; ``durable``: the drained folder."""
    generation: int
    """The generation loaded."""
    path: str | None = None
    """The durable checkpoint folder (tier ``durable``)."""
    holders: dict[str, list[str]] = field(default_factory=dict)
    """Tier ``memory``: every data file -> the hosts holding an intact copy."""
    notes: list[str] = field(default_factory=list)
    """Fresher generations passed over, and why; copies found damaged."""
    md: bytes = b""
    """Tier ``memory``: the generation's ``.metadata``."""
    sidecar: bytes = b""
    """Tier ``memory``: its integrity sidecar."""
    hosts: HostMap | None = None
    """The loading job's ranks and hosts."""
    stats: Any = None
    """After :func:`ucp_dcp.memory.load`: this rank's reader ``ReadStats``."""
    step: int | None = None
    """Tier ``memory``: the training step the generation was saved at, when its saver said."""

    def serving(self) -> dict[int, str]:
        """Per loading rank, which tier serves it and from where."""
        assert self.hosts is not None
        out = {}
        for r, h in zip(self.hosts.ranks, self.hosts.hosts):
            if self.tier == "durable":
                out[r] = f"durable {self.path}"
                continue
            here = sum(h in hs for hs in self.holders.values())
            out[r] = (
                f"memory gen {self.generation}: {here} of {len(self.holders)} file(s) on its host ({h}), "
                "the rest served by peers holding them"
            )
        return out

    def describe(self) -> str:
        head = (
            f"memory generation {self.generation}"
            if self.tier == "memory"
            else f"durable generation {self.generation} ({self.path})"
        )
        return "\n".join([f"loading {head}", *(f"  passed over: {n}" for n in self.notes)])


def inspect_host(root: str, host: str, verify: bool = False) -> list[HostHolding]:
    """What ``host`` holds of every generation in its store (``verify``: hash every data file)."""
    out = []
    for gen in generations(root, host):
        folder = gen_dir(root, host, gen)
        h = HostHolding(host, gen)
        out.append(h)
        got = read_commit(folder)
        if got is None:
            h.problem = "not committed (the save died during the host copy)"
            continue
        h.metadata_hash = metadata_hash(got[0])
        try:
            marker = read_marker(folder)
        except CorruptCheckpointError as e:
            h.problem = e.message
            continue
        if marker is None:
            h.problem = "no completion marker (replication did not finish)"
            continue
        if marker.metadata_hash != h.metadata_hash or marker.generation != gen:
            h.problem = "its completion marker belongs to another commit"
            continue
        h.complete = True
        h.step = marker.step
        h.wanted = {n: s for n, (s, _) in marker.files.items()}
        for name, size in data_files(folder).items():
            want = marker.files.get(name)
            if want is None:
                continue  # a stray (a replica of an earlier, failed attempt): never read
            if size != want[0]:
                h.bad[name] = f"{size} bytes, the marker says {want[0]}"
            elif verify and file_hash(os.path.join(folder, name)) != want[1]:
                h.bad[name] = "its bytes do not hash to the marker's XXH3-128"
            else:
                h.files[name] = size
    return out


def choose(holdings: list[HostHolding], durable: list[int]) -> tuple[Tier, int, dict[str, list[str]], list[str]]:
    """The freshest loadable generation: ``(tier, generation, holders, notes)``. A memory generation
    needs a valid marker on some host and every file of it intact on some host; the durable copy is
    taken when it is fresher. Raises :class:`CheckpointNotFoundError` when there is neither."""
    notes: list[str] = []
    for h in holdings:
        for name, why in sorted(h.bad.items()):
            notes.append(f"gen {h.gen}: host {h.host}'s copy of {name} is damaged ({why}); not used")
    chosen: tuple[int, dict[str, list[str]]] | None = None
    for gen in sorted({h.gen for h in holdings}, reverse=True):
        mine = [h for h in holdings if h.gen == gen]
        done = [h for h in mine if h.complete]
        if not done:
            problems = sorted({h.problem or "" for h in mine})
            notes.append(f"gen {gen} (memory): incomplete on every host that holds it: {'; '.join(problems)}")
            continue
        wanted = done[0].wanted
        holders: dict[str, list[str]] = {n: [] for n in wanted}
        for h in done:
            for n in h.files:
                if n in holders:
                    holders[n].append(h.host)
        lost = sorted(n for n, hs in holders.items() if not hs)
        if lost:
            notes.append(
                f"gen {gen} (memory): {len(lost)} of {len(wanted)} piece(s) on no surviving host intact "
                f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): more hosts lost than it has replicas"
            )
            continue
        chosen = (gen, holders)
        break
    fresh_durable = max(durable, default=None)
    if chosen is not None and (fresh_durable is None or chosen[0] >= fresh_durable):
        return "memory", chosen[0], chosen[1], notes
    if fresh_durable is not None:
        return "durable", fresh_durable, {}, notes
    raise CheckpointNotFoundError(
        "no complete checkpoint generation anywhere: nothing in host memory is complete and intact, and there is "
        "no durable copy" + ("".join(f"\n  {n}" for n in notes) if notes else " (the memory store is empty)"),
        wanted="a complete generation",
        hint="start from scratch, or from a checkpoint saved elsewhere; a generation counts only once every piece "
        "has its replicas (MemoryTier.wait() says whether the last one did)",
    )


def locate(root: str, durable: str | None, group: dist.ProcessGroup | None = None, verify: bool = False) -> Source:
    """Collective over ``group``: every host's holdings gathered, the freshest complete generation chosen,
    and, for the memory tier, its commit sent to every rank."""
    hosts = gather_hosts(group)
    me = dist.get_rank() if dist.is_initialized() else 0
    mine: list[HostHolding] = []
    disk: list[int] = []
    failed: BaseException | None = None
    try:  # a failure here is gathered, not raised before the collective: no peer is left waiting
        mine = inspect_host(root, host_name(), verify) if me == hosts.leader(hosts.host_of(me)) else []
        disk = durable_generations(durable) if me == hosts.ranks[0] else []
    except Exception as e:  # noqa: BLE001 (raised below, on every rank)
        failed = e
    why = None if failed is None else f"{type(failed).__name__}: {failed}"
    got: list = [(mine, disk, why)]
    if dist.is_initialized():
        got = [None] * len(hosts.ranks)
        dist.all_gather_object(got, (mine, disk, why), group=group)
    if failed is not None:
        raise failed
    for r, (_, _, why) in zip(hosts.ranks, got):
        if why is not None:
            raise UCPError(
                f"rank {r} could not inspect its host's memory store for the load: {why}",
                hint="fix that host's store (or remove it: its generations are then read from replicas) and restart",
            )
    holdings = [h for hs, _, _ in got for h in hs]
    tier, gen, holders, notes = choose(holdings, got[0][1])
    src = Source(tier, gen, holders=holders, notes=notes, hosts=hosts)
    src.step = next((h.step for h in holdings if h.gen == gen and h.complete), None) if tier == "memory" else None
    if tier == "durable":
        assert durable is not None
        src.path = durable_dir(durable, gen)
        return src
    # the commit, from the lowest rank leading a host that holds the generation complete
    server = min(hosts.leader(h.host) for h in holdings if h.gen == gen and h.complete)
    box: list = [read_commit(gen_dir(root, host_name(), gen)) if me == server else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=server, group=group)
    src.md, src.sidecar = box[0]
    return src
