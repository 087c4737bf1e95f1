"""The command line names itself as it was called (``usage: ucp-dcp ...`` from the console script,
``usage: python -m ucp_dcp ...`` from ``-m``), and the shipped quickstart is in the package a wheel installs; the
wheel holds the library alone (issue 48): not the checkout's development package (``dev/ucp_dev``: the tests'
fixtures, the recipes' toy model), which ``make setup`` installs from the checkout."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ucp_dcp.tools.cli import prog_name

ROOT = Path(__file__).resolve().parents[2]


def _help(*cmd: str, cwd: Path) -> str:
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_prog_name_is_the_script_or_python_dash_m():
    assert prog_name("/venv/bin/ucp-dcp") == "ucp-dcp"
    assert prog_name("ucp-dcp") == "ucp-dcp"
    assert prog_name("/site-packages/ucp_dcp/__main__.py") == "python -m ucp_dcp"


def test_the_console_script_prints_its_own_name(tmp_path):
    script = Path(sys.executable).with_name("ucp-dcp")
    if not script.exists():  # NOVENV=1 runs the checkout by PYTHONPATH: no console script installed
        pytest.skip(f"no ucp-dcp console script beside {sys.executable}")
    assert _help(str(script), cwd=tmp_path).startswith("usage: ucp-dcp ")
    assert _help(str(script), "quickstart", cwd=tmp_path).startswith("usage: ucp-dcp quickstart ")


def test_python_dash_m_prints_python_dash_m(tmp_path):
    text = _help(sys.executable, "-m", "ucp_dcp", cwd=tmp_path)
    assert text.startswith("usage: python -m ucp_dcp "), text
    assert "quickstart" in text


def test_a_quickstart_phase_outside_torchrun_says_how_to_run_it(tmp_path):
    """``save``/``load`` are one rank of a torchrun job; without torchrun's environment the module says so
    instead of waiting for a rendezvous."""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    out = subprocess.run(
        [sys.executable, "-m", "ucp_dcp.examples.quickstart", "save", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 2, out
    assert "torchrun --nproc-per-node N -m ucp_dcp.examples.quickstart save CHECKPOINT" in out.stderr
    assert not (tmp_path / "ckpt").exists()


def test_the_wheels_packages_are_ucp_dcp_and_its_subpackages_alone():
    """pyproject's package list (what a wheel holds, found as setuptools finds it): ucp_dcp and every subpackage
    with an ``__init__.py``, and nothing else: not ``ucp_dev`` (dev/), nor ``ucp_dcp.testing`` / ``ucp_dcp.toy``."""
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_namespace_packages, find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    found = set(finder(str(ROOT), include=find["include"], exclude=find.get("exclude", ())))
    packages = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ucp_dcp").rglob("__init__.py")
    }  # the library's packages
    assert found == packages, (sorted(found - packages), sorted(packages - found))
    assert not any(p.split(".")[:2] in (["ucp_dcp", "testing"], ["ucp_dcp", "toy"]) for p in found)
    assert (ROOT / "dev" / "ucp_dev" / "toy" / "__init__.py").exists()  # the development package is beside it


@pytest.mark.slow
def test_the_wheel_ships_the_quickstart_and_the_console_script(tmp_path):
    """A wheel built from the checkout's pyproject (packages found by ``include = ["ucp_dcp", "ucp_dcp.*"]``) holds
    ``ucp_dcp/examples/`` and the ``ucp-dcp`` entry point, so ``pip install`` alone runs the quickstart, and the
    library alone: nothing of the development package beside it (dev/) or of its old homes in ucp_dcp."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    for name in ("ucp_dcp", "dev"):  # a copy: the build writes build/ and egg-info beside its sources
        subprocess.run(["cp", "-r", str(ROOT / name), str(src / name)], check=True)
    (src / "ucp_dcp" / "testing" / "__pycache__").mkdir(parents=True)  # what git leaves of a moved package
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("ucp_dcp-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert {"ucp_dcp/examples/__init__.py", "ucp_dcp/examples/quickstart.py"} <= names
    assert "ucp-dcp = ucp_dcp.tools.cli:main" in entry_points
    outside = sorted(n for n in names if not n.startswith(("ucp_dcp/", "ucp_dcp-")))
    assert not outside, outside
    dev = sorted(n for n in names if n.startswith(("ucp_dcp/testing/", "ucp_dcp/toy/")) or "ucp_dev" in n)
    assert not dev, dev
    library = {str(p.relative_to(ROOT)) for p in (ROOT / "ucp_dcp").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == library
