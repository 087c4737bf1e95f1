"""The import-time probes of the private torch behaviour ucp_dcp relies on (``ucp_dcp._probes``):
they pass on the installed torch, a torch that changed one is refused naming the probe (or, with
the override, warned about), and an untested release whose probes pass imports with a warning."""

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

import ucp_dcp
from ucp_dcp import _compat, _probes

_DRIVER = """
import json, os, sys, traceback, warnings
import torch, torch.distributed.checkpoint, torch.distributed.tensor
out_dir, scenarios = sys.argv[1], json.loads(sys.argv[2])
children = {}
for name, (patch, env) in scenarios.items():
    pid = os.fork()
    if pid == 0:  # the scenario: its own streams, environment and warning filters, then the import
        for fd, ext in ((1, "out"), (2, "err")):
            os.dup2(os.open(os.path.join(out_dir, name + "." + ext), os.O_WRONLY | os.O_CREAT, 0o644), fd)
        os.environ.update(env)
        warnings.simplefilter("always")
        try:
            exec(patch, {"torch": torch, "warnings": warnings})
            import ucp_dcp
            print("IMPORTED")
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    children[pid] = name
for pid, name in children.items():
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(out_dir, name + ".rc"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""
"""Imports ``ucp_dcp`` once per scenario, each in a child forked from one interpreter that has imported torch
(a fresh interpreter per scenario spent 2 s each importing torch: 13 s of ``make test``); the child applies the
scenario's change to torch, then imports ``ucp_dcp`` as a fresh process would (it was never imported there)."""


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
def import_after(tmp_path_factory) -> Iterator[Callable[[str], subprocess.CompletedProcess]]:
    """The imports of every scenario, started together at the first test that reads one."""
    out_dir = tmp_path_factory.mktemp("probes")
    env = {k: v for k, v in os.environ.items() if k != _compat.ALLOW_ENV}
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, str(out_dir), json.dumps(_SCENARIOS)], env=env)

    def result(name: str) -> subprocess.CompletedProcess:
        if driver.poll() is None:
            driver.wait(timeout=300)
        assert driver.returncode == 0, f"the probe driver failed ({driver.returncode})"
        read = lambda ext: (out_dir / f"{name}.{ext}").read_text()  # noqa: E731
        return subprocess.CompletedProcess(name, int(read("rc")), read("out"), read("err"))

    yield result
    if driver.poll() is None:
        driver.kill()
        driver.wait()


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
