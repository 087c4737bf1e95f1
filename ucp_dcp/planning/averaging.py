"""``Replicated(check="average")``: every rank holding a copy of a replicated piece sends it to the
rank that writes the piece, which saves the mean.

The coordinator picks the writers (:func:`average_writers`, after the dedup); at ``finish_plan``
every rank takes part in the exchange (:func:`exchange_averages`): point-to-point messages between
global ranks, so any save group works.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..errors import PatternError
from .collectives import p2p_group, send_device
from .payloads import LocalItems, LocalPlanPayload, PieceKey, PlanStructure
from .resolve import Resolved

__all__ = ["is_averaged", "average_writers", "exchange_averages"]

Duties = dict[PieceKey, tuple[int, list[int]]]
"""Averaged pieces a rank holds -> ``(global rank that writes the mean, global ranks holding a copy)``."""


def is_averaged(r: Resolved) -> bool:
    """The entry is a tensor under ``Replicated(check="average")``."""
    return r.replicated is not None and r.replicated.check == "average" and isinstance(r.value, torch.Tensor)


def average_writers(
    payloads: Sequence[LocalPlanPayload],
    items: Sequence[LocalItems],
    keep: Sequence[np.ndarray],
    structures: Sequence[PlanStructure],
) -> dict[int, Duties]:
    """Per rank (index into ``payloads``) with averaged pieces: who holds them and who writes them.
    ``items``, ``keep`` (the writer masks) and ``structures`` are per rank."""
    holders: dict[PieceKey, list[int]] = defaultdict(list)
    for p in payloads:
        for key in p.averaged:
            holders[key].append(p.global_rank)
    if not holders:
        return {}
    rank_of = [p.global_rank for p in payloads]
    writer: dict[PieceKey, int] = {}
    for r, (it, mask, st) in enumerate(zip(items, keep, structures)):
        for i in np.nonzero(mask)[0].tolist():
            a = int(it.atom[i])
            key = (st.names[a], tuple(it.off[i, : len(st.shapes[a] or ())].tolist()))
            if key in holders:
                writer[key] = rank_of[r]
    out: dict[int, Duties] = {}
    for r, g in enumerate(rank_of):
        mine = {k: (writer[k], sorted(h)) for k, h in holders.items() if g in h and k in writer}
        if mine:
            out[r] = mine
    return out


def exchange_averages(duties: Duties, resolved: Sequence[Resolved]) -> dict[PieceKey, torch.Tensor]:
    """Send this rank's copies to their writers and average what it writes; returns the means it
    writes. Called on every rank when any rank averages (pieces are visited in the same order
    everywhere)."""
    if threading.current_thread() is not threading.main_thread():
        atom = next((a for a, _ in duties), "a Replicated(check='average') atom")
        raise PatternError(
            "Replicated(check='average') needs collectives and cannot run inside async_save's "
            f"background thread (atom '{atom}')",
            atom=atom,
            hint="use a synchronous dcp.save, or check='error'/'warn' with async_save",
        )
    p2p_group()  # every rank at once: a side group, if the default group cannot carry host tensors
    if not duties:
        return {}
    me = dist.get_rank()
    frags = {(f.atom, f.box.offsets): (r, f) for r in resolved if is_averaged(r) for f in r.fragments}
    out = {}
    for key in sorted(duties):
        writer, holders = duties[key]
        r, f = frags[key]
        local = f.view(r.local).detach()
        # device tensors over NCCL, host tensors over gloo (the default group or a side group)
        device, group = send_device(local)
        mine = local.to(device=device, dtype=torch.float64).contiguous()
        if me != writer:
            dist.isend(mine, writer, group=group).wait()
            continue
        parts = {me: mine}
        bufs = {h: torch.empty_like(mine) for h in holders if h != me}
        for w in [dist.irecv(buf, h, group=group) for h, buf in bufs.items()]:
            w.wait()
        parts.update(bufs)
        total = sum(parts[h] for h in sorted(parts))
        out[key] = (total / len(parts)).to(device=r.local.device, dtype=r.local.dtype)
    return out
