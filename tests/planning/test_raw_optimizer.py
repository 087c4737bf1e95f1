"""The raw optimizer form (issue 31, item 3), one process: ``optimizer.state_dict()`` keys parameters by
integer position. It saves as DCP saves it (the same keys), loads back exactly into an optimizer that
lists the same parameters in the same order, and is refused with DCP's advice (``get_state_dict``)
where positions would name other parameters -- checked before a byte is read for ucp_dcp's
checkpoints, when the ``params`` lists are read for stock ones."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import expect_ucp_error, tensors_equal
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ucp_dcp
from ucp_dcp import UCPLoadPlanner
from ucp_dcp.planning.catalog import merge_local_catalogs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _job(seed: int, grouping: str = "two", steps: int = 1):
    """A model and AdamW (two param groups with their own lr) trained ``steps`` steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4))
    if grouping == "two":
        groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.02}]
    elif grouping == "swapped":  # same counts and shapes per position, other parameters at positions 0-1 / 2-3
        groups = [{"params": model[2].parameters(), "lr": 0.1}, {"params": model[0].parameters(), "lr": 0.02}]
    else:
        groups = [{"params": model.parameters(), "lr": 0.1}]
    opt = torch.optim.AdamW(groups, weight_decay=0.05)
    for _ in range(steps):
        model(torch.randn(2, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _raw(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    return tensors_equal(a.state_dict(), b.state_dict())  # state (steps included) and groups, bitwise


def test_raw_form_saves_with_dcp_keys_and_loads_back_exactly(tmp_path):
    model, opt = _job(0, steps=3)
    ucp_dcp.save(_raw(model, opt), tmp_path / "ucp")
    dcp.save(_raw(model, opt), checkpoint_id=tmp_path / "stock")
    ours = dcp.FileSystemReader(tmp_path / "ucp").read_metadata()
    stock = dcp.FileSystemReader(tmp_path / "stock").read_metadata()
    assert set(ours.state_dict_metadata) == set(stock.state_dict_metadata)  # saved as DCP saves it
    assert ours.planner_data["__ucp__"]["raw_optimizers"] == {"optim": [[0, 1], [2, 3]]}
    m2, o2 = _job(1, steps=1)  # other values, other step counts, other lr: everything must be replaced
    for g in o2.param_groups:
        g["lr"] = 9.0
    target = _raw(m2, o2)
    ucp_dcp.load(target, tmp_path / "ucp")
    o2.load_state_dict(target["optim"])
    assert _same_optimizer(o2, opt)
    assert tensors_equal(m2.state_dict(), model.state_dict())


def test_stock_dcp_loads_the_raw_form_ucp_dcp_saved(tmp_path):
    model, opt = _job(0, steps=2)
    ucp_dcp.save(_raw(model, opt), tmp_path)
    m2, o2 = _job(1)
    target = _raw(m2, o2)
    dcp.load(target, checkpoint_id=tmp_path)
    o2.load_state_dict(target["optim"])
    assert _same_optimizer(o2, opt)


def test_ucp_dcp_loads_a_stock_raw_checkpoint_at_the_same_layout(tmp_path):
    model, opt = _job(0, steps=2)
    dcp.save(_raw(model, opt), checkpoint_id=tmp_path)
    m2, o2 = _job(1)
    target = _raw(m2, o2)
    ucp_dcp.load(target, tmp_path)
    o2.load_state_dict(target["optim"])
    assert _same_optimizer(o2, opt)


def test_other_parameter_positions_are_refused_before_a_byte_is_read(tmp_path):
    model, opt = _job(0, steps=2)
    ucp_dcp.save(_raw(model, opt), tmp_path)
    m2, o2 = _job(1, "one")  # one group: positions [[0, 1, 2, 3]] where the checkpoint has [[0, 1], [2, 3]]
    target = _raw(m2, o2)
    before = copy.deepcopy(target)
    with pytest.raises(ucp_dcp.ParamGroupError) as e:
        ucp_dcp.load(target, tmp_path)
    err = e.value
    assert err.atom == "optim.param_groups" and "[[0, 1], [2, 3]], the target's [[0, 1, 2, 3]]" in str(err)
    assert "get_state_dict" in err.hint and "set_state_dict" in err.hint
    assert tensors_equal(target, before), "nothing was loaded"


def test_positions_naming_other_parameters_are_refused_and_the_hint_works(tmp_path):
    """The same position lists, other parameters behind them: the shapes disagree, and the error says
    why; the state dict by parameter name (the hint) loads whatever the optimizer's order."""
    model, opt = _job(0, steps=2)
    ucp_dcp.save(_raw(model, opt), tmp_path / "raw")
    m2, o2 = _job(1, "swapped")
    target = _raw(m2, o2)
    before = copy.deepcopy(target)
    with pytest.raises(ucp_dcp.ShapeMismatchError) as e:
        ucp_dcp.load(target, tmp_path / "raw")
    assert "'optim' is a raw optimizer.state_dict()" in str(e.value) and "get_state_dict" in e.value.hint
    assert tensors_equal(target, before), "nothing was loaded"
    ucp_dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), tmp_path / "fqn")
    named = dict(zip(("model", "optim"), get_state_dict(m2, o2)))
    ucp_dcp.load(named, tmp_path / "fqn")
    set_state_dict(m2, o2, model_state_dict=named["model"], optim_state_dict=named["optim"])
    for p_old, p_new in zip(model.parameters(), m2.parameters()):
        assert tensors_equal(opt.state[p_old], o2.state[p_new])
    saved_lr = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    got_lr = {id(p): g["lr"] for g in o2.param_groups for p in g["params"]}
    assert [saved_lr[id(p)] for p in model.parameters()] == [got_lr[id(p)] for p in m2.parameters()]


def test_a_stock_raw_checkpoint_at_other_positions_is_refused_when_read(tmp_path):
    """Swapped groups with equal shapes per position: the positions' shapes agree, only the saved
    ``params`` lists tell, and a stock checkpoint records them nowhere else."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)

    def opt_of(first, second):
        o = torch.optim.SGD([{"params": [first.weight], "lr": 0.1}, {"params": [second.weight, first.bias]}], lr=0.2)
        o.state_dict()  # positions: 0 first.weight | 1 second.weight, 2 first.bias
        return o

    saved = opt_of(a, b)
    dcp.save({"optim": saved.state_dict()}, checkpoint_id=tmp_path)
    regrouped = torch.optim.SGD([{"params": [a.weight, b.weight], "lr": 0.1}, {"params": [a.bias]}], lr=0.2)
    err = expect_ucp_error(
        lambda: dcp.load({"optim": regrouped.state_dict()}, checkpoint_id=tmp_path, planner=UCPLoadPlanner()),
        ucp_dcp.ParamGroupError,
    )
    assert "parameter positions [0] in a group where the target lists [0, 1]" in str(err)
    assert "get_state_dict" in err.hint


def test_raw_and_named_forms_do_not_load_into_each_other(tmp_path):
    model, opt = _job(0)
    ucp_dcp.save(_raw(model, opt), tmp_path / "raw")
    ucp_dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), tmp_path / "fqn")
    m2, o2 = _job(1)
    with pytest.raises(ucp_dcp.ParamGroupError, match="the target keys it by parameter name") as e:
        ucp_dcp.load(dict(zip(("model", "optim"), get_state_dict(m2, o2))), tmp_path / "raw")
    assert "get_state_dict" in e.value.hint
    with pytest.raises(ucp_dcp.ParamGroupError, match="does not hold it in that form") as e:
        ucp_dcp.load(_raw(m2, o2), tmp_path / "fqn")
    assert "get_state_dict" in e.value.hint


def test_ranks_listing_other_positions_are_refused_at_save():
    """Pipeline stages each number their own optimizer's parameters: equal keys, other parameters."""
    cats = [
        {"meshes": [], "atoms": {}, "raw_optimizers": {"optim": [[0, 1, 2]]}},
        {"meshes": [], "atoms": {}, "raw_optimizers": {"optim": [[0, 1]]}},
    ]
    with pytest.raises(ucp_dcp.ParamGroupError, match="other parameter positions on different ranks") as e:
        merge_local_catalogs(cats, writer={})
    assert "get_state_dict" in e.value.hint
    same = merge_local_catalogs([cats[0], cats[0]], writer={})
    assert same["raw_optimizers"] == {"optim": [[0, 1, 2]]}
