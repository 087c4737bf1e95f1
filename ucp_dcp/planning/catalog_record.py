"""The catalog as typed records, parsed from the checkpoint's JSON with every field checked.

A catalog comes from a file (``.metadata``'s ``planner_data``), so it is untrusted input: :meth:`Catalog.from_json`
checks the type of every field planning reads and raises :class:`~ucp_dcp.errors.CatalogError` naming the
field (``atoms['w'].shape``) instead of failing later on a bad value. Fields that were added over time are
optional (checkpoints of earlier ucp_dcp releases parse), fields this release does not know are kept in
``extra`` and written back unchanged (:meth:`Catalog.to_json`), so the on-disk format stays the one
:mod:`ucp_dcp.planning.catalog` documents.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CatalogError

__all__ = ["AtomLayout", "AtomRecord", "MeshRecord", "Catalog"]


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
