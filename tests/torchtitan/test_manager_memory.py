"""UCPCheckpointManager with the memory tier (``memory_interval``): saves into host memory beside the
durable ``step-N`` saves, and a resume that takes the fresher tier, at another layout, after a host is
lost. Two simulated hosts (``UCP_DCP_HOST``) of the shared gloo pool; the same small model, optimizer,
scheduler and train state as tests/torchtitan/test_manager.py.

Stock torchtitan would resume from the newest durable step (step 2 here); the memory tier's step 3 can
only come from host memory, read by ``MemoryReader`` (the spy records each DCP call's storage)."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("torchtitan")

import dist as D  # noqa: E402
from helpers import UCP_LOAD, UCP_SAVE, dcp_calls  # noqa: E402
from test_manager import TrainState, _equal, _manager, _parts, _snapshot, _train  # noqa: E402

from ucp_dcp.memory.store import host_dir  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

MEMORY_SAVE = ("save", "UCPSavePlanner", "_Writer")
MEMORY_LOAD = ("load", "UCPLoadPlanner", "MemoryReader")


def _train_and_save(rank, world, folder, root, steps, interval, memory_interval):
    D.setenv("UCP_DCP_HOST", f"node{rank}")
    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    train = TrainState()
    cfg = {"interval": interval, "memory_interval": memory_interval, "memory_root": root}
    m = _manager(folder, model, opt, sched, states={"train_state": train}, **cfg)
    snaps = {}
    for step in range(1, steps + 1):
        _train(model, opt, sched, 1)
        train.step = step
        snaps[step] = _snapshot(model, opt, sched)
        m.save(curr_step=step)
    m.close()
    return snaps, calls


def _resume(rank, world, folder, root, interval, memory_interval):
    D.setenv("UCP_DCP_HOST", f"node{rank}")
    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(1)
    opt.step()  # optimizer state exists to be loaded into
    train = TrainState()
    cfg = {"interval": interval, "memory_interval": memory_interval, "memory_root": root}
    m = _manager(folder, model, opt, sched, states={"train_state": train}, **cfg)
    assert m.load(step=-1)
    m.close()
    return _snapshot(model, opt, sched), train.step, calls


def _saved(interval, memory_interval, steps=3):
    folder, root = D.tmpdir(), D.tmpdir()
    snaps, calls = D.run(_train_and_save, 2, folder, root, steps, interval, memory_interval)[0]
    return folder, root, snaps, calls


def test_a_lost_host_resumes_on_fewer_ranks_from_the_fresher_memory_generation():
    folder, root, snaps, calls = _saved(interval=2, memory_interval=1)
    assert calls == [MEMORY_SAVE, UCP_SAVE, MEMORY_SAVE, MEMORY_SAVE]  # durable at step 2 only
    shutil.rmtree(host_dir(root, "node1"))  # node1 is lost: its pieces live on as node0's replicas
    got, step, calls = D.run(_resume, 1, folder, root, 2, 1)[0]
    assert step == 3 and _equal(got, snaps[3])  # the durable copy is step 2
    assert calls == [MEMORY_LOAD]


@pytest.mark.full
def test_a_fresher_durable_step_wins_over_an_older_memory_generation():
    folder, root, snaps, _ = _saved(interval=1, memory_interval=2)
    shutil.rmtree(host_dir(root, "node1"))
    got, step, calls = D.run(_resume, 1, folder, root, 1, 2)[0]
    assert step == 3 and _equal(got, snaps[3]) and calls == [UCP_LOAD]
    assert os.path.isdir(os.path.join(folder, "checkpoint", "step-3"))
