"""The toy LLM as a target of ``ucp_dcp plan``: the state dict and layout options ``recipes/elastic_resume.py``
loads with, at any topology (docs/plan.md). The library's ``plan`` knows nothing of this model: to it, this is a
user's job like any other.

* :func:`target`: the job as a user's function, for the command line:
  ``UCP_TOY_TOPOLOGY=pp=2,dp=512,tp=4 python -m ucp_dcp plan CKPT --target ucp_dev.toy.plan_target:target
  --world-size 4096`` (:func:`plan_command` writes that command for a topology). Its topology comes from
  ``UCP_TOY_TOPOLOGY`` (default ``dp=<world size>``), ModelConfig overrides from ``UCP_TOY_MODEL``
  (``ffn_dim=56,n_layers=6``: a model change). It builds one rank per (pipeline stage, expert-parallel rank)
  and rebinds it to the others (``plan_symmetry``): a rebound rank takes its class's options.
* :class:`RecipeTarget`: the same as a :class:`ucp_dcp.tools.dryrun.Target` object, for ``plan_load`` in Python
  (the tests): one rank per pipeline stage, each rank's own options.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ucp_dcp.errors import UCPError

from .layouts import ucp_options
from .model import ModelConfig
from .parallel import Topology, build_job, build_trainer

__all__ = ["RecipeTarget", "TARGET", "model_config", "plan_command", "target"]

TARGET = "ucp_dev.toy.plan_target:target"
"""``plan --target`` of :func:`target`."""
TOPOLOGY_ENV = "UCP_TOY_TOPOLOGY"
MODEL_ENV = "UCP_TOY_MODEL"


@dataclass
class RecipeTarget:
    """The recipe's toy LLM (:mod:`ucp_dev.toy`) at a topology string such as
    ``pp=2,dp=512,tp=4``: the state dict and layout options ``recipes/elastic_resume.py`` loads with."""

    topology: str
    name: str = ""
    cfg: Any = None
    """The model's ``ucp_dev.toy.ModelConfig`` (default: the recipe's)."""
    device: str | None = "cuda"
    """Its layouts stand for GPU jobs (the toy itself runs on CPUs, but ``plan`` sizes the load of the layout)."""

    def __post_init__(self) -> None:
        try:
            self.topo = Topology.parse(self.topology)
        except ValueError as e:
            raise UCPError(f"topology {self.topology!r}: {e}") from None
        self.cfg = self.cfg or ModelConfig()
        self.world_size = self.topo.world
        self.name = self.name or f"recipe {self.topo}"
        self._dims = ("pp", "dpr", "dp", "ep", "tp")
        self._shape = tuple(getattr(self.topo, d) for d in self._dims)

    def coord(self, rank: int) -> dict[str, int]:
        """The rank's coordinate on the job's (pp, dpr, dp, ep, tp) mesh (row-major, as build_job)."""
        out, rest = {}, rank
        for d, n in zip(reversed(self._dims), reversed(self._shape)):
            out[d], rest = rest % n, rest // n
        return out

    def symmetry(self, rank: int) -> Hashable:
        return self.coord(rank)["pp"]  # stages differ in modules; every other coordinate only moves shards

    def build(self, rank: int) -> dict[str, Any]:
        return build_trainer(self.cfg, build_job(self.topo), device="meta").state_dict()

    def options(self, rank: int) -> dict[str, Any]:
        return ucp_options(self.cfg, self.topo, self.coord(rank))


def model_config(text: str | None) -> Any:
    """``"ffn_dim=56,n_layers=6"`` -> the recipe's ModelConfig with those fields changed (None: unchanged)."""
    if not text:
        return None
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    kw: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, val = part.partition("=")
        if key not in fields or not val.lstrip("-").isdigit():
            raise UCPError(
                f"{MODEL_ENV}: bad item {part!r} (integer fields: "
                f"{', '.join(n for n, f in fields.items() if f.type in ('int', int))})"
            )
        kw[key] = int(val)
    return ModelConfig(**kw)


@functools.cache
def _recipe(topology: str, model: str, world_size: int) -> RecipeTarget:
    t = RecipeTarget(topology, cfg=model_config(model))
    if t.world_size != world_size:
        raise UCPError(
            f"{TOPOLOGY_ENV}={topology}: {t.world_size} ranks, but the plan's --world-size is {world_size}",
            hint=f"give --world-size {t.world_size}",
        )
    return t


def _job(world_size: int) -> RecipeTarget:
    """The job the environment names (``UCP_TOY_TOPOLOGY``, ``UCP_TOY_MODEL``)."""
    topology = os.environ.get(TOPOLOGY_ENV) or f"dp={world_size}"
    return _recipe(topology, os.environ.get(MODEL_ENV, ""), world_size)


def target(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``plan --target ucp_dev.toy.plan_target:target``: rank ``rank``'s state dict and planner options."""
    job = _job(world_size)
    return job.build(rank), job.options(rank)


def _symmetry(rank: int, world_size: int) -> Hashable:
    # stages differ in modules, EP ranks in their expert map; every other coordinate only moves shards
    c = _job(world_size).coord(rank)
    return c["pp"], c["ep"]


target.plan_symmetry = _symmetry
target.plan_device = "cuda"  # its layouts stand for GPU jobs (the toy runs on CPUs, but plan sizes the layout)


def plan_command(
    checkpoint: Any, topology: str, model: str | None = None, flags: Sequence[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """The ``python -m ucp_dcp plan`` command (and its environment) that plans ``checkpoint``'s load into the toy
    at ``topology`` (with ``model``'s ModelConfig overrides); ``flags`` are more ``plan`` options."""
    world = Topology.parse(topology).world
    env = {**os.environ, TOPOLOGY_ENV: topology}
    env.pop(MODEL_ENV, None)
    if model:
        env[MODEL_ENV] = model
    cmd = [sys.executable, "-m", "ucp_dcp", "plan", str(checkpoint), "--target", TARGET, "--world-size", str(world)]
    return [*cmd, *flags], env
