"""ucp_dcp inside torch_checkpointing (issue 34): its ``CheckpointManager`` with our ``UCPResharder`` on every
item, on the reconfiguration set's transitions (FSDP/TP changes, ``_StridedShard``, stage-local layers, fused
and padded parameters, MoE, optimizer groups). Each load is judged entry by entry against the oracle taken at
the save (``logical_state``, full tensors, bitwise); refusals must be our ``UCPError``.

Stock torch_checkpointing (``DefaultResharder``) loads 13 of these 15 transitions wrong without an error
(``recipes/bench_torch_checkpointing.py``): a test here fails if our resharder is swapped for it.
"""

import dist as D
import pytest
import torch
import torch.distributed as dist

from ucp_dcp.testing.checks import state_diffs
from ucp_dcp.testing.elastic import RECONFIG_SET
from ucp_dcp.testing.peer_tc import tc_manager
from ucp_dcp.toy import ModelConfig, Topology, build_job
from ucp_dcp.toy.layouts import trainer_options
from ucp_dcp.toy.parallel import build_trainer, logical_state, train_step

pytest.importorskip("torch_checkpointing")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

ITEMS = ("model", "optim", "train_state")
MAKE_TEST = [("dp=2,tp=2", "tp=4"), ("dp=2,pp=2", "pp=4")]
"""In make test: a TP change of the fused SwiGLU and padded vocabulary with FSDP2 x TP (``_StridedShard``)
saved, and stage-local layers renumbered across a PP change; the rest of the set is ``full``."""


def _resharder(cfg, tr):
    from ucp_dcp.peers.torch_checkpointing import UCPResharder

    return UCPResharder(**trainer_options(cfg, tr))


def _save(rank, world, topo, root):
    torch.set_num_threads(1)
    job = build_job(Topology.parse(topo))
    cfg = ModelConfig()
    tr = build_trainer(cfg, job, seed=0)
    for _ in range(2):
        train_step(tr)
    mgr = tc_manager(_resharder(cfg, tr), keys=ITEMS)
    try:
        mgr.save(root + "/ckpt", tr.state_dict())
    finally:
        mgr.close()
    oracle = logical_state(tr)
    if dist.get_rank(job.group) == 0:
        torch.save(oracle, root + "/oracle.pt")


def _load(rank, world, topo, root):
    torch.set_num_threads(1)
    job = build_job(Topology.parse(topo))
    cfg = ModelConfig()
    tr = build_trainer(cfg, job, seed=1)  # another init: every value must come from the checkpoint
    sd = tr.state_dict()
    mgr = tc_manager(_resharder(cfg, tr), keys=ITEMS)
    try:
        sd = dict(mgr.load(root + "/ckpt", into=sd))
    finally:
        mgr.close()
    tr.load_state_dict(sd)
    oracle = torch.load(root + "/oracle.pt", weights_only=False)
    return state_diffs(oracle, logical_state(tr)), len(oracle)


def _world(topo):
    return Topology.parse(topo).world


def _case(t):
    return pytest.param(*t, marks=() if t in MAKE_TEST else pytest.mark.full, id=f"{t[0]}->{t[1]}")


@pytest.mark.parametrize("save,load", [_case(t) for t in RECONFIG_SET if max(_world(t[0]), _world(t[1])) <= 4])
def test_transition_loads_bitwise_through_torch_checkpointing(save, load):
    root = D.tmpdir()
    D.run(_save, _world(save), save, root)
    res = D.run(_load, _world(load), load, root)
    diffs, n = res[0]
    assert n > 100
    for rank_diffs, _ in res:
        assert not rank_diffs, f"{save} -> {load}: {len(rank_diffs)}/{n} entries differ, e.g. {rank_diffs[:5]}"
