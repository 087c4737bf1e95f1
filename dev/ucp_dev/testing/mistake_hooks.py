"""Mistakes of *subclassing* (issue 31): ``UCPSavePlanner``/``UCPLoadPlanner`` subclassed the way DCP's
docs subclass its default planners, run on 2 gloo ranks (an FSDP2-sharded model, a replicated DTensor, an
object) beside the other classes of the harness (:mod:`ucp_dev.testing.mistakes`).

Each hook pattern either does what DCP's planner would do with it (``ok``: the state is bitwise what the
hook asked for) or is refused with a ``UCPError``; returning with any other state is ``silent`` (the hook was
ignored). Patterns that ucp_dcp documents as refused (``docs/concepts.md``, "Subclassing the planners") must be refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from ucp_dcp.planning.load_planner import UCPLoadPlanner
from ucp_dcp.planning.save_planner import UCPSavePlanner
from ucp_dcp.storage.reader import UCPFileSystemReader
from ucp_dcp.storage.writer import UCPFileSystemWriter
from ucp_dev.testing.checks import state_diffs
from ucp_dev.testing.mistake_forms import WORLD, _flat, _job
from ucp_dev.testing.mistake_runs import agree, attempt

__all__ = ["HOOK_SCENARIOS", "hooks_worker"]


def _state(seed: int) -> dict:
    """An FSDP2-sharded model, a replicated DTensor holding a NaN, an object."""
    model, _ = _job(False, seed, sharded=True)
    torch.manual_seed(50 + seed)
    rep = torch.randn(3, 2)
    rep[0, 0] = float("nan")
    mesh = init_device_mesh("cpu", (WORLD,))
    return {"model": model.state_dict(), "rep": distribute_tensor(rep, mesh, [Replicate()]), "note": f"secret{seed}"}


def _save(state: dict, folder: str, cls: type = UCPSavePlanner) -> Any:
    planner = cls(replica_digests="writer")  # the writer compares replicated copies as the hooks give them
    dcp.save(state, storage_writer=UCPFileSystemWriter(folder), planner=planner)
    return planner


def _load(state: dict, folder: str, cls: type = UCPLoadPlanner, **kw: Any) -> Any:
    planner = cls(**kw)
    dcp.load(state, storage_reader=UCPFileSystemReader(folder), planner=planner)
    return planner


def _sub(base: type, **methods: Callable[..., Any]) -> type:
    return type(f"User{base.__name__}", (base,), methods)


# -- save hooks ----------------------------------------------------------------------------------------


def _redact(folder: str) -> tuple[dict, dict]:
    def transform_object(self, item, obj):
        if item.type == WriteItemType.BYTE_IO and isinstance(obj, str):
            obj = "<redacted>"
        elif isinstance(obj, torch.Tensor):
            obj = torch.nan_to_num(obj)
        return super(cls, self).transform_object(item, obj)

    cls = _sub(UCPSavePlanner, transform_object=transform_object)
    saved = _state(0)
    _save(saved, folder, cls)
    target = _state(1)
    _load(target, folder)
    expected = {k: torch.nan_to_num(v) if isinstance(v, torch.Tensor) else v for k, v in _flat("", saved).items()}
    return {**expected, ".note": "<redacted>"}, _flat("", target)


def _ema(folder: str) -> tuple[dict, dict]:
    saved = _state(0)
    ema = {"model": {k: v * 0.5 for k, v in saved["model"].items()}}

    def lookup_object(self, index):
        key = self.key_of(index)  # the user's flattened key of the atom
        if key.startswith("model."):
            return find_state_dict_object({key: ema["model"][key[len("model.") :]]}, replace(index, fqn=key))
        return super(cls, self).lookup_object(index)

    cls = _sub(UCPSavePlanner, lookup_object=lookup_object)
    _save(saved, folder, cls)
    target = _state(1)
    _load(target, folder)
    return _flat("", {**saved, **ema}), _flat("", target)


def _fp16(folder: str) -> tuple[dict, dict]:
    def create_local_plan(self):
        plan = super(cls, self).create_local_plan()
        for p in plan.items:
            if p.tensor_data is not None:
                p.tensor_data.properties.dtype = torch.float16
        return plan

    def resolve_data(self, item):
        data = super(cls, self).resolve_data(item)
        return data if item.type == WriteItemType.BYTE_IO else data.to(torch.float16)

    cls = _sub(UCPSavePlanner, create_local_plan=create_local_plan, resolve_data=resolve_data)
    saved = _state(0)
    _save(saved, folder, cls)
    target = _state(1)
    _load(target, folder)
    expected = {k: v.half().float() if isinstance(v, torch.Tensor) else v for k, v in _flat("", saved).items()}
    return expected, _flat("", target)


def _drop_save(folder: str) -> tuple[dict, dict]:
    def create_local_plan(self):
        plan = super(cls, self).create_local_plan()
        return replace(plan, items=[it for it in plan.items if it.index.fqn not in ("note", "model.norm.weight")])

    cls = _sub(UCPSavePlanner, create_local_plan=create_local_plan)
    saved = _state(0)
    _save(saved, folder, cls)
    target = _state(1)
    fresh = _flat("", target)
    _load(target, folder, allow_partial_load=True)  # the dropped values are not in the checkpoint
    expected = _flat("", saved)
    return {**expected, ".note": "secret1", ".model.norm.weight": fresh[".model.norm.weight"]}, _flat("", target)


# -- load hooks -----------------------------------------------------------------------------------------


def _drop_load(folder: str) -> tuple[dict, dict]:
    def create_local_plan(self):
        plan = super(cls, self).create_local_plan()
        return replace(plan, items=[it for it in plan.items if it.dest_index.fqn != "model.norm.weight"])

    cls = _sub(UCPLoadPlanner, create_local_plan=create_local_plan)
    saved = _state(0)
    _save(saved, folder)
    target = _state(1)
    fresh = _flat("", target)[".model.norm.weight"]
    _load(target, folder, cls)
    return {**_flat("", saved), ".model.norm.weight": fresh}, _flat("", target)


def _commit_bf16(folder: str) -> tuple[dict, dict]:
    def commit_tensor(self, item, tensor):  # no super(): DCP's default does nothing here
        self.committed = getattr(self, "committed", 0) + 1

    cls = _sub(UCPLoadPlanner, commit_tensor=commit_tensor)
    saved = _state(0)
    _save(saved, folder)
    target = _state(1)
    target["model"] = {k: v.to(torch.bfloat16) for k, v in target["model"].items()}
    _load(target, folder, cls)
    expected = {**saved, "model": {k: v.to(torch.bfloat16) for k, v in saved["model"].items()}}
    return _flat("", expected), _flat("", target)


def _shadow(folder: str) -> tuple[dict, dict]:
    saved = _state(0)
    _save(saved, folder)
    target = _state(1)
    shadow = {"model.output.weight": torch.zeros_like(target["model"]["output.weight"])}

    def lookup_tensor(self, index):
        if index.fqn in shadow:
            return find_state_dict_object(shadow, index)
        return super(cls, self).lookup_tensor(index)

    cls = _sub(UCPLoadPlanner, lookup_tensor=lookup_tensor)
    fresh = _flat("", target)[".model.output.weight"]
    _load(target, folder, cls)
    loaded = {**_flat("", target), "shadow": _flat("", shadow["model.output.weight"])[""]}
    return {
        **_flat("", saved),
        ".model.output.weight": fresh,
        "shadow": saved["model"]["output.weight"].full_tensor(),
    }, loaded


def _meta_materialize(folder: str) -> tuple[dict, dict]:
    def resolve_tensor(self, item):
        return torch.empty_like(super(cls, self).resolve_tensor(item), device="cpu")

    def commit_tensor(self, item, tensor):
        self.state_dict[item.dest_index.fqn] = tensor

    cls = _sub(UCPLoadPlanner, resolve_tensor=resolve_tensor, commit_tensor=commit_tensor)
    saved = _state(0)
    _save(saved, folder)
    planner = _load(_state(1), folder, cls)
    mine = {f"model.{k}": v.to_local() for k, v in saved["model"].items()}
    return mine, {k: planner.state_dict[k] for k in mine}


# -- documented refusals -----------------------------------------------------------------------------------


def _rename_without_super(folder: str) -> tuple[dict, dict]:
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):  # DCP's RenamePlanner (load)
        self.original_state_dict = state_dict
        self.state_dict = {"foo_" + k: v for k, v in state_dict.items()}
        self.metadata, self.is_coordinator = metadata, is_coordinator

    _save(_state(0), folder)
    target = _state(1)
    _load(target, folder, _sub(UCPLoadPlanner, set_up_planner=set_up_planner))
    return _flat("", _state(0)), _flat("", target)


def _global_drop(folder: str) -> tuple[dict, dict]:
    def create_global_plan(self, plans):
        plans = [replace(p, items=[it for it in p.items if it.index.fqn != "note"]) for p in plans]
        return super(cls, self).create_global_plan(plans)

    cls = _sub(UCPSavePlanner, create_global_plan=create_global_plan)
    _save(_state(0), folder, cls)
    return {}, {}


def _finish_drop(folder: str) -> tuple[dict, dict]:
    def finish_plan(self, plan):
        plan = super(cls, self).finish_plan(plan)
        return replace(plan, items=[it for it in plan.items if it.index.fqn != "note"])

    cls = _sub(UCPSavePlanner, finish_plan=finish_plan)
    _save(_state(0), folder, cls)
    return {}, {}


@dataclass(frozen=True)
class HookScenario:
    run: Callable[[str], tuple[dict, dict]]
    hook: str
    """The hook the subclass overrides, as the summary prints it (the save side)."""
    pattern: str
    """What the override does (the load side)."""
    must_refuse: bool = False
    """Documented as refused: returning at all is silent."""


HOOK_SCENARIOS: dict[str, HookScenario] = {
    "hooks-redact": HookScenario(_redact, "save transform_object", "redact a string, nan_to_num tensors"),
    "hooks-ema": HookScenario(_ema, "save lookup_object", "EMA weights saved for the live ones"),
    "hooks-fp16": HookScenario(_fp16, "save create_local_plan+resolve_data", "DCP's FP16Planner"),
    "hooks-drop-save": HookScenario(_drop_save, "save create_local_plan", "items dropped: kept out"),
    "hooks-drop-load": HookScenario(_drop_load, "load create_local_plan", "reads dropped: target kept"),
    "hooks-commit-bf16": HookScenario(_commit_bf16, "load commit_tensor", "no super(), fp32 -> bf16 target"),
    "hooks-shadow": HookScenario(_shadow, "load lookup_tensor", "read into a shadow tensor"),
    "hooks-meta": HookScenario(_meta_materialize, "load resolve_tensor+commit_tensor", "DCP's MetaModelMaterialize"),
    "hooks-rename-nosuper": HookScenario(
        _rename_without_super, "load set_up_planner", "DCP's RenamePlanner, no super()", must_refuse=True
    ),
    "hooks-global-drop": HookScenario(_global_drop, "save create_global_plan", "items dropped", must_refuse=True),
    "hooks-finish-drop": HookScenario(_finish_drop, "save finish_plan", "items dropped", must_refuse=True),
}
"""Every subclass-hook pattern, by the name the summary prints."""


def hooks_worker(rank: int, world: int, root: str, names: list[str]) -> list[dict] | None:
    """Every rank: run the scenarios ``names`` (one folder each); rank 0 returns the harness's result dicts."""
    results = []
    for name in names:
        sc = HOOK_SCENARIOS[name]
        failure, expected, loaded = attempt(sc.run, os.path.join(root, name))
        if failure is not None:
            hooks = sc.hook.split()[1].split("+")
            if failure["outcome"] == "unclear" and any(h in failure["error"] for h in hooks):
                # a refused hook has no atom to name: naming the hook (and the fix, the hint) is clear
                failure["outcome"] = "refused" if failure.get("hint") else "unclear"
                failure.pop("mentions", None)
        failure = agree(failure)
        diffs = [] if failure is not None or sc.must_refuse else state_diffs(expected, loaded)
        diffs = agree(diffs or None) or []
        dist.barrier()
        if failure is not None:
            res = dict(failure)
        elif sc.must_refuse:
            res = {"outcome": "silent", "diffs": 0, "first": ["documented as refused; no error"]}
        else:
            res = {"outcome": "silent", "diffs": len(diffs), "first": diffs[:4]} if diffs else {"outcome": "ok"}
        results.append({"save": sc.hook, "load": sc.pattern, "mistake": name, **res})
    return results if rank == 0 else None
