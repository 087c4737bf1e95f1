"""The job an ``export --to torchtitan`` loads into and writes from: the resuming job's own flags, at world size 1.

The export builds what torchtitan's Trainer would (and what torchtitan builds for a seed checkpoint): the
model with real CPU tensors and no parallelism, its optimizers with their state (torchtitan's zero step)
and LR schedulers, from the flags of the job that will resume (:func:`parse_flags`), after checking those
flags accept the data-parallel degree asked for (:func:`check_degree`). :func:`mapping_from_flags` reads
the same flags for ``export --to hf --mapping torchtitan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UCPError
from .job import TrainState, job_config, parse_job

__all__ = ["HINT_FLAGS", "Job", "build_job", "check_degree", "mapping_from_flags", "parse_flags"]

HINT_FLAGS = (
    "give the job's own torchtitan flags after the export's, e.g. --module llama3 --config "
    "llama3_debugmodel --hf_assets_path ... --dataloader.dataset_path ... --training.seq_len ..."
)


def parse_flags(argv: list[str]) -> Any:
    """The resuming job's config from its torchtitan flags (``--module`` and ``--config`` required)."""
    if not any(a == "--module" or a.startswith("--module=") for a in argv):
        raise UCPError("export --to torchtitan needs the job's --module and --config", hint=HINT_FLAGS)
    return parse_job(argv, HINT_FLAGS)


@dataclass
class Job:
    """The training objects the export loads the checkpoint into and writes from (one process)."""

    model: Any
    """The whole model, real CPU tensors."""
    optimizers: Any
    """torchtitan's ``OptimizersContainer``, its state created by the zero step."""
    lr_schedulers: Any
    """torchtitan's ``LRSchedulersContainer``."""
    train_state: TrainState
    """The Trainer's ``train_state`` entry (step, ntokens_seen)."""


def build_job(cfg: Any) -> Job:
    """Model (real CPU tensors, no parallelism), optimizers with their state, LR schedulers, as the
    Trainer builds them (and as torchtitan builds its seed checkpoint)."""
    from torchtitan.components.optimizer.utils import init_optim_state
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import utils as tt_utils

    mc = cfg.model_spec.model
    with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[cfg.training.dtype]):
        model = mc.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizers = cfg.optimizer.build(model_parts=[model])
    lr_schedulers = cfg.lr_scheduler.build(optimizers=optimizers, training_steps=cfg.training.steps)
    for optim in optimizers.optimizers:
        init_optim_state(optim)
    return Job(model, optimizers, lr_schedulers, TrainState())


def check_degree(config: Any, dp: int) -> None:
    """``dp`` against the job's flags: an explicit data-parallel degree must agree, and torchtitan
    must accept the batch sizes at ``dp`` (it refuses a global batch that is not a multiple of the
    local batch times the data-parallel degree)."""
    P, T = config.parallelism, config.training
    shard, rep = int(P.data_parallel_shard_degree), int(P.data_parallel_replicate_degree)
    if shard > 0 and shard * rep != dp:
        raise UCPError(
            f"the job's flags give data-parallel degree {shard * rep} (dp_replicate {rep} x dp_shard "
            f"{shard}), --dp says {dp}",
            saved=shard * rep,
            wanted=dp,
            hint="give the flags of the job that will resume, or leave its dp_shard at -1",
        )
    gbs = T.global_batch_size if T.global_batch_size > 0 else T.local_batch_size * dp
    if gbs % (T.local_batch_size * dp):
        raise UCPError(
            f"global batch size {gbs} is not a multiple of local batch size {T.local_batch_size} x "
            f"data-parallel degree {dp}: torchtitan refuses that job",
            wanted=dp,
            hint="--training.global_batch_size / --training.local_batch_size of the job that will resume",
        )


def mapping_from_flags(argv: list[str]) -> Any:
    """:func:`~ucp_dcp.torchtitan.mappings.hf_mapping` of the model a torchtitan job's flags describe
    (``--module llama3 --config llama3_8b ...``; ``export --to hf --mapping torchtitan``)."""
    from .mappings import hf_mapping

    return hf_mapping(job_config(parse_flags(argv), unsharded=True).model_spec.model)
