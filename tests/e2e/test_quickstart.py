"""The README's quickstart as a user runs it, from a folder outside the checkout (the code comes from the installed
package, ``ucp_dcp/examples/quickstart.py``): every process must exit 0.

Under torch 2.13 it aborted at exit in 3 of 14 saves on 2 ranks ("terminate called without an active
exception", SIGABRT, after ``QUICKSTART OK``): a gloo worker thread dropped the last all-gather's tensors while
Python was finalizing (core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherCoalescedWork`` -> ``decref``
-> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``). The example ends with a barrier, whose work holds no
Python tensors; 0 of 16 aborted after. One run catches a return of it about 1 time in 5, so it runs several.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SIGNAL = re.compile(r"terminate called|SIGABRT|Signal \d+|exitcode\s*:\s*-\d+")


def _run(cmd, cwd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and not SIGNAL.search(text), f"exit {out.returncode}:\n{text[-3000:]}"
    return out.stdout


def _torchrun(world, *args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    return _run([*cmd, "-m", "ucp_dcp.examples.quickstart", *args], cwd)


def test_the_quickstart_saves_and_loads_and_every_process_exits_zero(tmp_path):
    """One phase per torchrun job (``torchrun -m ucp_dcp.examples.quickstart save|load``), the load into a fresh
    model and AdamW with no training step."""
    for i in range(3):  # the abort was at exit, about 1 save in 5
        _torchrun(2, "save", str(tmp_path / f"ckpt{i}"), cwd=tmp_path)
    stdout = _torchrun(4, "load", str(tmp_path / "ckpt2"), cwd=tmp_path)
    assert "QUICKSTART OK: 16 of 16 entries bitwise at 4 ranks" in stdout, stdout


def test_the_one_command_quickstart_starts_its_own_ranks_and_says_what_it_wrote(tmp_path):
    """The README's first-screen command, ``ucp-dcp quickstart CKPT``: 2 ranks save, 4 load, no torchrun; it names
    the checkpoint folder and the ``.ref.pt`` it wrote, and both are there."""
    script = Path(sys.executable).with_name("ucp-dcp")
    if not script.exists():  # NOVENV=1 runs the checkout by PYTHONPATH: no console script installed
        pytest.skip(f"no ucp-dcp console script beside {sys.executable}")
    ckpt = tmp_path / "ckpt"
    stdout = _run([str(script), "quickstart", str(ckpt)], cwd=tmp_path)
    assert "QUICKSTART saved at 2 ranks" in stdout, stdout
    assert "QUICKSTART OK: 16 of 16 entries bitwise at 4 ranks" in stdout, stdout
    assert f"wrote {ckpt}/ (the checkpoint: " in stdout and f"{ckpt}.ref.pt" in stdout, stdout
    assert (ckpt / ".metadata").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    assert (tmp_path / "ckpt.ref.pt").is_file()
