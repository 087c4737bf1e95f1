"""``ucp_dcp export --to torchtitan``: the way back to stock torchtitan.

One save with ucp_dcp's torchtitan option (the debug model, FSDP dp_shard=2, global-cursor loader,
checkpoints at steps 2 and 3) is exported at --dp 1 and --dp 2 and resumed by the **stock** Trainer
(torchtitan's own config, CheckpointManager, DCP default planner and FileSystemReader, its own text
loader; no ucp_dcp module but the CPU launcher can be imported in the resuming job): the state right after the load equals the
saved state bitwise, the step-3 loss equals the uninterrupted run's, and the stock loaders' next
global batch is the windows the uninterrupted run took. Refusals are checked without a Trainer."""

import io
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

pytest.importorskip("torchtitan")
from helpers import skip_unless_torchtitan_runs  # noqa: E402

skip_unless_torchtitan_runs()

import torch  # noqa: E402

from ucp_dev.testing.checks import TOL_FIRST, state_diffs  # noqa: E402
from ucp_dev.testing.titan import jobs as tr  # noqa: E402
from ucp_dev.testing.titan.assets import make_assets  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS, SAVED, GBS, SEQ = 3, 2, 8, 64
JOB = ["--module", "llama3", "--config", "llama3_debugmodel"]  # the stock job (same model as llama3_debugmodel_ucp)


def _job_flags(assets):
    return [
        *JOB,
        "--hf_assets_path",
        str(assets / "tokenizer"),
        "--dataloader.dataset_path",
        str(assets / "dataset"),
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        str(GBS),
        "--training.steps",
        str(STEPS),
        "--training.mixed_precision_param",
        "float32",
        "--debug.seed",
        "0",
    ]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("export_assets"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, assets):
    """The uninterrupted run with ucp_dcp's option at dp_shard=2: checkpoints at steps 2 and 3, the
    full state right after the step-2 save (oracle) and every step's loss."""
    root = tmp_path_factory.mktemp("export_save")
    tr.run_job(
        {"dp": 2},
        root,
        assets,
        STEPS,
        ["--checkpoint.interval", str(SAVED)],
        {
            "UCP_TITAN_METRICS": str(root / "loss.json"),
            "UCP_TITAN_STATE": str(root / "oracle.pt"),
            "UCP_TITAN_STATE_STEP": str(SAVED),
        },
        config="llama3_debugmodel_ucp",
    )
    return root


def _export(capsys, src, out, dp, *extra):
    from ucp_dcp.__main__ import main

    rc = main(["export", "--to", "torchtitan", str(src), str(out), "--dp", str(dp), *extra])
    text = capsys.readouterr()
    return rc, text.out, text.err


@pytest.fixture(scope="module")
def exports(tmp_path_factory, saved, assets):
    """``export --dp 1`` and ``--dp 2`` of the step-2 checkpoint, through the CLI (in this process)."""
    from ucp_dcp.__main__ import main

    out = tmp_path_factory.mktemp("exports")
    done = {}
    for dp in (1, 2):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = main(
                [
                    "export",
                    "--to",
                    "torchtitan",
                    str(saved / "checkpoint"),
                    str(out / f"dp{dp}"),
                    "--dp",
                    str(dp),
                    "--step",
                    str(SAVED),
                    *_job_flags(assets),
                ]
            )
        assert rc == 0, buf.getvalue()
        done[dp] = (out / f"dp{dp}" / f"step-{SAVED}", buf.getvalue())
    return done


# A ``ucp_dcp`` package ahead of the real one: it runs none of the real package's code and refuses every
# submodule. The CPU launcher (ucp_dev.testing.titan, outside ucp_dcp) imports none of them.
_BLOCKER = """
import sys

__path__ = [{real!r}]


class _Blocker:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.startswith("ucp_dcp."):
            raise ImportError(f"ucp_dcp is blocked: the stock resume must not use it ({{name}})")
        return None


sys.meta_path.insert(0, _Blocker())
"""


def _blocked_env(tmp_path):
    """The resuming job's environment: the launcher and its CPU attention importable, the rest of
    ``ucp_dcp`` (the library, its torchtitan integration) not."""
    block = tmp_path / "no_ucp_dcp" / "ucp_dcp"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text(_BLOCKER.format(real=str(tr.PACKAGE_ROOT / "ucp_dcp")))
    env = tr.titan_env()
    env["PYTHONPATH"] = str(block.parent) + os.pathsep + env["PYTHONPATH"]
    for module, blocked in (("ucp_dcp.api", True), ("ucp_dcp.torchtitan", True), (tr.LAUNCHER, False)):
        probe = subprocess.run(
            [sys.executable, "-c", f"import {module}"], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert (probe.returncode != 0 and "ucp_dcp is blocked" in probe.stderr) == blocked, (module, probe.stderr)
    return env


def _stock_resume(tmp_path, assets, ckpt, dp):
    """torchtitan's own Trainer (stock config, checkpointer and loader; the CPU launcher) resumes
    from ``ckpt`` at dp_shard=``dp`` and trains the last step, saving nothing."""
    out = tmp_path / f"stock_dp{dp}"
    out.mkdir()
    cmd = [
        *tr.launcher_cmd(dp),
        *_job_flags(assets),
        "--parallelism.spmd_backend",
        "partial_dtensor",
        "--override.imports",
        tr.CPU_ATTENTION,
        "--training.disable_cuda_graphs",
        "--checkpoint.enable",
        "--checkpoint.load_only",
        "--checkpoint.initial_load_path",
        str(ckpt),
        "--checkpoint.no-initial_load_model_only",
        "--parallelism.data_parallel_shard_degree",
        str(dp),
        "--dump_folder",
        str(out),
    ]
    env = {
        **_blocked_env(tmp_path),
        "UCP_TITAN_METRICS": str(out / "loss.json"),
        "UCP_TITAN_STATE": str(out / "loaded.pt"),
    }
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, "\n".join(log.splitlines()[-30:])
    assert f"Loading the checkpoint from {ckpt}" in log
    return out


def _check_resume(saved, resumed):
    oracle = torch.load(saved / "oracle.pt", weights_only=False)
    loaded = torch.load(resumed / "loaded.pt", weights_only=False)
    assert len(oracle) > 200 and state_diffs(oracle, loaded) == [], state_diffs(oracle, loaded)[:6]
    assert loaded["train_state/step"] == SAVED and loaded["lr_scheduler"] == oracle["lr_scheduler"]
    ref, res = tr.losses(saved / "loss.json"), tr.losses(resumed / "loss.json")
    assert abs(res[STEPS] - ref[STEPS]) <= TOL_FIRST * abs(ref[STEPS]), (ref, res)


@pytest.mark.slow
def test_export_writes_torchtitans_own_format(exports):
    """What the export writes: torchtitan's keys (wq/wk/wv weights, fused wqkv moments, FQN-keyed
    param groups, one dataloader entry per rank), one unsharded file, no ucp_dcp sidecar."""
    from torch.distributed.checkpoint import FileSystemReader

    for dp, (ckpt, text) in exports.items():
        md = FileSystemReader(str(ckpt)).read_metadata()
        keys = set(md.state_dict_metadata)
        assert "layers.0.attention.qkv_linear.wq.weight" in keys
        assert "layers.0.attention.qkv_linear.wqkv.weight" not in keys
        assert "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg" in keys
        assert "optimizer.param_groups.layers.0.attention.qkv_linear.wqkv.weight.lr" in keys
        assert not [k for k in keys if k.startswith("optimizer.") and ".wq." in k]
        assert {k for k in keys if k.startswith("dataloader.")} == {f"dataloader.dp_rank_{r}" for r in range(dp)} | {
            "dataloader.world_size"
        }
        assert {"lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen"} <= keys
        assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp"]
        assert f"stock torchtitan, data-parallel degree {dp}" in text and "checked equal" in text, text


@pytest.mark.slow
def test_stock_trainer_resumes_the_dp1_export_at_another_layout(exports, saved, assets, tmp_path):
    """Saved at FSDP dp=2, exported --dp 1, resumed by stock torchtitan at dp=1: bitwise state, and
    the next step's loss is the uninterrupted run's (same global batch)."""
    _check_resume(saved, _stock_resume(tmp_path, assets, exports[1][0], 1))


@pytest.mark.slow
def test_stock_trainer_resumes_the_dp2_export_at_the_saved_layout(exports, saved, assets, tmp_path):
    """Saved at FSDP dp=2, exported --dp 2 (each rank's windows of the rest of the epoch in its
    loader's buffers), resumed by stock torchtitan at dp=2: bitwise state, same step-3 loss."""
    _check_resume(saved, _stock_resume(tmp_path, assets, exports[2][0], 2))


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_stock_loaders_take_the_uninterrupted_runs_next_batch(exports, assets, dp):
    """Read with stock DCP alone, the exported dataloader entries put torchtitan's own text loaders at
    the windows the uninterrupted run takes next: window ``16 + r + k*dp`` on rank ``r`` (the
    global-cursor deal), the uninterrupted stream counted from its start."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from ucp_dcp.torchtitan.dataloader import GlobalWindowDataset

    ckpt = exports[dp][0]
    sd = {"dataloader": {**{f"dp_rank_{r}": b"" for r in range(dp)}, "world_size": 0}}
    dcp.load(sd, storage_reader=FileSystemReader(str(ckpt)))
    tok = HuggingFaceTokenizer(tokenizer_path=str(assets / "tokenizer"))
    cursor = SAVED * GBS
    stream = GlobalWindowDataset("c4_test", str(assets / "dataset"), tok, SEQ, 0, 1).iter_windows()
    ref = [next(stream) for _ in range(cursor + GBS)]
    cfg = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(assets / "dataset"))
    for r in range(dp):
        loader = HuggingFaceTextDataLoader(
            cfg, dp_world_size=dp, dp_rank=r, tokenizer=tok, seq_len=SEQ, local_batch_size=1
        )
        loader.load_state_dict(sd["dataloader"])
        it = iter(loader)
        for k in range(GBS // dp):
            inputs, labels = next(it)
            w, want_in, want_lab = ref[cursor + r + k * dp]
            assert w == cursor + r + k * dp
            assert torch.equal(inputs["input"][0], want_in["input"]) and torch.equal(labels[0], want_lab)
            assert torch.equal(inputs["positions"][0], want_in["positions"])


@pytest.mark.slow
def test_reexport_of_a_stock_checkpoint_keeps_its_per_rank_loader_state(exports, assets, tmp_path, capsys):
    """A checkpoint holding torchtitan's per-rank loader state (here the --dp 2 export itself, read
    through ucp_dcp as any stock checkpoint) is exported at its own degree with those entries copied
    and the tensors unchanged; at another degree it is refused, naming the saved one."""
    from torch.distributed.checkpoint import FileSystemReader

    src = exports[2][0]
    rc, out, err = _export(capsys, src, tmp_path / "again", 2, *_job_flags(assets))
    assert rc == 0 and "2 per-rank stock entries copied as saved" in out, out + err
    again = tmp_path / "again" / f"step-{SAVED}"
    a, b = FileSystemReader(str(src)).read_metadata(), FileSystemReader(str(again)).read_metadata()
    assert set(a.state_dict_metadata) == set(b.state_dict_metadata)
    sd_a, sd_b = _all_tensors(src, a), _all_tensors(again, b)
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a) and len(sd_a) > 150
    rc, out, err = _export(capsys, src, tmp_path / "refused", 1, *_job_flags(assets))
    assert rc == 2 and "per-rank dataloader state for data-parallel degree 2" in err and "--dp 2" in err, err
    assert not (tmp_path / "refused").exists()


def _all_tensors(path, md):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=FileSystemReader(str(path)))
    return sd


@pytest.mark.slow
def test_refused_when_the_rest_of_the_epoch_does_not_fit_the_stock_buffers(
    saved, assets, tmp_path, capsys, monkeypatch
):
    """--dp 2 needs the rest of the epoch in the stock loaders' buffers: beyond the bound the export
    refuses before writing anything, and names --dp 1 and --no-dataloader."""
    import ucp_dcp.torchtitan.stock_loader as sl

    monkeypatch.setattr(sl, "BUFFER_COPIES", 1 << 10)
    rc, out, err = _export(capsys, saved / "checkpoint", tmp_path / "out", 2, "--step", str(SAVED), *_job_flags(assets))
    assert rc == 2 and "at data-parallel degree 2" in err and "--dp 1" in err and "--no-dataloader" in err, err
    assert not (tmp_path / "out").exists()


def test_refused_when_the_cursor_is_past_the_first_epoch(assets):
    """A later epoch of the global cursor has its own document order, which stock torchtitan does
    not reproduce: no --dp keeps the position."""
    from ucp_dcp.errors import UCPError
    from ucp_dcp.torchtitan.job import job_config, parse_job
    from ucp_dcp.torchtitan.stock_loader import cursor_to_stock

    cfg = job_config(parse_job(_job_flags(assets), hint=""), unsharded=True)
    tok = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path)
    cursor = {"version": 1, "cursor": 4000, "epoch": 1, "doc": 3, "offset": 0, "seq_len": SEQ, "dataset": "c4_test"}
    for dp in (1, 2):
        with pytest.raises(UCPError, match="epoch 1.*no data-parallel degree keeps the position"):
            cursor_to_stock(cfg, cursor, dp, tok)


@pytest.mark.slow
def test_no_dataloader_and_flag_checks(saved, assets, tmp_path, capsys):
    """--no-dataloader writes no loader state (the printed resume flags exclude it); a --dp the job's
    flags or batch sizes contradict is refused before anything is read."""
    from torch.distributed.checkpoint import FileSystemReader

    rc, out, err = _export(capsys, saved / "checkpoint", tmp_path / "nodata", 4, "--no-dataloader", *_job_flags(assets))
    assert rc == 0, err
    ckpt = tmp_path / "nodata" / f"step-{STEPS}"  # the folder's latest step
    keys = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert not [k for k in keys if k.startswith("dataloader")] and "--checkpoint.exclude_from_loading dataloader" in out
    assert "ntokens_seen=384 per data-parallel rank (the job's 1536 over 4" in out, out
    rc, out, err = _export(capsys, saved / "checkpoint", tmp_path / "bad", 3, *_job_flags(assets))
    assert rc == 2 and "not a multiple of local batch size 2 x data-parallel degree 3" in err, err
    rc, out, err = _export(
        capsys,
        saved / "checkpoint",
        tmp_path / "bad",
        1,
        *_job_flags(assets),
        "--parallelism.data_parallel_shard_degree",
        "2",
    )
    assert rc == 2 and "data-parallel degree 2" in err and "--dp says 1" in err, err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_export_to_hf_of_a_full_titan_checkpoint_loads_in_transformers(saved, tmp_path, capsys):
    """``export --to hf --mapping torchtitan`` on the run's full step-2 checkpoint (model, optimizer,
    train state; dp_shard=2, fused wqkv saved as wq/wk/wv atoms): transformers loads the folder (no
    missing or unexpected keys) and its logits are the saved parameters' (the oracle's)."""
    pytest.importorskip("transformers")
    from titan_models import _close, _from_pretrained, _titan, _titan_logits
    from torchtitan.models.llama3 import model_registry

    from ucp_dcp.__main__ import main

    out = tmp_path / "hf"
    rc = main(
        ["export", "--to", "hf", str(saved / "checkpoint" / f"step-{SAVED}"), str(out), "--mapping", "torchtitan", *JOB]
    )
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "exported" in text.out and (out / "config.json").exists()
    oracle = {
        k.replace("._checkpoint_wrapped_module", ""): v  # activation-checkpoint wrappers' segment
        for k, v in torch.load(saved / "oracle.pt", weights_only=False).items()
    }
    model = _titan(model_registry("debugmodel").model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(oracle[f"param/{name}"])
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))
    _close(_titan_logits(model, tokens), _from_pretrained(out)(tokens).logits)
