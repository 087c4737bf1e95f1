"""``--target titan``: plans of a real torchtitan checkpoint at other layouts.

One save (torchtitan's Trainer with ucp_dcp, GQA debug model, FSDP dp_shard=4, one step; the tests'
own harness) is planned, in this process, at dp_shard=2, dp_shard=2 x tp=2 and dp_shard=2 x pp=2 (each
loads, every rank reads), at another model config (fails, naming the atom), and with a per-rank
(stock) dataloader (the manager's dataloader policy refuses it in ``preflight``). The dp_shard=2 plan is
compared, rank by rank, with a real resume of the Trainer at dp_shard=2 from the same checkpoint (the
reader's ``ReadStats``).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torchtitan")
from helpers import skip_unless_torchtitan_runs  # noqa: E402

skip_unless_torchtitan_runs()

from ucp_dcp import UCPError  # noqa: E402
from ucp_dcp.storage.opening import open_path  # noqa: E402
from ucp_dcp.tools.dryrun import plan_load  # noqa: E402
from ucp_dcp.torchtitan.plan_target import TitanTarget  # noqa: E402
from ucp_dev.testing.titan import jobs as tr  # noqa: E402
from ucp_dev.testing.titan.assets import make_assets  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]

RESTART = 'ucp_dcp.torchtitan.overrides.checkpointer={"dataloader_policy": "restart"}'


def _flags(assets, config=tr.UCP_CONFIG, extra=(), **topo) -> list[str]:
    """The Trainer flags of the save job (``ucp_dev.testing.titan.jobs.run_job``) at another topology."""
    return [
        "--module",
        "ucp_dev.testing",
        "--config",
        config,
        "--hf_assets_path",
        str(assets / "tokenizer"),
        "--dataloader.dataset_path",
        str(assets / "dataset"),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "8",
        "--parallelism.spmd_backend",
        "partial_dtensor",
        "--training.disable_cuda_graphs",
        "--checkpoint.enable",
        *tr.topology_flags(topo),
        *extra,
    ]


# sitecustomize for the real resume's workers: each rank writes its reader's ReadStats after the load
_STATS_HOOK = """
import os
if os.environ.get("RANK") is not None and os.environ.get("UCP_PLAN_STATS"):
    import json
    from ucp_dcp.storage.reader import UCPFileSystemReader

    _read = UCPFileSystemReader.read_data

    def read_data(self, plan, planner):
        out = _read(self, plan, planner)
        s = self.stats
        with open(f"{os.environ['UCP_PLAN_STATS']}.{os.environ['RANK']}", "w") as f:
            json.dump({"bytes_read": s.bytes_read, "reads": s.ranges, "bytes_received": s.bytes_received,
                       "fallbacks": s.fallbacks}, f)
        return out

    UCPFileSystemReader.read_data = read_data
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(assets, step folder, tmp root) of one save: dp_shard=4, one step, checkpoint at step 1."""
    root = tmp_path_factory.mktemp("plan_titan")
    assets = make_assets(root / "assets")
    tr.run_job({"dp": 4}, root / "save", assets, 1, ["--checkpoint.interval", "1"], {})
    return assets, root / "save" / "checkpoint" / "step-1", root


def _plan(step, target, **kw):
    md = open_path(step)[0]
    errors = target.preflight(md)
    return errors, plan_load(step, target, **kw)


@pytest.mark.slow
def test_plan_loads_at_new_layouts(saved):
    assets, step, _ = saved
    for topo, built in (({"dp": 2}, 2), ({"dp": 2, "tp": 2}, 2), ({"dp": 2, "pp": 2}, 4)):
        target = TitanTarget.from_args(_flags(assets, **topo))
        assert target.world_size == (4 if len(topo) == 2 else 2)
        errors, report = _plan(step, target)
        assert errors == [] and report.loads, (topo, errors, report.problems)
        assert all(r.bytes_read > 0 and r.reads > 0 for r in report.ranks), (topo, report.ranks)
        # one build per pipeline stage, plus the check of the last rank of each
        assert report.built == built and len(report.ranks) == target.world_size, (topo, report.built)
    assert target.name == "titan llama3/debugmodel_gqa dp_shard=2,pp=2"
    assert [target.symmetry(r) for r in range(4)] == [0, 0, 1, 1]
    full = report
    # a model-only load (initial_load_model_only): the weights only, no rule on train_state declared
    model_only = TitanTarget.from_args(_flags(assets, dp=2, pp=2) + ["--model-only"])
    errors, report = _plan(step, model_only)
    assert errors == [] and report.loads, report.problems
    assert 0 < sum(r.bytes_read for r in report.ranks) < sum(r.bytes_read for r in full.ranks) / 2
    assert all(p.pattern != r"train_state\.ntokens_seen" for p in model_only.options(3)["options"].patterns)


@pytest.mark.slow
def test_plan_matches_a_real_resume_rank_by_rank(saved, tmp_path):
    """The plan of the dp_shard=2 resume (CPU state: no staging cuts; one host) against the real
    Trainer's resume from the same checkpoint: per-rank bytes, read calls, bytes received, fallbacks."""
    assets, step, _ = saved
    report = plan_load(step, TitanTarget.from_args(_flags(assets, dp=2)), device="cpu", ranks_per_node=8)
    assert report.loads, report.problems
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_STATS_HOOK)
    stats = tmp_path / "stats"
    env = {"PYTHONPATH": os.pathsep.join([str(hook), tr.CODE_PATH]), "UCP_PLAN_STATS": str(stats)}
    out = tmp_path / "resume"
    tr.run_job({"dp": 2}, out, assets, 1, tr.resume_flags(step.parent.parent, 1, 1), env)
    real = [json.loads((tmp_path / f"stats.{r}").read_text()) for r in range(2)]
    planned = [
        {"bytes_read": r.bytes_read, "reads": r.reads, "bytes_received": r.bytes_received, "fallbacks": r.fallbacks}
        for r in report.ranks
    ]
    assert planned == real


@pytest.mark.slow
def test_another_model_config_fails_naming_the_atom(saved):
    """The stock debug model (16 KV heads) is not the saved GQA model (4 KV heads): wk/wv differ."""
    assets, step, _ = saved
    errors, report = _plan(step, TitanTarget.from_args(_flags(assets, config="llama3_debugmodel_ucp", dp=2)))
    assert errors == [] and not report.loads
    (p,) = report.problems
    assert p.error == "ShapeMismatchError" and p.ranks == [0, 1], p
    assert "'layers.0.attention.qkv_linear.wk.weight': saved shape (64, 256), wanted shape (256, 256)" in p.message


@pytest.mark.slow
def test_per_rank_dataloader_is_refused_in_preflight(saved):
    """A stock per-rank loader cannot take the saved global-cursor state: the manager refuses the
    resume before reading (preflight); under ``dataloader_policy='restart'`` it loads the rest."""
    assets, step, _ = saved
    stock = TitanTarget.from_args(_flags(assets, config=tr.STOCK_CONFIG, dp=2))
    assert [stock.symmetry(r) for r in range(2)] == [(0, 0), (0, 1)], "dataloader.dp_rank_<r>: ranks differ"
    errors, report = _plan(step, stock)
    (e,) = errors
    assert isinstance(e, UCPError) and e.atom == "dataloader"
    assert "global-cursor dataloader state but this run uses a per-rank loader" in str(e)
    assert "refusing to resume at an undefined data position" in str(e)
    assert report.loads, "the other states plan as usual (the dataloader left out)"
    assert [stock.symmetry(r) for r in range(2)] == [0, 0]

    restart = TitanTarget.from_args(_flags(assets, config=tr.STOCK_CONFIG, dp=2, extra=["--override.imports", RESTART]))
    errors, report = _plan(step, restart)
    assert errors == [] and report.loads, report.problems
    assert restart.options(1)["options"].data_slot == 1


def test_job_flags_errors():
    with pytest.raises(UCPError, match="--module and --config"):
        TitanTarget.from_args(["--parallelism.data_parallel_shard_degree", "2"])
    flags = ["--module", "llama3", "--config", "llama3_debugmodel"]  # data_parallel_shard_degree -1
    with pytest.raises(UCPError, match="data_parallel_shard_degree is -1"):
        TitanTarget.from_args(flags)
    with pytest.raises(UCPError, match="building the job's tokenizer/dataloader failed"):  # no data here
        TitanTarget.from_args(flags + ["--parallelism.data_parallel_shard_degree", "2"])
    flags += ["--checkpoint.exclude_from_loading", "dataloader"]
    t = TitanTarget.from_args(flags + ["--parallelism.tensor_parallel_degree", "2"], world_size=8)
    assert t.world_size == 8 and t.name == "titan llama3/debugmodel dp_shard=4,tp=2"
    assert [t.coord(r)["batch"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(UCPError, match="rejected the job flags"):
        TitanTarget.from_args(flags + ["--parallelism.no_such_degree", "2"])
    with pytest.raises(UCPError, match="global batch size 6 is not a multiple"):
        TitanTarget.from_args(
            flags + ["--parallelism.data_parallel_shard_degree", "4", "--training.global_batch_size", "6"]
        )
