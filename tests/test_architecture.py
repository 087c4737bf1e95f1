"""The package's architecture, read from the source: layers as folders, no import running back up, no
cycles, the development package (the toy model, the test fixtures) apart from the library, and private torch /
torchtitan names only through the ``_compat`` modules -- imported or reached by attribute.

Layers, lowest first (a module imports only its own layer and those below it, anywhere in the file,
also inside functions):

    base      ucp_dcp.errors, ucp_dcp._compat, ucp_dcp._version, ucp_dcp.progress
    layout    ucp_dcp/layout/ (names, placements, fragments, patterns, ...), ucp_dcp.options, ucp_dcp._probes
    planning  ucp_dcp/planning/ (the two planners and their steps)
    storage   ucp_dcp/storage/ (format, commit, reader, writer, ...), ucp_dcp.api (save/load: planners + storage)
    memory    ucp_dcp/memory/ (the host-memory checkpoint tier: generations, replicas, drain, loads from peers)
    sources   ucp_dcp/sources/ (Hugging Face, other frameworks' checkpoints)
    peers     ucp_dcp/peers/ (ucp_dcp inside other checkpointing libraries: torch_checkpointing's resharder)
    torchtitan  ucp_dcp/torchtitan/ (the integration)
    tools     ucp_dcp/tools/ (the command line), ucp_dcp.__main__

The checkout's development package ``ucp_dev`` (dev/, not in the wheel: tests/tools/test_cli_names.py) stands
apart: no ucp_dcp module imports it or names it in code. ``ucp_dev.toy`` (the recipes' and tests' model) may use
ucp_dcp's base, layout and sources (its rules and HF presets), and its model and trainer import no ucp_dcp module.
``ucp_dev.testing`` (the fixtures tests and recipes share) sits on top of everything: it may import any module and
patch torch / torchtitan internals (the CPU launcher) without going through ``_compat``.
``ucp_dcp.examples`` (the quickstart, shipped so that ``pip install`` alone runs it) is user code: it imports the
package as a user's script does (``import ucp_dcp``), and no module imports it but the command line's
``quickstart`` (``ucp_dcp.tools.cli``).
The package ``ucp_dcp`` (its ``__init__``) only re-exports and is imported by no module (but the examples).
"""

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ucp_dcp"
DEV = Path(__file__).resolve().parent.parent / "dev" / "ucp_dev"
LAYERS = ("base", "layout", "planning", "storage", "memory", "sources", "peers", "torchtitan", "tools")
TOP_LEVEL = {
    "ucp_dcp.errors": "base",
    "ucp_dcp.settings": "base",  # the environment variables, read in one place: the errors only
    "ucp_dcp._compat": "base",
    "ucp_dcp._version": "base",
    "ucp_dcp.progress": "base",
    "ucp_dcp.train_state": "base",  # RNG and data-position entries: torch and the errors only
    "ucp_dcp.options": "layout",
    "ucp_dcp._probes": "layout",
    "ucp_dcp.api": "storage",
    "ucp_dcp.__main__": "tools",
}
"""The layer of each module at the top of the package (the folders give the others)."""
TOY_MAY_IMPORT = ("base", "layout", "sources")
COMPAT = ("ucp_dcp._compat", "ucp_dcp.torchtitan._compat")
"""The only modules that may name private torch / torchtitan names."""
PRIVATE_ROOTS = ("torch", "torchtitan")


def _module(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES = {_module(p): ast.parse(p.read_text()) for p in sorted(PKG.rglob("*.py"))}
KNOWN = set(SOURCES)
DEV_SOURCES = {_module(p, DEV): ast.parse(p.read_text()) for p in sorted(DEV.rglob("*.py"))}
"""The development package's modules (``ucp_dev.toy``, ``ucp_dev.testing``), read the same way."""
ROOTS = ("ucp_dcp", "ucp_dev")


def _is_pkg(name: str) -> bool:
    base = DEV if name.split(".")[0] == "ucp_dev" else PKG
    return (base.parent / Path(*name.split(".")) / "__init__.py").exists()


def _imported(name: str, tree: ast.Module) -> set[str]:
    """ucp_dcp and ucp_dev modules (and names) module ``name`` imports, anywhere in it, also inside functions."""
    pkg = name if _is_pkg(name) else name.rsplit(".", 1)[0]
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] in ROOTS:
                mod = node.module
            else:
                continue
            if node.module:
                deps.add(mod)
            deps.update(f"{mod}.{a.name}" for a in node.names)  # `from . import catalog`: a module
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.split(".")[0] in ROOTS)
    return deps


def _imports(name: str) -> set[str]:
    """ucp_dcp modules ``name`` imports (anywhere in it, also inside functions)."""
    return {d for d in _imported(name, SOURCES[name]) if d in KNOWN and d != name}


GRAPH = {m: _imports(m) for m in SOURCES}
DEV_KNOWN = KNOWN | set(DEV_SOURCES)
DEV_GRAPH = {m: {d for d in _imported(m, t) if d in DEV_KNOWN and d != m} for m, t in DEV_SOURCES.items()}
"""The development package's imports of ucp_dcp and ucp_dev modules."""


def _layer(m: str) -> str | None:
    """The layer of ucp_dcp module ``m``; ``examples`` and ``package`` for those two; None: not placed."""
    if m == "ucp_dcp":
        return "package"
    if m in TOP_LEVEL:
        return TOP_LEVEL[m]
    folder = m.split(".")[1]
    if folder == "examples":
        return folder
    return folder if folder in LAYERS else None


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _inside(m: str, pkg: str) -> bool:
    return m == pkg or m.startswith(pkg + ".")


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in SOURCES if _layer(m) is None)
    assert not unplaced, f"modules in no layer folder (or add them to TOP_LEVEL with a reason): {unplaced}"


@pytest.mark.parametrize("module", sorted(m for m in SOURCES if _layer(m) in LAYERS))
def test_module_imports_no_higher_layer(module):
    rank = LAYERS.index(_layer(module))
    up = sorted(d for d in GRAPH[module] if _layer(d) in LAYERS and LAYERS.index(_layer(d)) > rank)
    assert not up, f"{module} ({_layer(module)}) imports a higher layer: {[(d, _layer(d)) for d in up]}"


def test_no_module_imports_or_names_the_development_package():
    """``ucp_dev`` (the toy model, the tests' and recipes' fixtures) is not in the wheel: the library never
    imports it, nor names it in code (a default, a module path in a command line); its documentation may."""
    imports = {m: sorted(d for d in _imported(m, t) if d.split(".")[0] == "ucp_dev") for m, t in SOURCES.items()}
    assert not any(imports.values()), {m: d for m, d in imports.items() if d}
    named = {}
    for m, tree in SOURCES.items():
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings, attribute docs
        found = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and "ucp_dev" in n.value and id(n) not in docs
        ]
        if found:
            named[m] = found
    assert not named, named


@pytest.mark.parametrize("module", sorted(m for m in DEV_SOURCES if m.startswith("ucp_dev.toy")))
def test_toy_imports_only_what_it_may(module):
    bad = sorted(d for d in DEV_GRAPH[module] if not d.startswith("ucp_dev.toy") and _layer(d) not in TOY_MAY_IMPORT)
    assert not bad, f"{module} imports {bad}; the toy model may use ucp_dcp's {TOY_MAY_IMPORT} only"


def test_only_the_fixtures_import_the_toy_model_in_the_development_package():
    bad = {
        m: sorted(d for d in deps if d.startswith("ucp_dev.toy"))
        for m, deps in DEV_GRAPH.items()
        if not m.startswith(("ucp_dev.toy", "ucp_dev.testing"))
    }
    assert not any(bad.values()), {m: d for m, d in bad.items() if d}


def test_toy_model_and_trainer_depend_on_no_ucp_dcp_module():
    """The oracle (``ucp_dev.toy.parallel.logical_state``) must not depend on the code under test."""
    assert {"ucp_dev.toy.model", "ucp_dev.toy.parallel", "ucp_dev.toy.layouts"} <= set(DEV_SOURCES)
    for m in ("ucp_dev.toy.model", "ucp_dev.toy.parallel"):
        seen, todo = set(), [m]
        while todo:
            for dep in DEV_GRAPH.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        outside = sorted(d for d in seen if not d.startswith("ucp_dev.toy."))
        assert not outside, f"{m} reaches {outside}"


@pytest.mark.parametrize("planner", ["save_planner", "load_planner"])
def test_planners_reach_no_storage_module(planner):
    reached = sorted(
        m for m in _closure(f"ucp_dcp.planning.{planner}") if _layer(m) not in ("base", "layout", "planning")
    )
    assert not reached, f"ucp_dcp.planning.{planner} reaches {reached}"


def test_no_import_cycles():
    for m in GRAPH:
        if m == "ucp_dcp":  # the package's __init__ re-exports; modules never import it
            continue
        assert m not in _closure(m) - {"ucp_dcp"}, f"{m} imports itself through {sorted(_closure(m))}"
    assert not any("ucp_dcp" in deps for m, deps in GRAPH.items() if _layer(m) not in ("package", "examples")), (
        "a module imports the package"
    )


def test_only_the_command_line_imports_the_examples():
    """The examples are user code on top of the package: the library never depends on them."""
    assert "ucp_dcp.examples.quickstart" in KNOWN
    bad = {
        m: sorted(d for d in GRAPH[m] if _layer(d) == "examples")
        for m in SOURCES
        if _layer(m) != "examples" and m != "ucp_dcp.tools.cli"
    }
    assert not any(bad.values()), {m: d for m, d in bad.items() if d}


def test_the_package_init_only_re_exports():
    """``ucp_dcp/__init__.py`` holds imports, ``__all__`` and the import-time probe, no definitions."""
    defs = [n.name for n in SOURCES["ucp_dcp"].body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not defs, defs


def test_no_module_shadows_the_standard_library():
    shadows = [m for m in GRAPH if m.rsplit(".", 1)[-1] in sys.stdlib_module_names]
    assert not shadows, shadows


# -- private torch / torchtitan names only through _compat ------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_here() -> set[str]:
    """Every name ucp_dcp itself defines or binds: functions, classes, attributes it assigns, variables, and
    what the ``_compat`` modules import (they hand private names on under a name of their own)."""
    out = set()
    for m, tree in SOURCES.items():
        for n in ast.walk(tree):
            if m in COMPAT and isinstance(n, ast.alias):
                out.add(n.asname or n.name)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
    return out


def _private_uses(name: str, defined: set[str]) -> list[str]:
    """Private names of torch / torchtitan that module ``name`` uses: imported (``from torch._x import y``,
    ``from torch.x import _y``), reached along an attribute chain from an imported torch / torchtitan name
    (``torch.storage._get_dtype...``, ``dist.distributed_c10d._world``), or reached on an object by a private
    attribute that ucp_dcp does not define itself (``manager._states_to_load()``, ``t._local_tensor``)."""
    tree, found, roots = SOURCES[name], [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in PRIVATE_ROOTS:
                for a in node.names:
                    if any(_private(p) for p in node.module.split(".")) or _private(a.name):
                        found.append(f"from {node.module} import {a.name}")
                    roots.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PRIVATE_ROOTS:
                    if any(_private(p) for p in a.name.split(".")):
                        found.append(f"import {a.name}")
                    roots.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in roots:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif node.attr not in defined:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_torch_and_torchtitan_names_only_through_compat():
    defined = _defined_here()
    bad = {m: _private_uses(m, defined) for m in SOURCES if m not in COMPAT}
    bad = {m: uses for m, uses in bad.items() if uses}
    assert not bad, f"private names outside {COMPAT} (add a named function there): {bad}"


def test_the_private_name_scan_sees_attribute_access():
    """The scan itself: an attribute chain from torch and a private method of a library object are caught."""
    src = (
        "import torch\nfrom torchtitan.x import M\ntorch.storage._get_dtype(1)\nM._y\nm._flattened_model_states_sd()\n"
    )
    SOURCES["ucp_dcp._scan_probe"] = ast.parse(src)
    try:
        uses = _private_uses("ucp_dcp._scan_probe", set())
    finally:
        del SOURCES["ucp_dcp._scan_probe"]
    assert sorted(u.split(": ", 1)[1] for u in uses) == [
        "M._y",
        "m._flattened_model_states_sd",
        "torch.storage._get_dtype",
    ]


def _listed(section: str) -> set[str]:
    """The module files a table of docs/concepts.md's section ``section`` names."""
    import re

    text = (PKG.parent / "docs" / "concepts.md").read_text()
    part = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = "\n".join(line for line in part.splitlines() if line.startswith("|"))
    return set(re.findall(r"`([\w/]+\.py)`", rows))


@pytest.mark.parametrize(("section", "root"), [("Code map", PKG), ("Development package map", DEV)])
def test_the_code_maps_in_docs_concepts_list_every_module_and_nothing_else(section, root):
    """docs/concepts.md's code map names every module under ucp_dcp/ (but the packages' __init__) and none
    that is gone; its development package map the same for dev/ucp_dev/."""
    listed = _listed(section)
    present = {str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py"}
    assert not present - listed, f"modules missing from the {section.lower()}: {sorted(present - listed)}"
    assert not listed - present, f"the {section.lower()} lists modules that do not exist: {sorted(listed - present)}"
