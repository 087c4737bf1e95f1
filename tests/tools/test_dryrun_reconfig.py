"""The plan of every load of the reconfiguration set (``ucp_dcp.testing.elastic.RECONFIG_SET``, up to 8 ranks) gives every rank
exactly the bytes, read calls, storage items, bytes received and fallbacks the real load's ``ReadStats``
counted. The plan runs in this process (fake process group, meta tensors); the real loads are those
test_reconfig.py ran (their checkpoints and figures are reused when it ran in this session), or, for
the transitions it does not run, a save and load on the pool here.
"""

from __future__ import annotations

import sys

import pytest
from plan_check import compare, plan, real_load
from test_reconfig import MAKE_TEST

from ucp_dcp.testing.elastic import RECONFIG_SET

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


TRANSITIONS = RECONFIG_SET


def _id(t) -> str:
    return f"{t[0]}-to-{t[1]}".replace("=", "").replace(",", "")


@pytest.mark.slow
@pytest.mark.parametrize(
    "save,load",
    # make test plans the loads test_reconfig.py runs there (MAKE_TEST); the rest are in make test-full
    [pytest.param(*t, marks=() if t in MAKE_TEST else pytest.mark.full, id=_id(t)) for t in TRANSITIONS],
)
def test_plan_is_exactly_the_loads_reads(save, load):
    # the resume test's runs (tests/planning/test_reconfig.py) when this session ran it, else a load of our own
    run = getattr(sys.modules.get("test_reconfig"), "RUNS", {}).get((save, load))
    if run is not None:  # the resume test's own load: its checkpoint and every rank's ReadStats
        ckpt, stats = run["ckpt"], run["load_stats"]
    else:
        folder, real = real_load(save, load)
        assert "stats" in real, f"the real load failed: {real}"
        ckpt, stats = f"{folder}/ckpt", real["stats"]
    report = plan(ckpt, load)
    diffs = compare(report, stats)
    assert not diffs, "\n".join(diffs[:20])
    assert sum(r.bytes_read for r in report.ranks) > 0
