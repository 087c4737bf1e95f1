"""torchtitan integration: fused wqkv without all-gathers, a real Trainer resume at a new DP degree,
stock checkpoints resuming with the one-flag switch, and the dataloader policy; both SPMD backends
(``partial_dtensor``, and torchtitan's default ``spmd_types`` through the launcher's patch (s)) and
the async checkpoint modes (``async``; ``async_with_pinned_mem`` through patch (p) on CPU)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan")
from helpers import skip_unless_torchtitan_runs  # noqa: E402

skip_unless_torchtitan_runs()

from helpers import ROOT  # noqa: E402

from ucp_dev.testing.titan import jobs as tr  # noqa: E402
from ucp_dev.testing.titan.assets import make_assets  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]


def _driver(tmp_path, dp, tp, fused, backend="partial_dtensor"):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            str(ROOT / "tests" / "support" / "titan_driver.py"),
            str(tmp_path / f"d{dp}{tp}{fused}{backend}"),
            str(dp),
            str(tp),
            str(int(fused)),
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=tr.titan_env(),
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1])


def test_fused_qkv_atoms_without_redistribute(tmp_path):
    """Fused wqkv and its moments are saved and loaded from local shards: zero DTensor.redistribute
    calls on wqkv (FSDP2 and TP; FSDP2 under both SPMD backends), against the stock hook path which
    all-gathers."""
    for dp, tp, backend in ((2, 1, "partial_dtensor"), (1, 2, "partial_dtensor"), (2, 1, "spmd_types")):
        r = _driver(tmp_path, dp, tp, fused=True, backend=backend)
        assert r["backend"] == backend, r
        assert r["save_redistributes"] == 0 and r["load_redistributes"] == 0, r
        assert r["diffs"] == [] and r["entries"] > 100, r
        assert r["ntokens_seen"] == [192, 0], "per-rank counts summed at save; the coordinator takes the total"
    stock = _driver(tmp_path, 2, 1, fused=False)
    assert stock["save_redistributes"] > 0 and stock["load_redistributes"] > 0, (
        "the counter must see the stock all-gathers"
    )


def _written_by_ucp(step_dir):
    """The checkpoint went through UCP's planner (fused wqkv moments saved as wq/wk/wv atoms) and
    storage (integrity sidecar verified)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ucp_dcp.storage.opening import open_path

    keys = set(FileSystemReader(step_dir).read_metadata().state_dict_metadata)
    assert "optimizer.state.layers.0.attention.qkv_linear.wq.weight.exp_avg" in keys, sorted(keys)[:8]
    assert not [k for k in keys if "wqkv" in k], [k for k in keys if "wqkv" in k][:4]
    assert open_path(step_dir)[1].status == "verified"


def _log(root, name, side):
    return (root / name / side / "log.txt").read_text()


def test_real_trainer_resumes_at_a_new_dp_degree(tmp_path):
    """Async (thread) save at dp=2 -> resume at dp=1: state bitwise equal to the oracle."""
    assets = make_assets(tmp_path / "assets")
    ok, line = tr.transition("dp2async-dp1", tmp_path, assets, steps=3, k=2)
    assert ok, line
    _written_by_ucp(tmp_path / "dp2async-dp1" / "save" / "checkpoint" / "step-2")


def test_async_with_pinned_mem_saves_in_the_checkpoint_process(tmp_path):
    """``async_mode="async_with_pinned_mem"``: DCP's process-based async save (planner and storage
    writer pickled into a checkpoint process) at dp=2, resumed at dp=1 bitwise. On CPU the launcher
    drops the non-blocking copy (patch (p)) and torch skips pinning; the GPU tier runs it as is."""
    assets = make_assets(tmp_path / "assets")
    ok, line = tr.transition("dp2pinned-dp1", tmp_path, assets, steps=3, k=2)
    assert ok, line
    assert "Checkpoint background process is running" in _log(tmp_path, "dp2pinned-dp1", "save")
    _written_by_ucp(tmp_path / "dp2pinned-dp1" / "save" / "checkpoint" / "step-2")


def test_default_spmd_types_backend_resumes_at_a_new_layout(tmp_path):
    """torchtitan's default backend ``spmd_types``: FSDP at dp=2 (launcher patch (s): torch 2.13's
    FSDP cannot shard spmd_types' plain parameters on an SPMD mesh) -> resume under pipeline
    parallelism pp=2 (torchtitan's own size-1-mesh path, unpatched), bitwise."""
    assets = make_assets(tmp_path / "assets")
    ok, line = tr.transition("spmd-dp2-pp2", tmp_path, assets, steps=3, k=2)
    assert ok, line
    assert "spmd_types FSDP on data-parallel mesh ('dp_shard',) without DataParallelMeshDims" in _log(
        tmp_path, "spmd-dp2-pp2", "save"
    )
    assert "spmd_types FSDP mesh ('dp_shard',), dims None (unpatched)" in _log(tmp_path, "spmd-dp2-pp2", "resume")
    _written_by_ucp(tmp_path / "spmd-dp2-pp2" / "save" / "checkpoint" / "step-2")


def test_model_only_export_saves_and_loads_back_with_the_option_on(tmp_path):
    """torchtitan's last-step export (``last_save_model_only``, the default of its llama3 8B+ and qwen3
    configs) with the one-flag option on a stock config: written at dp=2, then loaded model-only
    (``initial_load_path`` + ``initial_load_model_only``) by a fresh Trainer at dp=1; the weights must
    be bitwise the trained ones. Used to fail at save: the train-state rule matched no name."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    assets = make_assets(tmp_path / "assets")
    flags = ["--checkpoint.interval", "10", "--checkpoint.last_save_model_only"]
    overrides = [tr.ONE_FLAG, "ucp_dcp.torchtitan.overrides.dataloader"]
    save, load = tmp_path / "save", tmp_path / "load"
    oracle = {"UCP_TITAN_STATE": str(save / "trained.pt"), "UCP_TITAN_STATE_STEP": "1"}
    tr.run_job({"dp": 2}, save, assets, 1, flags, oracle, config=tr.STOCK_CONFIG, overrides=overrides)
    export = (save / "checkpoint" / "step-1").resolve()
    keys = set(FileSystemReader(export).read_metadata().state_dict_metadata)
    assert "layers.0.attention.qkv_linear.wk.weight" in keys and not [k for k in keys if "wqkv" in k], sorted(keys)[:8]
    assert not [k for k in keys if k.split(".")[0] in ("optimizer", "train_state", "lr_scheduler", "dataloader")]
    from ucp_dcp.storage.opening import open_path

    assert open_path(export)[1].status == "verified", "the option saves through ucp_dcp's storage (checksums, commit)"
    tr.run_job(
        {"dp": 1},
        load,
        assets,
        1,
        [*flags, "--checkpoint.initial_load_path", str(export), "--checkpoint.initial_load_model_only"],
        {"UCP_TITAN_STATE": str(load / "loaded.pt")},
        config=tr.STOCK_CONFIG,
        overrides=overrides,
    )
    trained = torch.load(save / "trained.pt", weights_only=False)
    loaded = torch.load(load / "loaded.pt", weights_only=False)
    params = [k for k in trained if k.startswith("param/")]
    assert len(params) > 40 and all(torch.equal(trained[k], loaded[k]) for k in params)
    assert loaded["train_state/step"] == 0, "a model-only load starts training afresh"
    assert (load / "checkpoint" / "step-1" / ".metadata").exists(), "the fresh Trainer's own export"


def test_stock_checkpoint_resumes_with_the_one_flag_switch_and_dataloader_policy(tmp_path):
    assets = make_assets(tmp_path / "assets")
    ok, line = tr.transition("stock-dp2-dp2", tmp_path, assets, steps=3, k=2)
    assert ok, line
    # the stock per-rank dataloader state (dp=2) cannot be remapped to dp=1 with the global-cursor loader
    save = tmp_path / "stock-dp2-dp2" / "save"
    flags = tr.resume_flags(save, 2, 3)
    loader = "ucp_dcp.torchtitan.overrides.dataloader"
    err = tr.run_job(
        {"dp": 1},
        tmp_path / "err",
        assets,
        3,
        flags,
        {"UCP_TITAN_EXPECT_FAILURE": "1"},
        config=tr.STOCK_CONFIG,
        overrides=[tr.ONE_FLAG, loader],
    )
    text = err.stdout + err.stderr
    assert err.returncode != 0 and "UCPError" in text and "refusing to resume at an undefined data position" in text
    assert "saved at data-parallel degree 2" in text or "per-rank dataloader state" in text
    restart = f'{tr.ONE_FLAG}={{"dataloader_policy": "restart"}}'
    ok = tr.run_job(
        {"dp": 1}, tmp_path / "restart", assets, 3, flags, {}, config=tr.STOCK_CONFIG, overrides=[restart, loader]
    )
    assert ok.returncode == 0 and "dataloader_policy='restart'" in ok.stdout + ok.stderr


def test_trainer_resumes_from_s3_at_a_new_layout(tmp_path, monkeypatch):
    """``--checkpoint.folder s3://bucket/run`` on a local S3 server (moto, its own process): saved at dp=2
    every step with keep_latest_k=2, resumed by a Trainer at tp=2 that finds step 3 in the store itself,
    bitwise, and trains to step 5. Steps 1 and 2 were purged when step 4 committed; steps 3-5 are left,
    committed, written by ucp_dcp's writer (verified sidecar on the store)."""
    pytest.importorskip("s3fs")
    import s3fs

    from ucp_dcp.storage.opening import open_path
    from ucp_dcp.torchtitan.step_folders import StepFolders
    from ucp_dev.testing.s3_server import spawn_server

    assets = make_assets(tmp_path / "assets")
    proc, aws = spawn_server("titan")
    url = "s3://titan/run/checkpoint"
    try:
        ok, line = tr.store_resume(tmp_path, assets, url, aws, {"dp": 2}, {"tp": 2})
        assert ok, line
        assert f"Loading the checkpoint from {url}/step-3" in _log_at(tmp_path / "resume")
        for k, v in aws.items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        folders = StepFolders(url)
        assert {n: folders.committed(n) for n in folders.steps().values()} == {
            "step-3": True,
            "step-4": True,
            "step-5": True,
        }
        assert open_path(f"{url}/step-3")[1].status == "verified"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        proc.terminate()
        proc.wait(timeout=30)


def _log_at(folder):
    return (folder / "log.txt").read_text()
