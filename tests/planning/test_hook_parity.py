"""DCP's documented planner extension points (issue 31): each pattern written once, as DCP's docs
subclass the default planners, mixed into DCP's planners and into ucp_dcp's, and run through
``dcp.save``/``dcp.load`` (DCP's storage for DCP's planners, ucp_dcp's for ucp_dcp's). The results
are compared bitwise, or ucp_dcp's documented refusal is asserted. Every case also checks that the
hook had an effect, so it fails if the hook were ignored. One process (DCP runs without a process
group), except one 2-rank case where the global plan decides who writes."""

from __future__ import annotations

from dataclasses import replace

import dist as D
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItemType

from ucp_dcp import (
    UCPError,
    UCPFileSystemReader,
    UCPFileSystemWriter,
    UCPLoadPlanner,
    UCPSavePlanner,
    first_ucp_error,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PLANNERS = [
    ("dcp", DefaultSavePlanner, DefaultLoadPlanner, FileSystemWriter, FileSystemReader),
    ("ucp", UCPSavePlanner, UCPLoadPlanner, UCPFileSystemWriter, UCPFileSystemReader),
]


@pytest.fixture(params=PLANNERS, ids=[p[0] for p in PLANNERS])
def family(request):
    return request.param


def _mix(pattern: type, base: type) -> type:
    """The pattern mixed into a planner base, as a user subclass would be written."""
    return type(f"{pattern.__name__}On{base.__name__}", (pattern, base), {})


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    w[1, 2] = float("nan")
    return {"w": w, "m": torch.randn(3, 3, generator=g), "b": torch.ones(3), "secret": "hunter2", "step": 7}


def _zeros() -> dict:
    return {"w": torch.zeros(4, 3), "m": torch.zeros(3, 3), "b": torch.zeros(3), "secret": "", "step": 0}


def _save(family, tmp_path, state, pattern=None, **kw):
    _, save_cls, _, writer, _ = family
    planner = _mix(pattern, save_cls)(**kw) if pattern else save_cls()
    dcp.save(state, storage_writer=writer(tmp_path), planner=planner)
    return planner


def _load(family, tmp_path, state, pattern=None, **kw):
    _, _, load_cls, _, reader = family
    planner = _mix(pattern, load_cls)(**kw) if pattern else load_cls()
    dcp.load(state, storage_reader=reader(tmp_path), planner=planner)
    return planner


def _refusal(fn) -> UCPError:
    """The UCPError ``fn`` raises (dcp.save/dcp.load wrap a rank's failure in a CheckpointException)."""
    with pytest.raises(BaseException) as info:
        fn()
    err = info.value if isinstance(info.value, UCPError) else first_ucp_error(info.value)
    assert isinstance(err, UCPError), info.value
    return err


def _same(a, b) -> bool:
    """Equal bitwise (NaNs included), dtype and shape too; other values by ``==``."""
    if not isinstance(a, torch.Tensor):
        return a == b
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _both(run) -> dict:
    """``run(family, path)`` on both families (fresh folders); their results must be bitwise equal."""
    return {f[0]: run(f, D.tmpdir()) for f in PLANNERS}


def _assert_parity(out: dict) -> dict:
    dcp_out, ucp_out = out["dcp"], out["ucp"]
    assert set(dcp_out) == set(ucp_out), (sorted(dcp_out), sorted(ucp_out))
    bad = [k for k in dcp_out if not _same(dcp_out[k], ucp_out[k])]
    assert not bad, {k: (dcp_out[k], ucp_out[k]) for k in bad}
    return dcp_out


# -- save hooks ------------------------------------------------------------------------------------


class Redact:
    """``transform_object``: a string redacted, NaNs of a tensor replaced, before they are written."""

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, str):
            object = "<redacted>"
        elif isinstance(object, torch.Tensor):
            object = torch.nan_to_num(object)
        return super().transform_object(write_item, object)


class Ema:
    """``lookup_object``: EMA weights saved instead of the live ones (looked up by the key)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ema = {"w": torch.full((4, 3), 0.5)}

    def lookup_object(self, index):
        if index.fqn in self.ema:
            return self.ema[index.fqn]
        return super().lookup_object(index)


class FP16:
    """DCP's ``SavePlanner`` docstring example (``for p in plan.items``: the docstring iterates the
    plan itself, which is not iterable)."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        for p in plan.items:
            if p.tensor_data is not None:
                p.tensor_data.properties.dtype = torch.float16
        return plan

    def resolve_data(self, write_item):
        item = super().resolve_data(write_item)
        return item if write_item.type == WriteItemType.BYTE_IO else item.to(torch.float16)


class HalfData:
    """``resolve_data`` alone returning fp16 data for fp32 items: DCP stores the fp16 tensor and converts at
    load, ucp_dcp converts to the item's dtype at save; either way the load sees fp16-rounded values."""

    def resolve_data(self, write_item):
        item = super().resolve_data(write_item)
        return item if write_item.type == WriteItemType.BYTE_IO else item.to(torch.float16)


class KeepSecretOut:
    """``create_local_plan`` dropping items: a secret stays out of the checkpoint."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        return replace(plan, items=[it for it in plan.items if it.index.fqn != "secret"])


class Prefix:
    """``set_up_planner`` editing the state dict before ``super()`` (DCP's RenamePlanner, save side)."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        super().set_up_planner({"foo_" + k: v for k, v in state_dict.items()}, storage_meta, is_coordinator)


class SeesGlobalItems:
    """``create_global_plan`` reading the gathered items (DCP's load-balancing example reads them)."""

    def create_global_plan(self, all_plans):
        self.seen = sorted(it.index.fqn for p in all_plans for it in p.items)
        return super().create_global_plan(all_plans)


class ExtraMetadata:
    """DCP's SaveExtraDataPlanner, keeping ``planner_data`` a dict (DCP's mappings live there)."""

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        return plans, replace(metadata, planner_data={**metadata.planner_data, "extra": "per-save data"})


def _loaded(family, path, target=None, **kw) -> dict:
    target = target if target is not None else _zeros()
    _load(family, path, target, **kw)
    return target


@pytest.mark.parametrize("pattern", [Redact, Ema, FP16, HalfData])
def test_save_data_hooks_match_dcp(pattern):
    def run(family, path):
        _save(family, path, _state(), pattern)
        return _loaded(family, path)

    out = _assert_parity(_both(run))
    plain = _state()
    if pattern is Redact:
        assert out["secret"] == "<redacted>" and not out["w"].isnan().any()
    if pattern is Ema:
        assert torch.equal(out["w"], torch.full((4, 3), 0.5))
    if pattern in (FP16, HalfData):  # rounded to fp16 on the way, loaded back into fp32
        assert torch.equal(out["m"], plain["m"].half().float()) and not torch.equal(out["m"], plain["m"])


def test_save_local_plan_drops_an_item_like_dcp():
    def run(family, path):
        _save(family, path, _state(), KeepSecretOut)
        md = family[4](path).read_metadata()
        assert "secret" not in md.state_dict_metadata  # (DCP's flatten mappings still name it)
        assert "secret" not in md.planner_data.get("__ucp__", {"atoms": {}})["atoms"]  # nor ucp_dcp's catalog
        target = _zeros()
        del target["secret"]
        out = _loaded(family, path, target)
        with pytest.raises(BaseException, match="Missing key in checkpoint state_dict"):  # both say DCP's words
            _load(family, path, _zeros())
        return out

    out = _assert_parity(_both(run))
    assert torch.equal(out["m"], _state()["m"])


def test_save_set_up_planner_edit_matches_dcp():
    def run(family, path):
        _save(family, path, _state(), Prefix)
        return _loaded(family, path, {"foo_" + k: v for k, v in _zeros().items()})

    out = _assert_parity(_both(run))
    assert out["foo_step"] == 7


def test_save_global_plan_hooks_match_dcp():
    def run(family, path):
        planner = _save(family, path, _state(), type("Both", (ExtraMetadata, SeesGlobalItems), {}))
        md = family[4](path).read_metadata()
        return {"seen": planner.seen, "extra": md.planner_data["extra"]}

    out = _assert_parity(_both(run))
    assert out["seen"] == ["b", "m", "secret", "step", "w"] and out["extra"] == "per-save data"


# -- save: refusals -----------------------------------------------------------------------------------


class DropInGlobalPlan:
    def create_global_plan(self, all_plans):
        all_plans = [replace(p, items=[it for it in p.items if it.index.fqn != "secret"]) for p in all_plans]
        return super().create_global_plan(all_plans)


class DropInFinishPlan:
    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        return replace(plan, items=[it for it in plan.items if it.index.fqn != "secret"])


class ListPlannerData:
    """DCP's SaveExtraDataPlanner as written: ``planner_data`` replaced by a list."""

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        return plans, replace(metadata, planner_data=["per-rank-data"])


class WrongSize:
    """``lookup_object`` giving a value of another size than the item's (DCP would write it as given)."""

    def lookup_object(self, index):
        return torch.ones(2) if index.fqn == "w" else super().lookup_object(index)


class SetUpWithoutSuper:
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator


class EditAfterSuper:
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.state_dict["extra"] = torch.ones(2)


SAVE_REFUSALS = [
    (DropInGlobalPlan, "create_global_plan changed the plan's items"),
    (DropInFinishPlan, "finish_plan changed the plan's items"),
    (ListPlannerData, "create_global_plan: the metadata's planner_data lost ucp_dcp's catalog"),
    (WrongSize, "not a tensor of the item's size (4, 3)"),
    (SetUpWithoutSuper, "did not call super().set_up_planner()"),
    (EditAfterSuper, "self.state_dict was changed after UCPSavePlanner.set_up_planner resolved it"),
]


@pytest.mark.parametrize(("pattern", "words"), SAVE_REFUSALS, ids=[p.__name__ for p, _ in SAVE_REFUSALS])
def test_save_hooks_ucp_cannot_carry_are_refused(tmp_path, pattern, words):
    err = _refusal(lambda: _save(PLANNERS[1], tmp_path, _state(), pattern))
    assert words in str(err), err
    assert not (tmp_path / ".metadata").exists()  # nothing committed


def test_dcp_private_hooks_are_refused_at_class_definition():
    with pytest.raises(UCPError, match="UCPSavePlanner does not support overriding _create_global_plan"):
        type("P", (UCPSavePlanner,), {"_create_global_plan": lambda self, plans: None})
    with pytest.raises(UCPError, match="UCPLoadPlanner does not support overriding resolve_bytes"):
        type("P", (UCPLoadPlanner,), {"resolve_bytes": lambda self, item: None})


# -- load hooks -----------------------------------------------------------------------------------------


class MetaMaterialize:
    """DCP's ``LoadPlanner`` docstring example: read into fresh CPU tensors, kept in ``self.state_dict``."""

    def resolve_tensor(self, read_item):
        tensor = super().resolve_tensor(read_item)
        return torch.empty_like(tensor, device="cpu")

    def commit_tensor(self, read_item, tensor):
        self.state_dict[read_item.dest_index.fqn] = tensor


class CountCommits:
    """``commit_tensor`` without ``super()``: the values must land in the target all the same."""

    def commit_tensor(self, read_item, tensor):
        self.committed = getattr(self, "committed", []) + [read_item.dest_index.fqn]


class Shadow:
    """``lookup_tensor``: ``w`` is loaded into a shadow tensor; the live one stays as it is."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shadow = {"w": torch.full((4, 3), -1.0)}

    def lookup_tensor(self, index):
        return self.shadow[index.fqn] if index.fqn in self.shadow else super().lookup_tensor(index)


class Transposed:
    """``transform_tensor``: ``m`` receives the saved values through a transposed view."""

    def transform_tensor(self, read_item, tensor):
        if read_item.dest_index.fqn == "m":
            tensor = tensor.t()
        return super().transform_tensor(read_item, tensor)


class BytesAside:
    """``load_bytes`` without ``super()``: objects collected by the planner, the state dict untouched."""

    def load_bytes(self, read_item, value):
        self.objects = {**getattr(self, "objects", {}), read_item.dest_index.fqn: torch.load(value)}


class KeepFreshW:
    """``create_local_plan`` dropping reads: ``w`` keeps its fresh value."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        return replace(plan, items=[it for it in plan.items if it.dest_index.fqn != "w"])


class StripPrefix:
    """``set_up_planner`` editing the state dict before ``super()``: keys renamed to the saved ones."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner({k.removeprefix("new_"): v for k, v in state_dict.items()}, metadata, is_coordinator)


def _saved(family) -> str:
    path = D.tmpdir()
    _save(family, path, _state())
    return path


def test_load_meta_materialize_matches_dcp():
    def run(family, path):
        path = _saved(family)
        target = _zeros()
        planner = _load(family, path, target, MetaMaterialize)
        assert torch.equal(target["m"], torch.zeros(3, 3))  # the target itself is left alone
        return {k: planner.state_dict[k] for k in ("w", "m", "b")}

    out = _assert_parity(_both(run))
    assert torch.equal(out["m"], _state()["m"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_commit_without_super_still_fills_the_target(dtype):
    def run(family, path):
        path = _saved(family)
        target = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in _zeros().items()}
        planner = _load(family, path, target, CountCommits)
        return {**target, "committed": sorted(planner.committed)}

    out = _assert_parity(_both(run))
    assert out["committed"] == ["b", "m", "w"]
    assert torch.equal(out["m"], _state()["m"].to(dtype))


def test_load_tensor_hooks_match_dcp():
    def run(family, path):
        path = _saved(family)
        target = _zeros()
        planner = _load(family, path, target, type("Both", (Shadow, Transposed), {}))
        return {**target, "shadow": planner.shadow["w"]}

    out = _assert_parity(_both(run))
    assert torch.equal(out["w"], torch.zeros(4, 3))  # the live tensor untouched
    assert _same(out["shadow"], _state()["w"])
    assert torch.equal(out["m"], _state()["m"].t())


def test_load_bytes_override_matches_dcp():
    def run(family, path):
        path = _saved(family)
        target = _zeros()
        planner = _load(family, path, target, BytesAside)
        return {**target, **{f"obj.{k}": v for k, v in planner.objects.items()}}

    out = _assert_parity(_both(run))
    assert out["obj.secret"] == "hunter2" and out["secret"] == "" and out["obj.step"] == 7


def test_load_local_plan_drops_reads_like_dcp():
    def run(family, path):
        path = _saved(family)
        target = {**_zeros(), "w": torch.full((4, 3), 3.0)}
        _load(family, path, target, KeepFreshW)
        return target

    out = _assert_parity(_both(run))
    assert torch.equal(out["w"], torch.full((4, 3), 3.0)) and torch.equal(out["m"], _state()["m"])


class SeesLoadItems:
    """Load ``create_global_plan`` reading the gathered reads."""

    def create_global_plan(self, global_plan):
        self.seen = sorted(it.dest_index.fqn for p in global_plan for it in p.items)
        return super().create_global_plan(global_plan)


def test_load_global_plan_sees_the_reads_like_dcp():
    def run(family, path):
        path = _saved(family)
        planner = _load(family, path, _zeros(), SeesLoadItems)
        return {"seen": planner.seen}

    assert _assert_parity(_both(run))["seen"] == ["b", "m", "secret", "step", "w"]


class EmaByUserKey:
    """``lookup_object`` by the user's keys: ``key_of`` maps an atom to its flattened key (here the
    atom drops the ``module.`` wrapper segment)."""

    def lookup_object(self, index):
        key = self.key_of(index)
        return torch.full((2,), 0.5) if key == "model.module.x" else super().lookup_object(index)


def test_lookup_object_by_the_users_key(tmp_path):
    ucp = PLANNERS[1]
    _save(ucp, tmp_path, {"model": {"module.x": torch.ones(2)}}, EmaByUserKey)
    target = {"model": {"module.x": torch.zeros(2)}}
    _load(ucp, tmp_path, target)
    assert torch.equal(target["model"]["module.x"], torch.full((2,), 0.5))


def test_load_set_up_planner_edit_matches_dcp():
    def run(family, path):
        path = _saved(family)
        target = {"new_" + k: v for k, v in _zeros().items() if isinstance(v, torch.Tensor)}
        _load(family, path, target, StripPrefix)
        return target

    out = _assert_parity(_both(run))
    assert torch.equal(out["new_m"], _state()["m"])


# -- load: refusals ---------------------------------------------------------------------------------------


class DocRename:
    """DCP's ``LoadPlanner`` docstring RenamePlanner: ``set_up_planner`` without ``super()``."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.original_state_dict = state_dict
        self.state_dict = {"foo_" + k: v for k, v in state_dict.items()}
        self.metadata = metadata
        self.is_coordinator = is_coordinator


class DropReadsInGlobalPlan:
    def create_global_plan(self, global_plan):
        return super().create_global_plan([replace(p, items=p.items[1:]) for p in global_plan])


class DropReadsInFinishPlan:
    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        return replace(plan, items=plan.items[1:])


LOAD_REFUSALS = [
    (DocRename, "did not call super().set_up_planner()"),
    (DropReadsInGlobalPlan, "create_global_plan changed the plan's items"),
    (DropReadsInFinishPlan, "finish_plan changed the plan's items"),
]


@pytest.mark.parametrize(("pattern", "words"), LOAD_REFUSALS, ids=[p.__name__ for p, _ in LOAD_REFUSALS])
def test_load_hooks_ucp_cannot_carry_are_refused(pattern, words):
    ucp = PLANNERS[1]
    path = _saved(ucp)
    target = _zeros()
    err = _refusal(lambda: _load(ucp, path, target, pattern))
    assert words in str(err), err
    assert torch.equal(target["m"], torch.zeros(3, 3))  # refused before any byte was read


def test_resolve_tensor_override_with_a_narrowing_read_is_refused_unless_lossy():
    ucp = PLANNERS[1]
    path = _saved(ucp)
    target = {k: v.half() for k, v in _zeros().items() if isinstance(v, torch.Tensor)}
    assert "the override of resolve_tensor" in str(_refusal(lambda: _load(ucp, path, target, MetaMaterialize)))
    dcp_planner = _load(PLANNERS[0], _saved(PLANNERS[0]), dict(target), MetaMaterialize)
    planner = _load(ucp, path, target, MetaMaterialize, allow_lossy_dtype=True)
    assert all(_same(planner.state_dict[k], dcp_planner.state_dict[k]) for k in ("w", "m", "b"))


# -- two ranks: the global plan decides who writes ------------------------------------------------------


def _two_rank_worker(rank: int, world: int, root: str) -> list:
    """Rank 0 drops its copy of the replicated ``b`` in create_local_plan: rank 1's copy is written."""

    class DropOnRank0:
        def create_local_plan(self):
            plan = super().create_local_plan()
            if dist.get_rank() == 0:
                plan = replace(plan, items=[it for it in plan.items if it.index.fqn != "b"])
            return plan

    out = []
    for name, save_cls, _, writer, reader in PLANNERS:
        path = f"{root}/{name}"
        state = {"b": torch.full((3,), 1.0 + dist.get_rank()), "w": torch.arange(4.0)}
        planner = _mix(DropOnRank0, save_cls)()  # the copies differ: only rank 1's is saved, nothing to compare
        dcp.save(state, storage_writer=writer(path), planner=planner)
        target = {"b": torch.zeros(3), "w": torch.zeros(4)}
        dcp.load(target, storage_reader=reader(path), planner=PLANNERS[[p[0] for p in PLANNERS].index(name)][2]())
        out.append(target)
    return out


@pytest.mark.slow
def test_two_ranks_item_dropped_on_one_rank_is_written_by_the_other():
    for dcp_out, ucp_out in D.run(_two_rank_worker, 2, D.tmpdir()):
        assert all(_same(dcp_out[k], ucp_out[k]) for k in dcp_out)
        assert torch.equal(ucp_out["b"], torch.full((3,), 2.0))
