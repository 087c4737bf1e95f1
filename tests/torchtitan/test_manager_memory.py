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


def _train_and_save(rank, world, folder, root, steps, interval, memory_interval, fault_step=None, env=None, keep=0):
    D.setenv("UCP_DCP_HOST", f"node{rank}")
    for k, v in (env or {}).items():
        D.setenv(k, v)
    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    train = TrainState()
    cfg = {"interval": interval, "memory_interval": memory_interval, "memory_root": root, "keep_latest_k": keep}
    m = _manager(folder, model, opt, sched, states={"train_state": train}, **cfg)
    snaps = {}
    for step in range(1, steps + 1):
        _train(model, opt, sched, 1)
        train.step = step
        snaps[step] = _snapshot(model, opt, sched)
        if step == fault_step:  # every rank dies in this generation's drain: files copied, no commit
            m._memory.tier.wait()
            m._memory.tier.fault = "drain"
        m.save(curr_step=step)
    m.close()
    return snaps, calls


def _resume(rank, world, folder, root, interval, memory_interval, env=None):
    D.setenv("UCP_DCP_HOST", f"node{rank}")
    for k, v in (env or {}).items():
        D.setenv(k, v)
    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(1)
    opt.step()  # optimizer state exists to be loaded into
    train = TrainState()
    cfg = {"interval": interval, "memory_interval": memory_interval, "memory_root": root}
    m = _manager(folder, model, opt, sched, states={"train_state": train}, **cfg)
    assert m.load(step=-1)
    m.close()
    return _snapshot(model, opt, sched), train.step, calls


def _saved(interval, memory_interval, steps=3, keep=0):
    folder, root = D.tmpdir(), D.tmpdir()
    snaps, calls = D.run(_train_and_save, 2, folder, root, steps, interval, memory_interval, None, None, keep)[0]
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


def test_memory_generations_drain_to_step_folders_that_load_at_a_new_layout_when_memory_is_gone():
    """No durable save in the run (interval 10): every step-N folder is a memory generation drained in the
    background, and keep_latest_k=2 purges them as its own; with every host's memory gone, the resume at 1
    rank reads the drained step 4 from disk."""
    folder, root, snaps, calls = _saved(interval=10, memory_interval=1, steps=4, keep=2)
    assert calls == [MEMORY_SAVE] * 4, "only memory saves: the step folders can only be the tier's drains"
    ckpt = os.path.join(folder, "checkpoint")
    committed = [n for n in (1, 2, 3, 4) if os.path.isfile(os.path.join(ckpt, f"step-{n}", ".metadata"))]
    assert committed == [3, 4], "keep_latest_k=2 at the end: drains in flight at a save's purge counted at close"
    shutil.rmtree(root)  # every host lost (or rebooted): memory is gone
    got, step, calls = D.run(_resume, 1, folder, root, 10, 1)[0]
    assert step == 4 and _equal(got, snaps[4])
    assert calls == [UCP_LOAD]


def test_a_drain_that_dies_before_its_commit_leaves_the_previous_drained_step_loadable():
    folder, root = D.tmpdir(), D.tmpdir()
    snaps, _ = D.run(_train_and_save, 2, folder, root, 3, 10, 1, 3)[0]
    step3 = os.path.join(folder, "checkpoint", "step-3")
    assert any(n.endswith(".distcp") for n in os.listdir(step3)), "the dead drain copied its data files"
    assert not os.path.exists(os.path.join(step3, ".metadata")), "and never committed them"
    shutil.rmtree(root)
    got, step, calls = D.run(_resume, 1, folder, root, 10, 1)[0]
    assert step == 2 and _equal(got, snaps[2]) and calls == [UCP_LOAD]


@pytest.mark.full
def test_memory_generations_drain_to_an_object_store(s3):
    """``--checkpoint.folder s3://...``: the drain uploads each rank's files and commits with one PUT of
    .metadata; the resume with memory gone reads the drained step from the store."""
    pytest.importorskip("s3fs")
    from ucp_dcp.torchtitan.step_folders import StepFolders

    root = D.tmpdir()
    snaps, calls = D.run(_train_and_save, 1, s3.prefix, root, 2, 10, 1, None, s3.env())[0]
    assert calls == [MEMORY_SAVE] * 2
    assert StepFolders(f"{s3.prefix}/checkpoint").latest() == 2
    shutil.rmtree(root)
    got, step, calls = D.run(_resume, 1, s3.prefix, root, 10, 1, s3.env())[0]
    assert step == 2 and _equal(got, snaps[2]) and calls == [UCP_LOAD]


def test_keep_latest_k_never_purges_the_step_folder_a_drain_is_writing(tmp_path):
    """A drain in flight writes step-3 without .metadata yet; a durable save of step 4 then purges with
    keep_latest_k=1: stock rules would purge step-3 (older than the kept committed step 4, uncommitted) and
    the drain would commit over deleted files. The folder a drain is writing is skipped; the others go."""
    import queue
    from types import SimpleNamespace

    from ucp_dcp.torchtitan import UCPCheckpointManager

    for step, committed in ((1, True), (2, False), (3, False), (4, True)):
        os.makedirs(tmp_path / f"step-{step}")
        (tmp_path / f"step-{step}" / "__0_0.distcp").write_bytes(b"x")
        if committed:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"m")
    draining = SimpleNamespace(in_flight=lambda: "step-3")
    fake = SimpleNamespace(
        folder=str(tmp_path), keep_latest_k=1, purge_queue=queue.Queue(), _memory=draining, _should_purge=lambda: True
    )
    UCPCheckpointManager._purge_stale_checkpoints(fake)
    purged = sorted(os.path.basename(fake.purge_queue.get_nowait()) for _ in range(fake.purge_queue.qsize()))
    assert purged == ["step-1", "step-2"], purged
    assert (tmp_path / "step-3" / "__0_0.distcp").exists()
