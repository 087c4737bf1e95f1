"""``UCPCheckpointManager``'s Hugging Face path: ``initial_load_in_hf`` and ``last_save_in_hf``.

Hugging Face folders go through ucp_dcp's HF path (:mod:`ucp_dcp.torchtitan.mappings` maps llama3, qwen3,
qwen3 MoE and deepseek_v3 models), not torchtitan's state-dict adapter:

* load (:func:`load_hf`): :class:`~ucp_dcp.sources.hf.HFStorageReader` presents the folder as atoms and
  ``UCPLoadPlanner`` fills the live (sharded) state from them -- the fused ``wqkv`` local shards straight
  from the separate q/k/v tensors, rotary rows permuted on the way, each rank reading only the byte ranges
  its shards need; no all-gather and no full tensor. An MoE model's ``expert_bias_E`` (no HF tensor) is set
  to zero (:mod:`ucp_dcp.torchtitan.hf_moe`). Quantized HF checkpoints are refused;
* save (:func:`save_hf`): the model state is saved as a ucp_dcp checkpoint in a temporary sibling folder,
  exported collectively (:func:`~ucp_dcp.sources.hf.publish.export_hf`, box by box, every rank a share)
  into the checkpoint folder, and the temporary folder is removed. Files are sharded by size
  (``hf_max_shard_bytes``); the adapter's ``fqn_to_index_mapping`` is not followed.

(Deferring to the stock HF path with ``fused_qkv_atoms`` on would drop q/k/v silently: the stock
adapter skips the fused ``wqkv`` key.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torchtitan.components.checkpointer import AsyncMode
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.tools.utils import GarbageCollection

from ..errors import UCPError, ucp_errors
from ..layout.patterns import Rule, Tied
from ..planning.load_planner import UCPLoadPlanner
from ..planning.save_planner import UCPSavePlanner
from ..storage.writer import UCPFileSystemWriter
from .mappings import hf_mapping, tied_rules
from .moe import EXPERT_BIAS

__all__ = ["HFManager", "hf_model_config", "load_hf", "save_hf"]

logger = logging.getLogger("ucp_dcp.torchtitan.manager")  # the manager's messages, under its name


class HFManager(Protocol):
    """What the HF path uses of :class:`~ucp_dcp.torchtitan.manager.UCPCheckpointManager`."""

    ucp: Any
    """The manager's ``Config`` (``hf_max_shard_bytes``)."""
    states: dict[str, Any]
    """torchtitan's states; the model's is filled after a load."""
    sd_adapter: Any
    """torchtitan's state-dict adapter (its ``model_config``), or None."""
    _model_parts: list[nn.Module]
    """The model parts (their ``config`` when there is no adapter)."""
    hf_load_stats: Any
    """Set by :func:`load_hf`: the reader's ``ReadStats``."""
    hf_save_stats: Any
    """Set by :func:`save_hf`: the export's stats."""

    def _call_rules(self, state_dict: dict[str, Any]) -> list[Rule]: ...

    def _load_planner(self, rules: list[Rule]) -> UCPLoadPlanner: ...

    def _save_planner(self, rules: list[Rule]) -> UCPSavePlanner: ...


def hf_model_config(manager: HFManager) -> Any:
    """The model config a mapping is made from: the state-dict adapter's, else the model's own."""
    adapter_cfg = getattr(manager.sd_adapter, "model_config", None)
    if adapter_cfg is not None:
        return adapter_cfg
    cfg = getattr(manager._model_parts[0], "config", None)
    if cfg is None:
        raise UCPError(
            "a Hugging Face load or save needs the model config (from the state-dict adapter or the model's config)",
            hint="build the manager with the model's sd_adapter, as the Trainer does",
        )
    return cfg


def _hf_rules(manager: HFManager, state_dict: dict[str, Any], model_config: Any) -> list[Rule]:
    """The call's rules, and the model's ``Tied`` rules unless the user declared one."""
    rules = manager._call_rules(state_dict)
    if not any(isinstance(r, Tied) for r in rules):
        rules += tied_rules(model_config)
    return rules


def load_hf(manager: HFManager, state_dict: dict[str, Any], checkpoint_id: str, from_quantized: bool) -> None:
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
    cfg = hf_model_config(manager)
    mapping = hf_mapping(cfg)
    reader = HFStorageReader(checkpoint_id, mapping)
    # HF has no load-balancing bias: HF's router is ours with it at zero (ucp_dcp.torchtitan.hf_moe)
    to_load, zeroed = zero_fill(state_dict, mapping)
    rules = _hf_rules(manager, to_load, cfg)
    if zeroed:  # not loaded: its Replicated rule would match nothing
        rules = [r for r in rules if getattr(r, "pattern", None) != EXPERT_BIAS]
    with ucp_errors():
        dcp.load(to_load, storage_reader=reader, planner=manager._load_planner(rules))
    manager.states[MODEL].load_state_dict(state_dict)
    manager.hf_load_stats = reader.stats
    logger.info(
        "UCP: loaded Hugging Face %s (%s mapping) in %.2fs, %d bytes read by this rank",
        checkpoint_id,
        mapping.name,
        time.monotonic() - begin,
        reader.stats.bytes_read,
    )


def save_hf(
    manager: HFManager, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any, enable_garbage_collection: bool
) -> None:
    """Write the model state as a Hugging Face folder at ``checkpoint_id`` (collective; see module
    doc). torchtitan casts the state to ``export_dtype`` before the call; the files keep it."""
    from ..sources.hf.publish import export_hf

    if async_mode != AsyncMode.DISABLED:
        logger.warning("UCP: a Hugging Face save is written synchronously (async_mode %s ignored)", async_mode)
    begin = time.monotonic()
    cfg = hf_model_config(manager)
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
        planner = manager._save_planner(_hf_rules(manager, state_dict, cfg))
        with ucp_errors():
            dcp.save(state_dict, storage_writer=UCPFileSystemWriter(scratch), planner=planner)
        stats = export_hf(
            scratch, checkpoint_id, mapping, max_shard_bytes=manager.ucp.hf_max_shard_bytes, overwrite=True
        )
        if coordinator:
            _write_single_file_index(checkpoint_id)
        manager.hf_save_stats = stats
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
        GarbageCollection.collect("GC collection invoked by checkpointer.")


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
