"""The memory tier in ``UCPCheckpointManager``: saves into host memory every ``memory_interval`` steps,
beside torchtitan's durable saves on ``interval``, and a resume from the freshest complete tier.

A memory save is :meth:`ucp_dcp.memory.MemoryTier.save` of the same flattened states and with the same
save planner (rules, strict mode, data slot) as the manager's durable save: training waits for the copy
into host memory, the replicas to other hosts follow in the background (docs/memory.md). Every
``memory_drain_every``-th memory generation is then drained, still in the background, into the
checkpoint folder as torchtitan's ``step-N`` folder (local or ``s3://``; same data files and sidecar,
same commit point as a durable save): a disk copy without training waiting for it, which torchtitan's
resume, ``load(step=N)`` and ``keep_latest_k`` see as one of its own steps. A step the manager saved
durably itself is not drained (its folder is already the checkpoint), nor is any folder that is already
committed. torchtitan's own ``step-N`` saves on ``interval`` are unchanged.

``load(step=-1)`` (torchtitan's resume) compares the freshest complete memory generation's step with
the newest durable ``step-N`` and loads the fresher one (memory on a tie: it is the faster read), at
any layout, with the manager's load planner and dataloader policy. An explicit ``load(step=N)`` and
first loads (``initial_load_path``, Hugging Face) are torchtitan's, from storage.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointNotFoundError, InvalidArgumentError
from ..memory import MemoryTier, Source, locate
from ..memory import load as memory_load
from ..memory.reader import MemoryReader
from ..memory.store import default_root
from ..memory.tier import Staging
from ..planning.checkpoint_group import dcp_group

__all__ = ["ManagerMemory", "memory_root"]

logger = logging.getLogger(__name__)


def memory_root(configured: str, folder: str) -> str:
    """The manager's memory store: ``configured``, else one folder per checkpoint folder under the
    default root (two jobs on a host with different checkpoint folders never share generations)."""
    if configured:
        return configured
    return os.path.join(default_root(), "tt-" + xxhash.xxh3_64_hexdigest(os.path.abspath(folder).encode()))


class ManagerMemory:
    """A manager's memory tier (collective to create: every rank of the job).

    Args:
        interval: save into host memory every ``interval`` steps (>= 1).
        root: the memory store (:func:`memory_root`).
        replicas: k, copies of each host's pieces on other hosts.
        folder: the checkpoint folder memory generations are drained to as ``step-N`` (None: no drain).
        drain_every: drain every n-th memory generation (0: none).
        control: the tier's collectives on control groups (``checkpoint.control_group``; None: the environment).
    """

    def __init__(
        self,
        interval: int,
        root: str,
        replicas: int,
        folder: str | None = None,
        drain_every: int = 1,
        control: bool | None = None,
        staging: Staging = "buffered",
    ) -> None:
        if interval < 1:
            raise InvalidArgumentError(f"checkpoint.memory_interval must be >= 1 to use the tier, got {interval}")
        self.interval = interval
        self.root = root
        drain = folder is not None and drain_every > 0
        self.tier = MemoryTier(
            root,
            replicas=replicas,
            durable=folder if drain else None,
            drain_layout="step",
            drain_every=max(1, drain_every),
            control_group=control,
            staging=staging,
        )
        self.control = control
        self.loaded: Source | None = None
        """What the last resume from memory loaded (None: it was not from memory)."""

    def due(self, load_only: bool, step: int, last_step: bool) -> bool:
        """Is a memory save due at this step (not at the last step: the job ends there; not in a
        load-only job)?"""
        return not load_only and not last_step and step % self.interval == 0

    def save(self, states: dict[str, Any], planner: Any, step: int, drain: bool = True) -> None:
        """Copy ``states`` into host memory (collective); replicas and the drain (unless ``drain`` is
        False: the manager saved this step durably) follow in the background."""
        gen = self.tier.save(states, planner=planner, step=step, drain=drain)
        logger.info(f"UCP memory tier: step {step} is generation {gen} ({self.tier.blocked_s:.2f} s blocked)")

    def in_flight(self) -> set[str]:
        """The ``step-N`` folders a drain may be writing now or soon (keep_latest_k must not purge them)."""
        if self.tier.target is None:
            return set()
        return {f"step-{step}" for step in self.tier.busy_steps if step is not None}

    def fresher_than(self, durable_step: int) -> Source | None:
        """The freshest complete memory generation when it is at least as fresh as ``durable_step`` (memory
        wins a tie: the faster read); None when the durable copy should be loaded (collective)."""
        self.tier.wait()  # a generation of this job still completing counts
        try:
            src = locate(self.root, None, dcp_group(None, self.control))
        except CheckpointNotFoundError as e:
            logger.info(f"UCP memory tier: nothing to resume from in memory ({e.message.splitlines()[0]})")
            return None
        if src.step is None or src.step < durable_step:
            logger.info(f"UCP memory tier: memory step {src.step} is older than durable step {durable_step}")
            return None
        return src

    def metadata(self, src: Source) -> Callable[[], Metadata]:
        """The generation's metadata, for the manager's dataloader policy."""
        return MemoryReader(src, self.root).metadata_for_load

    def load(self, states: dict[str, Any], planner: Any, src: Source, durable: bool) -> bool:
        """Load ``src`` into ``states`` (collective). False when every memory copy of a piece was found
        damaged during the load and ``durable`` (a durable step exists: the manager loads it over the
        partly loaded states); without one, the error is raised (a fresh start would keep them)."""
        try:
            self.loaded = memory_load(states, self.root, planner=planner, source=src, control_group=self.control)
        except CheckpointNotFoundError as e:
            if not durable:
                raise
            logger.warning(f"UCP memory tier: step {src.step} not loadable from memory: {e.message.splitlines()[0]}")
            return False
        logger.info(f"UCP memory tier: resumed step {src.step} from {self.loaded.describe()}")
        return True

    def close(self) -> None:
        self.tier.close()
