"""Value digests, so the coordinator can tell whether same-named plain values agree across ranks.

DCP keeps one rank's copy of any plain tensor or object saved under a shared name and drops the
rest; if the copies differ that is a silent loss. Each rank sends an 8-byte digest per such value
in its (small) plan, and the coordinator compares them before anything is written.

Objects are digested through their pickle, but tensors inside them (in containers, or attributes of
custom objects) are replaced by a digest of their dtype, shape and bytes: torch pickles a tensor's
storage under a per-process id, so equal tensors would otherwise never compare equal across ranks.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

__all__ = ["value_digest", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's values as row-major bytes (copied to the host and made compact when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


class _NotComparable(Exception):
    """The object holds something whose value this rank cannot digest on its own (a DTensor)."""


def _tensor_token(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """What a tensor inside an object contributes to the object's digest: dtype, shape, bytes."""
    if isinstance(t, DTensor):  # a local shard: its peers legitimately hold other values
        raise _NotComparable
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_sparse or t.layout != torch.strided or t.device.type == "meta":
        raise _NotComparable
    return str(t.dtype), tuple(t.shape), xxhash.xxh3_64_digest(tensor_bytes(t)) if t.numel() else b""


class _ValuePickler(pickle.Pickler):
    """Pickles an object with every tensor and storage in it replaced by a token of its value."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return ("ucp-tensor",) + _tensor_token(obj)
        if isinstance(obj, torch.TypedStorage):
            obj = obj.untyped()
        if isinstance(obj, torch.UntypedStorage):
            raw = torch.empty(0, dtype=torch.uint8, device=obj.device).set_(obj)
            return ("ucp-storage",) + _tensor_token(raw)
        return None


def _canonical(value: Any) -> Any:
    """``value`` with every set (and frozenset) in plain containers sorted: a set pickles in
    iteration order, which follows each process's string-hash seed, so ranks would disagree."""
    if type(value) in (set, frozenset):
        items = [_canonical(v) for v in value]
        try:
            items.sort()
        except TypeError:
            items.sort(key=repr)
        return ("\x00ucp-set", type(value).__name__, items)
    if type(value) is dict:
        return {k: _canonical(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_canonical(v) for v in value)
    return value


def _object_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    _ValuePickler(buf, protocol=4).dump(_canonical(value))
    return buf.getvalue()


def value_digest(value: Any) -> int | None:
    """8-byte digest of a plain tensor (dtype, shape and bytes) or a picklable object; None when the
    object cannot be serialized deterministically (it is then not compared). Tensors hash their bytes
    with XXH3-64 (~25 GB/s: plain tensors can be whole models under DDP); tensors inside an object
    count by value the same way (so equal objects on different ranks digest equal), and an object
    holding a DTensor or another tensor without plain strided memory is not compared."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(value, torch.Tensor):
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        if value.numel():
            raw = tensor_bytes(value)
            h.update(xxhash.xxh3_64_digest(raw))
    else:
        try:
            h.update(_object_bytes(value))
        except Exception:  # _NotComparable, or not picklable: not compared
            return None
    return int.from_bytes(h.digest(), "little")
