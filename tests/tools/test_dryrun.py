"""``ucp_dcp.tools.dryrun``: a plan is the load's own figures and errors, not an estimate.

A load that fails (a shape change) must fail in the plan, made in this process (fake process group,
meta tensors), with the same error on the same ranks as the real load on the pool. The symmetry the
plan uses (one state dict built per pipeline stage, rebound to the other ranks) is checked against a
build of every rank. The figures of every layout of the reconfiguration set: tests/tools/test_dryrun_reconfig.py.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import ROOT
from plan_check import compare_errors, plan, rank_stats, real_load

from ucp_dcp import UCPError
from ucp_dcp._compat import _StridedShard
from ucp_dcp.tools.dryrun import FunctionTarget, plan_load
from ucp_dcp.tools.dryrun.report import format_report, parse_rate, rank_ranges, report_json
from ucp_dcp.tools.dryrun.world import fake_rank, rebind, structure
from ucp_dev.toy import ModelConfig
from ucp_dev.toy.plan_target import TARGET, RecipeTarget

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


def test_a_rebound_rank_takes_its_class_representatives_options():
    """A function target's options may differ between its symmetry classes (a pipeline stage's stage_map): a rank
    that was rebound, not built, takes those of the first built rank of its own class."""

    def two_stages(rank, world_size):
        return {}, {"stage": rank % 2}

    two_stages.plan_symmetry = lambda rank, world_size: rank % 2
    t = FunctionTarget(two_stages, 6, "two stages", extra_options={"x": 1})
    t.build(0), t.build(1), t.build(5)
    assert [t.options(r) for r in range(6)] == [{"stage": r % 2, "x": 1} for r in range(6)]


def test_missing_checkpoint_is_an_open_problem(tmp_path):
    report = plan_load(tmp_path / "nothing", RecipeTarget("dp=2"))
    assert not report.loads and report.problems[0].where == "open"
    assert "DOES NOT LOAD" in format_report(report)
    json.dumps(report_json(report), default=str)


def test_cli_exit_codes(tmp_path, capsys):
    from ucp_dcp.__main__ import main

    assert main(["plan", str(tmp_path), "--target", TARGET]) == 2  # no --world-size
    assert "give the job's --world-size" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--target", TARGET, "--world-size", "2"]) == 2  # no checkpoint
    # the toy LLM is no target of the library's own: the recipes give it as a function
    assert main(["plan", str(tmp_path), "--target", "recipe", "--world-size", "2"]) == 2
    assert "expected 'package.module:function'" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--target", "nomodule_xyz:fn", "--world-size", "2"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def _example():
    """docs/examples/plan_fsdp2.py (the documented FSDP2 target), imported from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_fsdp2", ROOT / "docs" / "examples" / "plan_fsdp2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _one_rank_target(rank, world_size):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _example().build(device="meta")
    return dict(zip(("model", "optim"), get_state_dict(model, optim)))


@pytest.mark.parametrize("writer", ["stock", "ucp"])
def test_plan_of_a_one_process_load_is_its_read_stats(tmp_path, writer):
    """Without a process group (DCP's one-process mode): the plan's figures are the reader's, for a
    checkpoint of DCP's own writer (records parsed from each item's zip directory, no checksums) and
    of ucp_dcp's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ucp_dcp
    from ucp_dcp.tools.dryrun import FunctionTarget

    plan_fsdp2 = _example()
    model, optim = plan_fsdp2.build(device="cpu")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    sd = dict(zip(("model", "optim"), get_state_dict(model, optim)))
    if writer == "stock":
        dcp.save(sd, checkpoint_id=str(tmp_path))
    else:
        ucp_dcp.save(sd, tmp_path)
    model2, optim2 = plan_fsdp2.build(device="cpu")
    target = dict(zip(("model", "optim"), get_state_dict(model2, optim2)))
    reader = ucp_dcp.UCPFileSystemReader(str(tmp_path))
    dcp.load(target, storage_reader=reader, planner=ucp_dcp.UCPLoadPlanner())
    report = plan_load(tmp_path, FunctionTarget(_one_rank_target, 1, "one rank"), device="cpu", keep_items=True)
    assert report.loads, report.problems
    mine = report.ranks[0]
    got = rank_stats(reader)
    assert (mine.bytes_read, mine.reads, mine.items, mine.fallbacks) == (
        got["bytes_read"],
        got["reads"],
        got["items"],
        got["fallbacks"],
    )
    assert report.integrity == ("none" if writer == "stock" else "verified")


def test_the_documented_fsdp2_target_plans_through_the_cli(tmp_path, monkeypatch, capsys):
    """docs/plan.md's example: a plain FSDP2 job's own builder as the target, 16 ranks, one built."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ucp_dcp
    from ucp_dcp.__main__ import main

    ex = _example()
    model, optim = ex.build(device="cpu")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    ucp_dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optim))), tmp_path / "ckpt")
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    rc = main(
        [
            "plan",
            str(tmp_path / "ckpt"),
            "--target",
            "plan_fsdp2:target",
            "--world-size",
            "16",
            "--bandwidth",
            "1GB/s",
            "--json",
            str(tmp_path / "plan.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "LOADS" in out and "estimated load time" in out, out
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["loads"] and len(report["ranks"]) == 16 and report["built"] == 2  # one, and the symmetry check
    assert all(r["bytes_read"] + r["bytes_received"] > 0 for r in report["ranks"])


def test_the_dry_run_parses_the_catalog_once_whatever_the_world_size(tmp_path, monkeypatch):
    """Per-checkpoint work is shared by the simulated ranks: a catalog parse per rank (22 ms at 800
    atoms) took the 1,024-rank plan from 39 s to 70 s once, and only CI's plan tier noticed."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ucp_dcp
    from ucp_dcp.planning.catalog import Catalog
    from ucp_dcp.tools.dryrun import FunctionTarget

    model, optim = _example().build(device="cpu")

    ucp_dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optim))), tmp_path)
    parse = Catalog.from_json.__func__
    calls: list[int] = []
    monkeypatch.setattr(Catalog, "from_json", classmethod(lambda cls, raw: calls.append(1) or parse(cls, raw)))
    counts = {}
    for n in (2, 4):
        calls.clear()
        report = plan_load(tmp_path, FunctionTarget(_one_rank_target, n, "replicated"), device="cpu")
        assert report.loads, report.problems
        counts[n] = len(calls)
    assert counts[2] == counts[4] > 0, counts


def test_the_plans_gathered_bytes_are_the_plan_the_reader_sends(tmp_path, monkeypatch):
    """What ``plan`` reports for the coordinator's plan gather is the pickle of the plan the reader's
    ``prepare_local_plan`` hands DCP in a real load (one process: rank 0, its host named as the plan names it)."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ucp_dcp
    from ucp_dcp.tools.dryrun import FunctionTarget

    model, optim = _example().build(device="cpu")
    ucp_dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optim))), tmp_path)
    sent: list[int] = []

    class Reader(ucp_dcp.UCPFileSystemReader):
        def prepare_local_plan(self, plan):
            out = super().prepare_local_plan(plan)
            sent.append(len(pickle.dumps(out)))
            return out

    monkeypatch.setenv("UCP_DCP_HOST", "node0")
    model2, optim2 = _example().build(device="cpu")
    target = dict(zip(("model", "optim"), get_state_dict(model2, optim2)))
    dcp.load(target, storage_reader=Reader(str(tmp_path)), planner=ucp_dcp.UCPLoadPlanner())
    report = plan_load(tmp_path, FunctionTarget(_one_rank_target, 1, "one rank"), device="cpu")
    assert report.loads, report.problems
    assert sent and report.ranks[0].plan_bytes == sent[0] == report.gathered_plan_bytes
    assert "gathered plans: the coordinator receives" in format_report(report)
    assert report_json(report)["gathered_plan_bytes"] == sent[0]


def test_a_plan_in_two_processes_is_the_plan_in_one(tmp_path):
    """Ranks planned side by side in forked workers (tools/dryrun/workers.py) give the same report, rank by
    rank, as one process planning them all."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ucp_dcp
    from ucp_dcp.tools.dryrun import FunctionTarget

    ex = _example()
    model, optim = ex.build(device="cpu")
    ucp_dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optim))), tmp_path)
    reports = [
        report_json(plan_load(tmp_path, FunctionTarget(ex.target, 24, "fsdp2"), ranks_per_node=4, workers=w))
        for w in (1, 2, 3)
    ]
    for r in reports:
        r.pop("seconds"), r.pop("peak_memory")
    assert reports[0]["loads"] and reports[0]["built"] == 2 and reports[0]["gathered_plan_bytes"] > 0
    assert reports[1] == reports[0] == reports[2]
    assert any(r["bytes_received"] for r in reports[0]["ranks"])  # read-once across the simulated hosts


def test_plan_prints_the_control_messages_of_the_load(tmp_path):
    """``plan`` names the store requests the load would make (its gates, two more for the read-once exchange),
    from the model CI's plan tier checks against real calls (``recipes/scale.py --check-counts``): O(1) a rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ucp_dcp
    from ucp_dcp.planning.checkpoint_group import EXCHANGE_GATES, GATES, call_requests
    from ucp_dcp.tools.dryrun import FunctionTarget

    ex = _example()
    model, optim = ex.build(device="cpu")
    ucp_dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optim))), tmp_path)
    per_rank = set()
    for world, read_once in ((8, "hosts"), (24, "hosts"), (8, "off")):
        report = plan_load(tmp_path, FunctionTarget(ex.target, world, "fsdp2"), ranks_per_node=4, read_once=read_once)
        c = report_json(report)["control"]
        exchange = any(r.bytes_received for r in report.ranks)
        assert exchange == (read_once == "hosts"), read_once
        assert c["gates"] == GATES["load"] + (EXCHANGE_GATES if exchange else 0)
        assert c["requests"] == call_requests(world, c["gates"])
        per_rank.add((read_once, c["requests_per_rank"]))
        assert f"control messages: {c['gates']} gates" in format_report(report)
    hosts = [p for m, p in per_rank if m == "hosts"]
    assert len(hosts) == 2 and max(hosts) - min(hosts) < 1  # per rank alike at 8 and 24 ranks (verdicts: per call)


def test_the_rebound_local_shapes_and_mesh_records_are_dtensors_own():
    """The dry run's shortcuts (tools/dryrun/world.py): each rebound local shape is DTensor's own
    ``compute_local_shape_and_global_offset`` (strided shards' sizes worked out once for all coordinates), and a
    mesh copy declared another's twin records what it would have recorded itself."""
    import itertools

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from ucp_dcp._compat import compute_local_shape_and_global_offset, dtensor_from_local, dtensor_local_shape
    from ucp_dcp._compat import mesh_for_rank as copy_mesh
    from ucp_dcp.layout import placements as P

    with fake_rank(0, 12):
        root = init_device_mesh("cpu", (2, 3, 2), mesh_dim_names=("pp", "dp", "tp"))
        slices = [root, root["dp"], root["tp"], root["dp", "tp"], root["pp", "tp"]]
    opts = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
    for r in range(12):
        with fake_rank(r, 12):
            cache: dict = {}
            for s in slices:
                m = copy_mesh(s, r, cache, P.declare_twin)
                assert m.get_coordinate() == m._compute_coordinate_on_dim()
                t = dtensor_from_local(torch.empty(1, device="meta"), m, [Replicate()] * m.ndim, torch.Size([1]), (1,))
                assert P.mesh_info(t) == P._mesh_info(m)
                for shape in [(7, 5), (1, 3), (13, 2)]:
                    for pl in itertools.product(opts, repeat=m.ndim):
                        want = tuple(compute_local_shape_and_global_offset(torch.Size(shape), m, pl)[0])
                        assert dtensor_local_shape(torch.Size(shape), m, pl) == want, (r, shape, pl)
