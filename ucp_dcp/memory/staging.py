"""Staging: a state dict copied into host buffers kept from one memory save to the next.

A memory save that writes the caller's tensors itself blocks training for DCP's planning collectives
and the write into the store. Staged, it blocks only for one copy into buffers this rank already owns
(no page faults after the first save, no collective), and the planning and the write into the store
run in the tier's background thread on the copy while training changes the originals.

The copy keeps what a planner sees: the same keys and nesting, DTensors with the same mesh,
placements, global shape and stride, and aliasing (two entries that are views of the same memory,
a tied embedding, stay one staged tensor). Values that are not tensors are deep-copied. Buffers of
CUDA tensors are pinned (allocated once, so the pinning cost is paid once).

Why not DCP's ``StateDictStager`` (``torch.distributed.checkpoint._state_dict_stager``, the same deep copy
with buffers kept per source storage): it is private in every torch we support (2.11's ``DefaultStager``
closes it after each stage, docs/compatibility.md), pins every buffer or none where this pins only CUDA
sources', and does not count the bytes it keeps (:attr:`Stager.bytes`, which the tier reports).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from .._compat import dtensor_from_local

__all__ = ["Stager"]


def _view_key(t: torch.Tensor) -> tuple:
    """Two tensors with equal keys are the same view of the same memory (storage, offset, shape, stride)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


class Stager:
    """Copies state dicts into host buffers, reused by path while a path keeps its shape and dtype."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes = 0
        """Bytes of the buffers held (host memory this stager keeps between saves)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` (``Stateful`` values replaced by their ``state_dict()``, as DCP does)."""
        seen: dict[tuple, torch.Tensor] = {}
        used: set[str] = set()
        top = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
        out = self._copy(top, "", seen, used)
        for path in set(self._buffers) - used:  # entries the state no longer has
            del self._buffers[path]
        self.bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        return out

    def _copy(self, obj: Any, path: str, seen: dict[tuple, torch.Tensor], used: set[str]) -> Any:
        if isinstance(obj, DTensor):
            # not from_local: it would move the host buffer back to a CUDA mesh's device (DCP's own
            # staging also keeps a device mesh over a host local tensor)
            local = self._tensor(obj.to_local(), path, seen, used)
            return dtensor_from_local(local, obj.device_mesh, obj.placements, obj.shape, obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, seen, used)
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}.{k}", seen, used) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._copy(v, f"{path}.{i}", seen, used) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: str, seen: dict[tuple, torch.Tensor], used: set[str]) -> torch.Tensor:
        key = _view_key(t)
        if key in seen:  # an alias of an entry already staged: the same staged tensor
            return seen[key]
        buf = self._buffers.get(path)
        pin = t.device.type == "cuda"  # a device-to-host copy runs at the link's rate only into pinned memory
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != pin:
            buf = self._buffers[path] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buf.copy_(t.detach())  # synchronous: the state may change as soon as the save returns
        used.add(path)
        seen[key] = buf
        return buf
