"""The reconfiguration set (scaled-down UCP paper experiments) run in-process on the pool, one item per
transition: those of at most 4 ranks on the 4-process pool (sub-groups), the two 8-rank ones on the
8-process pool. `make reconfig` runs the whole set in fresh processes per job, with timings.

The set (``RECONFIG_SET``) and the resume check are ``ucp_dev.testing.elastic``'s, the ones the recipes run;
the model and trainer are ``ucp_dev.toy``'s.
"""

import pytest
from reconfig_set import MAKE_TEST, STEPS, TRANSITIONS, world
from reconfig_set import transition_id as _id

from ucp_dev.testing.elastic import resume_problems

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EIGHT_RANK = [("dp=2,tp=2,pp=2", "dp=2,tp=2"), ("dp=2,tp=2,ep=2", "dp=4,ep=2")]
SMALL = [t for t in TRANSITIONS if max(world(t[0]), world(t[1])) <= 4]


def _tier(t: tuple[str, str]):
    return pytest.param(*t, marks=() if t in MAKE_TEST else pytest.mark.full, id=_id(t))


def test_the_set_is_ten_transitions_of_at_most_4_ranks_and_the_8_rank_ones():
    assert len(SMALL) == 10 and set(MAKE_TEST) <= set(SMALL)
    assert all(t in TRANSITIONS for t in EIGHT_RANK)
    assert ("dp=4", "dpr=2,dp=2") in SMALL  # the HSDP load whose traffic is checked
    assert all(world(s) <= 8 and world(l) <= 8 for s, l in TRANSITIONS)


def _check(reconfig_runs, save, load):
    r = reconfig_runs(save, load)
    problems = resume_problems(r, STEPS)
    print(f"{save} -> {load}: {r['seconds']:.1f}s, {r['entries']} state entries, io {r['io']}")
    assert not problems, f"RESUME MISMATCH: {save} -> {load}: " + "; ".join(problems)
    return r


@pytest.mark.slow
@pytest.mark.parametrize("save,load", [_tier(t) for t in SMALL])
def test_reconfig_transition_up_to_4_ranks(reconfig_runs, save, load):
    r = _check(reconfig_runs, save, load)
    if (save, load) == ("dp=4", "dpr=2,dp=2"):
        # loading HSDP (2 replicas of each FSDP shard, one per simulated host): no saved item is read on
        # both hosts; the other host's replica arrives from the reader instead of storage
        hsdp = r["io"]
        assert hsdp["hosts"] == 2 and hsdp["items_read_on_several_hosts"] == 0, hsdp
        assert hsdp["bytes_received"] > 0.5 * hsdp["bytes_read"] > 0, hsdp


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("save,load", EIGHT_RANK, ids=[_id(t) for t in EIGHT_RANK])
def test_reconfig_8_rank_transition(reconfig_runs, save, load):
    _check(reconfig_runs, save, load)
