"""Tied target keys whose two saved copies are compared when read (a tied model saved by stock DCP).

Stock ``dcp.save`` writes a tied model's shared ``Parameter`` under each of its names, as copies, and
records no checksums that :func:`~ucp_dcp.planning.ties.saved_equal` could compare at plan time. A
tied target loading such a checkpoint reads every copy (the reads planned for each key, as for an
untied target) into scratch memory of the saved dtype instead of the target, one fragment of the
shared tensor at a time. When every read of a fragment has arrived the copies are compared bitwise:
equal, the first key's value is copied into the reads' destinations and they are committed (one
value, the tie kept); different, :class:`~ucp_dcp.errors.AmbiguousLayoutError` is raised with the
hint of the plan-time refusal (untie the target), and nothing of that tensor is written on this rank.

:func:`~ucp_dcp.planning.declarations.alias_problems` picks the keys, ``UCPLoadPlanner`` routes their
reads here (``resolve_tensor`` hands out the scratch, ``commit_tensor`` the comparison).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from .._compat import narrow_tensor_by_index
from ..errors import UCPError
from .declarations import tie_error

__all__ = ["TieReads"]


@dataclass
class _Fragment:
    """One fragment of a tied tensor being read: every key's copy, the reads that arrived."""

    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    arrived: dict[str, int] = field(default_factory=dict)
    done: list[tuple[ReadItem, torch.Tensor]] = field(default_factory=list)


class TieReads:
    """The reads of tied keys compared when read, for one load (``compared``: compared key -> the key
    whose value loads, the first of its tensor; ``reads``: this rank's final read items)."""

    def __init__(
        self, compared: Mapping[str, str], targets: Mapping[str, Any], reads: Sequence[ReadItem], md: Metadata
    ):
        self._loader = {**{a: a for a in compared.values()}, **compared}
        self._atoms = {k: next(iter(targets[k].atoms)) for k in self._loader}
        self._boxes = {k: [f.box for f in targets[k].fragments] for k in self._loader}
        self._md = md
        counts: dict[tuple[str, int], dict[str, int]] = {}
        for it in reads:
            key = it.dest_index.fqn
            if key in self._loader:
                need = counts.setdefault((self._loader[key], it.dest_index.index or 0), {})
                need[key] = need.get(key, 0) + math.prod(it.lengths)
        for (loader, _), need in counts.items():
            keys = [loader] + sorted(k for k, a in compared.items() if a == loader)
            if len({need.get(k, 0) for k in keys}) > 1:  # an override dropped some reads of the tensor
                raise UCPError(
                    f"create_local_plan: the reads of {keys} (one tensor, whose saved copies are compared when "
                    f"read) were dropped for some keys but not all: {need}",
                    atom=self._atoms[loader],
                    hint="drop the reads of every key of a tied tensor, or of none",
                )
        self._need = counts
        self._open: dict[tuple[str, int], _Fragment] = {}
        self._dest: dict[int, torch.Tensor] = {}
        self._failed: set[str] = set()
        self._lock = threading.Lock()

    def holds(self, item: ReadItem) -> bool:
        return item.dest_index.fqn in self._loader

    def scratch(self, item: ReadItem, dest: torch.Tensor) -> torch.Tensor:
        """Where the reader puts the bytes of ``item``: its box of the key's copy of the fragment (saved
        dtype); ``dest`` (what the read would have filled) gets the value once the copies compare equal."""
        key, i = item.dest_index.fqn, item.dest_index.index or 0
        with self._lock:
            frag = self._open.setdefault((self._loader[key], i), _Fragment())
            copy = frag.scratch.get(key)
            if copy is None:
                smd = self._md.state_dict_metadata[item.storage_index.fqn]
                assert isinstance(smd, TensorStorageMetadata)  # alias_problems compares saved tensors only
                dtype = smd.properties.dtype
                copy = frag.scratch[key] = torch.empty(self._boxes[key][i].sizes, dtype=dtype)
            self._dest[id(item)] = dest
        return narrow_tensor_by_index(copy, item.dest_offsets, item.lengths)

    def arrive(self, item: ReadItem, tensor: torch.Tensor) -> list[tuple[ReadItem, torch.Tensor]]:
        """``item`` was read into ``tensor``: nothing to commit yet ([]), or, its fragment complete and its
        copies equal, every read of the fragment with its destination, which now holds the value."""
        key, i = item.dest_index.fqn, item.dest_index.index or 0
        loader = self._loader[key]
        with self._lock:
            frag = self._open.get((loader, i))
            dest = self._dest.pop(id(item), None)
            copy = frag.scratch.get(key) if frag is not None else None
            if (
                frag is None
                or copy is None
                or dest is None
                or tensor.untyped_storage().data_ptr() != copy.untyped_storage().data_ptr()
            ):
                raise UCPError(
                    f"'{key}' is one tensor with {sorted(k for k, a in self._loader.items() if a == loader)}, whose "
                    "saved copies are compared when read into scratch memory; commit_tensor got another tensor "
                    f"than resolve_tensor handed out for it ({type(tensor).__name__} {tuple(tensor.shape)})",
                    atom=self._atoms[key],
                    hint="let an override of resolve_tensor return super().resolve_tensor(read_item), and commit "
                    "the tensor it returned",
                )
            frag.done.append((item, dest))
            frag.arrived[key] = frag.arrived.get(key, 0) + math.prod(item.lengths)
            if frag.arrived != self._need[(loader, i)]:
                return []
            del self._open[(loader, i)]
        value = frag.scratch[loader]
        for other in sorted(frag.scratch):
            if other != loader:
                self._compare(loader, other, i, value, frag.scratch[other])
        with torch.no_grad():
            for it, d in frag.done:
                d.copy_(narrow_tensor_by_index(value, it.dest_offsets, it.lengths))
        return frag.done

    def _compare(self, a: str, b: str, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Raise unless the two copies hold the same bytes (also once another fragment of the tensor differed)."""
        differ = (_bytes(x) != _bytes(y)).any(dim=1)
        n = int(differ.sum())
        if not n and a not in self._failed:
            return
        self._failed.add(a)
        box = self._boxes[b][i]
        if n:
            at = torch.unravel_index(differ.nonzero()[0, 0], x.shape) if x.dim() else ()
            where = tuple(o + int(j) for o, j in zip(box.offsets, at))
            found = f"{n} of {x.numel()} values differ, the first at index {where}"
        else:
            found = "another piece of them differs"
        why = f"the checkpoint holds different values for them (compared when read, no checksums showing it: {found})"
        raise tie_error(a, b, self._atoms[a], self._atoms[b], why)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor, one row per element (NaN payloads and -0.0 count)."""
    return t.reshape(-1).view(torch.uint8).view(t.numel(), t.element_size())
