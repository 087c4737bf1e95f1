"""``--target mod:fn`` is imported from the current folder, as ``python -m ucp_dcp`` does, also by the
``ucp-dcp`` console script, whose ``sys.path`` does not hold that folder (issue 34); the hint says what was
searched, or which module the target itself failed to import."""

import sys

import pytest

from ucp_dcp.errors import UCPError
from ucp_dcp.tools.dryrun.targets import load_function


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's folder with ``mine/plan_mine.py``, the current folder; sys.path as the console script has it."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "mine" / "plan_mine.py").write_text("def target(rank, world_size):\n    return {}\n")
    (tmp_path / "broken.py").write_text("import not_installed_anywhere_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("mine", "mine.plan_mine", "broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_the_target_module_is_found_in_the_current_folder(project):
    assert load_function("mine.plan_mine:target")(0, 1) == {}


def test_a_module_that_is_nowhere_is_named_with_the_folder_searched(project, monkeypatch):
    with pytest.raises(UCPError) as e:
        load_function("theirs.plan:target")
    assert "no 'theirs' package or theirs.py in the current folder" in e.value.hint and str(project) in e.value.hint


def test_a_dependency_the_target_lacks_is_named_as_such(project):
    with pytest.raises(UCPError) as e:
        load_function("broken:target")
    assert "'not_installed_anywhere_xyz'" in e.value.hint and "a module it imports" in e.value.hint
