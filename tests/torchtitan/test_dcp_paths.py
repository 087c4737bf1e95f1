"""UCPCheckpointManager makes its own DCP calls: no module attribute of torchtitan is swapped (two managers in
two threads save at once, each with our planner and storage), and a torchtitan manager that would call DCP
from a method ucp_dcp does not override -- a save that would silently be stock -- is refused at construction."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

pytest.importorskip("torchtitan")

import torchtitan.components.checkpointer.dcp as tt_dcp  # noqa: E402
from helpers import assert_written_by_ucp  # noqa: E402
from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402

from ucp_dcp import UCPError  # noqa: E402
from ucp_dcp.torchtitan.planner_dcp import check_dcp_paths, dcp_calls_outside  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_torchtitan_calls_dcp_only_from_the_methods_we_override():
    assert dcp_calls_outside(CheckpointManager) == []
    # the scan does see torchtitan's calls (in the two methods the manager overrides)
    assert dcp_calls_outside(CheckpointManager, allowed=()) == [
        "CheckpointManager.dcp_save",
        "CheckpointManager.dcp_load",
    ]


class _SavesElsewhere:
    """A manager whose last-step save calls DCP itself, past dcp_save."""

    def dcp_save(self, state_dict, checkpoint_id):
        dcp.save(state_dict, checkpoint_id=checkpoint_id)

    def _save_last_step(self, state_dict, checkpoint_id):
        dcp.save(state_dict, checkpoint_id=checkpoint_id)


def test_a_dcp_call_outside_the_overridden_methods_is_refused_naming_it():
    assert dcp_calls_outside(_SavesElsewhere, library=__name__) == ["_SavesElsewhere._save_last_step"]
    with pytest.raises(UCPError, match=r"calls DCP from _SavesElsewhere._save_last_step, which ucp_dcp does not"):
        check_dcp_paths(_SavesElsewhere, library=__name__)


class _Optim:
    def __init__(self, model):
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def state_dict(self):
        return {"lr": 0.1}

    def load_state_dict(self, sd):
        pass

    def init_cache_state_dict(self):
        pass


class _Stateless:
    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def _manager(folder, seed):
    from ucp_dcp.torchtitan import UCPCheckpointManager

    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    config = UCPCheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=1,
        async_mode="disabled",
        last_save_model_only=False,
        keep_latest_k=0,  # no purge: it asks for a process group
    )
    m = UCPCheckpointManager(
        config,
        dataloader=_Stateless(),
        model_parts=[model],
        optimizers=_Optim(model),
        lr_schedulers=_Stateless(),
        states={},
        sd_adapter=None,
        base_folder=folder,
    )
    return m, model


def test_two_managers_save_at_once_each_through_ucp_and_nothing_is_patched(tmp_path, monkeypatch):
    seen = []
    real = dcp.save

    def spy(*args, **kwargs):
        seen.append((tt_dcp.dcp is dcp, type(kwargs.get("planner")).__name__, type(kwargs["storage_writer"]).__name__))
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", spy)
    managers = [_manager(str(tmp_path / f"run{i}"), i) for i in range(2)]
    errors = []

    def save(m):
        try:
            assert m.save(curr_step=1)
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=save, args=(m,)) for m, _ in managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen == [(True, "UCPSavePlanner", "UCPFileSystemWriter")] * 2
    for i, (m, model) in enumerate(managers):
        step = str(tmp_path / f"run{i}" / "checkpoint" / "step-1")
        assert_written_by_ucp(step)  # our catalog and a verified sidecar
        fresh, fresh_model = _manager(str(tmp_path / f"run{i}"), 10 + i)
        assert fresh.load(step=1)
        assert torch.equal(fresh_model.weight, model.weight)
        m.close()
        fresh.close()
    assert os.path.isdir(tmp_path / "run1" / "checkpoint")


# -- the control group (issue 32): the manager's synchronous saves and loads give DCP the control group ---------


def _manager_calls_worker(rank, world, root, choice):
    from types import SimpleNamespace

    import dist as D
    from torchtitan.components.checkpointer import AsyncMode

    from ucp_dcp.planning import checkpoint_group as cg
    from ucp_dcp.planning.load_planner import UCPLoadPlanner
    from ucp_dcp.planning.save_planner import UCPSavePlanner
    from ucp_dcp.torchtitan.planner_dcp import ucp_dcp_load, ucp_dcp_save, ucp_reader

    seen = []
    for name in ("save", "load"):
        real = getattr(dcp, name)
        D.patch(dcp, name, lambda *a, _real=real, **k: seen.append(type(k["process_group"]).__name__) or _real(*a, **k))
    manager = SimpleNamespace(ucp=SimpleNamespace(control_group=choice), states={})
    state = {"w": torch.arange(6.0) + 1}
    ucp_dcp_save(manager, state, root, AsyncMode.DISABLED, UCPSavePlanner(), False)
    got = {"w": torch.zeros(6)}
    ucp_dcp_load(manager, got, root, UCPLoadPlanner(), ucp_reader(root))
    return seen, torch.equal(got["w"], state["w"]), len(cg._GROUPS)


@pytest.mark.slow
@pytest.mark.parametrize("choice", [True, False])
def test_the_managers_sync_save_and_load_run_dcps_collectives_on_the_checkpoint_group(tmp_path, choice):
    import dist as D

    for seen, equal, groups in D.run(_manager_calls_worker, 2, str(tmp_path / "ckpt"), choice, timeout=90):
        assert equal and seen == (["CheckpointGroup"] * 2 if choice else ["NoneType"] * 2) and groups == int(choice)
