"""The small decoder-only transformer of the recipes and tests, and its pp x dpr x dp x ep x tp trainer.

Not part of the checkpointing library: it lives in the checkout's development package (``dev/``, not in the
``ucp-dcp`` wheel), and no ucp_dcp module imports it. It is the one copy of the model and trainer the recipes
(``recipes/elastic_resume.py``), the multi-process tests and ``python -m ucp_dcp plan --target
ucp_dev.toy.plan_target:target`` (:mod:`.plan_target`) use:

* :mod:`.model`: the model (every layout ucp_dcp's patterns describe) and its logical parameters,
* :mod:`.parallel`: topologies, meshes, parallelization, the training step and the oracle
  (:func:`logical_state`, independent of ucp_dcp); ``build_trainer(..., device="meta")`` builds a
  rank's state-dict structure without weights,
* :mod:`.layouts`: the pattern rules and index maps that describe its layouts to ucp_dcp,
* :mod:`.plan_target`: the model at any topology as a target of ``ucp_dcp plan`` (imported on its own: it is
  not re-exported here).
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
