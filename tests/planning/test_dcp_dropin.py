"""ucp_dcp as a drop-in for DCP's defaults (issue 13): DCP's error phrases and exception types,
DCP's constructor parameters (order, defaults, meaning) on the planners and storage classes, and
DCP's call orders when planner methods are called directly. Single process (DCP runs without a
process group) except the one option whose effect needs two ranks."""

from __future__ import annotations

import inspect
import io
import logging
import os
import pickle

import dist as D
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_written_by_ucp
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan

import ucp_dcp
from ucp_dcp import UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPOptions, UCPSavePlanner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict:
    return {"model": {"a": torch.arange(12.0).reshape(4, 3), "b": torch.ones(2)}, "step": 7}


def _metadata(path) -> object:
    return FileSystemReader(path).read_metadata()


def _dcp_error(planner, target, md) -> Exception:
    """What DCP's own planner raises at local planning (set-up, then the local plan)."""
    planner.set_up_planner(target, md, True)
    with pytest.raises(Exception) as info:
        planner.create_local_plan()
    return info.value


# -- 1. error phrases and types ------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    dcp.save(_state(), checkpoint_id=tmp_path, planner=UCPSavePlanner())
    return tmp_path


def test_missing_key_has_dcps_words_and_type(saved):
    """A key the checkpoint lacks: DCP's first line, as a RuntimeError, plus ucp's list and hint."""
    md = _metadata(saved)
    target = {**_state(), "extra": {"c": torch.zeros(3)}}
    theirs = _dcp_error(DefaultLoadPlanner(), target, md)
    ours = _dcp_error(UCPLoadPlanner(), {**_state(), "extra": {"c": torch.zeros(3)}}, md)
    assert type(theirs) is RuntimeError and isinstance(ours, RuntimeError)
    assert isinstance(ours, ucp_dcp.MissingAtomsError) and isinstance(ours, ucp_dcp.UCPError)
    assert str(ours).splitlines()[0] == str(theirs) == "Missing key in checkpoint state_dict: extra.c."
    assert "1 atom(s) wanted by the target" in str(ours) and "hint:" in str(ours)
    assert ours.atom == "extra.c" and ours.wanted == ["extra.c"]


def test_missing_key_names_the_target_key_not_the_atom(saved):
    """A wrapped name (torch.compile's ``_orig_mod.``) is stripped to find the atom, but DCP's phrase
    names the key of the caller's state dict, as DCP would."""
    md = _metadata(saved)
    target = _state()
    target["model"]["_orig_mod.z"] = torch.zeros(1)
    err = _dcp_error(UCPLoadPlanner(), target, md)
    assert str(err).startswith("Missing key in checkpoint state_dict: model._orig_mod.z.\n")
    assert err.atom == "model.z"


def test_size_mismatch_has_dcps_words_and_type(saved):
    """A different global shape: DCP's first line, as a ValueError, then atom, shapes and hint."""
    md = _metadata(saved)
    target = _state()
    target["model"]["a"] = torch.zeros(5, 3)
    theirs = _dcp_error(DefaultLoadPlanner(), target, md)
    target = _state()
    target["model"]["a"] = torch.zeros(5, 3)
    ours = _dcp_error(UCPLoadPlanner(), target, md)
    assert type(theirs) is ValueError and isinstance(ours, ValueError)
    assert isinstance(ours, ucp_dcp.ShapeMismatchError)
    assert str(ours).splitlines()[0] == str(theirs)
    assert str(theirs) == "Size mismatch between saved torch.Size([4, 3]) and current: torch.Size([5, 3]) for model.a"
    assert "atom 'model.a': saved shape (4, 3), wanted shape (5, 3)" in str(ours) and "hint:" in str(ours)
    assert (ours.saved, ours.wanted) == ((4, 3), (5, 3))


def test_tensor_saved_where_target_holds_an_object_has_dcps_words(saved):
    md = _metadata(saved)
    target = _state()
    target["model"]["b"] = "not a tensor"
    theirs = _dcp_error(DefaultLoadPlanner(), target, md)
    target = _state()
    target["model"]["b"] = "not a tensor"
    ours = _dcp_error(UCPLoadPlanner(), target, md)
    assert type(theirs) is ValueError and isinstance(ours, ucp_dcp.ShapeMismatchError)
    assert str(ours).splitlines()[0] == str(theirs)
    assert str(theirs).startswith("Invalid checkpoint metadata for model.b, expected BytesStorageMetadata")


@pytest.mark.parametrize("planner", [DefaultLoadPlanner, UCPLoadPlanner])
def test_code_written_against_dcp_matches_through_dcp_load(saved, planner):
    """Through dcp.load both raise DCP's CheckpointException whose text carries the phrase, and the
    per-rank exception is caught by the type DCP uses."""
    missing = {**_state(), "extra": torch.zeros(1)}
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: extra"):
        dcp.load(missing, checkpoint_id=saved, planner=planner())
    wrong = _state()
    wrong["model"]["a"] = torch.zeros(4, 4)
    with pytest.raises(CheckpointException, match="Size mismatch between saved") as info:
        dcp.load(wrong, checkpoint_id=saved, planner=planner())
    ((inner, _),) = info.value.failures.values()
    try:
        raise inner
    except ValueError as e:  # DCP's type
        assert "for model.a" in str(e)


def test_dcp_typed_errors_still_pickle_and_unwrap():
    for cls, base in ((ucp_dcp.MissingAtomsError, RuntimeError), (ucp_dcp.ShapeMismatchError, ValueError)):
        e = cls("Missing key in checkpoint state_dict: x.", atom="x", saved=(1,), wanted=(2,), hint="h")
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and isinstance(back, base) and str(back) == str(e)
        assert (back.atom, back.saved, back.wanted, back.hint) == ("x", (1,), (2,), "h")
        with pytest.raises(cls):
            with ucp_dcp.ucp_errors():
                raise CheckpointException("load", {0: (e, None)})


# -- 2. DCP's constructor parameters ---------------------------------------------------------------


def _dcp_params(cls) -> list[tuple[str, object, object]]:
    return [
        (p.name, p.default, p.kind)
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]


@pytest.mark.parametrize(
    "ours,theirs",
    [
        (UCPSavePlanner, DefaultSavePlanner),
        (UCPLoadPlanner, DefaultLoadPlanner),
        (UCPFileSystemWriter, FileSystemWriter),
        (UCPFileSystemReader, FileSystemReader),
    ],
    ids=["save-planner", "load-planner", "writer", "reader"],
)
def test_positional_parameters_are_dcps(ours, theirs):
    """Same names, order and defaults as DCP's class; everything of ours is keyword-only after."""
    assert _dcp_params(ours) == _dcp_params(theirs)
    extra = [
        p
        for p in inspect.signature(ours.__init__).parameters.values()
        if p.name not in {n for n, _, _ in _dcp_params(theirs)}
    ]
    assert extra and all(p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD) for p in extra)


def test_save_planner_positional_arguments_mean_what_they_mean_in_dcp():
    args = (True, False, None, True, True)
    ours, theirs = UCPSavePlanner(*args), DefaultSavePlanner(*args)
    for attr in ("flatten_state_dict", "flatten_sharded_tensors", "dedup_save_to_lowest_rank", "_enable_plan_caching"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.dedup_save_to_lowest_rank is True and ours._enable_plan_caching is True
    with pytest.raises(TypeError):
        UCPSavePlanner(True, True, None, False, False, "warn")  # check_replicas is keyword-only


def test_load_planner_positional_arguments_mean_what_they_mean_in_dcp():
    ours, theirs = UCPLoadPlanner(False, False, True), DefaultLoadPlanner(False, False, True)
    for attr in ("flatten_state_dict", "flatten_sharded_tensors", "allow_partial_load"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    with pytest.raises(TypeError):
        UCPLoadPlanner(True, True, False, "off")  # read_once is keyword-only


@pytest.mark.parametrize("cls", [UCPSavePlanner, UCPLoadPlanner])
def test_options_passed_where_dcp_has_flatten_state_dict_is_refused_clearly(cls):
    with pytest.raises(TypeError, match=r"options=UCPOptions"):
        cls(UCPOptions(strict=False))
    assert cls(options=UCPOptions(strict=False)).strict is False
    assert cls(strict=False).strict is False


def test_partial_load_positional(saved):
    target = {**_state(), "extra": torch.full((2,), 5.0)}
    planner = UCPLoadPlanner(True, True, True)
    dcp.load(target, checkpoint_id=saved, planner=planner)
    assert planner.missing_atoms == ["extra"] and target["extra"].tolist() == [5.0, 5.0]
    assert torch.equal(target["model"]["a"], _state()["model"]["a"])


def _flat() -> dict:
    return {"w": torch.arange(6.0).reshape(2, 3), "v": torch.ones(3, dtype=torch.int64), "step": 3}


def test_flatten_state_dict_false_on_a_flat_state_dict_saves_and_loads_as_dcp(tmp_path):
    """Nothing to flatten: the keys are those DCP's planner writes with the same flag, and it loads."""
    dcp.save(_flat(), checkpoint_id=tmp_path / "ours", planner=UCPSavePlanner(False))
    dcp.save(_flat(), checkpoint_id=tmp_path / "dcp", planner=DefaultSavePlanner(False))
    ours, theirs = _metadata(tmp_path / "ours"), _metadata(tmp_path / "dcp")
    assert set(ours.state_dict_metadata) == set(theirs.state_dict_metadata) == {"w", "v", "step"}
    assert_written_by_ucp(tmp_path / "ours", storage=False)
    for src in ("ours", "dcp"):
        back = {"w": torch.zeros(2, 3), "v": torch.zeros(3, dtype=torch.int64), "step": 0}
        dcp.load(back, checkpoint_id=tmp_path / src, planner=UCPLoadPlanner(False))
        assert torch.equal(back["w"], _flat()["w"]) and torch.equal(back["v"], _flat()["v"]) and back["step"] == 3


@pytest.mark.parametrize("side", ["save", "load"])
def test_flatten_state_dict_false_on_a_nested_state_dict_is_refused_clearly(saved, side):
    """DCP would keep each nested container whole, as one pickled object: ucp_dcp refuses that at
    set-up, naming the keys and both ways out, before anything is written or read."""
    if side == "save":
        planner = UCPSavePlanner(flatten_state_dict=False)
        call = lambda: planner.set_up_planner(_state(), None, True)  # noqa: E731
    else:
        planner = UCPLoadPlanner(flatten_state_dict=False)
        md = _metadata(saved)
        call = lambda: planner.set_up_planner(_state(), md, True)  # noqa: E731
    with pytest.raises(ucp_dcp.UCPError, match="flatten_state_dict=False") as info:
        call()
    text = str(info.value)
    assert "'model'" in text and "'step'" not in text and f"{side} each as one pickled object" in text
    assert "flatten_state_dict=True" in text
    with pytest.raises(CheckpointException, match="flatten_state_dict=False"):
        if side == "save":
            dcp.save(_state(), checkpoint_id=saved / "x", planner=UCPSavePlanner(False))
        else:
            dcp.load(_state(), checkpoint_id=saved, planner=UCPLoadPlanner(False))


def test_flatten_sharded_tensors_either_way_is_the_same_for_tensors(tmp_path):
    dcp.save(_state(), checkpoint_id=tmp_path, planner=UCPSavePlanner(True, False))
    assert_written_by_ucp(tmp_path, storage=False)
    back = {"model": {"a": torch.zeros(4, 3), "b": torch.zeros(2)}, "step": 0}
    dcp.load(back, checkpoint_id=tmp_path, planner=UCPLoadPlanner(True, False))
    assert torch.equal(back["model"]["a"], _state()["model"]["a"]) and back["step"] == 7


def test_deprecated_dedup_replicated_tensors_is_accepted_and_warned_like_dcp(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="torch.distributed.checkpoint.default_planner"):
        planner = UCPSavePlanner(True, True, True)
    assert "dedup_replicated_tensors" in caplog.text
    dcp.save(_state(), checkpoint_id=tmp_path, planner=planner)
    assert "model.a" in _metadata(tmp_path).state_dict_metadata


class _CachingPlanner(UCPSavePlanner):
    """Its own class name: plan caches are per planner class (DCP's rule), so no other test shares it."""


def test_enable_plan_caching_positional_reuses_the_plan_and_saves_new_values(tmp_path):
    from ucp_dcp.planning.save_planner import _CACHE

    _CACHE.pop("_CachingPlanner", None)
    for i in range(3):
        sd = {"w": torch.full((3, 2), float(i)), "step": i}
        planner = _CachingPlanner(True, True, None, False, True)
        planner.set_up_planner(sd, None, True)
        local = planner.create_local_plan()
        assert local.usable == (i == 0), "an unchanged local plan is sent as unusable (DCP's protocol)"
        dcp.save(sd, checkpoint_id=tmp_path / str(i), planner=_CachingPlanner(True, True, None, False, True))
        back = {"w": torch.zeros(3, 2), "step": -1}
        dcp.load(back, checkpoint_id=tmp_path / str(i), planner=UCPLoadPlanner())
        assert back["w"].eq(i).all() and back["step"] == i
    assert _CACHE["_CachingPlanner"].global_plan is not None
    _CACHE.pop("_CachingPlanner", None)


def _lowest_rank_worker(rank, world, root, lowest):
    """Four values every rank holds under the same names (replicas): who writes them?"""
    sd = {f"r{i}": torch.full((64,), float(i)) for i in range(4)}
    path = f"{root}/lowest{int(lowest)}"
    dcp.save(sd, checkpoint_id=path, planner=UCPSavePlanner(True, True, None, lowest))
    md = FileSystemReader(path).read_metadata()
    return sorted(
        {info.relative_path.split("_")[2] for idx, info in md.storage_data.items() if idx.fqn != "__ucp_io__"}
    )


@pytest.mark.slow
def test_dedup_save_to_lowest_rank_positional_means_rank_zero_writes_replicas():
    root = D.tmpdir()
    assert D.run(_lowest_rank_worker, 2, root, True)[0] == ["0"]
    assert D.run(_lowest_rank_worker, 2, root, False)[0] == ["0", "1"]  # spread by planned bytes


def test_writer_positional_arguments_mean_what_they_mean_in_dcp(tmp_path):
    args = (tmp_path, False, False, 2, 5_000_000, True, False)
    ours, theirs = UCPFileSystemWriter(*args), FileSystemWriter(*args)
    for attr in (
        "single_file_per_rank",
        "sync_files",
        "thread_count",
        "per_thread_copy_ahead",
        "cache_staged_state_dict",
        "overwrite",
        "serialization_format",
    ):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    with pytest.raises(TypeError):
        UCPFileSystemWriter(
            tmp_path, True, True, 1, 10_000_000, False, True, None, SerializationFormat.TORCH_SAVE, False
        )  # checksums is keyword-only


def _data_files(path) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".distcp"))


def test_writer_single_file_per_rank_thread_count_and_overwrite_are_honoured(tmp_path):
    sd = {f"t{i}": torch.full((8,), float(i)) for i in range(4)}
    dcp.save(sd, storage_writer=UCPFileSystemWriter(tmp_path / "one", True, True, 1))
    dcp.save(sd, storage_writer=UCPFileSystemWriter(tmp_path / "two", True, True, 2))
    dcp.save(sd, storage_writer=UCPFileSystemWriter(tmp_path / "each", False))
    assert [len(_data_files(tmp_path / d)) for d in ("one", "two", "each")] == [1, 2, 4]
    for d in ("one", "two", "each"):
        back = {f"t{i}": torch.zeros(8) for i in range(4)}
        dcp.load(back, storage_reader=UCPFileSystemReader(tmp_path / d))
        assert all(back[f"t{i}"].eq(i).all() for i in range(4))
    with pytest.raises(CheckpointException, match="overwrite=False"):
        dcp.save(sd, storage_writer=UCPFileSystemWriter(tmp_path / "one", True, True, 1, 10_000_000, False, False))


def test_writer_cache_staged_state_dict_is_dcps_staging_cache(tmp_path):
    """The option reaches DCP's own staging code (``stage`` is FileSystemWriter's, not replaced):
    the staged copy is kept and reused. It pins memory, so the reuse is checked only with a GPU."""
    writer = UCPFileSystemWriter(tmp_path, cache_staged_state_dict=True)
    assert writer.cache_staged_state_dict is True and UCPFileSystemWriter.stage is FileSystemWriter.stage
    if torch.cuda.is_available():
        first = writer.stage({"w": torch.ones(4)})
        second = writer.stage({"w": torch.full((4,), 2.0)})
        assert second["w"].tolist() == [2.0] * 4 and first["w"].data_ptr() == second["w"].data_ptr()


class _Xor(StreamTransformExtension):
    """A toy stream transform (every byte XOR 0x5A), so no compression package is needed."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> _Xor:
        return _Xor()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b) -> int:
                data = np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8) ^ 0x5A
                output.write(data.tobytes())
                return len(data)

            def close(self) -> None:
                output.close()
                super().close()

        return Writer()

    def transform_from(self, input):
        return io.BytesIO((np.frombuffer(input.read(), dtype=np.uint8) ^ 0x5A).tobytes())


def test_writer_refuses_what_it_cannot_honour(tmp_path):
    with pytest.raises(ucp_dcp.UCPError, match="stream transforms") as info:
        UCPFileSystemWriter(tmp_path, True, True, 1, 10_000_000, False, True, [_Xor()])
    assert "FileSystemWriter" in str(info.value) and info.value.wanted == ["_Xor"]
    with pytest.raises(ucp_dcp.UCPError, match="torch.save records only") as info:
        UCPFileSystemWriter(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)
    pickle.loads(pickle.dumps(info.value))
    UCPFileSystemWriter(tmp_path, True, True, 1, 10_000_000, False, True, [])  # no transforms: fine


def _xor_registry() -> ExtensionRegistry:
    registry = ExtensionRegistry()
    registry.register(_Xor)
    return registry


def test_reader_extension_registry_positional_decodes_dcps_transformed_tensors(tmp_path):
    sd = {"w": torch.arange(10.0), "m": torch.ones(2, 2)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[_Xor()]))
    back = {"w": torch.zeros(10), "m": torch.zeros(2, 2)}
    dcp.load(back, storage_reader=UCPFileSystemReader(tmp_path, _xor_registry()), planner=UCPLoadPlanner())
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["m"], sd["m"])


def test_reader_extension_registry_decodes_dcps_transformed_objects(tmp_path):
    """An object item saved through DCP's stream transforms is decoded by the reader's registry before the
    planner unpickles it, as DCP's reader does; a reader without the extension refuses it as DCP's does."""
    dcp.save(
        {"meta": {"k": "v"}, "w": torch.arange(3.0)}, storage_writer=FileSystemWriter(tmp_path, _extensions=[_Xor()])
    )
    back = {"meta": {"k": ""}, "w": torch.zeros(3)}
    reader = UCPFileSystemReader(tmp_path, _xor_registry())
    dcp.load(back, storage_reader=reader, planner=UCPLoadPlanner())
    assert back["meta"] == {"k": "v"} and torch.equal(back["w"], torch.arange(3.0))
    stock = {"meta": {"k": ""}, "w": torch.zeros(3)}
    dcp.load(stock, storage_reader=FileSystemReader(tmp_path, _xor_registry()), planner=DefaultLoadPlanner())
    assert stock["meta"] == back["meta"]
    with pytest.raises(CheckpointException, match="Unknown extension"):
        dcp.load({"meta": {"k": ""}}, storage_reader=UCPFileSystemReader(tmp_path), planner=UCPLoadPlanner())


def test_storage_classes_with_positional_arguments_pickle(tmp_path):
    w = pickle.loads(pickle.dumps(UCPFileSystemWriter(tmp_path, False, False, 3, checksums=False)))
    assert (w.single_file_per_rank, w.sync_files, w.thread_count, w.checksums) == (False, False, 3, False)
    r = pickle.loads(pickle.dumps(UCPFileSystemReader(tmp_path, None, thread_count=2)))
    assert r.thread_count == 2


# -- 3. DCP's call orders, driven by hand ----------------------------------------------------------


def _items_and_data(planner, plan) -> dict:
    return {(it.index.fqn, tuple(it.index.offset or ())): planner.resolve_data(it) for it in plan.items}


def _same_data(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x.getvalue() != y.getvalue():
            return False
    return True


def test_save_finish_plan_right_after_the_local_plan_is_final_as_in_dcp():
    """One process, no global step: DCP's planner takes the local plan as final; ours plans the
    rank alone, and resolves the same items to the same data."""
    got = {}
    for cls in (DefaultSavePlanner, UCPSavePlanner):
        p = cls()
        p.set_up_planner(_state(), None, True)
        final = p.finish_plan(p.create_local_plan())
        got[cls] = _items_and_data(p, final)
    assert _same_data(got[DefaultSavePlanner], got[UCPSavePlanner])


@pytest.mark.parametrize("writer_cls", [FileSystemWriter, UCPFileSystemWriter])
@pytest.mark.parametrize("global_step", [True, False], ids=["with-global-plan", "local-plan-as-final"])
def test_save_driven_by_hand_in_dcps_order_loads_back(tmp_path, writer_cls, global_step):
    """set_up -> local plan -> [global plan] -> finish -> write -> finish, as dcp.save calls them."""
    planner, writer = UCPSavePlanner(), writer_cls(tmp_path)
    planner.set_up_planner(_state(), None, True)
    writer.set_up_storage_writer(True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    if global_step:
        plans, md = planner.create_global_plan([local])
        plans = writer.prepare_global_plan(plans)
        final = planner.finish_plan(plans[0])
    else:
        final = planner.finish_plan(writer.prepare_global_plan([local])[0])
        md = planner.metadata  # kept by the one-rank plan, as create_global_plan keeps it (DCP too)
    results = writer.write_data(final, planner).wait()
    writer.finish(md, [results])
    assert_written_by_ucp(tmp_path, storage=writer_cls is UCPFileSystemWriter)
    back = {"model": {"a": torch.zeros(4, 3), "b": torch.zeros(2)}, "step": 0}
    dcp.load(back, checkpoint_id=tmp_path, planner=DefaultLoadPlanner())
    assert torch.equal(back["model"]["a"], _state()["model"]["a"]) and back["step"] == 7


def test_save_create_global_plan_on_a_coordinator_that_planned_nothing():
    """DCP's global step needs only the plans: ours too (its own rules still checked)."""
    rank = UCPSavePlanner()
    rank.set_up_planner(_state(), None, False)
    local = rank.create_local_plan()
    plans, md = UCPSavePlanner().create_global_plan([local])
    assert "model.a" in md.state_dict_metadata and ucp_dcp.read_catalog(md.planner_data) is not None
    final = rank.finish_plan(plans[0])
    assert {it.index.fqn for it in final.items} >= {"model.a", "model.b", "step"}


@pytest.mark.parametrize(
    "call,step",
    [
        (lambda p: p.create_local_plan(), "set_up_planner"),
        (lambda p: p.finish_plan(SavePlan([])), "create_local_plan"),
        (lambda p: p.resolve_data(None), "create_local_plan"),
    ],
    ids=["local-before-set-up", "finish-before-local", "resolve-before-local"],
)
def test_save_steps_out_of_order_name_the_missing_step(call, step):
    with pytest.raises(ucp_dcp.UCPError, match=step):
        call(UCPSavePlanner())


def test_save_reused_planner_forgets_the_previous_plan():
    p = UCPSavePlanner()
    p.set_up_planner(_state(), None, True)
    p.finish_plan(p.create_local_plan())
    p.set_up_planner({"x": torch.zeros(2)}, None, True)
    with pytest.raises(ucp_dcp.UCPError, match="create_local_plan"):
        p.finish_plan(SavePlan([]))


def test_save_plans_from_another_planner_are_refused():
    dcp_planner = DefaultSavePlanner()
    dcp_planner.set_up_planner(_state(), None, True)
    foreign = dcp_planner.create_local_plan()
    with pytest.raises(ucp_dcp.UCPError, match=r"rank\(s\) \[0\] were not made by UCPSavePlanner"):
        UCPSavePlanner().create_global_plan([foreign])
    ours = UCPSavePlanner()
    ours.set_up_planner(_state(), None, True)
    ours.create_local_plan()
    with pytest.raises(ucp_dcp.UCPError, match="neither this planner's local plan"):
        ours.finish_plan(foreign)


def _load_by_hand(planner, reader, target, global_step: bool) -> None:
    md = reader.read_metadata()
    planner.set_up_planner(target, md, True)
    reader.set_up_storage_reader(md, True)
    local = reader.prepare_local_plan(planner.create_local_plan())
    central = reader.prepare_global_plan(planner.create_global_plan([local]))[0] if global_step else local
    reader.read_data(planner.finish_plan(central), planner).wait()


@pytest.mark.parametrize("reader_cls", [FileSystemReader, UCPFileSystemReader])
@pytest.mark.parametrize("global_step", [True, False], ids=["with-global-plan", "local-plan-as-final"])
def test_load_driven_by_hand_in_dcps_orders(saved, reader_cls, global_step):
    """DCP's load planner accepts its local plan in finish_plan (one process, no global step): ours
    does too, and the load fills the target."""
    back = {"model": {"a": torch.zeros(4, 3), "b": torch.zeros(2)}, "step": 0}
    _load_by_hand(UCPLoadPlanner(), reader_cls(saved), back, global_step)
    assert torch.equal(back["model"]["a"], _state()["model"]["a"]) and back["step"] == 7


def test_load_create_global_plan_on_a_coordinator_that_planned_nothing(saved):
    md = _metadata(saved)
    rank = UCPLoadPlanner()
    rank.set_up_planner(_state(), md, False)
    local = rank.create_local_plan()
    (central,) = UCPLoadPlanner().create_global_plan([local])
    assert rank.finish_plan(central).items


@pytest.mark.parametrize(
    "call,step",
    [
        (lambda p: p.create_local_plan(), "set_up_planner"),
        (lambda p: p.finish_plan(LoadPlan([])), "create_local_plan"),
        (lambda p: p.load_bytes(None, io.BytesIO()), "create_local_plan"),
        (lambda p: p.resolve_tensor(None), "set_up_planner"),
    ],
    ids=["local-before-set-up", "finish-before-local", "bytes-before-local", "tensor-before-set-up"],
)
def test_load_steps_out_of_order_name_the_missing_step(call, step):
    with pytest.raises(ucp_dcp.UCPError, match=step):
        call(UCPLoadPlanner())


def test_load_set_up_without_metadata_says_what_to_pass():
    with pytest.raises(ucp_dcp.UCPError, match="no checkpoint metadata") as info:
        UCPLoadPlanner().set_up_planner(_state(), None, True)
    assert "read_metadata" in str(info.value)


def test_load_reused_planner_forgets_the_previous_plan(saved):
    md = _metadata(saved)
    p = UCPLoadPlanner()
    p.set_up_planner(_state(), md, True)
    p.finish_plan(p.create_local_plan())
    p.set_up_planner(_state(), md, True)
    with pytest.raises(ucp_dcp.UCPError, match="create_local_plan"):
        p.finish_plan(LoadPlan([]))


def test_load_plans_from_another_planner_are_refused(saved):
    md = _metadata(saved)
    theirs = DefaultLoadPlanner()
    theirs.set_up_planner(_state(), md, True)
    with pytest.raises(ucp_dcp.UCPError, match="not made by UCPLoadPlanner"):
        UCPLoadPlanner().create_global_plan([theirs.create_local_plan()])


# -- 4. pickling ------------------------------------------------------------------------------------


def test_planners_built_positionally_pickle_with_their_configuration():
    rules = [ucp_dcp.Replicated(r"w")]
    s = pickle.loads(
        pickle.dumps(
            UCPSavePlanner(False, False, None, True, True, check_replicas="warn", patterns=rules, strict=False)
        )
    )
    assert (
        s.flatten_state_dict,
        s.flatten_sharded_tensors,
        s.dedup_save_to_lowest_rank,
        s._enable_plan_caching,
        s.check_replicas,
        s.rules,
        s.strict,
    ) == (False, False, True, True, "warn", tuple(rules), False)
    ld = pickle.loads(pickle.dumps(UCPLoadPlanner(False, False, True, read_once="off", trust=True)))
    assert (ld.flatten_state_dict, ld.flatten_sharded_tensors, ld.allow_partial_load, ld.read_once, ld.trust) == (
        False,
        False,
        True,
        "off",
        True,
    )


def test_planner_pickles_of_the_previous_format_still_load():
    """Before DCP's parameters came first, a planner pickled as (options, our options only)."""
    from ucp_dcp.planning import load_planner, save_planner

    s = save_planner._rebuild(
        UCPSavePlanner,
        UCPOptions(strict=False),
        {"check_replicas": "off", "dedup_save_to_lowest_rank": True, "enable_plan_caching": False},
    )
    assert (s.strict, s.check_replicas, s.dedup_save_to_lowest_rank, s.flatten_state_dict) == (False, "off", True, True)
    ld = load_planner._rebuild(
        UCPLoadPlanner,
        UCPOptions(),
        {"read_once": "ranks", "allow_partial_load": True, "allow_lossy_dtype": False, "trust": False},
    )
    assert (ld.read_once, ld.allow_partial_load, ld.flatten_state_dict) == ("ranks", True, True)
