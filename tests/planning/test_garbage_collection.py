"""A call and Python's garbage collector: a save or load leaves no reference cycle through its planner (what it
made is freed by reference counts when it returns), and it runs with automatic collection paused on the
main thread (``checkpoint_group.guarded``), not on a background one.

A sink closing over the planner once made the planner, the checkpoint's metadata and every plan one cycle per
load (4,479 objects at 2 ranks of ``recipes/scale.py``'s state, ~60,000 at 16): a generation-2 collection
then ran inside some load (0.25 s of CPU, 1.3-2.4 s of wall time with 16 ranks on 2 cores) while every other
rank waited for it at the next collective -- the slow loads of ``make scale``. Stock DCP's own calls leave a
few hundred small objects (its unpickler's and pickler's classes) and none of these."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import ucp_dcp
from ucp_dcp.planning import plan_cache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

OURS = ("ucp_dcp.", "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    opt = torch.optim.AdamW([{"params": m[0].parameters(), "lr": 0.1}, {"params": m[1].parameters(), "lr": 0.2}])
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    # objects, not only tensors: each gets a sink (the closure that made the cycle)
    return {"model": msd, "optim": osd, "extra": {"epoch": seed, "name": f"run-{seed}"}}


def _cyclic_garbage(fn) -> list[str]:
    """The types of ours (and DCP's metadata) that ``fn()`` left in reference cycles."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()  # nothing collected before the check: every cycle the call made is still there
    try:
        fn()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    return [t for t in found if t.startswith(OURS)]


@pytest.mark.parametrize("cache_plans", [False, True], ids=["planned", "cached-plan"])
def test_load_leaves_no_cycle_through_the_planner(tmp_path, cache_plans):
    plan_cache.clear()
    ucp_dcp.save(_state(1), tmp_path / "ck")
    if cache_plans:
        ucp_dcp.load(_state(2), tmp_path / "ck", cache_plans=True)  # plans and caches: the next load hits
    target = _state(2)
    left = _cyclic_garbage(lambda: ucp_dcp.load(target, tmp_path / "ck", cache_plans=cache_plans))
    assert left == [], f"a load left these in reference cycles: {left}"
    assert target["extra"] == {"epoch": 1, "name": "run-1"}  # the object sinks did fill the target
    if cache_plans:
        assert plan_cache.counters.get("local_hit", 0) >= 1
    plan_cache.clear()


def test_save_leaves_no_cycle_through_the_planner(tmp_path):
    sd = _state(3)
    ucp_dcp.save(sd, tmp_path / "warm")
    left = _cyclic_garbage(lambda: ucp_dcp.save(sd, tmp_path / "ck"))
    assert left == [], f"a save left these in reference cycles: {left}"


class _Probe:
    """A ``Stateful`` value: DCP calls its ``state_dict()`` inside the save; it notes whether collection ran."""

    def __init__(self) -> None:
        self.gc_enabled: list[bool] = []

    def state_dict(self) -> dict:
        self.gc_enabled.append(gc.isenabled())
        return {"w": torch.arange(4.0)}

    def load_state_dict(self, sd: dict) -> None:
        self.gc_enabled.append(gc.isenabled())


def test_a_call_pauses_automatic_collection_on_the_main_thread_only(tmp_path):
    import threading

    probe = _Probe()
    assert gc.isenabled()
    ucp_dcp.save({"probe": probe}, tmp_path / "main")
    ucp_dcp.load({"probe": probe}, tmp_path / "main")
    assert len(probe.gc_enabled) >= 2 and not any(probe.gc_enabled)  # paused inside the save and the load
    assert gc.isenabled()  # and back on after

    gc.disable()  # a caller that manages collection itself (torchtitan's GarbageCollection) keeps it off
    try:
        ucp_dcp.save({"probe": probe}, tmp_path / "off")
        assert not gc.isenabled()
    finally:
        gc.enable()

    background = _Probe()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ucp_dcp.save({"probe": background}, tmp_path / "thread")
        except BaseException as e:  # noqa: BLE001 (re-raised by the assertion below)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    assert background.gc_enabled == [True]  # a background call leaves the process's collection alone
