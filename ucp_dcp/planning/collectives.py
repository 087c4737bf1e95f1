"""Which process group carries our point-to-point messages, for every kind of default group.

Our exchanges (read-once pieces at load, ``Replicated(check="average")`` at save) are messages
between global ranks. Host bytes need a group with a CPU backend: the default group when it has
one (``gloo``, ``cpu:gloo,cuda:nccl``), else one gloo *side group* over the ranks involved,
created once and reused. Device tensors travel over NCCL when the default group has it.
``UCP_DCP_P2P=side`` forces the side group (so CPU tests run that path on gloo).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .. import settings
from .._compat import default_group, group_registered

__all__ = ["P2P_ENV", "PEER_TIMEOUT_ENV", "peer_timeout", "carries_cpu", "p2p_group", "send_device"]

P2P_ENV = settings.ENV["p2p"]
"""``side``: send host bytes on the gloo side group even when the default group could carry them."""


def carries_cpu(backend: str) -> bool:
    """Whether a process group with this backend string (``dist.get_backend()``: ``gloo``,
    ``nccl``, ``cpu:gloo,cuda:nccl``, ...) can send CPU tensors."""
    backend = backend.lower()
    if ":" in backend:  # a device -> backend map
        return any(part.split(":", 1)[0].strip() == "cpu" for part in backend.split(","))
    return backend not in ("nccl", "xccl", "hccl")


PEER_TIMEOUT_ENV = settings.ENV["peer_timeout_s"]
DEFAULT_PEER_TIMEOUT_S = settings.DEFAULT_PEER_TIMEOUT_S
peer_timeout = settings.peer_timeout_s
"""Seconds to wait for another rank (``$UCP_DCP_PEER_TIMEOUT_S``, default 30: :mod:`ucp_dcp.settings`)."""


_SIDE: dict[tuple[int, ...] | None, tuple[object, dist.ProcessGroup]] = {}
"""``members -> (default group, side group)``. Not keyed by ``id()`` of the default group: after
``destroy_process_group()`` and a new ``init_process_group()`` a recycled id would hand back a
destroyed group. An entry is used only while its default group is the current one and its side
group is still registered."""


def p2p_group(ranks: list[int] | None = None) -> dist.ProcessGroup | None:
    """The group for host-byte messages among ``ranks`` (global ranks; None: the whole world):
    None (the default group) when it carries CPU tensors, else one gloo group, created once per
    default group and member set. Every member must call this in the same order (group creation
    synchronizes the members)."""
    if carries_cpu(str(dist.get_backend())) and not settings.p2p_side():
        return None
    members = tuple(sorted(ranks)) if ranks is not None else None
    current = default_group()
    hit = _SIDE.get(members)
    if hit is None or hit[0] is not current or not group_registered(hit[1]):
        side = dist.new_group(
            ranks=list(members) if members is not None else None,
            backend="gloo",
            use_local_synchronization=members is not None,
            timeout=timedelta(seconds=peer_timeout()),  # its own bound: a lost peer fails it in seconds
        )
        hit = _SIDE[members] = (current, side)
    return hit[1]


def send_device(t: torch.Tensor) -> tuple[torch.device, dist.ProcessGroup | None]:
    """Where a tensor travels for a point-to-point exchange among all ranks: device tensors over the
    default group when it has a backend for their device (NCCL for CUDA), everything else as host
    tensors over :func:`p2p_group`. Returns ``(device to send from, group)``."""
    if t.device.type != "cpu":
        backend = str(dist.get_backend()).lower()
        if t.device.type == "cuda" and ("nccl" in backend):
            return t.device, None
    return torch.device("cpu"), p2p_group()
