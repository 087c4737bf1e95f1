"""``make gpu-check`` (recipes/gpu_check.py): it skips with one line without CUDA, reads its goals from
the steps' results as the issue states them, and (e2e) its CPU rehearsal runs every step end to end."""

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from helpers import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "recipes" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_it_prints_one_skipped_line_and_succeeds(tmp_path, capsys, monkeypatch):
    gc = _module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main(["--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [gc.SKIP_LINE]
    assert "SKIPPED" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def _junit(path, cases):
    body = "".join(
        f'<testcase classname="tests.gpu.m" name="{n}">{"" if o == "passed" else f"<{o}/>"}</testcase>'
        for n, o in cases.items()
    )
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def test_tiers_count_as_met_only_when_tests_ran_and_none_failed(tmp_path):
    gc = _module()
    ran = gc.junit(_junit(tmp_path / "a.xml", {"t1": "passed", "t2": "skipped"}))
    assert (ran["tests"], ran["passed"], ran["skipped"], ran["failures"]) == (2, 1, 1, 0)
    failed = gc.junit(_junit(tmp_path / "b.xml", {"t1": "passed", "t2": "failure"}))
    skipped = gc.junit(_junit(tmp_path / "c.xml", {"t1": "skipped"}))
    ok = lambda t, done=True: gc._tier_ok({"x": {**t, "completed": done}}, "x")  # noqa: E731
    assert ok(ran) == 1.0
    assert ok(failed) == 0.0
    assert ok(skipped) is None  # no GPU: the tier did not run, not "passed"
    assert ok(ran, done=False) is None  # cut short by its time limit


def test_goals_are_read_from_the_step_results_against_the_issue_thresholds(tmp_path):
    gc = _module()
    results = {
        "single": [
            {"case": "load warm", "metric": "of raw", "value": 0.85},
            {"case": "load warm", "metric": "x DCP", "value": 9.0},
            {"case": "load cold", "metric": "of raw", "value": 0.95},
            {"case": "save", "metric": "of raw", "value": 0.7},
            {"case": "load cold raw T8", "metric": "GB/s", "value": 2.0},
            {"case": "load cold raw gds", "metric": "GB/s", "value": 3.0},
        ],
        "shared": {
            "loads": {
                "same": {"gbps": {"ucp": 9.0}, "raw_gbps": 10.0, "bytes_over_needed": {"ucp": 1.0}, "time_s": {}},
                "hsdp RS0": {
                    "gbps": {"ucp": 7.0},
                    "raw_gbps": 10.0,
                    "bytes_over_needed": {"ucp": 1.06},
                    "time_s": {"ucp": 1.0, "ucp_off": 1.02},
                },
            }
        },
        "async": {"median": {"ucp": {"blocked": 0.15}}},
        "gpu_tier": {
            "tests": 2,
            "passed": 1,
            "failures": 1,
            "errors": 0,
            "completed": True,
            "cases": {"m::test_gpu_one_rank_nccl_save_async_save_and_load[nccl]": "failed", "m::other": "passed"},
        },
    }
    got = {g["goal"]: (g["value"], g["met"]) for g in gc.evaluate(results)}
    assert got["one GPU: warm load / best raw pipeline"] == (0.85, True)
    assert got["one GPU: warm load / DCP's default"] == (9.0, False)
    assert got["one GPU: cold load / best raw pipeline"] == (0.95, True)
    assert got["one GPU: save from CUDA / raw"] == (0.7, False)
    assert got["shared GPU: worst case load / raw"] == (0.7, False)  # the worst case counts
    assert got["shared GPU: worst bytes read / needed, checksums verified"] == (1.06, False)
    assert got["HSDP: default read-once time / read-once off"][1] is True
    assert got["async save of 2 GiB from CUDA: blocked s"] == (0.15, True)
    assert got["async save on cuda:nccl,cpu:gloo and NCCL-only (GPU tier)"] == (0.0, False)
    assert got["GPU tier"] == (0.0, False)
    assert got["CPU quick tier on this torch"] == (None, None)  # not run: not measured, not met
    assert got["raw cuFile (GDS) / best raw cold pipeline (informs a GDS reader)"] == (1.5, True)
    goals = gc.evaluate(results)
    line = gc.summary_line({"device": "GPU X", "torch": "2.11"}, goals, rehearse=False)
    assert line.startswith(
        f"GPU CHECK GPU X, torch 2.11: {sum(bool(g['met']) for g in goals)} of {len(goals)} goals met"
    )
    assert "not measured: CPU quick tier on this torch" in line
    gc.svg_plot(goals, "t", tmp_path / "p.svg")
    assert ET.parse(tmp_path / "p.svg").getroot().tag.endswith("svg")


@pytest.mark.slow
@pytest.mark.e2e
def test_rehearsal_runs_every_step_on_the_cpu_through_the_staging_path(tmp_path):
    """``--rehearse``: the same steps a GPU run issues, on CPU targets forced through the host staging
    buffers, tiny sizes; every step succeeds and its results reach the JSON, the plot and the summary."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    run = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "gpu_check.py"), "--rehearse", "--out", str(out)]
        + ["--scratch", str(scratch), "--budget", "400"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("GPU CHECK REHEARSAL (CPU stand-in figures, not GPU figures): "), last
    report = json.loads((out / "gpu_check.json").read_text())
    assert [s for s, r in report["steps"].items() if r["rc"] != 0] == []
    assert set(report["steps"]) == {"gpu_tier", "single", "shared", "async", "quick_tier"}
    res = report["results"]
    loads = res["shared"]["loads"]
    assert set(loads) == {"same layout S0->S0", "tp-dim S0->S1", "hsdp RS0 2xN/2", "1->N S0", "N->1 S0"}
    for name, case in loads.items():  # the device path, forced: every byte went through staging buffers
        assert case["staged_bytes"] == case["needed_bytes"], name
        assert case["bytes_over_needed"]["ucp"] <= 1.05, (name, case["bytes_over_needed"])
    assert res["gpu_tier"]["tests"] > 0 and res["gpu_tier"]["skipped"] == res["gpu_tier"]["tests"]
    assert res["quick_tier"]["passed"] > 0 and res["quick_tier"]["failures"] == 0
    assert res["async"]["verify"] == "ok"
    assert len(report["goals"]) == len(_module().GOALS)
    assert ET.parse(out / "gpu_check.svg").getroot().tag.endswith("svg")
    assert not scratch.exists()  # the checkpoints are gone; only results stay under --out
