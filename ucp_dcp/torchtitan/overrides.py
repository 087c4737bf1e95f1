"""torchtitan ``--override.imports`` entries: switch a stock config to ucp_dcp with one flag::

    --override.imports ucp_dcp.torchtitan.overrides.checkpointer,ucp_dcp.torchtitan.overrides.dataloader

``checkpointer`` swaps ``CheckpointManager`` for ``UCPCheckpointManager`` (manager options as JSON
kwargs: ``'ucp_dcp.torchtitan.overrides.checkpointer={"dataloader_policy": "restart"}'``);
``dataloader`` swaps torchtitan's text loader for the global-cursor loader that resumes at any
data-parallel degree; ``interleaved_dataloader`` does the same for torchtitan's interleaved text loader
(``InterleavedHuggingFaceTextDataLoader``, weighted mixing of several sources). torchtitan names one
override per entry, so a job lists the ones it wants; each can be used alone.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.config import derive, override
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, InterleavedHuggingFaceTextDataLoader

from .dataloader import GlobalCursorTextDataLoader
from .interleave import InterleavedGlobalCursorDataLoader
from .manager import UCPCheckpointManager


@override(target=CheckpointManager.Config, exact=True, description="ucp_dcp: reshardable checkpoints")
def checkpointer(cfg: CheckpointManager.Config, **options: Any) -> UCPCheckpointManager.Config:
    return derive(cfg, UCPCheckpointManager.Config, **options)


@override(target=HuggingFaceTextDataLoader.Config, exact=True, description="ucp_dcp: global-cursor dataloader")
def dataloader(cfg: HuggingFaceTextDataLoader.Config) -> GlobalCursorTextDataLoader.Config:
    return derive(cfg, GlobalCursorTextDataLoader.Config)


@override(
    target=InterleavedHuggingFaceTextDataLoader.Config,
    exact=True,
    description="ucp_dcp: global-cursor interleaved dataloader",
)
def interleaved_dataloader(
    cfg: InterleavedHuggingFaceTextDataLoader.Config,
) -> InterleavedGlobalCursorDataLoader.Config:
    return derive(cfg, InterleavedGlobalCursorDataLoader.Config)
