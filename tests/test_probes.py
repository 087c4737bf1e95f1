"""The import-time probes of the private torch behaviour ucp_dcp relies on (``ucp_dcp._probes``):
they pass on the installed torch, a torch that changed one is refused naming the probe (or, with
the override, warned about), and an untested release whose probes pass imports with a warning."""

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

import ucp_dcp
from ucp_dcp import _compat, _probes


def _start_import(patch: str, **env: str) -> subprocess.Popen:
    """``import ucp_dcp`` in a fresh interpreter after running ``patch`` (which changes torch)."""
    code = f"import torch, warnings\n{patch}\nimport ucp_dcp\nprint('IMPORTED')"
    full = {k: v for k, v in os.environ.items() if k != _compat.ALLOW_ENV}
    return subprocess.Popen(
        [sys.executable, "-W", "always", "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**full, **env},
    )


def test_every_probe_passes_on_the_installed_torch():
    assert _probes.run_probes() == []


def test_installed_torch_is_a_tested_release():
    assert _compat.torch_release() in _compat.TESTED_TORCH, torch.__version__


def test_untested_release_whose_probes_pass_imports_with_a_warning(import_after):
    out = import_after("untested-release")
    assert out.returncode == 0 and "IMPORTED" in out.stdout, out.stderr
    assert "UntestedTorchWarning" in out.stderr and "found torch 2.99.0" in out.stderr
    assert "Its probes of the private torch behaviour it relies on pass" in out.stderr


def test_a_tested_release_imports_without_a_warning(import_after):
    out = import_after("tested-release")
    assert out.returncode == 0 and "UntestedTorchWarning" not in out.stderr, out.stderr


_CHANGED_RECORD = """
import dataclasses, torch.distributed.checkpoint.filesystem as fs
@dataclasses.dataclass
class _StorageInfo:
    path: str
    start: int
    length: int
fs._StorageInfo = _StorageInfo
"""


_SCENARIOS: dict[str, tuple[str, dict[str, str]]] = {
    "untested-release": ("torch.__version__ = '2.99.0'", {}),
    "tested-release": ("", {}),
    "changed-record": (_CHANGED_RECORD, {}),
    "changed-record-allowed": (_CHANGED_RECORD, {_compat.ALLOW_ENV: "1"}),
    # a torch whose _StridedShard split its dim contiguously (like Shard) would put rows elsewhere
    "changed-strided-shard": (
        "from torch.distributed.tensor import Shard\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "_StridedShard._split_tensor = lambda self, t, k, **kw: Shard(self.dim)._split_tensor(t, k, **kw)",
        {},
    ),
    "changed-planner-hook": (
        "from torch.distributed.checkpoint.planner import LoadPlanner\n"
        "LoadPlanner.commit_tensor = lambda self, read_item, tensor, stream: None",
        {},
    ),
}
"""Each changed torch the probes are tried against, with the environment of its import."""


@pytest.fixture(scope="module")
def import_after() -> Iterator[Callable[[str], subprocess.CompletedProcess]]:
    """The imports of every scenario, started together (each interpreter spends seconds importing
    torch; one after another they cost ``make test`` 18 s) and awaited by the test that reads one."""
    started = {name: _start_import(patch, **env) for name, (patch, env) in _SCENARIOS.items()}
    done: dict[str, subprocess.CompletedProcess] = {}

    def result(name: str) -> subprocess.CompletedProcess:
        if name not in done:
            proc = started[name]
            out, err = proc.communicate(timeout=300)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return done[name]

    yield result
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_changed_storage_record_is_refused_naming_the_probe(import_after):
    out = import_after("changed-record")
    assert out.returncode != 0 and "IMPORTED" not in out.stdout
    assert "UnsupportedTorchError" in out.stderr
    assert "probe 'storage_records'" in out.stderr and "['path', 'start', 'length']" in out.stderr
    assert f"set {_compat.ALLOW_ENV}=1" in out.stderr and "pip install 'torch>=2.11,<2.16'" in out.stderr


def test_override_turns_a_failed_probe_into_a_warning(import_after):
    out = import_after("changed-record-allowed")
    assert out.returncode == 0 and "IMPORTED" in out.stdout, out.stderr
    assert "UntestedTorchWarning" in out.stderr and "probe 'storage_records'" in out.stderr


def test_changed_strided_shard_semantics_are_refused(import_after):
    out = import_after("changed-strided-shard")
    assert out.returncode != 0 and "probe 'strided_shard'" in out.stderr, out.stderr
    assert "wrong rows" in out.stderr


def test_changed_planner_hook_is_refused(import_after):
    out = import_after("changed-planner-hook")
    assert out.returncode != 0 and "probe 'planner_hooks'" in out.stderr, out.stderr
    assert "LoadPlanner.commit_tensor takes ['read_item', 'tensor', 'stream']" in out.stderr


def test_untested_torch_error_is_an_import_error():
    assert issubclass(ucp_dcp.UnsupportedTorchError, ImportError)
    assert issubclass(ucp_dcp.UntestedTorchWarning, UserWarning)


def test_default_stager_reuse_is_found_by_behaviour():
    """torch 2.11's DefaultStager closes itself after each stage (a second save through it fails in
    torch); 2.12+ reuse it. The recipes build one stager per save where it cannot be reused."""
    from ucp_dcp._compat import default_stager_reusable, torch_release

    assert default_stager_reusable() == (torch_release() >= (2, 12))
