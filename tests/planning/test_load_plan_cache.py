"""The load-plan cache in one process (``cache_plans``, :mod:`ucp_dcp.planning.plan_cache`): a repeated load
plans once and loads bitwise what a fresh plan loads, into the same or into new target objects (sinks, param
groups, fused tensors loaded unsplit rebuilt on the current targets); anything the plan depends on -- the
checkpoint, dtypes, aliasing, options -- plans afresh; a coordinator without the plan makes ``ucp_dcp.load``
plan again. The multi-rank cases (gather bytes, layouts, one rank re-planning): test_load_plan_cache_dist.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ucp_dcp
from ucp_dcp import UCPFileSystemReader, UCPLoadPlanner
from ucp_dcp.layout.fragments import Box, Fragment
from ucp_dcp.layout.patterns import Fused
from ucp_dcp.planning import plan_cache
from ucp_dcp.planning.entries import Entry, GroupTarget
from ucp_dcp.planning.plan_cache import SIGNED_FIELDS
from ucp_dcp.planning.resolve import Resolved
from ucp_dcp.storage import reader as keyed_plans  # the reader's side of the cache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _empty_cache():
    plan_cache.clear()
    plan_cache.counters.clear()
    yield
    plan_cache.clear()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        return self.b(self.a(x).relu()).sum()


def _trained(seed: int):
    torch.manual_seed(seed)
    m = Net()
    opt = torch.optim.AdamW([{"params": m.a.parameters(), "lr": 0.1}, {"params": m.b.parameters(), "lr": 0.2}])
    for _ in range(2):
        m(torch.randn(5, 4)).backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _state(m, opt, extra: int = 7):
    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd, "extra": {"epoch": extra, "ids": torch.arange(3) + extra}}


def _fresh():
    """A new model and optimizer of the same layout (other values, other lr): the target of a load."""
    torch.manual_seed(99)
    m = Net()
    opt = torch.optim.AdamW([{"params": m.a.parameters(), "lr": 1.0}, {"params": m.b.parameters(), "lr": 1.0}])
    m(torch.randn(5, 4)).backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def _load(path, target=None, **kw):
    """Load ``path`` into a fresh model + optimizer (or ``target``); returns (model, opt, stats)."""
    m, opt = target or _fresh()
    sd = _state(m, opt, extra=0)
    stats = ucp_dcp.load(sd, path, **kw)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return m, opt, stats, sd


def _same(m1, o1, m2, o2) -> bool:
    s1, s2 = _state(m1, o1), _state(m2, o2)
    f1, f2 = dict(_flat(s1)), dict(_flat(s2))
    if f1.keys() != f2.keys():
        return False
    for k, v in f1.items():
        w = f2[k]
        if isinstance(v, torch.Tensor):
            if not (v.dtype == w.dtype and v.shape == w.shape and torch.equal(v.view(-1), w.view(-1))):
                return False
        elif v != w:
            return False
    return True


def _flat(x, prefix=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix, x


def test_a_repeated_load_reuses_its_plan_and_loads_bitwise_into_new_and_the_same_targets(tmp_path):
    m, opt = _trained(1)
    ucp_dcp.save(_state(m, opt), tmp_path / "c")
    m1, o1, s1, sd1 = _load(tmp_path / "c")
    assert not s1.plan_cached and not s1.global_plan_cached
    # new target objects, same layout: the plan is reused, the values land in the new objects
    m2, o2, s2, sd2 = _load(tmp_path / "c")
    assert s2.plan_cached and s2.global_plan_cached, plan_cache.counters
    assert plan_cache.counters["local_hit"] == 1 and plan_cache.counters["transport_reused"] == 1
    # the same target objects again, after they changed (the loaded values must come back)
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)
    for g in o2.param_groups:
        g["lr"] = 5.0
    m3, o3, s3, sd3 = _load(tmp_path / "c", target=(m2, o2))
    assert s3.plan_cached
    for got in ((m1, o1), (m2, o2), (m3, o3)):
        assert _same(m, opt, *got)
    assert [g["lr"] for g in o2.param_groups] == [0.1, 0.2]  # param groups: sinks of this load's dicts
    for got in (sd1, sd2, sd3):  # a plain object and tensor outside the model, into each load's own dict
        assert got["extra"]["epoch"] == 7 and torch.equal(got["extra"]["ids"], torch.arange(3) + 7)
    # cache_plans=False: planned, nothing reported
    _, _, s4, _ = _load(tmp_path / "c", cache_plans=False)
    assert not s4.plan_cached and plan_cache.counters["local_hit"] == 2


def test_another_checkpoint_a_dtype_aliasing_or_an_option_plans_afresh(tmp_path):
    m, opt = _trained(1)
    ucp_dcp.save(_state(m, opt), tmp_path / "a")
    n, nopt = _trained(2)  # the same layout, other values
    ucp_dcp.save(_state(n, nopt), tmp_path / "b")
    _load(tmp_path / "a")
    m2, o2, s, _ = _load(tmp_path / "b")
    assert not s.plan_cached and _same(n, nopt, m2, o2)
    m3, o3, s, _ = _load(tmp_path / "a")  # the first checkpoint's plan is still cached
    assert s.plan_cached and _same(m, opt, m3, o3)
    # the same checkpoint into a target of another dtype
    sd = {"model": {k: v.to(torch.float64) for k, v in m.state_dict().items()}}
    assert not ucp_dcp.load(sd, tmp_path / "a").plan_cached
    assert all(torch.equal(sd["model"][k], v.to(torch.float64)) for k, v in m.state_dict().items())
    assert ucp_dcp.load(sd, tmp_path / "a").plan_cached
    # an option of the planner
    assert not ucp_dcp.load(sd, tmp_path / "a", read_once="off").plan_cached
    # two keys sharing one tensor (a tie) vs two tensors of the same shapes: the plans differ (aliasing decides
    # which key reads), so the tied target re-plans although keys, shapes and dtypes are the same
    ucp_dcp.save({"model": {"a.weight": m.a.weight.detach(), "b.weight": m.a.weight.detach().clone()}}, tmp_path / "t")
    w = torch.zeros(6, 4)
    tied = {"model": {"a.weight": w, "b.weight": w}}
    untied = {"model": {"a.weight": torch.zeros(6, 4), "b.weight": torch.zeros(6, 4)}}
    assert [ucp_dcp.load(t, tmp_path / "t").plan_cached for t in (untied, untied, tied, tied)] == [0, 1, 0, 1]
    assert torch.equal(w, m.a.weight.detach()) and torch.equal(untied["model"]["b.weight"], m.a.weight.detach())


D, Q, KV, G = 6, 8, 4, 2
QKV = Fused(r"(.*)wqkv\.weight", [(r"\1wq.weight", Q), (r"\1wk.weight", KV), (r"\1wv.weight", KV)], blocks=G)


def test_a_fused_target_loaded_as_its_unsplit_stock_tensor_again_from_a_cached_plan(tmp_path):
    """Stock DCP saved the fused tensor; the rule's parts are absent, so the plan reads it unsplit
    (``create_local_plan`` switches the target's fragments): a hit must switch them too."""
    w = torch.arange(float((Q + 2 * KV) * D)).reshape(Q + 2 * KV, D)
    dcp.save({"model": {"wqkv.weight": w}}, checkpoint_id=tmp_path / "stock")
    for cached in (False, True, True):
        got = {"model": {"wqkv.weight": torch.zeros_like(w)}}
        stats = ucp_dcp.load(got, tmp_path / "stock", patterns=[QKV])
        assert stats.plan_cached == cached
        assert torch.equal(got["model"]["wqkv.weight"], w)


def test_a_coordinator_without_the_plan_makes_the_load_plan_again(tmp_path):
    m, opt = _trained(1)
    ucp_dcp.save(_state(m, opt), tmp_path / "c")
    _load(tmp_path / "c")
    for d in (plan_cache._PAYLOADS, keyed_plans._SUMMARIES, plan_cache._CHECKED, keyed_plans._TRANSPORTS):
        d.clear()  # what a coordinator in another process would lack
    m2, o2, s, _ = _load(tmp_path / "c")  # ucp_dcp.load: the miss, then a plan without the cache
    assert not s.plan_cached and _same(m, opt, m2, o2)
    _, _, s, _ = _load(tmp_path / "c")  # after a failed load a rank plans afresh once (and caches again)
    assert not s.plan_cached and plan_cache.counters["local_miss"] == 2
    # dcp.load itself raises the miss on every rank; the next load plans afresh, the one after reuses it
    for d in (plan_cache._PAYLOADS, keyed_plans._SUMMARIES, plan_cache._CHECKED, keyed_plans._TRANSPORTS):
        d.clear()
    sd = _state(*_fresh(), extra=0)
    with pytest.raises(plan_cache.PlanCacheMissError):
        with ucp_dcp.errors.ucp_errors():
            dcp.load(sd, storage_reader=UCPFileSystemReader(tmp_path / "c"), planner=UCPLoadPlanner(cache_plans=True))
    planner = UCPLoadPlanner(cache_plans=True)
    dcp.load(sd, storage_reader=UCPFileSystemReader(tmp_path / "c"), planner=planner)
    assert planner.plan_cache_hit is False and planner.global_plan_cached is False
    planner = UCPLoadPlanner(cache_plans=True)
    dcp.load(sd, storage_reader=(r := UCPFileSystemReader(tmp_path / "c")), planner=planner)
    assert planner.plan_cache_hit is True and planner.global_plan_cached is True and r.stats.plan_cached


def test_an_override_of_the_local_plan_turns_the_cache_off(tmp_path):
    class Mine(UCPLoadPlanner):
        def create_local_plan(self):
            return super().create_local_plan()

    ucp_dcp.save({"w": torch.ones(3)}, tmp_path / "c")
    for _ in range(2):
        planner = Mine(cache_plans=True)
        dcp.load({"w": torch.zeros(3)}, storage_reader=UCPFileSystemReader(tmp_path / "c"), planner=planner)
        assert planner.plan_cache_hit is None


def test_the_key_covers_every_field_of_the_resolved_target():
    """A field added to what the local plan is made from must be added to the key (plan_cache.target_signature)."""
    for cls in (Resolved, Entry, Fragment, Box, GroupTarget):
        assert tuple(f.name for f in dataclasses.fields(cls)) == SIGNED_FIELDS[cls.__name__], cls
