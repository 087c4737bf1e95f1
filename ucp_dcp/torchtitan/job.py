"""A torchtitan job's config from its Trainer flags, as its Trainer has it before it builds anything.

Shared by the dry run's torchtitan target (:mod:`ucp_dcp.torchtitan.plan_target`, ``plan --target titan``)
and the way back to stock torchtitan (:mod:`ucp_dcp.torchtitan.to_stock`, ``export --to torchtitan``):
torchtitan's own ``ConfigManager`` parse (:func:`parse_job`), then the model config's
``update_from_config`` and the ``--override.imports`` (:func:`job_config`), with torchtitan's notices
quieted (:func:`quiet`), and the Trainer's ``train_state`` entry (:class:`TrainState`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from ..errors import UCPError

__all__ = ["quiet", "parse_job", "job_config", "TrainState", "DEGREES"]

DEGREES = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "context_parallel_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "expert_parallel_degree",
)
"""The ``parallelism`` degrees :func:`job_config` sets to 1 for an unsharded job."""


class _Quiet(logging.Filter):
    """Drops torchtitan's log records that contain any of ``noise`` (it logs on the root logger)."""

    def __init__(self, noise: Sequence[str]) -> None:
        super().__init__()
        self.noise = tuple(noise)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in str(record.msg) for n in self.noise)


@contextlib.contextmanager
def quiet(
    noise: Sequence[str] = ("initial_load_model_only",), warned: Sequence[str] = ("set_vital",)
) -> Iterator[None]:
    """Within: torchtitan's root-logger records containing any of ``noise`` and the warnings whose message
    contains any of ``warned`` are dropped. The defaults drop the notice that ``initial_load_model_only``
    needs an ``initial_load_path`` (logged for every default config, at every parse and manager build)
    and torchdata's ``set_vital`` warning (at every loader build)."""
    root, f = logging.getLogger(), _Quiet(noise)
    root.addFilter(f)
    try:
        with warnings.catch_warnings():
            for text in warned:
                warnings.filterwarnings("ignore", message=f".*{text}.*")
            yield
    finally:
        root.removeFilter(f)


def parse_job(argv: Sequence[str], hint: str) -> Any:
    """torchtitan's ``ConfigManager`` parse of a job's flags; what it rejects is a :class:`UCPError` with ``hint``."""
    from torchtitan.config import ConfigManager

    try:
        with quiet():
            return ConfigManager().parse_args(list(argv))
    except SystemExit:  # tyro has printed its own message (unknown flag, bad value)
        raise UCPError(f"torchtitan rejected the job flags ({' '.join(argv)})", hint=hint) from None
    except (ValueError, ImportError, AssertionError, TypeError) as e:
        raise UCPError(f"torchtitan could not read the job config: {type(e).__name__}: {e}", hint=hint) from None


def job_config(config: Any, *, unsharded: bool = False) -> Any:
    """A copy of ``config`` as the Trainer has it when it starts building: the model config updated
    from the job config, then the ``--override.imports`` applied. ``unsharded``: every parallelism
    degree set to 1 first (a job at world size 1, as torchtitan's seed checkpoint is written)."""
    from torchtitan.config.override import apply_overrides

    cfg = copy.deepcopy(config)
    if unsharded:
        for name in DEGREES:
            if hasattr(cfg.parallelism, name):
                setattr(cfg.parallelism, name, 1)
    with quiet():
        cfg.model_spec.model.update_from_config(config=cfg)
        if cfg.override.imports:
            try:
                apply_overrides(cfg.override, cfg)
            except (ImportError, ValueError) as e:
                raise UCPError(f"--override.imports: {e}", hint="put the override modules on PYTHONPATH") from None
    return cfg


class TrainState(Stateful):
    """The Trainer's ``train_state`` entry: an object with the Trainer's own ``state_dict`` /
    ``load_state_dict`` (the Trainer itself cannot be built without a device and weights)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        from torchtitan.trainer import Trainer

        return Trainer.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torchtitan.trainer import Trainer

        Trainer.load_state_dict(self, state_dict)
