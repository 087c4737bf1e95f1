"""Value digests, so the coordinator can tell whether same-named plain values agree across ranks.

DCP keeps one rank's copy of any plain tensor or object saved under a shared name and drops the
rest; if the copies differ that is a silent loss. Each rank sends an 8-byte digest per such value
in its (small) plan, and the coordinator compares them before anything is written.

Two values digest equal when keeping either one loses nothing: same types, same representation.
What a process does not control is left out:

* tensors (also inside objects, in containers or attributes) count by dtype, shape and bytes,
  never by the per-process storage id torch pickles them under; conjugate and negative views by
  the values they show;
* dicts and sets count by their items, not their order (dict and set equality ignores it; a set's
  order follows the process's string-hash seed); an ``OrderedDict`` keeps its order, as its
  equality does;
* objects shared by reference count as copies (pickle's memo would tell ``[s, s]`` from
  ``[s, copy(s)]``).

Floats are compared bitwise, in tensors and in objects: ``0.0`` and ``-0.0`` differ (``1/x`` tells
them apart), NaNs with equal bits agree. ``1``, ``1.0`` and ``True``, or ``bytes`` and
``bytearray``, differ too (the type would change on load), although ``==`` holds.
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
    t = t.detach().resolve_conj().resolve_neg()  # the values shown, not the memory under the view
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
    if t.is_sparse or t.layout != torch.strided or t.device.type == "meta":
        raise _NotComparable
    return str(t.dtype), tuple(t.shape), xxhash.xxh3_64_digest(tensor_bytes(t)) if t.numel() else b""


class _ValuePickler(pickle.Pickler):
    """Pickles an object canonically (see the module docstring): no memo, tensors and storages as
    tokens of their values, dicts and sets as their items in a fixed order."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=4)
        self.fast = True  # no memo: shared references pickle as copies (a cycle raises: not compared)

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is dict:
            items = list(obj.items())
            if all(type(k) is str for k in obj):
                items.sort(key=lambda kv: kv[0])
            else:  # any keys: order by their canonical bytes, a total order
                items.sort(key=lambda kv: _object_bytes(kv[0]))
            return ("ucp-dict", items)
        if t is set or t is frozenset:
            return ("ucp-set", t.__name__, sorted(map(_object_bytes, obj)))
        if isinstance(obj, torch.Tensor):
            return ("ucp-tensor",) + _tensor_token(obj)
        if isinstance(obj, torch.TypedStorage):
            obj = obj.untyped()
        if isinstance(obj, torch.UntypedStorage):
            raw = torch.empty(0, dtype=torch.uint8, device=obj.device).set_(obj)
            return ("ucp-storage",) + _tensor_token(raw)
        return None


def _object_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    _ValuePickler(buf).dump(value)
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
