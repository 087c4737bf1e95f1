"""Param groups of stock-DCP checkpoints are matched by membership, never by list position (issue 21):
a new job that lists its groups in another order gets each group's own lr / weight decay, as stock
``dcp.load`` + ``set_state_dict`` does through the saved names."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import assert_written_by_ucp, expect_ucp_error
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ucp_dcp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.body(x)).square().sum()


def _optim(m, order=("decay", "no_decay"), merged=False):
    groups = {
        "decay": {"params": [m.body.weight], "lr": 0.01, "weight_decay": 0.1},
        "no_decay": {"params": [m.body.bias, m.norm.weight, m.norm.bias], "lr": 0.02, "weight_decay": 0.0},
    }
    if merged:
        return torch.optim.AdamW([{"params": list(m.parameters()), "lr": 0.5}])
    return torch.optim.AdamW([groups[k] for k in order])


def _trained():
    torch.manual_seed(0)
    m = Net()
    o = _optim(m)
    for _ in range(2):
        m(torch.randn(3, 4)).backward()
        o.step()
        o.zero_grad()
    return m, o


def _fresh(order, merged=False):
    torch.manual_seed(1)
    m = Net()
    o = _optim(m, order, merged)
    for g in o.param_groups:  # hyperparameters a correct load must overwrite
        g["lr"], g["weight_decay"] = 9.0, 9.0
    return m, o


def _load(path, order, how):
    m, o = _fresh(order)
    msd, osd = get_state_dict(m, o)
    sd = {"model": msd, "optim": osd}
    if how == "ucp":
        dcp.load(sd, checkpoint_id=path, planner=ucp_dcp.UCPLoadPlanner())
    else:
        dcp.load(sd, checkpoint_id=path)
    set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return m, o


def _by_param(m, o):
    names = {p: n for n, p in m.named_parameters()}
    return {names[p]: (g["lr"], g["weight_decay"]) for g in o.param_groups for p in g["params"]}


@pytest.mark.parametrize("writer", ["stock", "ucp"])
def test_reordered_groups_get_their_own_hyperparameters(tmp_path, writer):
    m, o = _trained()
    msd, osd = get_state_dict(m, o)
    planner = ucp_dcp.UCPSavePlanner() if writer == "ucp" else None
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path, planner=planner)
    if writer == "ucp":
        assert_written_by_ucp(tmp_path, storage=False)
    want = _by_param(m, o)
    stock = _by_param(*_load(tmp_path, ("no_decay", "decay"), "stock"))
    ours_m, ours_o = _load(tmp_path, ("no_decay", "decay"), "ucp")
    assert stock == want, "stock dcp.load + set_state_dict matches by name"
    assert _by_param(ours_m, ours_o) == want
    for (n, p), (_, q) in zip(m.named_parameters(), ours_m.named_parameters()):
        assert torch.equal(p, q), n
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o.state[p][k], ours_o.state[q][k]), (n, k)


def test_a_target_group_spanning_saved_groups_with_other_values_is_refused(tmp_path):
    m, o = _trained()
    msd, osd = get_state_dict(m, o)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path)
    m2, o2 = _fresh(None, merged=True)
    msd, osd = get_state_dict(m2, o2)
    err = expect_ucp_error(
        lambda: dcp.load({"model": msd, "optim": osd}, checkpoint_id=tmp_path, planner=ucp_dcp.UCPLoadPlanner()),
        ucp_dcp.ParamGroupError,
    )
    assert "groups [0, 1]" in str(err) and "'lr' differ" in str(err) and err.atom.startswith("optim.param_groups.0")
