"""Reading other frameworks' ``torch.save`` files without running anything they contain.

DeepSpeed and Megatron checkpoints are pickles that name their own classes (DeepSpeed's
``fragment_address``, Megatron's ``ShardedTensor``, ``argparse.Namespace``...). Unpickling them for
real imports those packages and calls whatever the file names — the way a crafted checkpoint runs
code. Here every global outside a tiny allow-list (``OrderedDict``, ``torch.Size``, dtypes, a few
builtins) becomes an :class:`Opaque` record of its name, arguments and state, and every tensor a
:class:`TensorRef`: where its elements are in the file, read later as byte ranges. Nothing is
imported, called or allocated from the file's say-so.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..._compat import dtype_of_storage_type, torch_file_reader
from ...errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["Opaque", "TensorRef", "TorchFile", "dig", "load_inert", "parse_pickle"]


class Opaque:
    """A foreign object rebuilt inertly: its class's name, constructor arguments and pickled state."""

    qualname: str = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        self = object.__new__(cls)
        self.args, self.kwargs, self.state, self.items, self.entries = args, kwargs, None, [], {}
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # REDUCE calls the "class": keep the args
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, x: Any) -> None:
        self.items.append(x)

    def extend(self, xs: Any) -> None:
        self.items.extend(xs)

    def __setitem__(self, k: Any, v: Any) -> None:
        self.entries[k] = v

    def field(self, name: str, position: int | None = None) -> Any:
        """A field by name (from the pickled state or keyword arguments) or constructor position."""
        if isinstance(self.state, dict) and name in self.state:
            return self.state[name]
        if (
            isinstance(self.state, tuple)
            and len(self.state) == 2
            and isinstance(self.state[1], dict)
            and name in self.state[1]
        ):  # (dict state, slots state)
            return self.state[1][name]
        if name in self.kwargs:
            return self.kwargs[name]
        if position is not None and position < len(self.args):
            return self.args[position]
        raise KeyError(f"{self.qualname} has no field {name!r}")

    def __repr__(self) -> str:
        return f"<{self.qualname} args={self.args!r} state={self.state!r}>"


def dig(obj: Any, *keys: Any) -> Any:
    """``obj[k1][k2]...`` through dicts, lists and :class:`Opaque` fields."""
    for k in keys:
        obj = obj.field(k) if isinstance(obj, Opaque) else obj[k]
    return obj


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a ``torch.save`` file, not read: its storage record and view."""

    key: str
    """Storage record name (``data/<key>`` in the zip)."""
    dtype: torch.dtype
    offset: int
    """Storage offset of element 0, in elements."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        expect = tuple(math.prod(self.shape[d + 1 :]) for d in range(len(self.shape)))
        return all(s == e for s, e, n in zip(self.stride, expect, self.shape) if n > 1)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "range"): range,
}


def _rebuild_tensor(storage: Any, offset: int, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not (isinstance(storage, tuple) and len(storage) == 2 and isinstance(storage[1], torch.dtype)):
        raise pickle.UnpicklingError("a tensor without a storage record")
    return TensorRef(
        str(storage[0]), storage[1], int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride)
    )


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A tensor subclass or a tensor with attributes (DeepSpeed's ``ds_id``): the plain tensor."""
    if func is not _rebuild_tensor or not isinstance(args, tuple):
        raise pickle.UnpicklingError("a typed tensor rebuilt by something other than _rebuild_tensor_v2")
    return _rebuild_tensor(*args)


class _InertUnpickler(pickle.Unpickler):
    def __init__(self, f: Any) -> None:
        super().__init__(f)
        self._stubs: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        if module == "torch" and name.endswith("Storage"):
            return ("storage-type", dtype_of_storage_type(name))
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.device.__class__)):
            value = getattr(torch, name)
            if isinstance(value, torch.dtype):
                return value
        stub = self._stubs.get((module, name))
        if stub is None:
            stub = self._stubs[(module, name)] = type(name, (Opaque,), {"qualname": f"{module}.{name}"})
        return stub

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        kind = pid[1]
        dtype = kind[1] if isinstance(kind, tuple) and kind[0] == "storage-type" else torch.uint8
        return (pid[2], dtype)


def parse_pickle(data: bytes, where: str) -> Any:
    """Inertly unpickle ``data`` (see module doc)."""
    try:
        return _InertUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{where}: {e}", hint="the file is damaged or crafted") from None
    except (
        Exception
    ) as e:  # an untrusted file may fail the parser anywhere: reported as a damaged file, never passed on
        raise CorruptCheckpointError(
            f"{where} does not parse ({type(e).__name__}: {e})", hint="the file is damaged or not a torch.save file"
        ) from None


@dataclass
class TorchFile:
    """A ``torch.save`` file parsed inertly: its object tree and where each storage record lies."""

    path: str
    obj: Any
    """The pickled object with :class:`TensorRef` / :class:`Opaque` placeholders."""
    records: dict[str, tuple[int, int]]
    """Storage key -> (absolute byte offset, byte length) of its record."""
    size: int
    """File size in bytes."""

    def byte_offset(self, t: TensorRef) -> int:
        """Absolute offset of the tensor's element 0; the tensor must lie inside its record."""
        if t.key not in self.records:
            raise CorruptCheckpointError(f"{self.path}: tensor storage 'data/{t.key}' is not in the file")
        start, length = self.records[t.key]
        need = (t.offset + (t.numel and sum((n - 1) * s for n, s in zip(t.shape, t.stride)) + 1)) * t.dtype.itemsize
        if t.offset < 0 or need > length:
            raise CorruptCheckpointError(
                f"{self.path}: a tensor {list(t.shape)} reaches past its storage record "
                f"'data/{t.key}' ({need} > {length} bytes)",
                hint="the file is damaged",
            )
        return start + t.offset * t.dtype.itemsize


def load_inert(path: str | os.PathLike) -> TorchFile:
    """Parse the ``torch.save`` (zip) file at ``path`` without running or reading tensor data."""
    path = os.fspath(path)
    try:
        reader = torch_file_reader(path)
        data = reader.get_record("data.pkl")
    except FileNotFoundError:
        raise
    except Exception as e:  # torch's zip reader raises RuntimeError and others on a bad file: a damaged file
        raise CorruptCheckpointError(
            f"{path} is not a torch.save zip file ({type(e).__name__}: {e})",
            hint="the file is damaged, or saved with the legacy format",
        ) from None
    obj = parse_pickle(data, path)
    records: dict[str, tuple[int, int]] = {}
    for name in reader.get_all_records():
        if "/data/" in "/" + name or name.startswith("data/"):
            key = name.rsplit("data/", 1)[1]
            if key and "/" not in key:
                records[key] = (
                    int(reader.get_record_offset(name)),
                    int(reader.get_record_size(name))
                    if hasattr(reader, "get_record_size")
                    else _record_size(reader, name),
                )
    return TorchFile(path, obj, records, os.path.getsize(path))


def _record_size(reader: Any, name: str) -> int:
    return len(reader.get_record(name))
