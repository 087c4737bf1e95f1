"""How a value is laid out at save or load: a mesh and one placement per mesh dim.

A ``Layout`` is a plain, hashable description (no process group, no tensors) so that it can be
recorded in the catalog, compared by the plan cache, and fed to the pure fragment math. It is
derived from a DTensor's ``device_mesh``/``placements``; plain tensors have ``Layout.replicated()``.
Values without placements (``ShardedTensor``, ``CheckpointableTensor``): the second half of this module.
"""

from __future__ import annotations

import enum
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .._compat import ShardedTensor, _StridedShard, is_checkpointable_tensor, root_mesh
from ..errors import AmbiguousLayoutError, CatalogError

__all__ = [
    "CheckpointableShard",
    "Layout",
    "LocalShard",
    "MeshInfo",
    "Placement",
    "PlacementKind",
    "SHARD_RECORD_LIMIT",
    "checkpointable_shards",
    "declare_twin",
    "global_shape",
    "sharded_tensor_record",
    "sharded_tensor_shards",
]

_PLACEMENT_RE = re.compile(r"^(R|S\((\d+)\)|SS\((\d+),(\d+)\)|P\((\w+)\))$")


class PlacementKind(str, enum.Enum):
    """A placement's kind; the value is its code in the catalog (``R``, ``S(d)``, ...)."""

    REPLICATE = "R"
    SHARD = "S"
    STRIDED_SHARD = "SS"
    """``_StridedShard``: FSDP2 x TP on one dim, non-contiguous."""
    PARTIAL = "P"
    """A pending reduction (refused at save)."""

    @property
    def shards(self) -> bool:
        """Whether this kind cuts a tensor dim."""
        return self in (PlacementKind.SHARD, PlacementKind.STRIDED_SHARD)


@dataclass(frozen=True)
class Placement:
    """One mesh dim's placement, decoupled from DTensor classes."""

    kind: PlacementKind
    """Replicate, shard, strided shard or partial."""
    dim: int = -1
    """Tensor dim sharded by ``S``/``SS``; -1 otherwise."""
    split_factor: int = 1
    """``_StridedShard.split_factor`` for ``SS``; 1 otherwise."""
    reduce_op: str = ""
    """Reduction of a ``Partial`` placement (only to name it in errors)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", PlacementKind(self.kind))  # codes ("S") are accepted too

    @staticmethod
    def from_torch(p: Any) -> Placement:
        if isinstance(p, _StridedShard):  # check first: _StridedShard is not a Shard subclass today,
            return Placement(PlacementKind.STRIDED_SHARD, int(p.dim), int(p.split_factor))  # be explicit
        if isinstance(p, Shard):
            return Placement(PlacementKind.SHARD, int(p.dim))
        if isinstance(p, Replicate):
            return Placement(PlacementKind.REPLICATE)
        if isinstance(p, Partial):
            return Placement(PlacementKind.PARTIAL, reduce_op=str(p.reduce_op))
        raise AmbiguousLayoutError(f"unsupported DTensor placement {p!r}")

    def encode(self) -> str:
        if self.kind is PlacementKind.REPLICATE:
            return "R"
        if self.kind is PlacementKind.SHARD:
            return f"S({self.dim})"
        if self.kind is PlacementKind.STRIDED_SHARD:
            return f"SS({self.dim},{self.split_factor})"
        return f"P({self.reduce_op})"

    @staticmethod
    def decode(text: str) -> Placement:
        m = _PLACEMENT_RE.match(text)
        if not m:
            raise CatalogError(f"bad placement code {text!r}", saved=text)
        if text == "R":
            return Placement(PlacementKind.REPLICATE)
        if m.group(2) is not None:
            return Placement(PlacementKind.SHARD, int(m.group(2)))
        if m.group(3) is not None:
            return Placement(PlacementKind.STRIDED_SHARD, int(m.group(3)), int(m.group(4)))
        return Placement(PlacementKind.PARTIAL, reduce_op=m.group(5))

    def __str__(self) -> str:
        return self.encode()


@dataclass(frozen=True)
class MeshInfo:
    """A device mesh as recorded in the catalog."""

    shape: tuple[int, ...]
    """Mesh shape, e.g. ``(2, 2)``."""
    dim_names: tuple[str, ...] | None
    """``mesh_dim_names`` or None."""
    ranks: tuple[int, ...]
    """Global ranks of the mesh in row-major order (``mesh.mesh.flatten()``)."""
    position: tuple[tuple[str, int], ...] = ()
    """Where a mesh sliced from a larger one sits along that root mesh's pipeline and expert dims
    (``(("pp", 1),)`` for stage 1's FSDP mesh): the dims it does not span, with this rank's
    coordinate. Empty for a mesh that is not a slice, or spans them all."""
    replica_siblings: bool = False
    """The root mesh also has non-trivial dims of another kind the slice does not span (data-parallel
    ranks of a TP-only job each hold a whole copy on their own TP mesh): sibling slices hold replicas."""

    def to_json(self) -> dict[str, Any]:
        """The catalog's record of the mesh (a new dict each call; its ``ranks`` list, O(mesh size), is made
        once per mesh and shared: every DTensor on the mesh records it, treat it as read-only)."""
        ranks = self.__dict__.get("_ranks_json")
        if ranks is None:
            ranks = list(self.ranks)
            object.__setattr__(self, "_ranks_json", ranks)
        out: dict[str, Any] = {
            "shape": list(self.shape),
            "dim_names": list(self.dim_names) if self.dim_names is not None else None,
            "ranks": ranks,
        }
        if self.position:
            out["position"] = [list(p) for p in self.position]
        return out

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[tuple[str, int], ...]]:
        """``(sorted ranks, position)``: what tells two meshes apart in the mesh checks
        (:mod:`ucp_dcp.layout.structure`), worked out once per mesh."""
        key = self.__dict__.get("_key")
        if key is None:
            key = (tuple(sorted(self.ranks)), self.position)
            object.__setattr__(self, "_key", key)
        return key


@dataclass(frozen=True)
class Layout:
    """Mesh shape + placements of one value; ``mesh_shape == ()`` means a plain (replicated) value."""

    mesh_shape: tuple[int, ...]
    """Shape of the device mesh the value lives on (empty for plain tensors)."""
    placements: tuple[Placement, ...]
    """One placement per mesh dim, applied left to right like DTensor does."""
    mesh_dim_names: tuple[str, ...] | None = None
    """Mesh dim names, kept for the catalog and error messages."""

    @staticmethod
    def replicated() -> Layout:
        return Layout((), ())

    @staticmethod
    def from_dtensor(t: DTensor) -> Layout:
        # a pure function of the mesh's shape and names and the placements: made once per distinct one
        # (every DTensor of a state dict asks, and ``plan`` asks again for every rank it simulates)
        placements = tuple(t.placements)
        key = (_per_mesh(t.device_mesh, "shape", _mesh_shape), tuple((type(p), p) for p in placements))
        hit = _LAYOUTS.get(key)
        if hit is None:
            if len(_LAYOUTS) > 4096:
                _LAYOUTS.clear()
            shape, names = key[0]
            hit = _LAYOUTS[key] = Layout(shape, tuple(Placement.from_torch(p) for p in placements), names)
        return hit

    @property
    def is_plain(self) -> bool:
        return not self.mesh_shape

    def partial_dims(self) -> list[int]:
        return [i for i, p in enumerate(self.placements) if p.kind is PlacementKind.PARTIAL]

    def encode_placements(self) -> list[str]:
        return [p.encode() for p in self.placements]

    def describe(self) -> str:
        if self.is_plain:
            return "plain tensor"
        names = self.mesh_dim_names or tuple(f"d{i}" for i in range(len(self.mesh_shape)))
        dims = ",".join(f"{n}={s}" for n, s in zip(names, self.mesh_shape))
        return f"mesh({dims}) [{', '.join(self.encode_placements())}]"


_MESH_CACHE: dict[tuple[int, str], tuple[Any, Any]] = {}
"""(id of a mesh, what) -> (weak reference to the mesh, the value): what ucp_dcp works out once per mesh
object. Not an attribute of the mesh: a mesh is pickled with every ``torch.save`` of a DTensor on it, and
an attribute of ours in that pickle made the file unloadable with ``weights_only=True`` (torch's default)
and anywhere ucp_dcp is not installed."""
_TWINS: dict[int, tuple[Any, Any]] = {}
"""id of a mesh -> (weak reference to it, its twin): a mesh object declared to hold the same ranks in the same
places as another one (:func:`declare_twin`), whose per-mesh values it shares."""


def declare_twin(mesh: Any, twin: Any) -> None:
    """``mesh`` is another object for the mesh ``twin`` is, as this process's rank sees it: the same layout over
    the same rank map, the same dim names, a twin root, and the same slice of the root holding the rank (what
    ``DeviceMesh.mesh`` returns). What ucp_dcp works out per mesh (:func:`mesh_info`, the root's rank index) is
    then worked out once for both. ``ucp_dcp.tools.dryrun`` rebuilds each mesh for every rank it plans
    (:func:`ucp_dcp._compat.mesh_for_rank`); a rank in the same slice as an earlier one declares the copy a twin
    (each computed once, 2 per rank of a 4,096-rank plan, is O(world) each)."""
    while twin is not mesh and id(twin) in _TWINS:  # a chain resolves to its first mesh
        ref, first = _TWINS[id(twin)]
        if ref() is not twin:
            break
        twin = first
    if twin is mesh:
        return
    key = id(mesh)

    def forget(_ref: Any) -> None:
        _TWINS.pop(key, None)

    try:
        _TWINS[key] = (weakref.ref(mesh, forget), twin)
    except TypeError:  # not weakly referenceable: computed for itself
        pass


def _per_mesh(mesh: Any, what: str, compute: Callable[[Any], Any]) -> Any:
    key = (id(mesh), what)
    hit = _MESH_CACHE.get(key)
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    twin = _TWINS.get(id(mesh))
    if twin is not None and twin[0]() is mesh:
        value = _per_mesh(twin[1], what, compute)
    else:
        value = compute(mesh)

    def forget(_ref: Any) -> None:
        _MESH_CACHE.pop(key, None)

    try:
        ref = weakref.ref(mesh, forget)
    except TypeError:  # not weakly referenceable: computed each time
        return value
    _MESH_CACHE[key] = (ref, value)
    return value


def _mesh_shape(mesh: Any) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    return tuple(int(s) for s in mesh.shape), tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None


_LAYOUTS: dict[tuple[Any, tuple[Any, ...]], Layout] = {}
"""``((mesh shape, dim names), ((type, placement), ...))`` -> its :class:`Layout` (:meth:`Layout.from_dtensor`)."""


def _mesh_info(mesh: Any) -> MeshInfo:
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    position, siblings = _slice_position(mesh, ranks)
    return MeshInfo(tuple(int(s) for s in mesh.shape), names, ranks, position, siblings)


def mesh_info(t: DTensor) -> MeshInfo:
    # a mesh object's ranks never change, and every DTensor on it asks: O(mesh size) once
    return _per_mesh(t.device_mesh, "info", _mesh_info)


_STAGE_DIMS = {"pp", "pipe", "pipeline", "stage", "stages"}
_EXPERT_DIMS = {"ep", "expert", "experts"}


def is_stage_or_expert_dim(name: str) -> bool:
    """Whether a mesh dim named ``name`` numbers pipeline stages or expert-parallel ranks."""
    return bool(set(name.lower().split("_")) & (_STAGE_DIMS | _EXPERT_DIMS))


def _slice_position(mesh: Any, ranks: tuple[int, ...]) -> tuple[tuple[tuple[str, int], ...], bool]:
    """:attr:`MeshInfo.position` and :attr:`MeshInfo.replica_siblings` of ``mesh``, read off the
    root mesh it was sliced (or flattened) from: the root dims along which all of its ranks share
    one coordinate."""
    root = root_mesh(mesh)
    if root is mesh or not root.mesh_dim_names:
        return (), False
    index = _rank_coordinates(root)
    coords = [index[r] for r in ranks if r in index]
    if len(coords) != len(ranks):
        return (), False
    shape = tuple(int(s) for s in root.mesh.shape)
    position, siblings = [], False
    for d, name in enumerate(root.mesh_dim_names):
        if shape[d] == 1 or len({c[d] for c in coords}) > 1:
            continue  # trivial, or spanned by the slice
        if is_stage_or_expert_dim(name):
            position.append((name, coords[0][d]))
        else:
            siblings = True
    return tuple(position), siblings


def _rank_coordinates(root: Any) -> dict[int, tuple[int, ...]]:
    """Every rank's coordinate in the root mesh ``root``, built once per root mesh and cached on it: a
    ``grid == r`` scan per rank made each slice O(slice x root), which ``plan`` pays for every simulated rank
    (4,096 ranks: 253 s became 1,170 s)."""
    return _per_mesh(root, "coordinates", _coordinates)


def _coordinates(root: Any) -> dict[int, tuple[int, ...]]:
    grid = root.mesh
    flat = [int(r) for r in grid.flatten().tolist()]
    shape = tuple(int(s) for s in grid.shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return {r: tuple((i // strides[d]) % shape[d] for d in range(len(shape))) for i, r in enumerate(flat)}


def dtensor_coordinate(t: DTensor) -> tuple[int, ...] | None:
    """This rank's coordinate in ``t``'s mesh, or None if the rank is not part of it."""
    coord = t.device_mesh.get_coordinate()
    return None if coord is None else tuple(int(c) for c in coord)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CatalogError(f"unknown dtype {name!r}", saved=name)
    return dt


# -- values without placements: ShardedTensor and CheckpointableTensor ------------------------------------------------
# The local shards of values that carry no placements: a ``ShardedTensor`` (FSDP1 ``SHARDED_STATE_DICT``,
# ``torch.distributed._shard``: its shard plan lists boxes, read by :func:`sharded_tensor_shards` with nested
# ShardedTensors flattened, and described for the catalog in builtins by :func:`sharded_tensor_record`) and
# torch 2.14's ``CheckpointableTensor`` (:func:`checkpointable_shards`). DTensor placements:
# :mod:`ucp_dcp.layout.placements`.


# ShardedTensor ----------------------------------------------------------------------------------

SHARD_RECORD_LIMIT = 64
"""Shard plans with at most this many shards are listed in the catalog record in full; larger ones
(FSDP1 at scale: one shard per rank) keep the spec, its dim and the count. Every rank sends its
records to the coordinator, so a full list would cost O(ranks^2) per atom on the gather."""


@dataclass(frozen=True)
class LocalShard:
    """One piece of a ShardedTensor held by this rank, in the global tensor's coordinates."""

    offsets: tuple[int, ...]
    """Where the piece starts in the global tensor (nested offsets added up)."""
    sizes: tuple[int, ...]
    """Its extent per dim (the tensor's shape)."""
    tensor: torch.Tensor
    """The local memory."""


def sharded_tensor_shards(st: Any, name: str) -> list[LocalShard]:
    """This rank's pieces of ShardedTensor ``st`` (atom ``name``, for errors).

    A local shard whose tensor is itself a ShardedTensor (FSDP1 over a ``torch.distributed._shard``
    tensor-parallel shard: ``torch.distributed.tensor.parallel.fsdp``) contributes its own local
    shards, their offsets added to the outer shard's, at any depth and any count (DCP's
    ``_flatten_sharded_tensors`` does the same for one inner shard). Each piece must have the shape
    its metadata states and lie inside its parent; every piece must share one dtype and device."""
    out: list[LocalShard] = []
    _collect_shards(st, (0,) * len(st.size()), tuple(int(s) for s in st.size()), name, out)
    if len({p.tensor.dtype for p in out}) > 1 or len({p.tensor.device for p in out}) > 1:
        raise AmbiguousLayoutError(
            f"'{name}': the local shards of this ShardedTensor differ in dtype or device "
            f"({sorted({f'{p.tensor.dtype}@{p.tensor.device}' for p in out})})",
            atom=name,
            hint="keep every local shard of one ShardedTensor in one dtype on one device",
        )
    return out


def _collect_shards(st: Any, origin: tuple[int, ...], bound: tuple[int, ...], name: str, out: list[LocalShard]) -> None:
    for shard in st.local_shards():
        md = shard.metadata
        offs = tuple(int(o) for o in md.shard_offsets)
        sizes = tuple(int(n) for n in md.shard_sizes)
        if len(offs) != len(bound) or any(o < 0 or o + n > b for o, n, b in zip(offs, sizes, bound)):
            raise AmbiguousLayoutError(
                f"'{name}': a local shard at offsets {list(offs)} with sizes {list(sizes)} does not fit inside "
                f"shape {list(bound)} (the ShardedTensor's, or the shard holding it)",
                atom=name,
                saved=list(bound),
                wanted=[list(offs), list(sizes)],
                hint="the ShardedTensor's metadata is inconsistent; rebuild it from its local shards",
            )
        at = tuple(a + o for a, o in zip(origin, offs))
        t = shard.tensor
        if isinstance(t, ShardedTensor):
            if tuple(int(s) for s in t.size()) != sizes:
                raise AmbiguousLayoutError(
                    f"'{name}': a nested ShardedTensor of shape {list(t.size())} sits in a shard of sizes "
                    f"{list(sizes)}",
                    atom=name,
                    saved=list(sizes),
                    wanted=list(t.size()),
                    hint="an inner ShardedTensor must have the shape of the outer shard it fills",
                )
            _collect_shards(t, at, sizes, name, out)
            continue
        if isinstance(t, DTensor):
            raise AmbiguousLayoutError(
                f"'{name}': a ShardedTensor shard holds a DTensor ({Layout.from_dtensor(t).describe()}); the "
                "shard metadata states one box but the DTensor holds only its own piece of it, and no torch "
                "API builds such a value (FSDP1 + tensor parallelism nests ShardedTensors, or uses DTensors "
                "throughout with a device mesh)",
                atom=name,
                hint="save the DTensor itself, or give FSDP1 a device_mesh so its state dict holds DTensors",
            )
        if tuple(t.shape) != sizes:
            raise AmbiguousLayoutError(
                f"'{name}': a local shard's tensor has shape {list(t.shape)} but its metadata states sizes "
                f"{list(sizes)}",
                atom=name,
                saved=list(sizes),
                wanted=list(t.shape),
                hint="the ShardedTensor's metadata is inconsistent with its local shards",
            )
        out.append(LocalShard(at, sizes, t))


def sharded_tensor_record(st: Any) -> dict[str, Any]:
    """The catalog's description of a ShardedTensor's shard plan, in builtins only::

        {"kind": "sharded_tensor", "spec": "chunk", "dim": 0, "count": 4,
         "shards": [{"offsets": [0, 0], "sizes": [3, 5], "placement": "rank:0/cpu"}, ...]}

    ``spec`` is ``chunk`` (``ChunkShardingSpec``, with its ``dim``), ``enumerable`` or the spec's
    class name; ``shards`` is the global plan from the metadata (every rank holds the same), listed
    up to :data:`SHARD_RECORD_LIMIT` shards; ``nested`` marks shards that are ShardedTensors."""
    spec = getattr(st, "_sharding_spec", None)
    kind = type(spec).__name__ if spec is not None else "none"
    rec: dict[str, Any] = {
        "kind": "sharded_tensor",
        "spec": {"ChunkShardingSpec": "chunk", "EnumerableShardingSpec": "enumerable"}.get(kind, kind),
    }
    if rec["spec"] == "chunk":
        rec["dim"] = int(spec.dim) if isinstance(spec.dim, int) else str(spec.dim)
    plan = st.metadata().shards_metadata
    rec["count"] = len(plan)
    if len(plan) <= SHARD_RECORD_LIMIT:
        rec["shards"] = [
            {
                "offsets": [int(o) for o in m.shard_offsets],
                "sizes": [int(n) for n in m.shard_sizes],
                "placement": str(m.placement),
            }
            for m in plan
        ]
    if any(isinstance(s.tensor, ShardedTensor) for s in st.local_shards()):
        rec["nested"] = True
    return rec


# CheckpointableTensor (torch >= 2.14) ---------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointableShard:
    """One shard of a ``CheckpointableTensor``: a box of the global tensor held at a box of the local one."""

    global_offsets: tuple[int, ...]
    """Where the shard starts in the global tensor."""
    local_offsets: tuple[int, ...]
    """Where it starts in the local tensor (one local tensor may hold several shards, and padding)."""
    sizes: tuple[int, ...]
    """Its extent per dim (the same in both)."""


def global_shape(value: torch.Tensor) -> tuple[int, ...]:
    """The logical shape of a tensor value: a ``CheckpointableTensor``'s ``global_shape``, else its
    shape (a DTensor's and a ShardedTensor's shape is already the global one)."""
    if is_checkpointable_tensor(value):
        return tuple(int(n) for n in value.global_shape)
    return tuple(int(n) for n in value.shape)


def checkpointable_shards(value: torch.Tensor, name: str) -> list[CheckpointableShard]:
    """The shards a ``CheckpointableTensor`` (DCP's protocol, pytorch#189492) states: one per entry of
    ``global_offsets``/``local_offsets``/``local_sizes``. Checked as DCP checks them (equal counts,
    ranks, every box inside the global and the local shape), but as an error naming the atom."""
    shape = global_shape(value)
    local = tuple(int(n) for n in value.shape)
    goffs, loffs, sizes = (list(getattr(value, f)) for f in ("global_offsets", "local_offsets", "local_sizes"))
    problem = None
    if not len(goffs) == len(loffs) == len(sizes):
        problem = (
            f"global_offsets, local_offsets and local_sizes have {len(goffs)}, {len(loffs)} and {len(sizes)} entries"
        )
    out = []
    for i, (g, lo, n) in enumerate(zip(goffs, loffs, sizes)):
        if problem:
            break
        g, lo, n = tuple(int(x) for x in g), tuple(int(x) for x in lo), tuple(int(x) for x in n)
        if not len(g) == len(n) == len(shape) or len(lo) != len(local) or len(n) != len(local):
            problem = (
                f"shard {i} has {len(g)}-d global offsets, {len(lo)}-d local offsets and {len(n)}-d sizes for "
                f"a {len(shape)}-d global and {len(local)}-d local tensor"
            )
        elif any(o < 0 or k < 0 or o + k > d for o, k, d in zip(g, n, shape)):
            problem = (
                f"shard {i} at global offsets {list(g)} with sizes {list(n)} lies outside global_shape {list(shape)}"
            )
        elif any(o < 0 or k < 0 or o + k > d for o, k, d in zip(lo, n, local)):
            problem = (
                f"shard {i} at local offsets {list(lo)} with sizes {list(n)} lies outside the local shape {list(local)}"
            )
        else:
            out.append(CheckpointableShard(g, lo, n))
    if problem:
        raise AmbiguousLayoutError(
            f"'{name}': a CheckpointableTensor states inconsistent shards: {problem}",
            atom=name,
            saved=list(shape),
            wanted=list(local),
            hint="set global_shape, global_offsets, local_offsets and local_sizes as torch's "
            "torch.distributed.checkpoint.CheckpointableTensor documents them",
        )
    return out
