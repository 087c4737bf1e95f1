"""Which ranks share a host, and which hosts keep the replicas of a host's pieces.

Replicas go around a ring of the job's hosts in name order: host ``i``'s pieces are copied to hosts
``i+1 .. i+k``. Each replica host is different from the writer's host and from the other replicas,
so with ``k`` replicas any ``k`` lost hosts leave at least one copy of every piece. A piece of rank
``r`` (the ``j``-th rank of its host) goes to the ``j mod n``-th rank of each replica host (``n`` its
ranks), so the replication traffic spreads over the ranks of both hosts.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import InvalidArgumentError
from .store import host_name

__all__ = ["HostMap", "gather_hosts", "replica_hosts"]


@dataclass(frozen=True)
class HostMap:
    """The hosts of a job's ranks."""

    ranks: list[int]
    """Global ranks of the job, in group order."""
    hosts: list[str]
    """``hosts[i]``: the host of ``ranks[i]``."""

    @property
    def names(self) -> list[str]:
        """The job's hosts, sorted."""
        return sorted(set(self.hosts))

    def ranks_of(self, host: str) -> list[int]:
        """Global ranks on ``host``, ascending."""
        return sorted(r for r, h in zip(self.ranks, self.hosts) if h == host)

    def host_of(self, rank: int) -> str:
        return self.hosts[self.ranks.index(rank)]

    def leader(self, host: str) -> int:
        """The rank that writes a host's shared files (its lowest)."""
        return self.ranks_of(host)[0]

    def replica_rank(self, writer: int, host: str) -> int:
        """The rank of ``host`` that receives ``writer``'s pieces."""
        local = self.ranks_of(self.host_of(writer)).index(writer)
        peers = self.ranks_of(host)
        return peers[local % len(peers)]


def gather_hosts(group: dist.ProcessGroup | None = None) -> HostMap:
    """Every rank's host (collective over ``group``)."""
    if not dist.is_initialized():
        return HostMap([0], [host_name()])
    n = dist.get_world_size(group)
    got: list = [None] * n
    dist.all_gather_object(got, (dist.get_rank(), host_name()), group=group)
    return HostMap([int(r) for r, _ in got], [str(h) for _, h in got])


def replica_hosts(hosts: list[str], k: int) -> dict[str, list[str]]:
    """For every host, the ``k`` hosts that keep copies of its pieces (the next ones on the ring of
    sorted host names). ``k`` larger than the other hosts is cut to them, with a warning."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise InvalidArgumentError(f"replicas must be an int >= 0, got {k!r}")
    ring = sorted(set(hosts))
    if k > len(ring) - 1:
        warnings.warn(
            f"memory tier: {k} replica(s) asked for, but the job has {len(ring)} host(s): each piece gets "
            f"{len(ring) - 1}, so losing {'a host' if len(ring) == 1 else f'{len(ring)} hosts'} loses the memory "
            "copy (the durable copy remains)",
            stacklevel=2,
        )
        k = len(ring) - 1
    return {h: [ring[(i + j) % len(ring)] for j in range(1, k + 1)] for i, h in enumerate(ring)}
