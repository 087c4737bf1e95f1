"""The catalog: UCP metadata stored inside the checkpoint.

It lives in ``Metadata.planner_data[CATALOG_KEY]`` next to DCP's own flatten mappings (which stay
at the top level of ``planner_data`` so ``dcp_to_torch_save``, ``_EmptyStateDictLoadPlanner`` and
stock-planner loads keep working). It is made of builtins only (dict/list/str/int/bool/None), so
``.metadata`` unpickles where ``ucp_dcp`` is not installed.

Format (version 1)::

    {"format": "ucp-dcp.catalog", "version": 1,
     "writer": {"ucp_dcp": "0.1.0", "torch": "2.13.0"},
     "topology": {"world_size": 4,
                  "meshes": [{"shape": [2, 2], "dim_names": ["dp", "tp"], "ranks": [0, 1, 2, 3]}]},
     "atoms": {"model.layers.0.attn.wq.weight": {
                   "shape": [32, 32], "dtype": "float32", "value": "tensor",
                   "kind": "model", "param": "layers.0.attn.wq.weight", "pattern": "dtensor",
                   "layouts": [{"mesh": 0, "placements": ["SS(0,2)", "S(0)"]}]},
               ...}}

Readers ignore unknown keys; a larger *major* version than :data:`VERSION` is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import AmbiguousLayoutError, CatalogError, CatalogVersionError, ParamGroupError

__all__ = [
    "AtomLayout",
    "AtomRecord",
    "CATALOG_KEY",
    "Catalog",
    "FORMAT",
    "MeshRecord",
    "RAW_HINT",
    "VERSION",
    "load_catalog",
    "merge_local_catalogs",
    "merge_raw_optimizers",
    "raw_optimizer_error",
    "read_catalog",
]

CATALOG_KEY = "__ucp__"
"""Reserved key of ``Metadata.planner_data`` holding the catalog."""
FORMAT = "ucp-dcp.catalog"
VERSION = 1
"""Major version; bump on incompatible changes. Additive fields keep the version."""


def local_catalog() -> dict[str, Any]:
    """An empty per-rank catalog: ``meshes`` (list of mesh dicts) and ``atoms``."""
    return {"meshes": [], "atoms": {}}


def intern(items: list[dict[str, Any]], item: dict[str, Any]) -> int:
    """Index of ``item`` in ``items`` (meshes are shared by many atoms), appending it if new."""
    for i, x in enumerate(items):
        if x == item:
            return i
    items.append(item)
    return len(items) - 1


def merge_local_catalogs(
    local_cats: Sequence[dict[str, Any] | None],
    writer: dict[str, str],
    world_size: int | None = None,
    ranks: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Merge per-rank catalogs (one per distinct rank structure is enough) into the checkpoint
    catalog; every rank that holds an atom must agree on its logical shape, dtype and kind (else the
    save is ambiguous). ``ranks``: the ranks each catalog stands for (default: catalog ``i`` is rank
    ``i``), named in those errors. ``world_size`` defaults to the number of catalogs."""
    meshes: list[dict[str, Any]] = []
    atoms: dict[str, dict[str, Any]] = {}
    holders: dict[str, str] = {}
    raw = merge_raw_optimizers(local_cats)
    for i, cat in enumerate(local_cats):
        if not cat:
            continue
        rank = _ranks(ranks[i] if ranks is not None else [i])
        remap = [intern(meshes, m) for m in cat["meshes"]]
        for name, rec in cat["atoms"].items():
            layout = rec.get("layout")
            if layout is not None:
                layout = {"mesh": remap[layout["mesh"]], "placements": layout["placements"]}
            have = atoms.get(name)
            if have is None:
                merged = {k: v for k, v in rec.items() if k != "layout"}
                merged["layouts"] = [layout] if layout is not None else []
                atoms[name] = merged
                holders[name] = rank
                continue
            for key in ("shape", "dtype", "value", "kind"):
                if have.get(key) != rec.get(key):
                    raise AmbiguousLayoutError(
                        f"atom '{name}' is saved with {key}={have.get(key)!r} by {holders[name]} "
                        f"but {key}={rec.get(key)!r} by {rank}",
                        atom=name,
                        saved=have.get(key),
                        wanted=rec.get(key),
                        hint="every rank holding a piece of one logical tensor must describe the same tensor; "
                        "check for rank-dependent model construction or a name collision",
                    )
            sharded_now = layout is not None
            sharded_before = bool(have["layouts"])
            if sharded_now != sharded_before:
                raise AmbiguousLayoutError(
                    f"atom '{name}' is a plain tensor on some ranks and a DTensor on others "
                    f"({holders[name]} vs {rank})",
                    atom=name,
                    hint="save it with one layout everywhere (wrap the plain copy with DTensor.from_local, "
                    "or give the per-rank tensors distinct names)",
                )
            if layout is not None and layout not in have["layouts"]:
                have["layouts"].append(layout)
            if rec.get("aliases"):  # keys viewing this atom's tensor, on any rank
                have["aliases"] = sorted(set(have.get("aliases", ())) | set(rec["aliases"]))
    out = {
        "format": FORMAT,
        "version": VERSION,
        "writer": dict(writer),
        "topology": {"world_size": world_size if world_size is not None else len(local_cats), "meshes": meshes},
        "atoms": atoms,
    }
    if raw:
        out["raw_optimizers"] = raw
    return out


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 2`` / ``ranks [0, 1]``: the ranks one local catalog stands for, as errors name them."""
    shown = list(ranks)
    if len(shown) == 1:
        return f"rank {shown[0]}"
    return f"ranks {shown[:8]}" + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")


def merge_raw_optimizers(local_cats: Sequence[dict[str, Any] | None]) -> dict[str, list[list[int]]]:
    """The parameter positions of every raw ``optimizer.state_dict()`` saved, which all ranks must list
    alike: each rank's positions number its own optimizer's parameters, so under pipeline parallelism
    equal keys name different parameters (checked before the replicas, whose mismatch it explains)."""
    raw: dict[str, list[list[int]]] = {}
    for cat in local_cats:
        for prefix, groups in ((cat or {}).get("raw_optimizers") or {}).items():
            if raw.setdefault(prefix, groups) != groups:
                raise raw_optimizer_error(
                    prefix,
                    f"the raw optimizer.state_dict() '{prefix}' lists other parameter positions on different ranks "
                    f"({raw[prefix]} and {groups}): each rank's positions number its own optimizer's parameters "
                    "(pipeline stages), so equal keys would name different parameters",
                    raw[prefix],
                    groups,
                )
    return raw


RAW_HINT = (
    "build the state dict with torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) and "
    "load it back with set_state_dict: it keys optimizer state by parameter name (FQN), which any layout and "
    "parameter order can load; a raw optimizer.state_dict() loads only into an optimizer that lists the same "
    "parameters in the same order"
)
"""What DCP's docs advise for optimizer state, as the hint of every refusal of the raw form."""


def raw_optimizer_error(prefix: str, message: str, saved: Any, wanted: Any) -> ParamGroupError:
    """A refusal of a raw ``optimizer.state_dict()`` (parameters keyed by position) at ``prefix``."""
    return ParamGroupError(message, atom=f"{prefix}.param_groups", saved=saved, wanted=wanted, hint=RAW_HINT)


def read_catalog(planner_data: Any) -> dict[str, Any] | None:
    """The catalog inside ``Metadata.planner_data`` as stored (None for checkpoints written without
    ucp_dcp), checked field by field (:class:`~ucp_dcp.errors.CatalogError` names a bad one). Planning
    reads it typed: :func:`load_catalog`."""
    cat = _raw_catalog(planner_data)
    if cat is not None:
        Catalog.from_json(cat)
    return cat


def load_catalog(planner_data: Any) -> Catalog | None:
    """The catalog inside ``Metadata.planner_data`` as a typed, checked :class:`Catalog` (None: no catalog)."""
    cat = _raw_catalog(planner_data)
    return Catalog.from_json(cat) if cat is not None else None


def _raw_catalog(planner_data: Any) -> dict[str, Any] | None:
    """The catalog dict, its format and version checked (a newer major version is refused whole)."""
    if not isinstance(planner_data, dict):
        return None
    cat = planner_data.get(CATALOG_KEY)
    if cat is None:
        return None
    if not isinstance(cat, dict) or cat.get("format") != FORMAT:
        raise CatalogVersionError(
            f"planner_data[{CATALOG_KEY!r}] is not a ucp-dcp catalog",
            hint="the checkpoint's metadata was written by another tool under ucp_dcp's reserved key",
        )
    version = cat.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CatalogVersionError(
            f"checkpoint catalog version {version!r} is newer than this ucp_dcp supports ({VERSION})",
            saved=version,
            wanted=VERSION,
            hint="upgrade ucp_dcp to load this checkpoint",
        )
    return cat


# -- the catalog as typed records, parsed from the checkpoint's JSON with every field checked ------------------------
# A catalog comes from a file (``.metadata``'s ``planner_data``), so it is untrusted input: :meth:`Catalog.from_json`
# checks the type of every field planning reads and raises :class:`~ucp_dcp.errors.CatalogError` naming the
# field (``atoms['w'].shape``) instead of failing later on a bad value. Fields that were added over time are
# optional (checkpoints of earlier ucp_dcp releases parse), fields this release does not know are kept in
# ``extra`` and written back unchanged (:meth:`Catalog.to_json`), so the on-disk format stays the one
# :mod:`ucp_dcp.planning.catalog` documents.


def _fail(where: str, want: str, got: Any) -> CatalogError:
    return CatalogError(
        f"the checkpoint's catalog field {where} should be {want}, got {got!r}"[:400],
        saved=where,
        wanted=want,
        hint="the checkpoint's metadata is damaged, or another tool wrote under ucp_dcp's reserved key",
    )


def _str(v: Any, where: str, optional: bool = True) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise _fail(where, "a string", v)
    return v


def _int(v: Any, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _fail(where, "an integer", v)
    return v


def _ints(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise _fail(where, "a list of integers", v)
    return tuple(_int(x, f"{where}[{i}]") for i, x in enumerate(v))


def _strs(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)):
        raise _fail(where, "a list of strings", v)
    return tuple(_str(x, f"{where}[{i}]", optional=False) or "" for i, x in enumerate(v))


def _dict(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
        raise _fail(where, "a dict with string keys", v)
    return dict(v)


@dataclass(frozen=True)
class AtomLayout:
    """One DTensor layout an atom was saved with."""

    mesh: int
    """Index into :attr:`Catalog.meshes`."""
    placements: tuple[str, ...]
    """Placement codes, one per mesh dim (``S(0)``, ``R``, ``SS(0,2)``: :meth:`Placement.decode`)."""


@dataclass(frozen=True)
class AtomRecord:
    """What the catalog says of one atom (a logical tensor or object)."""

    value: str
    """``"tensor"`` or ``"object"``."""
    kind: str | None = None
    """``model``, ``optim_state``, ``param_group``, ... (:mod:`ucp_dcp.layout.naming`)."""
    param: str | None = None
    """The parameter name the atom belongs to (for optimizer state: the parameter's)."""
    pattern: str | None = None
    """How it was saved: ``dtensor``, ``plain``, ``fused``, ``padded``, ``object``, ``reduce:<op>``, ..."""
    shape: tuple[int, ...] | None = None
    """Logical (global) shape; None for an object."""
    dtype: str | None = None
    """Tensor dtype name (``float32``); None for an object."""
    layouts: tuple[AtomLayout, ...] = ()
    """The DTensor layouts of the ranks that saved it (empty: a plain tensor or an object)."""
    aliases: tuple[str, ...] = ()
    """Other keys that were this same tensor at save (tied parameters)."""
    live: str | None = None
    """The live tensor this atom is a part of (fused parts, tied copies)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Rule-specific fields (``rule``, ``live_shape``, ``blocks``, ``sharded_tensor``, ...), as written."""

    _KNOWN = ("value", "kind", "param", "pattern", "shape", "dtype", "layouts", "aliases", "live")

    @classmethod
    def from_json(cls, raw: Any, where: str) -> AtomRecord:
        d = _dict(raw, where)
        value = _str(d.get("value", "tensor"), f"{where}.value", optional=False)
        if value not in ("tensor", "object"):
            raise _fail(f"{where}.value", "'tensor' or 'object'", value)
        layouts = []
        for i, lay in enumerate(d.get("layouts") or ()):
            w = f"{where}.layouts[{i}]"
            lay = _dict(lay, w)
            layouts.append(
                AtomLayout(_int(lay.get("mesh"), f"{w}.mesh"), _strs(lay.get("placements"), f"{w}.placements"))
            )
        shape = d.get("shape")
        return cls(
            value=value or "tensor",
            kind=_str(d.get("kind"), f"{where}.kind"),
            param=_str(d.get("param"), f"{where}.param"),
            pattern=_str(d.get("pattern"), f"{where}.pattern"),
            shape=_ints(shape, f"{where}.shape") if shape is not None else None,
            dtype=_str(d.get("dtype"), f"{where}.dtype"),
            layouts=tuple(layouts),
            aliases=_strs(d.get("aliases") or (), f"{where}.aliases"),
            live=_str(d.get("live"), f"{where}.live"),
            extra={k: v for k, v in d.items() if k not in cls._KNOWN},
        )

    def to_json(self) -> dict[str, Any]:
        # the writer's keys: kind/param/pattern on every record, shape/dtype on tensors, live where set
        out: dict[str, Any] = {"value": self.value, "kind": self.kind, "param": self.param, "pattern": self.pattern}
        if self.shape is not None:
            out["shape"] = list(self.shape)
        for name in ("dtype", "live"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out["layouts"] = [{"mesh": lay.mesh, "placements": list(lay.placements)} for lay in self.layouts]
        if self.aliases:
            out["aliases"] = list(self.aliases)
        return out | self.extra


@dataclass(frozen=True)
class MeshRecord:
    """A device mesh some atom was saved on."""

    shape: tuple[int, ...]
    """Mesh shape."""
    ranks: tuple[int, ...]
    """The global ranks of the mesh, row-major."""
    dim_names: tuple[str, ...] | None = None
    """``mesh_dim_names``, or None."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other fields (``position``: the mesh's coordinates in a larger one), as written."""

    @classmethod
    def from_json(cls, raw: Any, where: str) -> MeshRecord:
        d = _dict(raw, where)
        names = d.get("dim_names")
        return cls(
            _ints(d.get("shape"), f"{where}.shape"),
            _ints(d.get("ranks"), f"{where}.ranks"),
            _strs(names, f"{where}.dim_names") if names is not None else None,
            {k: v for k, v in d.items() if k not in ("shape", "ranks", "dim_names")},
        )

    def to_json(self) -> dict[str, Any]:
        names = list(self.dim_names) if self.dim_names is not None else None
        return {"shape": list(self.shape), "dim_names": names, "ranks": list(self.ranks)} | self.extra


@dataclass(frozen=True)
class Catalog:
    """The checkpoint's catalog (``Metadata.planner_data["__ucp__"]``), checked."""

    version: int
    """Major format version (a larger one than this release reads is refused before parsing)."""
    writer: dict[str, str] = field(default_factory=dict)
    """Releases that wrote it (``{"ucp_dcp": ..., "torch": ...}``)."""
    world_size: int | None = None
    """Ranks of the save (None: an early catalog without a topology)."""
    meshes: tuple[MeshRecord, ...] = ()
    """The meshes the atoms' layouts index."""
    atoms: dict[str, AtomRecord] = field(default_factory=dict)
    """Atom name -> its record."""
    rules: tuple[dict[str, Any], ...] = ()
    """The pattern rules the save declared, as JSON (:func:`ucp_dcp.layout.patterns.rule_from_json`)."""
    maps: tuple[str, ...] = ()
    """Keys of the index maps (``layers``, ``experts``) the save used."""
    map_orders: dict[str, str] = field(default_factory=dict)
    """Index-map key -> ``ascending`` / ``descending`` / ``other``: how owners numbered their entries."""
    raw_optimizers: dict[str, list[list[int]]] = field(default_factory=dict)
    """Prefix of a raw ``optimizer.state_dict()`` -> its param groups' parameter positions."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Top-level fields this release does not know, kept as written."""

    _KNOWN = ("format", "version", "writer", "topology", "atoms", "rules", "maps", "map_orders", "raw_optimizers")

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Catalog:
        """Parse a catalog dict whose format and version were checked (:func:`ucp_dcp.planning.catalog.read_catalog`)."""
        d = _dict(raw, "catalog")
        topo = _dict(d.get("topology") or {}, "topology")
        ws = topo.get("world_size")
        atoms = _dict(d.get("atoms") or {}, "atoms")
        raw_opt = _dict(d.get("raw_optimizers") or {}, "raw_optimizers")
        rules = d.get("rules") or []
        if not isinstance(rules, list):
            raise _fail("rules", "a list of rule objects", rules)
        orders = _dict(d.get("map_orders") or {}, "map_orders")
        return cls(
            version=_int(d.get("version"), "version"),
            writer={k: str(v) for k, v in _dict(d.get("writer") or {}, "writer").items()},
            world_size=_int(ws, "topology.world_size") if ws is not None else None,
            meshes=tuple(
                MeshRecord.from_json(m, f"topology.meshes[{i}]") for i, m in enumerate(topo.get("meshes") or ())
            ),
            atoms={name: AtomRecord.from_json(rec, f"atoms[{name!r}]") for name, rec in atoms.items()},
            rules=tuple(_dict(r, f"rules[{i}]") for i, r in enumerate(rules)),
            maps=_strs(d.get("maps") or (), "maps"),
            map_orders={k: _str(v, f"map_orders[{k!r}]", optional=False) or "" for k, v in orders.items()},
            raw_optimizers={
                p: [list(_ints(g, f"raw_optimizers[{p!r}][{i}]")) for i, g in enumerate(_list(groups, p))]
                for p, groups in raw_opt.items()
            },
            extra={k: v for k, v in d.items() if k not in cls._KNOWN},
        )

    def to_json(self, format_name: str) -> dict[str, Any]:
        """The on-disk form (builtins only; ``format_name``: :data:`ucp_dcp.planning.catalog.FORMAT`)."""
        out: dict[str, Any] = {
            "format": format_name,
            "version": self.version,
            "writer": dict(self.writer),
            "topology": {"world_size": self.world_size, "meshes": [m.to_json() for m in self.meshes]},
            "atoms": {name: rec.to_json() for name, rec in self.atoms.items()},
            "rules": [dict(r) for r in self.rules],
            "maps": list(self.maps),
        }
        if self.map_orders:
            out["map_orders"] = dict(self.map_orders)
        if self.raw_optimizers:
            out["raw_optimizers"] = {p: [list(g) for g in gs] for p, gs in self.raw_optimizers.items()}
        return out | self.extra

    def aliases(self) -> dict[str, str]:
        """Alias key -> the atom saved for it."""
        return {alias: name for name, rec in self.atoms.items() for alias in rec.aliases}

    def saved_names(self) -> frozenset[str]:
        """Every name the catalog knows a saved value by: atoms, their parameters and live tensors (worked out
        once: a load asks twice, and ``plan`` again for every rank it simulates on one catalog)."""
        names = self.__dict__.get("_saved_names")
        if names is None:
            names = frozenset(x for name, rec in self.atoms.items() for x in (name, rec.param, rec.live) if x)
            object.__setattr__(self, "_saved_names", names)
        return names


def _list(v: Any, prefix: str) -> list[Any]:
    if not isinstance(v, list):
        raise _fail(f"raw_optimizers[{prefix!r}]", "a list of parameter-position lists", v)
    return v
