"""UCPCheckpointManager used the way torchtitan's own unit tests use its CheckpointManager: a small
model, a flat optimizer state, an LR scheduler and a dataloader handed to the manager directly (no
Trainer). Save/load round trips, keep-latest purging, async saves, model-only last-step saves and
initial loads, exclusions, load_step, empty states, a manager without ``train_state``, and the key set
of a checkpoint. One rank of the shared gloo pool per test (async saves need a process group).

Each test also shows that ucp_dcp did the work, not stock DCP (whose round trips at one layout would
pass the same checks): every DCP call had our planner and storage, and every step written holds our
catalog and a verified integrity sidecar."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchtitan")

import dist as D  # noqa: E402
from helpers import UCP_ASYNC_SAVE, UCP_LOAD, UCP_SAVE, assert_written_by_ucp, dcp_calls  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _assert_ucp_steps(folder, *steps) -> None:
    for step in steps:
        assert_written_by_ucp(os.path.join(folder, "checkpoint", f"step-{step}"))


class Optim:
    """A flat optimizer state (``param.state``) as torchtitan's OptimizersContainer saves it."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.opt = model, torch.optim.Adam(model.parameters(), lr=0.1)

    def step(self) -> None:
        self.model(torch.ones(1, 4)).sum().backward()
        self.opt.step()
        self.opt.zero_grad()

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.model, self.opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, sd, options=StateDictOptions(flatten_optimizer_state_dict=True))

    def init_cache_state_dict(self):
        pass


class Sched:
    def __init__(self) -> None:
        self.last_epoch = 0

    def state_dict(self):
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, sd):
        self.last_epoch = sd["last_epoch"]


class EmptyLoader:
    """A loader with no state (torchtitan's tests use one): saves nothing, loads nothing."""

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        assert sd == {}


class TrainState:
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _parts(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    return model, Optim(model), Sched()


def _manager(folder, model, opt, sched, states=None, loader=None, **cfg):
    from ucp_dcp.torchtitan import UCPCheckpointManager

    cfg = {
        "async_mode": "disabled",
        "last_save_model_only": False,
        "initial_load_model_only": False,
        "interval": 1,
        **cfg,
    }
    config = UCPCheckpointManager.Config(enable=True, folder="checkpoint", **cfg)
    return UCPCheckpointManager(
        config,
        dataloader=loader if loader is not None else EmptyLoader(),
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=sched,
        states=states if states is not None else {},
        sd_adapter=None,
        base_folder=folder,
    )


def _snapshot(model, opt, sched):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict().items()},
        sched.state_dict(),
    )


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _train(model, opt, sched, steps=2):
    for _ in range(steps):
        opt.step()
        sched.last_epoch += 1


def _steps(folder):
    return sorted(os.listdir(os.path.join(folder, "checkpoint")))


# -- tasks (run on one rank of the pool) ---------------------------------------------------------------------


def _save_load_round_trip(rank, world, folder, async_mode):
    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    train = TrainState()
    m = _manager(folder, model, opt, sched, states={"train_state": train}, async_mode=async_mode)
    _train(model, opt, sched)
    train.step, train.ntokens_seen = 2, 64
    want = _snapshot(model, opt, sched)
    assert m.save(curr_step=2)
    m.maybe_wait_for_staging()
    m.maybe_wait_for_saving()  # torchtitan 0.3's close() does not wait for an async save
    m.close()
    model2, opt2, sched2 = _parts(1)
    train2 = TrainState()
    opt2.step()  # optimizer state exists to be loaded into
    m2 = _manager(folder, model2, opt2, sched2, states={"train_state": train2})
    assert m2.load(step=-1)
    m2.close()
    got = _snapshot(model2, opt2, sched2)
    return _equal(got, want), train2.state_dict(), _steps(folder), calls


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_save_and_load_restore_every_state(async_mode):
    folder = D.tmpdir()
    equal, train, steps, calls = D.run(_save_load_round_trip, 1, folder, async_mode)[0]
    assert equal and train == {"step": 2, "ntokens_seen": 64} and steps == ["step-2"]
    assert calls == [UCP_SAVE if async_mode == "disabled" else UCP_ASYNC_SAVE, UCP_LOAD]
    _assert_ucp_steps(folder, 2)


def _no_train_state(rank, world, folder):
    """torchtitan's own manager test: states={"trainer": tensor}, an empty loader, an empty scheduler."""
    calls = dcp_calls(D.patch)
    model, opt, _ = _parts(0)

    class EmptySched:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    trainer = torch.tensor([1.2347])
    m = _manager(folder, model, opt, EmptySched(), states={"trainer": trainer})
    _train(model, opt, Sched())
    want = _snapshot(model, opt, Sched())[0]
    m.save(curr_step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    trainer.zero_()
    assert m.load(step=1)
    m.close()
    return _equal(model.state_dict(), want), trainer, calls


def test_manager_without_train_state_saves_and_empty_states_load():
    folder = D.tmpdir()
    equal, trainer, calls = D.run(_no_train_state, 1, folder)[0]
    assert equal and torch.equal(trainer, torch.tensor([1.2347]))
    assert calls == [UCP_SAVE, UCP_LOAD]
    _assert_ucp_steps(folder, 1)


def _keep_latest(rank, world, folder):
    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    m = _manager(folder, model, opt, sched, keep_latest_k=2)
    for step in (1, 2, 3, 4):
        opt.step()
        m.save(curr_step=step)
    deadline = time.time() + 20
    while _steps(folder) != ["step-3", "step-4"] and time.time() < deadline:
        time.sleep(0.05)  # purging runs on the manager's thread
    m.close()
    return _steps(folder), calls


def test_keep_latest_k_purges_older_steps():
    folder = D.tmpdir()
    steps, calls = D.run(_keep_latest, 1, folder)[0]
    assert steps == ["step-3", "step-4"] and calls == [UCP_SAVE] * 4
    _assert_ucp_steps(folder, 3, 4)


def _load_step_and_fresh_start(rank, world, folder):
    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    m = _manager(folder, model, opt, sched)
    fresh = m.load(step=-1)  # no checkpoint folder yet: a fresh start
    snaps = {}
    for step in (1, 2, 3):
        _train(model, opt, sched, 1)
        snaps[step] = _snapshot(model, opt, sched)
        m.save(curr_step=step)
    m.close()
    model2, opt2, sched2 = _parts(1)
    opt2.step()
    m2 = _manager(folder, model2, opt2, sched2, load_step=2)
    assert m2.load(step=2)
    m2.close()
    return fresh, _equal(_snapshot(model2, opt2, sched2), snaps[2]), calls


def test_load_step_picks_that_step_and_no_checkpoint_is_a_fresh_start():
    folder = D.tmpdir()
    fresh, equal, calls = D.run(_load_step_and_fresh_start, 1, folder)[0]
    assert fresh is False and equal
    assert calls == [UCP_SAVE] * 3 + [UCP_LOAD], "a fresh start loads nothing"
    _assert_ucp_steps(folder, 1, 2, 3)


def _exclusions(rank, world, folder):
    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    m = _manager(folder, model, opt, sched, states={"train_state": TrainState()})
    _train(model, opt, sched)
    want = _snapshot(model, opt, sched)
    m.save(curr_step=2)
    m.close()
    model2, opt2, sched2 = _parts(1)
    opt2.step()
    before = _snapshot(model2, opt2, sched2)
    train2 = TrainState()
    m2 = _manager(
        folder,
        model2,
        opt2,
        sched2,
        states={"train_state": train2},
        exclude_from_loading=["optimizer", "lr_scheduler", "train_state"],
    )
    assert m2.load(step=-1)
    m2.close()
    got = _snapshot(model2, opt2, sched2)
    return _equal(got[0], want[0]), _equal(got[1], before[1]), got[2] == before[2], train2.step, calls


def test_exclude_from_loading_leaves_those_states_alone():
    folder = D.tmpdir()
    model_loaded, opt_kept, sched_kept, step, calls = D.run(_exclusions, 1, folder)[0]
    assert model_loaded and opt_kept and sched_kept and step == 0
    assert calls == [UCP_SAVE, UCP_LOAD]
    _assert_ucp_steps(folder, 2)


def _last_step_model_only_and_initial_load(rank, world, folder):
    from ucp_dcp.storage.opening import read_metadata

    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    m = _manager(
        folder,
        model,
        opt,
        sched,
        states={"train_state": TrainState()},
        last_save_model_only=True,
        export_dtype="bfloat16",
    )
    _train(model, opt, sched)
    m.save(curr_step=5, last_step=True)
    m.close()
    keys = sorted(read_metadata(os.path.join(folder, "checkpoint", "step-5")).state_dict_metadata)
    # a new job starts from the export: initial_load_path, model only, into another folder
    model2, opt2, sched2 = _parts(1)
    other = os.path.join(folder, "next")
    m2 = _manager(
        other,
        model2,
        opt2,
        sched2,
        states={"train_state": TrainState()},
        initial_load_path=os.path.join(folder, "checkpoint", "step-5"),
        initial_load_model_only=True,
    )
    assert m2.load(step=-1)
    m2.close()
    want = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    got = {k: v.float() for k, v in model2.state_dict().items()}
    return keys, _equal(got, want), sched2.last_epoch, calls


def test_last_step_model_only_export_and_initial_model_only_load():
    folder = D.tmpdir()
    keys, equal, last_epoch, calls = D.run(_last_step_model_only_and_initial_load, 1, folder)[0]
    assert keys == ["0.bias", "0.weight", "1.bias", "1.weight"], "the export holds the model only"
    assert equal and last_epoch == 0
    assert calls == [UCP_SAVE, UCP_LOAD]
    _assert_ucp_steps(folder, 5)


def _key_sets(rank, world, folder, ntokens):
    from ucp_dcp.storage.opening import read_metadata

    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    m = _manager(folder, model, opt, sched, states={"train_state": TrainState()}, ntokens_seen=ntokens)
    _train(model, opt, sched, 1)
    m.save(curr_step=1)
    m.close()
    return sorted(read_metadata(os.path.join(folder, "checkpoint", "step-1")).state_dict_metadata), calls


@pytest.mark.parametrize("ntokens", ["sum", "off"])
def test_checkpoint_key_set_is_stocks(ntokens):
    """The keys are the stock manager's: model keys at the top level, optimizer/lr_scheduler/train_state
    flattened, nothing for an empty dataloader; the ntokens rule does not rename anything."""
    folder = D.tmpdir()
    keys, calls = D.run(_key_sets, 1, folder, ntokens)[0]
    assert calls == [UCP_SAVE]
    _assert_ucp_steps(folder, 1)
    params = ["0.bias", "0.weight", "1.bias", "1.weight"]
    opt = [
        f"optimizer.{k}"
        for k in [f"state.{p}.{s}" for p in params for s in ("exp_avg", "exp_avg_sq", "step")]
        + [
            f"param_groups.{p}.{h}"
            for p in params
            for h in (
                "amsgrad",
                "betas",
                "capturable",
                "decoupled_weight_decay",
                "differentiable",
                "eps",
                "foreach",
                "fused",
                "lr",
                "maximize",
                "weight_decay",
            )
        ]
    ]
    expected = sorted(params + ["lr_scheduler.last_epoch", "train_state.ntokens_seen", "train_state.step"])
    assert [k for k in keys if not k.startswith("optimizer.")] == expected
    assert {k for k in keys if k.startswith("optimizer.")} <= set(opt)
    assert {k for k in keys if k.startswith("optimizer.state.")} == {k for k in opt if k.startswith("optimizer.state.")}


def _global_loader_state(rank, world, folder, assets, interleaved=False):
    """Our loader's state goes through the manager as one global value and resumes the stream."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HFDataSource

    from ucp_dcp.storage.opening import read_metadata
    from ucp_dcp.torchtitan import GlobalCursorTextDataLoader, InterleavedGlobalCursorDataLoader

    def loader():
        tok = HuggingFaceTokenizer(tokenizer_path=os.path.join(assets, "tokenizer"))
        path = os.path.join(assets, "dataset")
        if interleaved:  # the same file twice: two sources, each with its own position
            cfg = InterleavedGlobalCursorDataLoader.Config(
                sources=[HFDataSource(dataset="c4_test", dataset_path=path, weight=w) for w in (1.0, 3.0)]
            )
            return InterleavedGlobalCursorDataLoader(
                cfg, dp_world_size=1, dp_rank=0, seq_len=32, local_batch_size=4, tokenizer=tok
            )
        cfg = GlobalCursorTextDataLoader.Config(dataset="c4_test", dataset_path=path)
        return GlobalCursorTextDataLoader(
            cfg, dp_world_size=1, dp_rank=0, seq_len=32, local_batch_size=4, tokenizer=tok
        )

    calls = dcp_calls(D.patch)
    model, opt, sched = _parts(0)
    dl = loader()
    m = _manager(folder, model, opt, sched, loader=dl)
    it = iter(dl)
    for _ in range(3):
        next(it)
    m.save(curr_step=3)
    m.close()
    saved = dl.state_dict()
    expected = [next(it)[0]["input"] for _ in range(2)]
    dl2 = loader()
    m2 = _manager(folder, *_parts(1), loader=dl2)
    m2.states["optimizer"].step()
    opens = _count_opens()
    assert m2.load(step=-1)
    m2.close()
    opened = len(opens)
    loaded = dl2.state_dict()
    it2 = iter(dl2)
    got = [next(it2)[0]["input"] for _ in range(2)]
    keys = sorted(
        k
        for k in read_metadata(os.path.join(folder, "checkpoint", "step-3")).state_dict_metadata
        if k.startswith("dataloader.")
    )
    return keys, all(torch.equal(a, b) for a, b in zip(got, expected)), saved, loaded, calls, opened


def _count_opens() -> list[str]:
    """From now on in this task, every opening of a checkpoint's metadata (read, verified, unpickled)."""
    import ucp_dcp.storage.opening as opening
    import ucp_dcp.storage.reader as reader

    opens: list[str] = []
    for mod in (opening, reader):
        real = mod.open_checkpoint

        def spy(*args, _real=real, **kwargs):
            opens.append(str(args[1]))
            return _real(*args, **kwargs)

        D.patch(mod, "open_checkpoint", spy)
    return opens


def test_global_loader_state_round_trips_through_the_manager(tmp_path_factory):
    from ucp_dcp.torchtitan.dataloader import STATE_KEYS
    from ucp_dev.testing.titan.assets import make_assets

    assets = make_assets(tmp_path_factory.mktemp("assets"), n_docs=200)
    folder = D.tmpdir()
    keys, same, saved, loaded, calls, opens = D.run(_global_loader_state, 1, folder, str(assets))[0]
    assert keys == sorted(f"dataloader.{k}" for k in STATE_KEYS)
    assert loaded == saved, "the loader's state right after the load is the state saved"
    assert same, "the batches after the load are the ones the saved loader would have given next"
    assert calls == [UCP_SAVE, UCP_LOAD]
    assert opens == 1, "the dataloader check and dcp.load share one opening of the metadata"
    _assert_ucp_steps(folder, 3)


def test_interleaved_loader_state_round_trips_through_the_manager(tmp_path_factory):
    """The interleaved state (lists per source, the RNG state as JSON) is saved as one global value each."""
    from ucp_dcp.torchtitan.interleave import STATE_KEYS
    from ucp_dev.testing.titan.assets import make_assets

    assets = make_assets(tmp_path_factory.mktemp("assets"), n_docs=200)
    folder = D.tmpdir()
    keys, same, saved, loaded, calls, _ = D.run(_global_loader_state, 1, folder, str(assets), True)[0]
    assert keys == sorted(f"dataloader.{k}" for k in STATE_KEYS)
    assert loaded == saved, "the loader's state right after the load is the state saved"
    assert same, "the batches after the load are the ones the saved loader would have given next"
    assert calls == [UCP_SAVE, UCP_LOAD]
    _assert_ucp_steps(folder, 3)
