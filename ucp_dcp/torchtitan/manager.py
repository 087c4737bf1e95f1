"""``UCPCheckpointManager``: torchtitan's DCP checkpoint manager with ucp_dcp's planners.

Every stock feature is kept (async modes, ``keep_latest_k``, ``load_step``, ``exclude_from_loading``,
seed checkpoints, last-step model-only exports), on a local folder or an object store
(``--checkpoint.folder s3://bucket/run``): the manager overrides torchtitan's ``dcp_save``/``dcp_load``,
through which torchtitan makes every DCP call, with the same calls plus the UCP planners and storage.

Hugging Face folders (``initial_load_in_hf``, ``last_save_in_hf``) go through ucp_dcp's HF path
(:mod:`ucp_dcp.torchtitan.manager_hf`), not torchtitan's state-dict adapter. The other parts of the
manager sit beside it: the fused-QKV atoms (:mod:`ucp_dcp.torchtitan.fused_qkv`), the planners and
storage in the manager's DCP calls (:mod:`ucp_dcp.torchtitan.planner_dcp`), the step folders found and
purged by their commit point (:mod:`ucp_dcp.torchtitan.step_folders`) and the dataloader
policy (:mod:`ucp_dcp.torchtitan.loader_policy`); this module holds the class, its options and the rules
each save or load declares.

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
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import MODEL

from ..errors import InvalidArgumentError, PatternError
from ..layout.patterns import Reduce, Rule, anchored_in, rule_from_json
from ..memory.tier import Staging
from ..planning.load_planner import UCPLoadPlanner
from ..planning.save_planner import CheckMode, UCPSavePlanner
from ..storage.opening import read_metadata
from ._compat import find_load_step, flattened_model_states_sd, should_purge, states_to_load
from .fused_qkv import FusedQKVModelWrapper, fused_qkv_rules, without_qkv_split_hooks
from .loader_policy import DataloaderPolicy, apply_dataloader_policy
from .manager_hf import load_hf, save_hf
from .memory_tier import ManagerMemory, memory_root
from .moe import moe_rules
from .planner_dcp import check_dcp_paths, ucp_dcp_load, ucp_dcp_save, ucp_reader
from .step_folders import step_folders

__all__ = ["UCPCheckpointManager", "FusedQKVModelWrapper", "fused_qkv_rules", "rules_for_call"]

logger = logging.getLogger(__name__)

NtokensSeen = Literal["sum", "off"]
"""``ntokens_seen``: sum the per-rank counts over data-parallel slots at save, or leave them alone."""


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
        control_group: bool = True
        """Synchronous saves and loads run DCP's collectives through the job's store
        (:mod:`ucp_dcp.planning.control_group`): a rank that dies ends the others with a
        ``PeerLostError`` within ``UCP_DCP_PEER_TIMEOUT_S``, not the process group's timeout.
        ``UCP_DCP_CONTROL_GROUP=off`` turns it off too. Async saves keep the manager's gloo group."""
        memory_interval: int = 0
        """Save into host memory (ucp_dcp's memory tier, docs/memory.md) every this many steps, beside
        the durable saves on ``interval``; a resume (``load(step=-1)``) takes the fresher of the newest
        complete memory generation and the newest durable step. 0: no memory tier."""
        memory_replicas: int = 1
        """Copies of each host's pieces of a memory save on other hosts (k: any k lost hosts lose none)."""
        memory_root: str = ""
        """The memory store; empty: ``$UCP_DCP_SHM_ROOT`` (default ``/dev/shm/ucp_dcp``) plus one folder per
        checkpoint folder."""
        memory_drain_every: int = 1
        """Drain every n-th memory generation, in the background, into the checkpoint folder as its
        ``step-N`` folder (local or object store; a step saved durably at the same step is not drained).
        0: none (the durable copies are the ``interval`` saves only)."""
        memory_staging: Staging = "buffered"
        """What a memory save after the first blocks training for (``MemoryTier(staging=)``): ``buffered``,
        a copy into host buffers kept between saves (a state-sized copy per rank held), the write into
        host memory in the background; ``direct``, the whole save into host memory, no buffers kept."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)  # a slots dataclass: no zero-argument super()
            for name, mode in (
                ("ntokens_seen", NtokensSeen),
                ("dataloader_policy", DataloaderPolicy),
                ("check_replicas", CheckMode),
                ("memory_staging", Staging),
            ):
                if getattr(self, name) not in get_args(mode):
                    raise InvalidArgumentError(
                        f"checkpoint.{name} must be one of {get_args(mode)}, got {getattr(self, name)!r}"
                    )
            if self.memory_interval < 0 or self.memory_replicas < 0 or self.memory_drain_every < 0:
                raise InvalidArgumentError(
                    "checkpoint.memory_interval, memory_replicas and memory_drain_every must be >= 0, got "
                    f"{self.memory_interval}, {self.memory_replicas} and {self.memory_drain_every}"
                )

    def __init__(self, config: Config, **kwargs: Any) -> None:
        check_dcp_paths(CheckpointManager)  # no torchtitan save/load path left to DCP's defaults
        model_parts = kwargs["model_parts"]
        # the stock ModelWrapper built by the parent caches a state dict: without the split hook,
        # building it does not all-gather wqkv either
        with without_qkv_split_hooks(model_parts if config.fused_qkv_atoms else []):
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
        self._memory = (
            ManagerMemory(
                config.memory_interval,
                memory_root(config.memory_root, self.folder),
                config.memory_replicas,
                folder=self.folder,
                drain_every=config.memory_drain_every,
                staging=config.memory_staging,
                control=False if not config.control_group else None,  # on: unless $UCP_DCP_CONTROL_GROUP says off
            )
            if config.memory_interval
            else None
        )

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
            except (ValueError, TypeError, PatternError) as e:
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

    # the memory tier beside torchtitan's own saves and resume (ucp_dcp.torchtitan.memory_tier)
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        memory = getattr(self, "_memory", None)
        if memory is None or not memory.due(self.load_only, curr_step, last_step):
            return saved
        states = flattened_model_states_sd(self)
        memory.save(states, self._save_planner(self._call_rules(states)), curr_step, drain=not saved)
        if not saved:  # keep_latest_k counts the drains committed by now; one still in flight (a staged save
            # does not wait for the previous generation's drain) is counted by a later purge, at the latest at close
            self._purge_stale_checkpoints()
        return True

    def _load(self, step: int = -1) -> bool:
        folders = step_folders(self.folder)
        if folders is not None:
            folders.forget_listings()  # torchtitan's exists/isdir checks share the fsspec client's cache
        memory = getattr(self, "_memory", None)
        durable = find_load_step(self) if memory is not None and step == -1 else -1
        src = memory.fresher_than(durable) if memory is not None and step == -1 else None
        if memory is not None and src is not None:
            states = self._apply_dataloader_policy(states_to_load(self, model_only=False), memory.metadata(src))
            if memory.load(states, self._load_planner(self._call_rules(states)), src, durable >= 0):
                if MODEL in self.states:
                    self.states[MODEL].load_state_dict(states)
                return True
        return super()._load(step)

    def _close(self) -> None:
        memory = getattr(self, "_memory", None)
        if memory is not None:
            memory.close()  # the last drains commit
            self._memory = None
            self._purge_stale_checkpoints()  # while torchtitan's purge thread still runs: keep_latest_k holds at the end
        super()._close()

    # torchtitan saves and loads only through these two (check_dcp_paths refuses a release that does not):
    # each makes torchtitan's own DCP calls with our planner and storage, patching nothing global
    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf:
            return save_hf(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection)
        planner = self._save_planner(self._call_rules(state_dict))
        return ucp_dcp_save(self, state_dict, checkpoint_id, async_mode, planner, enable_garbage_collection)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            return load_hf(self, state_dict, checkpoint_id, from_quantized)
        reader = ucp_reader(checkpoint_id)  # one opening of the metadata per rank for the check and the load
        opened = reader.metadata_for_load if reader is not None else functools.partial(read_metadata, checkpoint_id)
        state_dict = self._apply_dataloader_policy(state_dict, opened)
        return ucp_dcp_load(self, state_dict, checkpoint_id, self._load_planner(self._call_rules(state_dict)), reader)

    # step folders (torchtitan 0.3's hooks): discovery and keep_latest_k by commit point, fresh listings on a
    # store (ucp_dcp.torchtitan.step_folders, also forgotten at _load); a protocol ucp_dcp does not write to
    # keeps torchtitan's own
    def _find_load_step(self, folder: str = "") -> int:
        folders = step_folders(folder or self.folder)
        return super()._find_load_step(folder) if folders is None else folders.latest()

    def _purge_stale_checkpoints(self) -> None:
        folders = step_folders(self.folder)
        if folders is None:
            return super()._purge_stale_checkpoints()
        folders.forget_listings()
        if not should_purge(self):
            return
        memory = getattr(self, "_memory", None)
        draining = memory.in_flight() if memory is not None else set()
        for name in folders.stale(self.keep_latest_k):
            if name in draining:
                continue  # the memory tier's drain is writing it (a later purge takes it if it is stale then)
            folders.decommit(name)  # not a checkpoint from here on; the purge thread deletes the rest
            self.purge_queue.put(folders.join(name))

    def _apply_dataloader_policy(self, state_dict: dict[str, Any], metadata: Callable[[], Metadata]) -> dict[str, Any]:
        """``state_dict`` checked against the checkpoint's dataloader state (:mod:`.loader_policy`)."""
        return apply_dataloader_policy(state_dict, metadata, self.ucp.dataloader_policy)


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
