"""The side group of the read-once exchange across an in-process restart (destroy_process_group, then a
new init_process_group): never a group of the destroyed job, even when the new default group's ``id()``
is the old one's (CPython recycles ids of freed objects; torchft-style restarts hit it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ucp_dcp.planning.collectives as collectives
from ucp_dcp._compat import group_registered


def _init(tmp_path, name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/{name}", rank=0, world_size=1)


def test_a_new_job_in_the_same_process_gets_a_live_side_group_even_with_a_recycled_id(tmp_path, monkeypatch):
    monkeypatch.setenv(collectives.P2P_ENV, "side")  # a side group even where the default group carries CPU
    # every default group "has" one id, as a freed one's recycled id would: a cache keyed by id() hands
    # back the destroyed job's group here
    monkeypatch.setattr(collectives, "id", lambda _obj: 7, raising=False)
    monkeypatch.setattr(collectives, "_SIDE", {})
    _init(tmp_path, "a")
    try:
        first = collectives.p2p_group()
        assert first is not None and group_registered(first)
    finally:
        dist.destroy_process_group()
    _init(tmp_path, "b")
    try:
        second = collectives.p2p_group()
        assert second is not first, "the destroyed job's side group was handed to the new job"
        assert group_registered(second)
        t = torch.ones(3)
        dist.all_reduce(t, group=second)  # usable, not a destroyed group
        assert torch.equal(t, torch.ones(3))
    finally:
        dist.destroy_process_group()
