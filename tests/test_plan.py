"""``ucp_dcp.plan``: a plan is the load's own figures and errors, not an estimate.

A load that fails (a shape change) must fail in the plan, made in this process (fake process group,
meta tensors), with the same error on the same ranks as the real load on the pool. The symmetry the
plan uses (one state dict built per pipeline stage, rebound to the other ranks) is checked against a
build of every rank. The figures of every layout of the reconfiguration set: tests/test_reconfig_plan.py.
"""

from __future__ import annotations

import json
import os

import pytest

from plan_check import compare_errors, plan, real_load
from ucp_dcp import UCPError
from ucp_dcp._compat import _StridedShard
from ucp_dcp.plan import RecipeTarget, plan_load
from ucp_dcp.plan.report import format_report, parse_rate, rank_ranges, report_json
from ucp_dcp.plan.world import fake_rank, rebind, structure
from ucp_dcp.toy import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.slow
def test_plan_of_a_shape_change_raises_the_loads_error_on_the_same_ranks():
    wider = ModelConfig(ffn_dim=56)  # every dense FFN weight changes shape
    folder, real = real_load("dp=2", "dp=2,tp=2", wider)
    assert "errors" in real, "the real load should fail"
    report = plan(f"{folder}/ckpt", "dp=2,tp=2", wider)
    assert not report.loads and report.problems[0].error == "ShapeMismatchError"
    assert "ffn.w1.weight" in report.problems[0].message
    diffs = compare_errors(report, real["errors"])
    assert not diffs, "\n".join(diffs)


# -- in this process: symmetry, strided shards, reports -----------------------------------------------


def _rank_structures(topology: str) -> tuple[dict[int, dict], dict[int, dict]]:
    """Per rank: the structure of its own build, and of its stage representative's build rebound to it."""
    t = RecipeTarget(topology)
    built, rebound, reps = {}, {}, {}
    for r in range(t.world_size):
        with fake_rank(r, t.world_size):
            mine = rebind(t.build(r), r, keep_local=True)
            built[r] = structure(mine)
            key = t.symmetry(r)
            reps.setdefault(key, mine)
            rebound[r] = structure(rebind(reps[key], r))
    return built, rebound


@pytest.mark.parametrize("topology", ["pp=2,dp=2,tp=2", "dp=2,ep=2,tp=2", "dpr=2,dp=2,tp=2", "pp=2,vpp=2,dp=2"])
def test_a_rebound_state_dict_is_the_ranks_own_build(topology):
    built, rebound = _rank_structures(topology)
    for r in built:
        assert rebound[r] == built[r], f"rank {r}: " + next(k for k in built[r] if rebound[r].get(k) != built[r][k])


def test_strided_shards_are_among_the_planned_layouts():
    built, _ = _rank_structures("dp=2,tp=2")  # FSDP2 over TP on the same dim: _StridedShard
    placements = [p for s in built.values() for v in s.values() if v[0] == "dtensor" for p in v[4]]
    assert any(isinstance(p, _StridedShard) for p in placements)


def test_structure_sees_a_different_local_shard():
    with fake_rank(1, 2):
        sd = RecipeTarget("dp=2").build(1)
        a = structure(rebind(sd, 1, keep_local=True))
        b = structure(rebind(sd, 0))  # rank 0's piece, but this process is rank 1: the mesh slice differs
    assert a != b


def test_plan_refuses_a_process_that_has_a_process_group():
    import torch.distributed as dist

    with fake_rank(0, 1):
        with pytest.raises(UCPError, match="already has a default process group"):
            with fake_rank(0, 2):
                pass
    assert not dist.is_initialized()


def test_rates_and_rank_ranges():
    assert parse_rate("2GB/s") == 2e9 and parse_rate("800MiB/s") == 800 * 2**20 and parse_rate("1.5e9") == 1.5e9
    with pytest.raises(UCPError):
        parse_rate("fast")
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_missing_checkpoint_is_an_open_problem(tmp_path):
    report = plan_load(tmp_path / "nothing", RecipeTarget("dp=2"))
    assert not report.loads and report.problems[0].where == "open"
    assert "DOES NOT LOAD" in format_report(report)
    json.dumps(report_json(report), default=str)


def test_cli_exit_codes(tmp_path, capsys):
    from ucp_dcp.__main__ import main

    assert main(["plan", str(tmp_path), "--target", "recipe"]) == 2  # no --topology
    assert main(["plan", str(tmp_path), "--target", "recipe", "--topology", "dp=2"]) == 2  # no checkpoint
    assert main(["plan", str(tmp_path), "--target", "nomodule_xyz:fn", "--world-size", "2"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert not os.listdir(tmp_path)
