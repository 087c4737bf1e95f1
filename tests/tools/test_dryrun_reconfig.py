"""The plan of every load of the reconfiguration set (``ucp_dev.testing.elastic.RECONFIG_SET``, up to 8 ranks) gives every rank
exactly the bytes, read calls, storage items, bytes received and fallbacks the real load's ``ReadStats``
counted. The plan runs in this process (fake process group, meta tensors); the real loads are the
session's runs of the set (``reconfig_runs``, tests/conftest.py), shared with tests/planning/test_reconfig.py
whichever of the two asks first.
"""

from __future__ import annotations

import pytest
from plan_check import compare, plan
from reconfig_set import MAKE_TEST, TRANSITIONS
from reconfig_set import transition_id as _id

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.slow
@pytest.mark.parametrize(
    "save,load",
    # make test plans the loads test_reconfig.py runs there (MAKE_TEST); the rest are in make test-full
    [pytest.param(*t, marks=() if t in MAKE_TEST else pytest.mark.full, id=_id(t)) for t in TRANSITIONS],
)
def test_plan_is_exactly_the_loads_reads(reconfig_runs, save, load):
    run = reconfig_runs(save, load)  # its checkpoint and every load rank's ReadStats
    report = plan(run["ckpt"], load)
    diffs = compare(report, run["load_stats"])
    assert not diffs, "\n".join(diffs[:20])
    assert sum(r.bytes_read for r in report.ranks) > 0


@pytest.mark.slow
@pytest.mark.parametrize("load", ["pp=2,dp=2", "pp=2,ep=2,tp=2"])
def test_the_toys_function_target_plans_as_its_target_object(reconfig_runs, monkeypatch, load):
    """``plan --target ucp_dev.toy.plan_target:target`` (the toy LLM as a user's function, its topology in
    ``UCP_TOY_TOPOLOGY``) plans every rank as the :class:`RecipeTarget` object does: a rebound rank takes its
    class's options (a stage's stage_map, an EP rank's expert_map)."""
    from ucp_dcp.tools.dryrun import FunctionTarget, plan_load
    from ucp_dcp.tools.dryrun.report import report_json
    from ucp_dev.toy import plan_target

    run = reconfig_runs(*MAKE_TEST[0])
    monkeypatch.setenv("UCP_TOY_TOPOLOGY", load)
    world = plan_target.RecipeTarget(load).world_size
    fn = plan_load(run["ckpt"], FunctionTarget(plan_target.target, world, plan_target.TARGET), device="cpu")
    obj = plan_load(run["ckpt"], plan_target.RecipeTarget(load), device="cpu")
    assert fn.loads and obj.loads, (fn.problems, obj.problems)
    a, b = report_json(fn), report_json(obj)
    for key in ("target", "built", "seconds", "peak_memory"):
        a.pop(key), b.pop(key)
    assert a == b
