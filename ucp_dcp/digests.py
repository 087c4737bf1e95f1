"""Value digests, so the coordinator can tell whether same-named plain values agree across ranks.

DCP keeps one rank's copy of any plain tensor or object saved under a shared name and drops the
rest; if the copies differ that is a silent loss. Each rank sends an 8-byte digest per such value
in its (small) plan, and the coordinator compares them before anything is written.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

import torch
import xxhash

__all__ = ["value_digest"]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def value_digest(value: Any) -> int | None:
    """8-byte digest of a plain tensor (dtype, shape and bytes) or a picklable object; None when the
    object cannot be serialized deterministically (it is then not compared). Tensors hash their bytes
    with XXH3-64 (~25 GB/s: plain tensors can be whole models under DDP)."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(value, torch.Tensor):
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        if value.numel():
            raw = _tensor_bytes(value)
            h.update(xxhash.xxh3_64_digest(raw))
    else:
        try:
            h.update(pickle.dumps(value, protocol=4))
        except Exception:
            buf = io.BytesIO()
            try:
                torch.save(value, buf)
            except Exception:
                return None
            h.update(buf.getvalue())
    return int.from_bytes(h.digest(), "little")
