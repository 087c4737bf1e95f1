"""``UCPCheckpointManager``: torchtitan's DCP checkpoint manager with ucp_dcp's planners.

Every stock feature is kept -- the manager runs torchtitan's own ``dcp_save``/``dcp_load`` (async
modes, ``keep_latest_k``, ``load_step``, ``exclude_from_loading``, seed checkpoints, last-step
model-only exports) and only hands DCP the UCP planners.

Hugging Face folders (``initial_load_in_hf``, ``last_save_in_hf``) go through ucp_dcp's HF path
(:mod:`ucp_dcp.torchtitan.mappings` maps llama3, qwen3 and qwen3 MoE models), not torchtitan's state-dict adapter:

* load: :class:`~ucp_dcp.sources.hf.HFStorageReader` presents the folder as atoms and ``UCPLoadPlanner``
  fills the live (sharded) state from them -- the fused ``wqkv`` local shards straight from the
  separate q/k/v tensors, rotary rows permuted on the way, each rank reading only the byte ranges
  its shards need; no all-gather and no full tensor. An MoE model's ``expert_bias_E`` (no HF tensor)
  is set to zero (:mod:`ucp_dcp.torchtitan.hf_moe`). Quantized HF checkpoints are refused;
* save: the model state is saved as a ucp_dcp checkpoint in a temporary sibling folder, exported
  collectively (:func:`~ucp_dcp.sources.hf.publish.export_hf`, box by box, every rank a share) into the
  checkpoint folder, and the temporary folder is removed. Files are sharded by size
  (``hf_max_shard_bytes``); the adapter's ``fqn_to_index_mapping`` is not followed.

(Deferring to the stock HF path with ``fused_qkv_atoms`` on would drop q/k/v silently: the stock
adapter skips the fused ``wqkv`` key.)

What changes in the checkpoint:

* fused ``wqkv`` weights are no longer all-gathered to be split by a state-dict hook: the fused
  local shards are written as ``wq``/``wk``/``wv`` atoms by a ``Fused`` rule (group-major layout,
  one block per KV head), and their optimizer moments become ``wq``/``wk``/``wv`` moments too;
* MoE models: the load-balancing ``expert_bias_E`` buffers are declared ``Replicated`` (see
  :mod:`ucp_dcp.torchtitan.moe`);
* ``train_state.ntokens_seen`` (a per-rank count) is summed over data-parallel slots at save (the
  rule is declared only when the manager holds a ``train_state`` with that field);
* a save or load that leaves training state out on purpose (the last-step model-only export,
  ``initial_load_model_only``, step-0 loads, ``exclude_from_loading``) does not declare the rules
  anchored in that state (``train_state\\.ntokens_seen``): strict mode judges each call on the
  state it holds;
* the dataloader state is either global (``GlobalCursorTextDataLoader``: loads at any DP degree) or,
  for loaders that cannot be remapped, handled by ``dataloader_policy`` -- never a silent wrong
  position.

Kept in one module (over 400 lines): one class, a subclass of torchtitan's ``CheckpointManager`` whose
overrides share its state (planner options, HF paths, the dataloader policy); split, the overrides of one
class would sit in several files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch.distributed as dist
import torch.nn as nn
import torchtitan.components.checkpointer.dcp as tt_dcp
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import DATALOADER, MODEL, ModelWrapper
from torchtitan.models.common.attention import FusedQKVLinear

from .._compat import state_dict_hooks
from ..errors import PatternError, UCPError, ucp_errors
from ..layout.patterns import Fused, Reduce, Rule, Tied, anchored_in, rule_from_json
from ..planning.load_planner import UCPLoadPlanner
from ..planning.save_planner import CheckMode, UCPSavePlanner
from ..storage.opening import read_metadata
from ..storage.reader import UCPFileSystemReader
from ..storage.writer import UCPFileSystemWriter
from ._compat import qkv_split_hook
from .mappings import hf_mapping, tied_rules
from .moe import EXPERT_BIAS, moe_rules

__all__ = ["UCPCheckpointManager", "fused_qkv_rules", "rules_for_call"]

logger = logging.getLogger(__name__)

NtokensSeen = Literal["sum", "off"]
"""``ntokens_seen``: sum the per-rank counts over data-parallel slots at save, or leave them alone."""
DataloaderPolicy = Literal["error", "restart"]
"""``dataloader_policy``: refuse a dataloader state that cannot be remapped, or restart the data streams."""


class UCPCheckpointManager(CheckpointManager):
    """torchtitan checkpoint manager that saves parallelism-independent atoms (see module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        rules: list[str] = field(default_factory=list)
        """Extra ucp_dcp pattern rules, one JSON object each, e.g.
        '{"kind": "padded", "pattern": "tok_embeddings\\\\.weight", "size": 2000}'
        (kinds: fused, padded, replicated, reduce, tied; fields as in ucp_dcp.layout.patterns, including
        "optional": true for a rule strict mode should not count). A rule anchored in a training
        state (its pattern starts with the state's name and an escaped dot, 'train_state\\.') is
        declared only in saves and loads that include that state."""
        strict: bool = True
        """A declared rule that matches no name on any rank is an error (judged per save/load on the
        state it includes; rules marked optional are not counted)."""
        fused_qkv_atoms: bool = True
        """Save fused wqkv weights and their optimizer moments as wq/wk/wv atoms from local shards
        (no all-gather). Off: torchtitan's state-dict hook splits them (weights only)."""
        ntokens_seen: NtokensSeen = "sum"
        """train_state.ntokens_seen is a per-rank count: sum it over data-parallel slots at save
        (on load, slot 0 gets the total, the others 0, so the next save sums right)."""
        moe_rules: bool = True
        """MoE models: declare the load-balancing ``expert_bias_E`` buffers ``Replicated`` (copies
        compared at save; see :func:`ucp_dcp.torchtitan.moe.moe_rules`), when the model holds them."""
        dataloader_policy: DataloaderPolicy = "error"
        """When the saved dataloader state cannot be remapped to this run's data-parallel degree
        (per-rank loaders): 'error' refuses the load before reading anything; 'restart' restarts
        every rank's data stream from its beginning, with a warning."""
        check_replicas: CheckMode = "error"
        """Plain values saved under one name by several ranks must agree: error, warn or off."""
        enable_plan_caching: bool = False
        """DCP save-plan caching (the cache also compares layouts)."""
        hf_max_shard_bytes: int = 5 * 1024**3
        """Most data bytes per safetensors file of a Hugging Face save (``last_save_in_hf``)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)  # a slots dataclass: no zero-argument super()
            for name, mode in (
                ("ntokens_seen", NtokensSeen),
                ("dataloader_policy", DataloaderPolicy),
                ("check_replicas", CheckMode),
            ):
                if getattr(self, name) not in get_args(mode):
                    raise ValueError(f"checkpoint.{name} must be one of {get_args(mode)}, got {getattr(self, name)!r}")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        model_parts = kwargs["model_parts"]
        # the stock ModelWrapper built by the parent caches a state dict: without the split hook,
        # building it does not all-gather wqkv either
        with _without_qkv_split_hooks(model_parts if config.fused_qkv_atoms else []):
            super().__init__(config, **kwargs)
        if not self.enable:
            return
        if config.fused_qkv_atoms:
            self.states[MODEL] = FusedQKVModelWrapper(model_parts)
        self.ucp = config
        self._rules = self._build_rules(config, model_parts)
        self._model_parts = model_parts
        dataloader = kwargs.get("dataloader")
        self._data_slot = getattr(dataloader, "dp_rank", None)

    def _build_rules(self, config: Config, model_parts: list[nn.Module]) -> list[Rule]:
        rules: list[Rule] = []
        if config.fused_qkv_atoms:
            rules += fused_qkv_rules(model_parts)
        if config.moe_rules:
            rules += moe_rules(model_parts)
        if config.ntokens_seen == "sum" and _holds_ntokens_seen(self.states.get(TRAIN_STATE)):
            rules.append(Reduce(r"train_state\.ntokens_seen", "sum"))
        for text in config.rules:
            try:
                rules.append(rule_from_json(json.loads(text)))
            except (ValueError, TypeError) as e:
                raise PatternError(f"checkpoint.rules entry {text!r} is not a valid rule: {e}") from None
        return rules

    def _call_rules(self, state_dict: dict[str, Any]) -> list[Rule]:
        """The rules for one save or load of ``state_dict``: the training states this manager holds
        but the call leaves out on purpose (model-only export or load, ``exclude_from_loading``, the
        dataloader under ``dataloader_policy='restart'``) take their anchored rules with them."""
        left_out = [k for k in self.states if k != MODEL and k not in state_dict]
        return rules_for_call(self._rules, left_out)

    def _save_planner(self, rules: list[Rule]) -> UCPSavePlanner:
        return UCPSavePlanner(
            patterns=rules,
            strict=self.ucp.strict,
            check_replicas=self.ucp.check_replicas,
            data_slot=self._data_slot,
            enable_plan_caching=self.ucp.enable_plan_caching,
        )

    def _load_planner(self, rules: list[Rule]) -> UCPLoadPlanner:
        return UCPLoadPlanner(patterns=rules, strict=self.ucp.strict, data_slot=self._data_slot)

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf:
            return self._save_hf(state_dict, checkpoint_id, async_mode, enable_garbage_collection)
        rules = self._call_rules(state_dict)
        with _dcp_planners(save=lambda: self._save_planner(rules)):
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            return self._load_hf(state_dict, checkpoint_id, from_quantized)
        state_dict = self._apply_dataloader_policy(state_dict, checkpoint_id)
        rules = self._call_rules(state_dict)
        with _dcp_planners(load=lambda: self._load_planner(rules)):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    # -- Hugging Face ---------------------------------------------------------------------------------

    def _hf_model_config(self) -> Any:
        adapter_cfg = getattr(self.sd_adapter, "model_config", None)
        if adapter_cfg is not None:
            return adapter_cfg
        cfg = getattr(self._model_parts[0], "config", None)
        if cfg is None:
            raise UCPError(
                "a Hugging Face load or save needs the model config (from the state-dict adapter or the "
                "model's config)",
                hint="build the manager with the model's sd_adapter, as the Trainer does",
            )
        return cfg

    def _hf_rules(self, state_dict: dict[str, Any], model_config: Any) -> list[Rule]:
        rules = self._call_rules(state_dict)
        if not any(isinstance(r, Tied) for r in rules):
            rules += tied_rules(model_config)
        return rules

    def _load_hf(self, state_dict: dict[str, Any], checkpoint_id: str, from_quantized: bool) -> None:
        """Fill the model state from the Hugging Face folder ``checkpoint_id`` (see module doc)."""
        if from_quantized:
            raise UCPError(
                "initial_load_in_hf_quantized: ucp_dcp's Hugging Face path reads plain safetensors only",
                atom=MODEL,
                hint="load quantized checkpoints with torchtitan's stock CheckpointManager (the ucp_dcp option off)",
            )
        from ..sources.hf import HFStorageReader
        from ..sources.hf.mapping import zero_fill

        begin = time.monotonic()
        cfg = self._hf_model_config()
        mapping = hf_mapping(cfg)
        reader = HFStorageReader(checkpoint_id, mapping)
        # HF has no load-balancing bias: HF's router is ours with it at zero (ucp_dcp.torchtitan.hf_moe)
        to_load, zeroed = zero_fill(state_dict, mapping)
        rules = self._hf_rules(to_load, cfg)
        if zeroed:  # not loaded: its Replicated rule would match nothing
            rules = [r for r in rules if getattr(r, "pattern", None) != EXPERT_BIAS]
        with ucp_errors():
            tt_dcp.dcp.load(to_load, storage_reader=reader, planner=self._load_planner(rules))
        self.states[MODEL].load_state_dict(state_dict)
        self.hf_load_stats = reader.stats
        logger.info(
            "UCP: loaded Hugging Face %s (%s mapping) in %.2fs, %d bytes read by this rank",
            checkpoint_id,
            mapping.name,
            time.monotonic() - begin,
            reader.stats.bytes_read,
        )

    def _save_hf(
        self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any, enable_garbage_collection: bool
    ) -> None:
        """Write the model state as a Hugging Face folder at ``checkpoint_id`` (collective; see module
        doc). torchtitan casts the state to ``export_dtype`` before the call; the files keep it."""
        from ..sources.hf.publish import export_hf

        if async_mode != tt_dcp.AsyncMode.DISABLED:
            logger.warning("UCP: a Hugging Face save is written synchronously (async_mode %s ignored)", async_mode)
        begin = time.monotonic()
        cfg = self._hf_model_config()
        mapping = hf_mapping(cfg)
        world = dist.get_world_size() if dist.is_initialized() else 1
        coordinator = not dist.is_initialized() or dist.get_rank() == 0
        # not "step-N...": torchtitan would take a crashed save's scratch (it has .metadata) for a checkpoint
        scratch = os.path.join(os.path.dirname(os.path.normpath(os.fspath(checkpoint_id))), ".ucp-hf-scratch")
        if coordinator:
            shutil.rmtree(scratch, ignore_errors=True)  # left by a crashed save
        if world > 1:
            dist.barrier()
        try:
            planner = self._save_planner(self._hf_rules(state_dict, cfg))
            with ucp_errors():
                tt_dcp.dcp.save(state_dict, storage_writer=UCPFileSystemWriter(scratch), planner=planner)
            stats = export_hf(
                scratch, checkpoint_id, mapping, max_shard_bytes=self.ucp.hf_max_shard_bytes, overwrite=True
            )
            if coordinator:
                _write_single_file_index(checkpoint_id)
            self.hf_save_stats = stats
        finally:
            if world > 1:
                dist.barrier()
            if coordinator:
                shutil.rmtree(scratch, ignore_errors=True)
        logger.info(
            "UCP: saved Hugging Face %s (%s mapping, %d tensors) in %.2fs",
            checkpoint_id,
            mapping.name,
            stats.tensors,
            time.monotonic() - begin,
        )
        if enable_garbage_collection:
            tt_dcp.GarbageCollection.collect("GC collection invoked by checkpointer.")

    def _apply_dataloader_policy(self, state_dict: dict[str, Any], checkpoint_id: str) -> dict[str, Any]:
        """Check, before anything is read, that the saved dataloader state fits this run's loader."""
        loader = state_dict.get(DATALOADER)
        if loader is None:
            return state_dict
        target = loader.state_dict() if hasattr(loader, "state_dict") else loader  # DCP loads Stateful objects
        if not isinstance(target, dict) or not target:  # nothing to load (a loader without state), as stock
            return state_dict
        saved = {
            k[len(DATALOADER) + 1 :]
            for k in read_metadata(checkpoint_id).state_dict_metadata
            if k.startswith(DATALOADER + ".")
        }
        problem = _dataloader_mismatch(saved, set(target), target.get("world_size"))
        if problem is None:
            return state_dict
        if self.ucp.dataloader_policy == "restart":
            logger.warning(
                "UCP: %s; dataloader_policy='restart': every rank restarts its data stream from the "
                "beginning (deterministically), the rest of the state is loaded",
                problem,
            )
            return {k: v for k, v in state_dict.items() if k != DATALOADER}
        raise UCPError(
            f"{problem}; refusing to resume at an undefined data position",
            atom=DATALOADER,
            saved=sorted(saved)[:6],
            wanted=sorted(target)[:6],
            hint="use ucp_dcp's GlobalCursorTextDataLoader (resumes at any DP degree), set "
            "checkpoint.dataloader_policy='restart', or exclude_from_loading=['dataloader']",
        )


TRAIN_STATE = "train_state"
"""The Trainer's own state in the manager's ``states`` (``{"step", "ntokens_seen"}``)."""


def _holds_ntokens_seen(state: Any) -> bool:
    """Does the manager's ``train_state`` have an ``ntokens_seen`` (the built-in Reduce rule's target)?
    torchtitan's Trainer always does; a trainer built on the manager may hold none or another one."""
    if state is None:
        return False
    sd = state.state_dict() if hasattr(state, "state_dict") else state
    return isinstance(sd, dict) and "ntokens_seen" in sd


def rules_for_call(rules: list[Rule], left_out: list[str]) -> list[Rule]:
    """``rules`` less those anchored in a state the call leaves out (``Reduce(r"train_state\\.x")``
    when ``"train_state"`` is left out): there is nothing for them to match, on purpose, so strict
    mode must not count them. Every other rule is declared as usual (a rule that matches nothing in
    a call holding its state is still an error in strict mode)."""
    kept = [r for r in rules if not any(anchored_in(r, ns) for ns in left_out)]
    if len(kept) < len(rules):
        logger.debug(
            "UCP: %s left out of this save/load: rules %s not declared",
            left_out,
            [r.pattern for r in rules if r not in kept],
        )
    return kept


def _dataloader_mismatch(saved: set[str], target: set[str], world: int | None) -> str | None:
    """Why the saved dataloader keys cannot fill the target loader (None if they can)."""
    per_rank = lambda keys: sorted(k for k in keys if k.startswith("dp_rank_"))  # noqa: E731
    if not saved:
        return "the checkpoint holds no dataloader state"
    if per_rank(target):
        if not per_rank(saved):
            return "the checkpoint holds a global-cursor dataloader state but this run uses a per-rank loader"
        if len(per_rank(saved)) != world or not set(per_rank(target)) <= saved:
            return (
                f"the per-rank dataloader state was saved at data-parallel degree {len(per_rank(saved))} "
                f"and cannot be remapped to data-parallel degree {world}"
            )
        return None
    missing = target - saved
    if missing:
        kind = "per-rank" if per_rank(saved) else "another"
        return f"the checkpoint holds {kind} dataloader state ({', '.join(sorted(saved)[:3])}), not {sorted(missing)}"
    return None


class FusedQKVModelWrapper(ModelWrapper):
    """torchtitan's model state, but with fused ``wqkv`` left fused: its state-dict hook (which
    redistributes wqkv to Replicate to split it) is bypassed, and ucp_dcp's ``Fused`` rule writes the
    local shards as ``wq``/``wk``/``wv`` atoms. On load the fused key arrives directly, so the merge
    hook has nothing to merge."""

    def _get_state_dict(self) -> dict[str, Any]:
        with _without_qkv_split_hooks(self.model):
            return super()._get_state_dict()


@contextlib.contextmanager
def _without_qkv_split_hooks(models: list[nn.Module]) -> Iterator[None]:
    removed: list[tuple[nn.Module, int, Any]] = []
    split = qkv_split_hook()
    for model in models:
        for m in model.modules():
            if isinstance(m, FusedQKVLinear):
                for hid, hook in list(state_dict_hooks(m).items()):
                    if hook is split:
                        removed.append((m, hid, hook))
                        del state_dict_hooks(m)[hid]
    try:
        yield
    finally:
        for m, hid, hook in removed:
            state_dict_hooks(m)[hid] = hook


def fused_qkv_rules(model_parts: list[nn.Module]) -> list[Fused]:
    """One ``Fused`` rule per distinct fused-QKV geometry (identical on every rank: each rank's
    geometries are gathered, since a pipeline stage sees only its own layers)."""
    shapes = set()
    for model in model_parts:
        for m in model.modules():
            if isinstance(m, FusedQKVLinear):
                hd, hpk = m.head_dim, m.heads_per_kv
                n_kv = m.wqkv.weight.shape[0] // (m.r_dim * hd)
                shapes.add((n_kv, hpk, hd))
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(shapes))
        shapes = {tuple(s) for g in gathered for s in g}
    if len(shapes) > 1:
        raise PatternError(
            f"fused QKV modules with different geometries {sorted(shapes)} are not supported by "
            "fused_qkv_atoms; declare one Fused rule per geometry in checkpoint.rules"
        )
    rules = []
    for n_kv, hpk, hd in sorted(shapes):
        rules.append(
            Fused(
                r"(.*)\.qkv_linear\.wqkv\.(weight|bias)",
                [
                    (r"\1.qkv_linear.wq.\2", n_kv * hpk * hd),
                    (r"\1.qkv_linear.wk.\2", n_kv * hd),
                    (r"\1.qkv_linear.wv.\2", n_kv * hd),
                ],
                blocks=n_kv,  # group-major: per KV head, its query heads then its key and value head
            )
        )
    return rules


def _write_single_file_index(folder: str) -> None:
    """``model.safetensors.index.json`` for a one-file export too, as torchtitan's own HF save writes
    (torchtitan recognises a step folder by ``.metadata`` or this index)."""
    from ..sources.hf.safetensors import read_header
    from ..sources.hf.source import INDEX, SINGLE

    single = os.path.join(folder, SINGLE)
    if os.path.exists(os.path.join(folder, INDEX)) or not os.path.exists(single):
        return
    st = read_header(single)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in st.tensors.values())},
        "weight_map": {name: SINGLE for name in sorted(st.tensors)},
    }
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f, indent=2)


def _with_storage(kwargs: dict[str, Any], key: str, cls: type) -> dict[str, Any]:
    """Our storage for a local ``checkpoint_id`` that came without one: checksums, atomic commit,
    safe opening (torchtitan passes ``storage_writer=None`` unless it writes Hugging Face files)."""
    cid = kwargs.get("checkpoint_id")
    if kwargs.get(key) is None and cid is not None and "://" not in str(cid):
        kwargs[key] = cls(cid)
    return kwargs


class _PlannerDCP:
    """Stands in for the ``dcp`` module inside torchtitan's checkpointer for one call, adding our
    planner and storage to ``save``/``async_save``/``load``; everything else is the real module."""

    def __init__(self, real: Any, save: Any, load: Any) -> None:
        self._real, self._save, self._load = real, save, load

    def save(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("planner", self._save())
        return self._real.save(*args, **_with_storage(kwargs, "storage_writer", UCPFileSystemWriter))

    def async_save(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("planner", self._save())
        return self._real.async_save(*args, **_with_storage(kwargs, "storage_writer", UCPFileSystemWriter))

    def load(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("planner", self._load())
        return self._real.load(*args, **_with_storage(kwargs, "storage_reader", UCPFileSystemReader))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _dcp_planners(save: Any = None, load: Any = None) -> Iterator[None]:
    real = tt_dcp.dcp
    tt_dcp.dcp = _PlannerDCP(real, save or (lambda: None), load or (lambda: None))
    try:
        yield
    finally:
        tt_dcp.dcp = real
