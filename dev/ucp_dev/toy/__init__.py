"""The small decoder-only transformer of the recipes and tests, and its pp x dpr x dp x ep x tp trainer.

Not part of the checkpointing library proper: no core ucp_dcp module imports it (``ucp_dcp.tools.dryrun``
may). It is the one copy of the model and trainer the recipes (``recipes/elastic_resume.py``), the
multi-process tests and ``python -m ucp_dcp plan --target recipe`` use:

* :mod:`.model`: the model (every layout ucp_dcp's patterns describe) and its logical parameters,
* :mod:`.parallel`: topologies, meshes, parallelization, the training step and the oracle
  (:func:`logical_state`, independent of ucp_dcp); ``build_trainer(..., device="meta")`` builds a
  rank's state-dict structure without weights,
* :mod:`.layouts`: the pattern rules and index maps that describe its layouts to ucp_dcp.
"""

from __future__ import annotations

from .layouts import trainer_options, ucp_options
from .model import ModelConfig, StageModel, logical_params
from .parallel import (
    GLOBAL_BATCH,
    Job,
    Topology,
    Trainer,
    build_job,
    build_trainer,
    global_batch,
    layer_split,
    live_logits,
    logical_state,
    my_stages,
    stage_ids,
    train_step,
)

__all__ = [
    "GLOBAL_BATCH",
    "Job",
    "ModelConfig",
    "StageModel",
    "Topology",
    "Trainer",
    "build_job",
    "build_trainer",
    "global_batch",
    "layer_split",
    "live_logits",
    "logical_params",
    "logical_state",
    "my_stages",
    "stage_ids",
    "train_step",
    "trainer_options",
    "ucp_options",
]
