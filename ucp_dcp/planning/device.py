"""Where state lives: which load targets go through host staging, and read items cut to fit it.

File bytes land in host memory; a target that is not a CPU tensor (a CUDA DTensor's local shard)
is filled through staging buffers of ``STAGE_BYTES`` (:mod:`ucp_dcp.storage.staging`). Planners cut the
read items of such targets with :func:`split_reads` so that every item, and every piece read-once
sends, fits one buffer. Pure functions and constants: planners and storage both use them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Literal

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .. import settings

__all__ = ["STAGE_BYTES", "STAGING_ENV", "split_box", "split_reads", "staging_forced", "needs_staging"]

STAGE_BYTES = 16 << 20
"""Size of one staging buffer, and the largest read item for a staged target."""
STAGING_ENV = settings.ENV["staging"]
"""``always``: stage CPU targets too (tests); ``auto`` (default): only non-CPU targets."""


StagingMode = Literal["auto", "always"]
"""Which targets go through host staging: only non-CPU ones, or CPU ones too (exercises the device path)."""


def staging_forced(mode: StagingMode | None = None) -> bool:
    """Whether CPU targets go through staging (``mode`` or, when None, ``$UCP_DCP_STAGING``)."""
    return settings.staging(mode) == "always"


def needs_staging(t: torch.Tensor, forced: bool) -> bool:
    """A target whose bytes cannot be written from the host directly (or any target when forced)."""
    return forced or t.device.type != "cpu"


def split_box(lengths: tuple[int, ...], itemsize: int, cap: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Sub-boxes ``(offsets, lengths)`` of a box of ``lengths``, in row-major order, each of at most
    ``cap`` bytes and each a contiguous byte range of the box's packed row-major bytes.

    Splits the first dimension ``d`` whose trailing block (``lengths[d+1:]``) fits in ``cap``:
    indices of dimensions before ``d`` are fixed per sub-box, ``d`` is cut into ranges of as many
    rows as fit, later dimensions stay whole."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or math.prod(lengths) * itemsize <= cap or 0 in lengths:
        return [((0,) * len(lengths), lengths)]
    d = next(d for d in range(len(lengths)) if math.prod(lengths[d + 1 :]) * itemsize <= cap)
    rows = max(1, cap // (math.prod(lengths[d + 1 :]) * itemsize))
    out = []
    for lead in itertools.product(*(range(n) for n in lengths[:d])):
        for start in range(0, lengths[d], rows):
            n = min(rows, lengths[d] - start)
            out.append((lead + (start,) + (0,) * (len(lengths) - d - 1), (1,) * d + (n,) + lengths[d + 1 :]))
    return out


def split_reads(
    items: Iterable[ReadItem],
    itemsize: Callable[[ReadItem], int],
    staged: Callable[[ReadItem], bool],
    cap: int | None = None,
) -> list[ReadItem]:
    """Read items with every tensor item of a staged target cut into sub-boxes of at most ``cap``
    (default :data:`STAGE_BYTES`) bytes (storage and destination offsets shifted alike), so a
    staging buffer holds any item."""
    cap = STAGE_BYTES if cap is None else cap
    out: list[ReadItem] = []
    for item in items:
        if item.type == LoadItemType.BYTE_IO or not staged(item):
            out.append(item)
            continue
        parts = split_box(tuple(item.lengths), itemsize(item), cap)
        if len(parts) == 1:
            out.append(item)
            continue
        for offs, lens in parts:
            out.append(
                replace(
                    item,
                    dest_offsets=torch.Size(a + b for a, b in zip(item.dest_offsets, offs)),
                    storage_offsets=torch.Size(a + b for a, b in zip(item.storage_offsets, offs)),
                    lengths=torch.Size(lens),
                )
            )
    return out
