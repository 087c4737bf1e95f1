"""The catalog as typed records: a bad field of the (untrusted) catalog is a CatalogError naming it, records
round-trip to the on-disk dict a save writes, and catalogs of earlier releases (fewer fields) still parse."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ucp_dcp
from ucp_dcp import CatalogError, CatalogVersionError
from ucp_dcp.planning.catalog import CATALOG_KEY, FORMAT, Catalog, load_catalog, read_catalog

GOOD = {
    "format": FORMAT,
    "version": 1,
    "writer": {"ucp_dcp": "0.1.0", "torch": "2.13.0"},
    "topology": {"world_size": 4, "meshes": [{"shape": [2, 2], "dim_names": ["dp", "tp"], "ranks": [0, 1, 2, 3]}]},
    "atoms": {
        "model.w": {
            "value": "tensor",
            "shape": [8, 4],
            "dtype": "float32",
            "kind": "model",
            "param": "w",
            "pattern": "dtensor",
            "layouts": [{"mesh": 0, "placements": ["S(0)", "R"]}],
            "aliases": ["model.head"],
        },
        "step": {"value": "object", "kind": "other", "param": None, "pattern": "object", "layouts": []},
    },
    "rules": [{"kind": "padded", "pattern": "x", "size": 3}],
    "maps": ["layers"],
    "map_orders": {"layers": "ascending"},
}


def _with(path: str, value):
    cat = copy.deepcopy(GOOD)
    *parents, last = path.split("/")
    d = cat
    for p in parents:
        d = d[int(p)] if isinstance(d, list) else d[p]
    d[last] = value
    return {CATALOG_KEY: cat}


def test_a_catalog_parses_into_typed_records():
    cat = load_catalog({CATALOG_KEY: GOOD})
    assert isinstance(cat, Catalog) and cat.world_size == 4 and cat.maps == ("layers",)
    w = cat.atoms["model.w"]
    assert w.shape == (8, 4) and w.layouts[0].placements == ("S(0)", "R") and cat.meshes[0].dim_names == ("dp", "tp")
    assert cat.aliases() == {"model.head": "model.w"}
    assert cat.to_json(FORMAT) == GOOD  # what a save writes, unchanged


@pytest.mark.parametrize(
    "path,value,named",
    [
        ("atoms/model.w/shape", "8x4", "atoms['model.w'].shape"),
        ("atoms/model.w/shape", [8, "4"], "atoms['model.w'].shape[1]"),
        ("atoms/model.w/value", "blob", "atoms['model.w'].value"),
        ("atoms/model.w/layouts", [{"mesh": "0", "placements": []}], "atoms['model.w'].layouts[0].mesh"),
        ("atoms/model.w/aliases", "model.head", "atoms['model.w'].aliases"),
        ("atoms/step", ["object"], "atoms['step']"),
        ("topology/world_size", "4", "topology.world_size"),
        ("topology/meshes", [{"shape": [2], "ranks": None}], "topology.meshes[0].ranks"),
        ("rules", {"kind": "padded"}, "rules"),
        ("maps", [1], "maps[0]"),
        ("map_orders", {"layers": 1}, "map_orders['layers']"),
        ("raw_optimizers", {"optim": [[0, "a"]]}, "raw_optimizers['optim'][0][1]"),
    ],
)
def test_a_bad_field_is_a_catalog_error_naming_it(path, value, named):
    for read in (load_catalog, read_catalog):
        with pytest.raises(CatalogError) as info:
            read(_with(path, value))
        assert f"field {named} " in str(info.value), str(info.value)
        assert isinstance(info.value, (CatalogVersionError, ValueError))


def test_a_catalog_of_an_earlier_release_parses():
    """The first catalogs had no rules, maps, map orders, dtypes or layouts lists."""
    old = {"format": FORMAT, "version": 1, "atoms": {"w": {"shape": [2], "kind": "model", "pattern": "plain"}}}
    cat = load_catalog({CATALOG_KEY: old})
    assert cat.atoms["w"].value == "tensor" and cat.rules == () and cat.world_size is None


def test_the_load_planner_refuses_a_damaged_catalog_naming_the_field(tmp_path):
    from helpers import rewrite_metadata

    ucp_dcp.save({"w": torch.ones(3)}, tmp_path)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    md.planner_data[CATALOG_KEY]["atoms"]["w"]["shape"] = ["three"]
    rewrite_metadata(tmp_path, md)
    with pytest.raises(CatalogError, match=r"atoms\['w'\]\.shape\[0\]"):
        ucp_dcp.load({"w": torch.zeros(3)}, tmp_path)


def test_a_saved_rule_missing_fields_is_a_pattern_error(tmp_path):
    from helpers import rewrite_metadata

    ucp_dcp.save({"w": torch.ones(3)}, tmp_path)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    md.planner_data[CATALOG_KEY]["rules"] = [{"kind": "padded", "pattern": "w"}]
    rewrite_metadata(tmp_path, md)
    with pytest.raises(ucp_dcp.PatternError, match="rule Padded in catalog: .*'size'"):
        ucp_dcp.load({"w": torch.zeros(3)}, tmp_path)
