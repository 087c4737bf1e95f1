"""End to end: the elastic-resume recipe in fresh processes, and its oracle catching a corruption; the MoE demo."""

import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _recipe(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "elastic_resume.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_recipe_resumes_and_detects_corruption(tmp_path):
    out = _recipe("--save-topology", "dp=2,tp=2", "--load-topology", "dp=3", "--steps", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESUME OK: dp=2,tp=2 -> dp=3:"), last
    assert (tmp_path / "loss.png").exists() and (tmp_path / "oracle.pt").exists()
    # flip one loaded element: the bitwise oracle must refuse it
    bad = _recipe(
        "--save-topology",
        "dp=2,tp=2",
        "--load-topology",
        "dp=3",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
        "--phase",
        "load",
        "--corrupt",
    )
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    last = bad.stdout.strip().splitlines()[-1]
    assert last.startswith("RESUME MISMATCH") and "differ from the oracle" in last, last


def test_moe_demo_resumes_at_ep4_and_catches_swapped_experts(tmp_path):
    """``make moe-demo``'s recipe, one resume (ep=4) plus its sabotage run; the other layouts are
    tests/e2e/test_titan_moe.py's."""
    pytest.importorskip("torchtitan")
    from helpers import skip_unless_torchtitan_runs

    skip_unless_torchtitan_runs()
    out = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "moe_demo.py"), "--only", "ep4", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0 and last.startswith("MOE OK: ep4: "), out.stdout[-3000:] + out.stderr[-3000:]
    assert "swapped experts caught" in last, last


def test_memory_demo_kills_a_host_and_resumes_at_a_smaller_layout_from_memory(tmp_path):
    """``make memory-demo``: a host SIGKILLed, its memory gone, the durable copy hidden; the resume at tp=2
    must come from the memory tier, bitwise."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "memory_demo.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0 and last.startswith("MEMORY OK: "), out.stdout[-3000:] + out.stderr[-3000:]
    assert "from memory generation 3" in last and "bitwise" in last, last


def test_memory_demo_a_host_sigkilled_while_replicating_leaves_the_previous_generation_to_resume(tmp_path):
    """node1's ranks SIGKILLed in the middle of the last generation's replication: that generation never
    completes, and the resume at tp=2 loads the one before it from memory, bitwise."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "memory_demo.py"),
            "--out",
            str(tmp_path),
            "--kill-during",
            "replication",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0 and last.startswith("MEMORY OK: "), out.stdout[-3000:] + out.stderr[-3000:]
    assert "generation 3 incomplete after node1 died replicating it" in out.stdout, out.stdout
    assert "from memory generation 2" in last and "bitwise" in last, last
