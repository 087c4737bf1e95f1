"""The reconfiguration set (scaled-down UCP paper experiments) run in-process on the pool, one item per
transition: those of at most 4 ranks on the 4-process pool (sub-groups), the two 8-rank ones on the
8-process pool. `make reconfig` runs the whole set in fresh processes per job, with timings.

The set (``RECONFIG_SET``) and the resume check are ``ucp_dcp.testing.elastic``'s, the ones the recipes run;
the model and trainer are ``ucp_dcp.toy``'s.
"""

import logging
import time

import dist as D
import pytest

from ucp_dcp.testing.elastic import RECONFIG_SET, elastic_resume, resume_problems
from ucp_dcp.toy import Topology

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

EIGHT_RANK = [("dp=2,tp=2,pp=2", "dp=2,tp=2"), ("dp=2,tp=2,ep=2", "dp=4,ep=2")]
STEPS = 2


def _world(text: str) -> int:
    return Topology.parse(text).world


TRANSITIONS = RECONFIG_SET
SMALL = [t for t in TRANSITIONS if max(_world(t[0]), _world(t[1])) <= 4]
MAKE_TEST = [("dp=4", "dpr=2,dp=2"), ("ep=4", "dp=4"), ("pp=3", "pp=2")]
"""The transitions ``make test`` runs (HSDP with its traffic check, EP to DP, PP re-staging; virtual stages are
tests/torchtitan/test_interleave.py's); the rest of the set runs in ``make test-full``; the e2e tier's mistake
set loads every transition bitwise (CI: a sample each run, all of it over the rotating shards)."""


def _tier(t: tuple[str, str]):
    return pytest.param(*t, marks=() if t in MAKE_TEST else pytest.mark.full, id=_id(t))


def _id(t) -> str:
    return f"{t[0]}-to-{t[1]}".replace("=", "").replace(",", "")


def test_the_set_is_ten_transitions_of_at_most_4_ranks_and_the_8_rank_ones():
    assert len(SMALL) == 10 and set(MAKE_TEST) <= set(SMALL)
    assert all(t in TRANSITIONS for t in EIGHT_RANK)
    assert ("dp=4", "dpr=2,dp=2") in SMALL  # the HSDP load whose traffic is checked
    assert all(_world(s) <= 8 and _world(l) <= 8 for s, l in TRANSITIONS)


def _transition_worker(rank, world, root, save, load, steps):
    D.setenv("UCP_DCP_HOST", f"node{rank // 2}")  # two simulated hosts of two ranks: read-once sends across
    # the oracle's full_tensor() of FSDP x TP weights logs a performance warning per call
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    out = elastic_resume(Topology.parse(save), Topology.parse(load), steps, root)
    if out is not None:
        out["seconds"] = time.perf_counter() - t0
    return out


RUNS: dict[tuple[str, str], dict] = {}
"""Each transition's figures (its checkpoint and every load rank's ReadStats): tests/tools/test_dryrun_reconfig.py plans
the same loads instead of saving again."""


def _check(save, load, world):
    r = D.run(_transition_worker, world, D.tmpdir(), save, load, STEPS)[0]
    RUNS[(save, load)] = r
    problems = resume_problems(r, STEPS)
    print(f"{save} -> {load}: {r['seconds']:.1f}s, {r['entries']} state entries, io {r['io']}")
    assert not problems, f"RESUME MISMATCH: {save} -> {load}: " + "; ".join(problems)
    return r


@pytest.mark.slow
@pytest.mark.parametrize("save,load", [_tier(t) for t in SMALL])
def test_reconfig_transition_up_to_4_ranks(save, load):
    r = _check(save, load, 4)
    if (save, load) == ("dp=4", "dpr=2,dp=2"):
        # loading HSDP (2 replicas of each FSDP shard, one per simulated host): no saved item is read on
        # both hosts; the other host's replica arrives from the reader instead of storage
        hsdp = r["io"]
        assert hsdp["hosts"] == 2 and hsdp["items_read_on_several_hosts"] == 0, hsdp
        assert hsdp["bytes_received"] > 0.5 * hsdp["bytes_read"] > 0, hsdp


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("save,load", EIGHT_RANK, ids=[_id(t) for t in EIGHT_RANK])
def test_reconfig_8_rank_transition(save, load):
    _check(save, load, 8)
