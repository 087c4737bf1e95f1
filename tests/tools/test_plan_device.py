"""``plan`` finds where the job's state lives (issue 47): it assumed CUDA, reporting "state on cuda" and 96 MiB of
staging buffers for a CPU job unless given ``--device cpu``. Now ``--device`` wins, then the target's own word
(``fn.plan_device``; the torchtitan target and the recipes' toy target say cuda), then where the tensors the target builds are;
only a target built on the meta device that says nothing is assumed to be a CUDA job, and the report says so."""

import pytest
import torch
from helpers import run_cli

import ucp_dcp
from ucp_dcp.planning.device import STAGE_BYTES
from ucp_dcp.tools.dryrun.report import format_report
from ucp_dcp.tools.dryrun.simulate import plan_load
from ucp_dcp.tools.dryrun.targets import FunctionTarget
from ucp_dev.toy import plan_target

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "no process group: one process" notice

KEYS = [f"t{i}" for i in range(6)]


def cpu_target(rank, world_size):
    return {k: torch.zeros(256, 256) for k in KEYS}


cpu_target.plan_symmetry = lambda rank, world_size: 0


def meta_target(rank, world_size):
    return {k: torch.zeros(256, 256, device="meta") for k in KEYS}


def declared_target(rank, world_size):
    return meta_target(rank, world_size)


declared_target.plan_device = "cpu"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan_device")
    ucp_dcp.save({k: torch.randn(256, 256) for k in KEYS}, path)
    return path


def test_a_target_built_on_the_cpu_plans_a_cpu_load_without_staging_buffers(ckpt):
    report = plan_load(ckpt, FunctionTarget(cpu_target, 2, "cpu job"))
    assert report.loads and (report.device, report.device_basis) == ("cpu", "tensors")
    assert "state on cpu (where the target's tensors are);" in format_report(report).splitlines()[0]
    assert [r.extra_host_bytes < STAGE_BYTES for r in report.ranks] == [True, True]  # no 16 MiB buffer
    r = run_cli("plan", str(ckpt), "--target", "test_plan_device:cpu_target", "--world-size", "2")
    assert r.returncode == 0 and "state on cpu (where the target's tensors are);" in r.stdout, r.stdout + r.stderr
    assert "extra host memory <= 0.00 MiB" in r.stdout, r.stdout


def test_device_cuda_still_plans_the_staged_load(ckpt):
    report = plan_load(ckpt, FunctionTarget(cpu_target, 2, "cpu job"), device="cuda")
    assert (report.device, report.device_basis) == ("cuda", "--device")
    assert "state on cuda;" in format_report(report).splitlines()[0]
    # the figures the default gave before: a staging buffer per staged read, up to the pool's size
    assert all(r.extra_host_bytes >= STAGE_BYTES for r in report.ranks), [r.extra_host_bytes for r in report.ranks]
    r = run_cli("plan", str(ckpt), "--target", "test_plan_device:cpu_target", "--world-size", "2", "--device", "cuda")
    assert "state on cuda;" in r.stdout and "extra host memory <= 96.00 MiB" in r.stdout, r.stdout + r.stderr


def test_meta_tensors_say_nothing_a_declared_device_does_and_the_recipe_is_a_gpu_job(ckpt):
    assumed = plan_load(ckpt, FunctionTarget(meta_target, 1, "meta job"))
    assert (assumed.device, assumed.device_basis) == ("cuda", "assumed")
    assert "(assumed: the target's tensors are on the meta device; --device cpu plans a CPU job)" in format_report(
        assumed
    )
    declared = plan_load(ckpt, FunctionTarget(declared_target, 1, "declared"))
    assert (declared.device, declared.device_basis) == ("cpu", "target")
    assert declared.ranks[0].extra_host_bytes < STAGE_BYTES
    assert plan_target.RecipeTarget("dp=2").device == "cuda"
    assert FunctionTarget(plan_target.target, 2).device == "cuda"
