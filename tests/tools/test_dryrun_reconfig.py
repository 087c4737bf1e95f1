"""The plan of every load of the reconfiguration set (``ucp_dcp.testing.elastic.RECONFIG_SET``, up to 8 ranks) gives every rank
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
