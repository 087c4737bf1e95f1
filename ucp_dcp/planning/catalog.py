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

from collections.abc import Sequence
from typing import Any

from ..errors import AmbiguousLayoutError, CatalogVersionError, ParamGroupError
from .catalog_record import Catalog

__all__ = [
    "CATALOG_KEY",
    "FORMAT",
    "VERSION",
    "RAW_HINT",
    "merge_local_catalogs",
    "merge_raw_optimizers",
    "raw_optimizer_error",
    "read_catalog",
    "load_catalog",
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
            for field in ("shape", "dtype", "value", "kind"):
                if have.get(field) != rec.get(field):
                    raise AmbiguousLayoutError(
                        f"atom '{name}' is saved with {field}={have.get(field)!r} by {holders[name]} "
                        f"but {field}={rec.get(field)!r} by {rank}",
                        atom=name,
                        saved=have.get(field),
                        wanted=rec.get(field),
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
