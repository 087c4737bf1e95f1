"""Settings in one place (issue 48): every environment variable the library reads is read in
``ucp_dcp/settings.py``, each is in the documented table, and a bad value is refused naming its variable."""

import ast
import pathlib

import pytest

from ucp_dcp import settings
from ucp_dcp.errors import InvalidArgumentError

PACKAGE = pathlib.Path(settings.__file__).parent
EXAMPLES = {"examples/quickstart.py"}  # a program of its own: it sets torchrun's variables for the ranks it spawns


def _environment_reads(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` that read the environment (``os.environ``, ``os.getenv``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
    return lines


def test_only_the_settings_module_reads_the_environment():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "settings.py" or rel in EXAMPLES:
            continue
        if lines := _environment_reads(path):
            found[rel] = lines
    assert not found, f"environment read outside ucp_dcp/settings.py: {found}"


def test_every_variable_is_in_the_settings_table_of_the_docs():
    doc = (PACKAGE.parent / "docs" / "guide.md").read_text()
    table = settings.__doc__ or ""
    for name in settings.ENV.values():
        assert f"``{name}``" in table, name
        assert f"`{name}`" in doc, f"{name} missing from the Settings table of docs/guide.md"


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan"])
def test_a_bad_timeout_is_refused_naming_its_variable(monkeypatch, value):
    monkeypatch.setenv("UCP_DCP_PEER_TIMEOUT_S", value)
    with pytest.raises(InvalidArgumentError, match="UCP_DCP_PEER_TIMEOUT_S"):
        settings.peer_timeout_s()
    monkeypatch.setenv("UCP_DCP_PEER_TIMEOUT_S", "8")
    monkeypatch.setenv("UCP_DCP_BEAT_S", value)
    with pytest.raises(InvalidArgumentError, match="UCP_DCP_BEAT_S"):
        settings.beat_s()


def test_defaults_and_values(monkeypatch):
    for name in settings.ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert settings.peer_timeout_s() == 30.0 and settings.beat_s() == 3.0
    assert settings.control_group() is True and settings.control_group(False) is False
    assert settings.progress() is None and settings.staging() == "auto" and not settings.p2p_side()
    monkeypatch.setenv("UCP_DCP_PEER_TIMEOUT_S", "8")
    monkeypatch.setenv("UCP_DCP_CONTROL_GROUP", "off")
    monkeypatch.setenv("UCP_DCP_PROGRESS", "0")
    monkeypatch.setenv("UCP_DCP_STAGING", "always")
    assert settings.beat_s() == 0.8 and settings.control_group() is False and settings.progress() is False
    assert settings.staging() == "always"
    monkeypatch.setenv("UCP_DCP_STAGING", "sometimes")
    with pytest.raises(InvalidArgumentError, match=r"UCP_DCP_STAGING"):
        settings.staging()
