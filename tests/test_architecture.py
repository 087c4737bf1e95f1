"""The package's layering, read from the source: planners above storage, no cycles, private torch
names only through ``_compat``, the core independent of the torchtitan integration and of the toy
model (``ucp_dcp.toy``), whose model and trainer depend on no other ucp_dcp module."""

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ucp_dcp"
PLANNERS = {"save_planner", "load_planner"}


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> tuple[set[str], list[tuple[str, str]]]:
    """ucp_dcp modules a file imports (anywhere in it, also inside functions), and every
    ``(torch module, name)`` it imports from torch."""
    name = _module(path)
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps, torch_names = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
                deps.update([mod] if node.module else [f"{mod}.{a.name}" for a in node.names])
            elif node.module and node.module.startswith("ucp_dcp"):
                deps.add(node.module)
            elif node.module and node.module.split(".")[0] == "torch":
                torch_names += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith("ucp_dcp"))
            torch_names += [(a.name, "") for a in node.names if a.name.split(".")[0] == "torch"]
    known = {_module(p) for p in PKG.rglob("*.py")}
    return {d for d in deps if d in known and d != name}, torch_names


GRAPH = {_module(p): _imports(p)[0] for p in PKG.rglob("*.py")}


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_planners_import_no_storage_module(planner):
    reached = {m for m in _closure(f"ucp_dcp.planning.{planner}") if m.startswith(("ucp_dcp.storage", "ucp_dcp.tools"))}
    assert not reached, f"ucp_dcp.planning.{planner} reaches storage modules {sorted(reached)}"


def test_core_imports_nothing_from_the_torchtitan_integration():
    # the tools (ucp_dcp.tools: plan, export) sit above the integration and import it only when asked for it
    core = [m for m in GRAPH if not m.startswith(("ucp_dcp.torchtitan", "ucp_dcp.tools"))]
    bad = {m: sorted(d for d in GRAPH[m] if d.startswith("ucp_dcp.torchtitan")) for m in core}
    assert not any(bad.values()), bad


def test_core_imports_nothing_from_the_toy_model():
    """``ucp_dcp.toy`` (the recipes' and tests' model and trainer) is not part of the library: only
    ``ucp_dcp.tools.dryrun`` (which plans loads for it) may import it."""
    def inside(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")

    core = [m for m in GRAPH if not inside(m, "ucp_dcp.toy") and not inside(m, "ucp_dcp.tools.dryrun")]
    bad = {m: sorted(d for d in GRAPH[m] if inside(d, "ucp_dcp.toy")) for m in core}
    assert not any(bad.values()), {m: d for m, d in bad.items() if d}


def test_toy_model_and_trainer_depend_on_no_other_ucp_dcp_module():
    """The oracle (``ucp_dcp.toy.parallel.logical_state``) must not depend on the code under test:
    the model and trainer reach only each other; ``layouts`` (the description to ucp_dcp) may use
    the library's rule types."""
    assert {"ucp_dcp.toy.model", "ucp_dcp.toy.parallel", "ucp_dcp.toy.layouts"} <= set(GRAPH)
    for m in ("ucp_dcp.toy.model", "ucp_dcp.toy.parallel"):
        outside = sorted(d for d in _closure(m) if not d.startswith("ucp_dcp.toy."))
        assert not outside, f"{m} reaches {outside}"


def test_no_import_cycles():
    for m in GRAPH:
        if m == "ucp_dcp":  # the package's __init__ re-exports; modules never import it
            continue
        assert m not in _closure(m) - {"ucp_dcp"}, f"{m} imports itself through {sorted(_closure(m))}"
    assert not any("ucp_dcp" in deps for m, deps in GRAPH.items() if m != "ucp_dcp"), "a module imports the package"


def test_private_torch_names_only_through_compat():
    bad = []
    for path in PKG.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for mod, name in _imports(path)[1]:
            if any(part.startswith("_") for part in mod.split(".")) or name.startswith("_"):
                bad.append(f"{_module(path)}: from {mod} import {name}")
    assert not bad, bad


def test_no_module_shadows_the_standard_library():
    shadows = [m for m in GRAPH if m.rsplit(".", 1)[-1] in sys.stdlib_module_names]
    assert not shadows, shadows
