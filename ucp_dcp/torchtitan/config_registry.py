"""torchtitan config registry: ``--module ucp_dcp.torchtitan --config <name>``.

* ``llama3_debugmodel_ucp``: torchtitan's llama3 debug model with ``UCPCheckpointManager`` and the
  global-cursor dataloader -- the one entry for users, to try the option.
* :func:`with_ucp`: the same for any torchtitan config, for a registry entry of your own whose
  options are ordinary ``--checkpoint.*`` flags (``def llama3_8b_ucp(): return with_ucp(llama3_8b())``).
  Without one, ``--override.imports ucp_dcp.torchtitan.overrides.checkpointer`` turns the option on for
  any stock config.

The CPU-sized models and configs the tests and recipes run are fixtures of the checkout's development package
(not shipped): ``--module ucp_dev.testing`` (``dev/ucp_dev/testing/config_registry.py``, docs/torchtitan.md).
"""

from __future__ import annotations

from typing import Any

from torchtitan.config import derive
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from .dataloader import GlobalCursorTextDataLoader
from .manager import UCPCheckpointManager

__all__ = ["llama3_debugmodel_ucp", "with_ucp"]


def with_ucp(cfg: Any) -> Any:
    """torchtitan Trainer config ``cfg`` with its checkpointer derived into ``UCPCheckpointManager`` and its
    text dataloader into ``GlobalCursorTextDataLoader`` (every stock option kept)."""
    cfg.checkpoint = derive(cfg.checkpoint, UCPCheckpointManager.Config)
    cfg.dataloader = derive(cfg.dataloader, GlobalCursorTextDataLoader.Config)
    return cfg


def llama3_debugmodel_ucp() -> Any:
    return with_ucp(llama3_debugmodel())
