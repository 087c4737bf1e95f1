"""``ucp_dcp.sources.hf.load_hf``: an HF folder into any layout in one call (``dcp.load`` underneath)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE

from ...errors import UnverifiedCheckpointWarning, ucp_errors
from ...planning.load_planner import UCPLoadPlanner
from ...storage.reader import ReadStats
from .mapping import HFMapping, zero_fill
from .source import HFStorageReader

__all__ = ["load_hf"]


def load_hf(
    state_dict: STATE_DICT_TYPE,
    path: str | os.PathLike,
    mapping: HFMapping,
    *,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int | None = None,
    quiet: bool = False,
    **planner_options: Any,
) -> ReadStats:
    """Load the Hugging Face folder ``path`` into ``state_dict`` in place (collective), at its layout.

    ``mapping`` names the HF tensors' atoms (e.g. :func:`ucp_dcp.torchtitan.mappings.hf_mapping`); ``planner_options`` go to
    :class:`~ucp_dcp.UCPLoadPlanner` (the target's ``patterns``, ``stage_map``, ``expert_map``,
    ``allow_partial_load`` for target weights HF does not have...). ``quiet``: do not warn that
    safetensors carries no checksums. Returns this rank's I/O figures.

    The mapping's :attr:`~HFMapping.zero` entries (state HF has no tensor for, e.g. torchtitan's
    ``expert_bias_E``) are set to zero, not read: HF's model is the target's with them at zero.
    """
    state_dict, _ = zero_fill(state_dict, mapping)
    reader = HFStorageReader(path, mapping, thread_count=thread_count)
    with ucp_errors(), warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
        dcp.load(
            state_dict, storage_reader=reader, planner=UCPLoadPlanner(**planner_options), process_group=process_group
        )
    return reader.stats
