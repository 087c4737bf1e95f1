"""Every private torch API ucp_dcp uses, and every difference between the torch releases it supports.

ucp_dcp relies on private DTensor/DCP internals (``_StridedShard`` semantics, DCP's storage-info
records and file views, its state-dict traversal helpers). No other module imports a private torch
name directly: they import it from here. Whether the installed torch still behaves the way the code
relies on is not judged by its version but checked at import by :mod:`ucp_dcp._probes`.

Supported: torch 2.11 through 2.15 (``TESTED_TORCH``). Where the releases differ, the difference
lives here:

* DCP's fsspec ``FileSystem`` moved: ``checkpoint.fsspec_filesystem._FileSystem`` from 2.15
  (the old ``checkpoint._fsspec_filesystem.FileSystem`` warns there), before it only the old path.
* ``_StridedShard.local_shard_size_and_offset`` returns every index with
  ``offset_mode=_StridedShardOffsetMode.ALL`` from 2.12; 2.11 has no ``_StridedShardOffsetMode``
  and takes ``return_first_offset=False`` (:func:`strided_shard_indices`).
* ``torch.distributed.checkpoint.CheckpointableTensor`` (a plain tensor carrying its global
  shape and shard boxes, pytorch#189492) exists from 2.14; before it such attributes mean nothing to
  DCP, and nothing to ucp_dcp (:func:`is_checkpointable_tensor` is False).
* FSDP2's ``fully_shard`` refuses every ``nn.ModuleList``/``ModuleDict`` on 2.11, also one with its
  own ``forward`` (2.12+ refuses only those without). The checkout's toy model (``ucp_dev.toy``,
  which by design imports nothing from ucp_dcp) therefore keeps its per-rank experts in a plain ``nn.Module``
  (``ucp_dev.toy.model.ListExperts``), with the same state-dict names on every release.
* ``DefaultStager`` on 2.11 closes its state-dict stager after every ``stage`` (clearing its copy
  dispatch table), so a second save through the same stager fails inside torch with
  ``KeyError: <class 'type'>``; 2.12+ keep it open until ``close()``. Callers that reuse one stager
  across saves ask :func:`default_stager_reusable` and build one per save where it is False.
* ``torch.distributed.checkpoint.state_dict._gc_context`` (automatic garbage collection off while
  ``get_state_dict``/``set_state_dict`` run, so that no rank pauses for a collection in the middle) is
  private; where a release lacks it, :func:`gc_paused` is the same few lines.
* ``dcp.async_save`` asserts that its process group has a CPU backend (every release 2.11-2.15):
  under an NCCL-only default group, pass a gloo group (:func:`group_has_cpu_backend`).

Kept in one module (about 530 lines): only this module may name private torch names
(``tests/test_architecture.py``), so every use of them, the dry run's mesh copies and local shapes included,
is here.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed import distributed_c10d as _c10d
from torch.distributed._shard._utils import narrow_tensor_by_index  # narrow a tensor to a box
from torch.distributed._shard.sharded_tensor import ShardedTensor  # legacy sharded values (refused)
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's nested-key flattening
from torch.distributed.checkpoint._traverse import set_element  # write a value at a state-dict path
from torch.distributed.checkpoint.filesystem import (  # DCP's file layout: our files stay readable by it
    _create_file_view,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.planner_helpers import _init_state_dict  # materialize lazy targets
from torch.distributed.tensor._utils import (  # a rank's piece of a DTensor (of a mesh / at a coordinate)
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 x TP non-contiguous shards

try:  # torch >= 2.12
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode
except ImportError:  # torch 2.11
    _StridedShardOffsetMode = None

try:  # torch >= 2.14 (pytorch#189492)
    from torch.distributed.checkpoint import CheckpointableTensor
except ImportError:
    CheckpointableTensor = None

__all__ = [
    "default_group",
    "completed_work",
    "group_timeout",
    "fsspec_filesystem",
    "fsspec_storage",
    "s3_call",
    "cat_ranges_concurrently",
    "narrow_tensor_by_index",
    "ShardedTensor",
    "flatten_state_dict",
    "set_element",
    "_create_file_view",
    "_split_by_size_and_type",
    "_StorageInfo",
    "_StoragePrefix",
    "_init_state_dict",
    "_StridedShard",
    "compute_local_shape_and_global_offset",
    "_compute_local_shape_and_global_offset",
    "fake_store",
    "mesh_for_rank",
    "dtensor_from_local",
    "dtensor_on_mesh",
    "CheckpointableTensor",
    "is_checkpointable_tensor",
    "strided_shard_indices",
    "strided_chunk_sizes",
    "dtensor_local_shape",
    "split_tensor",
    "group_has_cpu_backend",
    "TESTED_TORCH",
    "ALLOW_ENV",
    "torch_release",
    "root_mesh",
    "local_tensor",
    "dtype_of_storage_type",
    "torch_file_reader",
    "plan_caching",
    "cached_plans_key",
    "metadata_path",
    "state_dict_hooks",
]


def default_group() -> _c10d.ProcessGroup:
    """The default process group object (a cache key for groups we create per job)."""
    return _c10d._get_default_group()


def group_registered(group: _c10d.ProcessGroup) -> bool:
    """Whether ``group`` is still a live group of this process (``destroy_process_group`` unregisters
    every group: a cached one is then dead)."""
    return group in _c10d._world.pg_map


def default_store() -> Any:
    """The default group's store (the job's TCPStore, prefixed): keys every rank of the job can see."""
    return _c10d._get_default_store()


def completed_work(result: Any) -> Any:
    """A finished ``Work`` holding ``result`` (what a Python process group's collective returns once
    it is done: ``torch._C._distributed_c10d._create_work_from_future``, every release 2.11-2.15)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def group_timeout(group: _c10d.ProcessGroup) -> Any:
    """The collective timeout (a ``timedelta``) ``group`` was created with, read from its CPU or CUDA
    backend's options (gloo, NCCL: ``options._timeout``); None when no backend says."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or one without options
            continue
    return None


def set_default_timeout(timeout: Any) -> None:
    """Set the default group's collective timeout (a ``timedelta``) for the collectives that follow."""
    _c10d._set_pg_timeout(timeout)


def fsspec_filesystem() -> type:
    """DCP's fsspec-backed ``FileSystem`` (imported on use: it needs fsspec). torch 2.15 moved it to
    ``fsspec_filesystem._FileSystem``; the old module still exists there but warns on import."""
    try:
        from torch.distributed.checkpoint.fsspec_filesystem import _FileSystem as FileSystem
    except ImportError:  # torch <= 2.14
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    return FileSystem


def fsspec_storage() -> tuple[type, type]:
    """DCP's ``FsspecWriter`` and ``FsspecReader`` (the comparison in tests and ``recipes/bench_s3.py``);
    public in ``checkpoint.fsspec_filesystem`` from 2.15, before only in ``_fsspec_filesystem``."""
    try:
        from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError:  # torch <= 2.14
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


def s3_call(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 API call (``create_multipart_upload``, ...) through an ``s3fs`` file system's own client, session,
    retries and error translation (``S3FileSystem._call_s3``: s3fs has no public form of it)."""
    from fsspec.asyn import sync

    return sync(fs.loop, fs._call_s3, method, **kwargs)


def cat_ranges_concurrently(fs: Any, path: str, ranges: list[tuple[int, int]], limit: int = 32) -> list[bytes] | None:
    """The byte ranges ``[start, end)`` of one object fetched concurrently on an async fsspec file system's
    loop (its coroutine ``_cat_file``), at most ``limit`` in flight; None when ``fs`` is not async."""
    if not hasattr(fs, "_cat_file") or getattr(fs, "loop", None) is None:
        return None
    import asyncio

    from fsspec.asyn import sync

    async def gather() -> list[bytes]:
        gate = asyncio.Semaphore(limit)

        async def one(s: int, e: int) -> bytes:
            async with gate:
                return await fs._cat_file(path, start=s, end=e)

        return list(await asyncio.gather(*(one(s, e) for s, e in ranges)))

    return sync(fs.loop, gather)


def fake_store() -> torch.distributed.Store:
    """A store for torch's fake process group (``init_process_group("fake", ...)``): one process
    plays any rank of any world size, collectives do nothing (``ucp_dcp.tools.dryrun``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    return FakeStore()


def mesh_for_rank(
    mesh: torch.distributed.device_mesh.DeviceMesh,
    rank: int,
    cache: dict,
    on_twin: Callable[[Any, Any], None] | None = None,
) -> torch.distributed.device_mesh.DeviceMesh:
    """``mesh`` as global rank ``rank`` sees it (``ucp_dcp.tools.dryrun``): a copy with the same layout over
    the same root rank map whose stored rank and coordinate are ``rank``'s (DeviceMesh's private
    ``_rank``/``_coordinate_on_dim``/``_root_mesh``; ``DeviceMesh.mesh`` slices at the default
    group's rank, which must be ``rank``). No process groups are created. ``cache``: id -> copy.

    The slices of ``mesh``'s layout over its rank map (``DeviceMesh.mesh`` of every rank) are worked out once
    per ``mesh`` (:class:`_MeshSlices`): the copy's coordinate is read off its slice, and for a copy for a rank
    in the slice of an earlier copy (the same ranks in the same places, a twin root) ``on_twin(copy, earlier)``
    is called (``ucp_dcp.tools.dryrun`` declares them twins, :func:`ucp_dcp.layout.placements.declare_twin`,
    so what ucp_dcp works out per mesh is worked out once per slice, not once per rank)."""
    hit = cache.get(id(mesh))
    if hit is not None:
        return hit
    new = object.__new__(type(mesh))  # not copy.copy: DeviceMesh.__setstate__ looks groups up again
    new.__dict__.update(mesh.__dict__)
    new.__dict__.pop("_ucp_dcp_mesh_info", None)  # ucp_dcp.layout.placements's per-mesh cache: the copy has other ranks
    new._rank = rank
    new._hash = None
    if mesh._root_mesh is not None:
        new._root_mesh = mesh_for_rank(mesh._root_mesh, rank, cache, on_twin)
    slices = _MeshSlices.of(mesh)
    row = slices.row(rank) if slices is not None else None
    if row is None:
        new._coordinate_on_dim = new._compute_coordinate_on_dim()
    else:  # what _compute_coordinate_on_dim computes: the rank's place in its slice (DeviceMesh.mesh)
        new._coordinate_on_dim = type(mesh)._compute_coordinates_from_mesh(slices.full[row], rank)
        twin = slices.twins.setdefault(row, new)
        if twin is not new and on_twin is not None:
            if mesh._root_mesh is None or _twin_roots(new._root_mesh, twin._root_mesh):
                on_twin(new, twin)
    cache[id(mesh)] = new
    return new


def _twin_roots(a: Any, b: Any) -> bool:
    slices = _MeshSlices.of(a)
    return slices is not None and slices is _MeshSlices.of(b) and slices.full.size(0) == 1


class _MeshSlices:
    """A mesh's layout over its rank map, sliced as ``DeviceMesh.mesh`` slices it for each rank: the full
    tensor (one slice per row), the row each rank's ``mesh`` is, and the first copy made per row."""

    _BY_MESH: dict[int, tuple[Any, Any]] = {}
    """id of a mesh -> (weak reference to it, its slices); copies share their original's rank map and layout."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full = full
        self._row: dict[int, int] = {}
        if full.size(0) > 1:
            for i, ranks in enumerate(full.reshape(full.size(0), -1).tolist()):
                for r in ranks:
                    self._row.setdefault(int(r), i)  # DeviceMesh.mesh takes the first row holding the rank
        self.twins: dict[int, Any] = {}

    def row(self, rank: int) -> int | None:
        """The row ``DeviceMesh.mesh`` is for ``rank`` (None: it raises, or the rank is in none)."""
        if self.full.size(0) == 1:
            return 0
        return self._row.get(rank)

    @classmethod
    def of(cls, mesh: Any) -> _MeshSlices | None:
        """The slices of ``mesh`` (shared by its copies: they keep its rank map and layout); None for a
        DeviceMesh without torch 2.11-2.15's ``_layout``/``_rank_map`` (then copies are computed the plain way)."""
        import weakref

        layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
        if layout is None or rank_map is None or not hasattr(type(mesh), "_compute_coordinates_from_mesh"):
            return None
        key = id(rank_map)
        hit = cls._BY_MESH.get(key)
        if hit is None or hit[0]() is not rank_map:
            try:
                ref = weakref.ref(rank_map, lambda _ref: cls._BY_MESH.pop(key, None))
            except TypeError:
                return None
            hit = cls._BY_MESH[key] = (ref, {})
        by_layout: dict[Any, _MeshSlices | None] = hit[1]
        which = (layout, mesh.mesh_dim_names)
        if which not in by_layout:
            full = layout.remap_to_tensor(rank_map)
            by_layout[which] = cls(full) if full.dim() >= 2 else None
        return by_layout[which]


def dtensor_from_local(
    local: torch.Tensor,
    mesh: torch.distributed.device_mesh.DeviceMesh,
    placements: tuple,
    shape: torch.Size,
    stride: tuple[int, ...],
) -> torch.distributed.tensor.DTensor:
    """A DTensor of ``local`` without ``from_local``'s checks and autograd (what FSDP2 does)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    # DTensor(...) is DTensor.__new__ then an __init__ that only calls Tensor.__init__, under a dynamo guard
    # costing ~150 us a call (9/10 of the construction; ``plan`` rebinds ~70 DTensors per simulated rank)
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def dtensor_on_mesh(
    t: torch.distributed.tensor.DTensor, local: torch.Tensor, mesh: torch.distributed.device_mesh.DeviceMesh
) -> torch.distributed.tensor.DTensor:
    """``t``'s global tensor as another rank holds it (``ucp_dcp.tools.dryrun``): ``local`` on ``mesh`` (a copy of
    ``t``'s mesh for that rank) with ``t``'s placements, global shape and stride. ``t``'s spec is copied with the
    mesh replaced, as :func:`dtensor_from_local` would build it: its checks ran when ``t`` was made, and cost
    more than the rest of the rebinding of a rank."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    old = getattr(t, "_spec", None)
    meta = getattr(old, "tensor_meta", None)
    if type(old) is not DTensorSpec or meta is None or meta.dtype != local.dtype or not hasattr(old, "__dict__"):
        return dtensor_from_local(local, mesh, t.placements, t.shape, t.stride())
    spec = object.__new__(DTensorSpec)
    spec.__dict__.update(old.__dict__)
    spec.__dict__.update(mesh=mesh, _hash=None)
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def root_mesh(mesh: torch.distributed.device_mesh.DeviceMesh) -> torch.distributed.device_mesh.DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it was not sliced)."""
    get = getattr(mesh, "_get_root_mesh", None)
    return get() if get is not None else mesh


TESTED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
"""``(major, minor)`` releases the test-suite ran on (docs/compatibility.md). Another torch whose
probes (:mod:`ucp_dcp._probes`) pass imports with a warning; one whose probes fail is refused."""
ALLOW_ENV = "UCP_DCP_ALLOW_UNTESTED_TORCH"
"""``1``: import even when a probe fails (a warning instead of the error), for emergencies."""


def torch_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``2.14.1+cu130`` -> ``(2, 14)``); ``(-1, -1)``
    when it does not parse."""
    base = (version or torch.__version__).split("+")[0]
    try:
        major, minor = (int(x) for x in base.split(".")[:2])
    except ValueError:
        return -1, -1
    return major, minor


def is_checkpointable_tensor(value: object) -> bool:
    """Whether DCP treats ``value`` as a :class:`CheckpointableTensor` (torch >= 2.14): a plain
    tensor (not a DTensor, not a ShardedTensor) carrying ``global_shape``, ``global_offsets``,
    ``local_offsets`` and ``local_sizes``. Always False on a torch without the protocol."""
    if CheckpointableTensor is None or not isinstance(value, torch.Tensor) or isinstance(value, ShardedTensor):
        return False
    if hasattr(value, "__create_write_items__"):  # DTensor: DCP asks it first, so do we
        return False
    return isinstance(value, CheckpointableTensor)


def strided_shard_indices(p: _StridedShard, n: int, k: int, i: int) -> list[int]:
    """The global indices (in local order) that chunk ``i`` of ``k`` holds when ``_StridedShard``
    ``p`` splits a dim of size ``n``, as torch's own helper states them."""
    if _StridedShardOffsetMode is not None:  # torch >= 2.12
        _, offsets = p.local_shard_size_and_offset(n, k, i, offset_mode=_StridedShardOffsetMode.ALL)
    else:  # torch 2.11
        _, offsets = p.local_shard_size_and_offset(n, k, i, return_first_offset=False)
    return [int(o) for o in offsets]


def strided_chunk_sizes(p: _StridedShard, n: int, k: int) -> tuple[int, ...]:
    """The size of each of the ``k`` chunks ``_StridedShard`` ``p`` cuts a dim of size ``n`` into: what
    ``p.local_shard_size_and_offset(n, k, i)`` returns as the size for every ``i``, by the same call it makes
    (``_split_tensor`` of the dim's indices), once for all ``i``."""
    index = torch.arange(n).view([1] * int(p.dim) + [n])
    return tuple(int(s.numel()) for s in p._split_tensor(index, k, with_padding=False, contiguous=False)[0])


_STRIDED_SIZES: dict[tuple[int, int, int, int], tuple[int, ...]] = {}
"""``(dim, split_factor, dim size, chunks)`` -> :func:`strided_chunk_sizes` (:func:`dtensor_local_shape`)."""


def dtensor_local_shape(
    global_shape: Any, mesh: torch.distributed.device_mesh.DeviceMesh, placements: Any
) -> tuple[int, ...]:
    """The shape of this rank's local tensor of a DTensor of ``global_shape`` on ``mesh``: DTensor's own
    ``compute_local_shape_and_global_offset(...)[0]`` (``ucp_dcp.tools.dryrun`` rebinds a state dict to every
    rank it plans). DTensor works out a ``_StridedShard``'s size at a coordinate by cutting the whole dim into
    every chunk, O(chunks) per rank (the 4,096-rank plan's largest cost after the meshes); here those sizes are
    worked out once per dim size and mesh dim for all coordinates, by the same ``_split_tensor`` call
    (:func:`strided_chunk_sizes`). ``Shard`` sizes come from DTensor's own ``Shard`` method; other placements
    (and a rank outside the mesh) from DTensor's function itself."""
    from torch.distributed.tensor import Replicate, Shard

    coord = mesh.get_coordinate()
    if coord is None or not all(isinstance(p, (Shard, _StridedShard, Replicate)) for p in placements):
        return tuple(compute_local_shape_and_global_offset(global_shape, mesh, placements)[0])
    try:
        return _local_shape(global_shape, tuple(mesh.shape), coord, placements)
    except (AttributeError, TypeError):  # a torch whose placements lack these private methods: DTensor's own way
        return tuple(compute_local_shape_and_global_offset(global_shape, mesh, placements)[0])


def _local_shape(global_shape: Any, sizes: tuple[int, ...], coord: Any, placements: Any) -> tuple[int, ...]:
    from torch.distributed.tensor import Shard

    shape = list(global_shape)
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):  # first: not a Shard subclass today, but be explicit
            key = (int(p.dim), int(p.split_factor), int(shape[p.dim]), int(sizes[m]))
            every = _STRIDED_SIZES.get(key)
            if every is None:
                every = _STRIDED_SIZES[key] = strided_chunk_sizes(p, shape[p.dim], sizes[m])
            shape[p.dim] = every[coord[m]]
        elif isinstance(p, Shard):
            shape[p.dim] = p._local_shard_size_and_offset(
                curr_local_size=shape[p.dim], num_chunks=sizes[m], rank=coord[m]
            )[0]
    return tuple(shape)


def split_tensor(p: object, t: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The ``k`` pieces placement ``p`` (``Shard``/``_StridedShard``) cuts ``t`` into, unpadded:
    what ``distribute_tensor`` gives each coordinate of that mesh dim."""
    return p._split_tensor(t, k, with_padding=False, contiguous=True)[0]


def group_has_cpu_backend(group: _c10d.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the default group) has a backend for CPU tensors, which
    ``dcp.async_save`` asserts (``cpu:gloo,cuda:nccl`` has, plain ``nccl`` has not)."""
    pg = group if group is not None else default_group()
    return torch.device("cpu") in pg._device_types


_STAGER_REUSABLE: list[bool] = []


def default_stager_reusable() -> bool:
    """Whether one ``DefaultStager`` can stage more than one state dict (False on torch 2.11, whose
    ``DefaultStager`` closes its stager after each ``stage``). Found by staging a tiny state twice,
    once per process."""
    if not _STAGER_REUSABLE:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
            )
        )
        state = {"t": torch.zeros(1), "kind": torch.Tensor}  # a class object: what 2.11's cleared table misses
        try:
            for _ in range(2):
                stager.stage(state)
            _STAGER_REUSABLE.append(True)
        except KeyError:
            _STAGER_REUSABLE.append(False)
        finally:
            stager.close()
    return _STAGER_REUSABLE[0]


# -- private attributes of torch objects (named here so that no other module reaches them) ----------------


def local_tensor(t: Any) -> torch.Tensor:
    """A DTensor's local shard as DTensor stores it (``_local_tensor``: no autograd view, unlike ``to_local()``)."""
    return t._local_tensor


def dtype_of_storage_type(name: str) -> torch.dtype:
    """The dtype of a pickled legacy storage type name (``FloatStorage`` ...), as ``torch.load`` decodes it."""
    return torch.storage._get_dtype_from_pickle_storage_type(name)


def torch_file_reader(source: Any) -> Any:
    """torch's zip-archive reader (``torch._C.PyTorchFileReader``) over a path or a binary file object."""
    return torch._C.PyTorchFileReader(source)


def plan_caching(planner: Any) -> bool:
    """Whether DCP's ``DefaultSavePlanner`` was asked to cache plans (``enable_plan_caching``)."""
    return bool(planner._enable_plan_caching)


def cached_plans_key(planner: Any) -> str:
    """The key DCP's ``DefaultSavePlanner`` files its cached plans under (per planner class)."""
    return planner._cached_plans_key


def metadata_path(writer: Any) -> Any:
    """Where DCP's ``FileSystemWriter`` writes the checkpoint's ``.metadata``."""
    return writer._get_metadata_path()


def state_dict_hooks(module: Any) -> dict[int, Any]:
    """A module's ``state_dict`` post-hooks, by handle id (``nn.Module._state_dict_hooks``: removable in place)."""
    return module._state_dict_hooks


def allgather_into(backend: Any, output: torch.Tensor, input: torch.Tensor, *opts: Any) -> Any:
    """A backend's allgather into one tensor (``ProcessGroupGloo._allgather_base``, bound under that name in
    every release 2.11-2.15): what a Python process group's ``all_gather_single`` hands to gloo."""
    return backend._allgather_base(output, input, *opts)


def set_backend_timeout(backend: Any, timeout: Any) -> None:
    """A backend's op timeout for the ops that follow (``ProcessGroupGloo._set_default_timeout``, what
    ``distributed_c10d._set_pg_timeout`` calls, every release 2.11-2.15; ``set_timeout`` where it is public)."""
    setter = getattr(backend, "_set_default_timeout", None) or backend.set_timeout
    setter(timeout)


try:  # DCP's own: automatic collection off for a state-dict call, so no rank pauses for one in the middle
    from torch.distributed.checkpoint.state_dict import _gc_context as gc_paused
except ImportError:  # a release without it: the same lines

    @contextlib.contextmanager
    def gc_paused() -> Iterator[None]:
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was:
                gc.enable()
