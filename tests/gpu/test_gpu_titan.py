"""GPU tier: torchtitan's Trainer with the UCP option on one CUDA GPU, in the two settings CPU runs
reach only through launcher patches:

* torchtitan's default SPMD backend (``spmd_types``; no ``--parallelism.spmd_backend`` flag), with
  FSDP's own path (one GPU: torchtitan passes no ``DataParallelMeshDims``, patch (s) is a no-op);
* ``--checkpoint.async_mode async_with_pinned_mem``: pinned host memory, non-blocking copies on a
  staging stream, the save in DCP's checkpoint process (CPU runs drop the non-blocking copy).

Each test saves at step 2 of 3, resumes from that checkpoint in a fresh job, and requires the full
training state after the load to be bitwise the state right after the save (written with plain
``torch.save`` by the launcher; no ucp_dcp code in the oracle). The launcher runs with
``UCP_TITAN_DEVICE=cuda``: only its torch 2.13 / torchtitan 0.3.0 patches apply ((f), (g), (s));
attention is SDPA (``ucp_dev.testing.titan.cpu_attention``) so no FlexAttention compile is needed.

Part of the GPU tier (``make test-gpu``; ``make test`` never collects tests/gpu); skipped without
CUDA. Two torchrun jobs per test, one process each.
"""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

pytest.importorskip("torchtitan")
from helpers import skip_unless_torchtitan_runs  # noqa: E402

skip_unless_torchtitan_runs()

from ucp_dev.testing.checks import state_diffs  # noqa: E402
from ucp_dev.testing.titan import jobs as tr  # noqa: E402
from ucp_dev.testing.titan.assets import make_assets  # noqa: E402

STEPS, K = 3, 2  # train 3 steps, checkpoint at step 2, resume from it
DEVICE_ENV = {"UCP_TITAN_DEVICE": "cuda"}  # the launcher leaves torchtitan on its own device


def _save_and_resume(tmp_path, extra_save_flags):
    """Save job (1 GPU, default backend) then resume job; returns (oracle, loaded, ref losses,
    resumed losses, save log, resume log)."""
    assets = make_assets(tmp_path / "assets")
    save, load = tmp_path / "save", tmp_path / "resume"
    env = dict(DEVICE_ENV)
    tr.run_job(
        {"dp": 1},
        save,
        assets,
        STEPS,
        ["--checkpoint.interval", str(K), *extra_save_flags],
        {
            **env,
            "UCP_TITAN_METRICS": str(save / "loss.json"),
            "UCP_TITAN_STATE": str(save / "oracle.pt"),
            "UCP_TITAN_STATE_STEP": str(K),
        },
        backend=None,
    )
    tr.run_job(
        {"dp": 1},
        load,
        assets,
        STEPS,
        tr.resume_flags(save, K, STEPS),
        {**env, "UCP_TITAN_METRICS": str(load / "loss.json"), "UCP_TITAN_STATE": str(load / "loaded.pt")},
        backend=None,
    )
    oracle = torch.load(save / "oracle.pt", weights_only=False)
    loaded = torch.load(load / "loaded.pt", weights_only=False)
    return (
        oracle,
        loaded,
        tr.losses(save / "loss.json"),
        tr.losses(load / "loss.json"),
        (save / "log.txt").read_text(),
        (load / "log.txt").read_text(),
    )


def _check(tmp_path, oracle, loaded, ref, res, save_log, resume_log):
    assert "CUDA capacity" in save_log, "torchtitan must have run on the GPU"
    for log in (save_log, resume_log):  # the default backend, FSDP unpatched
        assert "spmd_types FSDP mesh ('dp_shard',), dims None (unpatched)" in log, log[-3000:]
    bad = state_diffs(oracle, loaded)
    assert not bad and len(oracle) > 100, f"{len(bad)} of {len(oracle)} state entries differ: {bad[:4]}"
    assert loaded["train_state/step"] == K
    # GPU kernels need not be bitwise deterministic run to run: the loss check is loose
    assert math.isfinite(res[STEPS]) and abs(res[STEPS] - ref[STEPS]) <= 1e-3 * abs(ref[STEPS]), (ref, res)

    from torch.distributed.checkpoint import FileSystemReader

    from ucp_dcp.storage.opening import open_path

    step_dir = tmp_path / "save" / "checkpoint" / f"step-{K}"
    keys = set(FileSystemReader(step_dir).read_metadata().state_dict_metadata)
    assert "optimizer.state.layers.0.attention.qkv_linear.wq.weight.exp_avg" in keys, "UCP's planner wrote it"
    assert not [k for k in keys if "wqkv" in k]
    assert open_path(step_dir)[1].status == "verified", "UCP's storage wrote it"


def test_default_backend_resumes_bitwise_on_one_gpu(tmp_path):
    _check(tmp_path, *_save_and_resume(tmp_path, []))


def test_async_with_pinned_mem_resumes_bitwise_on_one_gpu(tmp_path):
    result = _save_and_resume(tmp_path, ["--checkpoint.async_mode", "async_with_pinned_mem"])
    save_log = result[4]
    assert "Checkpoint background process is running" in save_log
    assert "Ignoring pin_memory flag" not in save_log, "pinned memory must be used on the GPU"
    _check(tmp_path, *result)
