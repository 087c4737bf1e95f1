"""A checkpoint written with ucp_dcp stays readable by stock DCP at the same layout: ``dcp.load`` with
DCP's default planner (and DCP's own reader) fills the same model and optimizer, and
``dcp_to_torch_save`` gives a state dict ``set_state_dict`` takes. The optimizer is in
``get_state_dict``'s nested form (``param_groups`` a list), as in the README's example."""

from __future__ import annotations

import dist as D
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import assert_written_by_ucp, tensors_equal
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ucp_dcp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _job(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optim = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-2},
            {"params": model[2].parameters(), "lr": 3e-3, "weight_decay": 0.0},
        ]
    )
    return model, optim


def _trained(seed: int = 0):
    model, optim = _job(seed)
    for _ in range(2):
        model(torch.randn(4, 6)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _same_state(a, b) -> None:
    (ma, oa), (mb, ob) = a, b
    assert all(tensors_equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values()))
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name, v in sa["state"][k].items():
            assert tensors_equal(v, sb["state"][k][name]), (k, name)


def _save(path, storage: str) -> tuple:
    model, optim = _trained()
    sd = dict(zip(("model", "optim"), get_state_dict(model, optim)))
    if storage == "ucp":
        ucp_dcp.save(sd, path)
    else:
        dcp.save(sd, checkpoint_id=str(path), planner=ucp_dcp.UCPSavePlanner())
    # what stock DCP reads back must be ucp_dcp's checkpoint, not one stock DCP wrote itself
    assert_written_by_ucp(path, storage=storage == "ucp")
    return model, optim


@pytest.mark.parametrize("storage", ["ucp", "dcp"])
def test_stock_dcp_load_fills_the_same_model_and_optimizer(tmp_path, storage):
    saved = _save(tmp_path / "ckpt", storage)
    model, optim = _job(seed=1)
    optim.step()  # optimizer state must exist to be filled
    sd = dict(zip(("model", "optim"), get_state_dict(model, optim)))
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))  # DCP's default planner and reader
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _same_state(saved, (model, optim))


def test_dcp_to_torch_save_gives_a_state_dict_set_state_dict_takes(tmp_path):
    saved = _save(tmp_path / "ckpt", "ucp")
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert isinstance(full["optim"]["param_groups"], list)
    model, optim = _job(seed=1)
    set_state_dict(model, optim, model_state_dict=full["model"], optim_state_dict=full["optim"])
    _same_state(saved, (model, optim))


STOCK_COPY_LR = 0.5
"""The lr written into the stock ``param_groups.<i>.lr`` copies only, so that a load shows which source it read."""


def _save_with_differing_stock_copies(path, monkeypatch) -> tuple:
    """A ucp_dcp save whose stock copies of the groups say lr=STOCK_COPY_LR, while its per-parameter
    entries keep each group's own lr (in a real save both hold the same values)."""
    import ucp_dcp.planning.resolve as resolve

    real = resolve.collect_entries

    def collect(*args, **kwargs):
        entries, groups = real(*args, **kwargs)
        for e in entries:
            if e.stock and e.key.endswith(".lr"):
                e.value = STOCK_COPY_LR
        return entries, groups

    with monkeypatch.context() as m:
        m.setattr(resolve, "collect_entries", collect)
        return _save(path, "ucp")


def _loaded(load) -> tuple:
    model, optim = _job(seed=1)
    optim.step()
    sd = dict(zip(("model", "optim"), get_state_dict(model, optim)))
    load(sd)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return model, optim


def test_ucp_load_prefers_its_own_per_parameter_groups(tmp_path, monkeypatch):
    """The stock entries are an extra: ucp_dcp fills the groups from each parameter's own entries
    (lr 1e-2 and 3e-3, as saved), not from the positional copies stock DCP reads."""
    path = tmp_path / "ckpt"
    saved = _save_with_differing_stock_copies(path, monkeypatch)
    _, stock = _loaded(lambda sd: dcp.load(sd, checkpoint_id=str(path)))
    assert [g["lr"] for g in stock.param_groups] == [STOCK_COPY_LR] * 2, "the premise: the two sources differ"
    _same_state(saved, _loaded(lambda sd: ucp_dcp.load(sd, path)))


def _fsdp_worker(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for seed, stock in ((0, False), (1, True)):
        model, optim = _job(seed)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(
            [
                {"params": model[0].parameters(), "lr": 1e-2},
                {"params": model[2].parameters(), "lr": 3e-3, "weight_decay": 0.0},
            ]
        )
        model(torch.randn(4, 6)).square().sum().backward()
        optim.step()
        sd = dict(zip(("model", "optim"), get_state_dict(model, optim)))
        if not stock:
            ucp_dcp.save(sd, folder)
        else:
            dcp.load(sd, checkpoint_id=folder)
            set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        full = {k: v.full_tensor() for k, v in get_state_dict(model, optim)[0].items()}
        osd = get_state_dict(model, optim)[1]
        out.append(
            (
                full,
                {
                    k: {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in s.items()}
                    for k, s in osd["state"].items()
                },
                osd["param_groups"],
            )
        )
    return out


def test_stock_dcp_load_of_an_fsdp2_checkpoint_at_the_same_layout():
    folder = D.tmpdir() + "/ckpt"
    (m0, s0, g0), (m1, s1, g1) = D.run(_fsdp_worker, 2, folder)[0]
    assert_written_by_ucp(folder)
    assert all(tensors_equal(m0[k], m1[k]) for k in m0)
    assert all(tensors_equal(s0[k][n], s1[k][n]) for k in s0 for n in s0[k])
    assert g0 == g1
