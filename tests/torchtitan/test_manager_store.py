"""UCPCheckpointManager with ``--checkpoint.folder s3://bucket/run`` (moto's server on 127.0.0.1, the session
fixture ``s3``): saves through our writer (commit by one PUT of .metadata) and loads through our reader; the
resume step is the newest *committed* one (a newer half-written step is skipped); ``keep_latest_k`` keeps the
k newest committed steps, a step in flight does not count, and a purged step stops being a checkpoint before
any of its objects goes. One rank of the shared gloo pool; the resume at another layout under a real
Trainer is tests/e2e/test_titan_trainer.py's."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("s3fs")

import dist as D  # noqa: E402
from helpers import UCP_LOAD, UCP_SAVE, dcp_calls  # noqa: E402
from test_manager import TrainState, _equal, _manager, _parts, _snapshot, _train  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _committed(url: str) -> dict[str, bool]:
    from ucp_dcp.torchtitan.step_folders import StepFolders

    f = StepFolders(url)
    return {name: f.committed(name) for name in sorted(f.steps().values())}


def _store_round_trip(rank, world, env, base):
    from ucp_dcp.storage.object_store import ObjectStore
    from ucp_dcp.storage.opening import open_path

    for k, v in env.items():
        D.setenv(k, v)
    calls = dcp_calls(D.patch)
    folder = f"{base}/checkpoint"
    model, opt, sched = _parts(0)
    train = TrainState()
    m = _manager(base, model, opt, sched, states={"train_state": train}, keep_latest_k=2)
    snaps = {}
    for step in (1, 2, 3):
        _train(model, opt, sched, 1)
        train.step = step
        snaps[step] = _snapshot(model, opt, sched)
        m.save(curr_step=step)
    # a save of step 4 that died before its commit: data objects, no .metadata
    store = ObjectStore(f"{folder}/step-4")
    store.put(store.join("__0_deadbeef_0.distcp"), b"half-written")
    m.save(curr_step=3)  # saving again purges: the dead step 4 is newer than every committed one, so it stays
    deadline = time.time() + 20
    while "step-1" in _committed(folder) and time.time() < deadline:
        time.sleep(0.05)  # the purge thread deletes the rest of a decommitted folder
    m.close()
    after_saves = _committed(folder)
    integrity = open_path(f"{folder}/step-3")[1].status
    model2, opt2, sched2 = _parts(1)
    opt2.step()
    train2 = TrainState()
    m2 = _manager(base, model2, opt2, sched2, states={"train_state": train2})
    assert m2.load(step=-1)
    m2.close()
    return after_saves, integrity, _equal(_snapshot(model2, opt2, sched2), snaps[3]), train2.step, calls


@pytest.mark.quick
def test_the_manager_saves_purges_and_resumes_on_s3(s3):
    after, integrity, equal, step, calls = D.run(_store_round_trip, 1, s3.env(), s3.prefix)[0]
    assert after == {"step-2": True, "step-3": True, "step-4": False}, after
    assert integrity == "verified", "written by UCPFileSystemWriter: sidecar and checksums on the store"
    assert equal and step == 3, "resumed from the newest committed step (3), not the half-written 4"
    assert calls == [UCP_SAVE] * 4 + [UCP_LOAD], calls


def test_keep_latest_k_counts_committed_steps_only(s3):
    """A step folder without .metadata newer than every committed step (a save in flight) is kept and does
    not count; one older than a committed step (a save that died) is purged; a purged step is decommitted
    first (its .metadata deleted before anything else), so a purge that dies half-way leaves no checkpoint
    naming deleted objects."""
    from ucp_dcp.storage.object_store import ObjectStore
    from ucp_dcp.torchtitan.step_folders import StepFolders

    folders = StepFolders(s3.prefix)
    for step, committed in ((1, True), (2, False), (3, True), (4, True), (5, False)):
        store = ObjectStore(f"{s3.prefix}/step-{step}")
        store.put(store.join("__0_0a0b0c0d_0.distcp"), b"x")
        if committed:
            store.put(store.join(".metadata"), b"m")
    assert folders.latest() == 4
    assert folders.stale(2) == ["step-1", "step-2"]
    assert folders.stale(1) == ["step-1", "step-2", "step-3"]
    folders.decommit("step-4")
    assert folders.latest() == 3 and not folders.committed("step-4")
