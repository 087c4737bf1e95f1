"""Target jobs a plan can build, rank by rank, inside one process.

A target knows its world size, builds the state dict one rank would pass to ``dcp.load`` (under a
fake default process group whose rank is that rank, tensors on the meta device), and the
``UCPLoadPlanner`` options that rank would use. ``symmetry(rank)`` may name a class of ranks whose
state dicts share one structure: the plan builds one rank per class and rebinds its state dict
to the others (:func:`ucp_dcp.tools.dryrun.world.rebind`), checking the claim on one more rank per class.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...errors import UCPError

__all__ = ["Target", "FunctionTarget", "load_function"]


class Target(Protocol):
    """What the plan needs from a target job."""

    name: str
    """Shown in the report (e.g. ``titan llama3/llama3_8b``, ``mypkg.jobs:target``)."""
    world_size: int
    """Ranks of the target job."""
    device: str | None
    """Where the job's state lives when the target knows (``cuda``, ``cpu``); None: ``plan`` looks at the
    tensors it builds (:func:`ucp_dcp.tools.dryrun.ranks.infer_device`)."""

    def symmetry(self, rank: int) -> Hashable | None:
        """A class key: ranks with equal keys have state dicts of the same structure (None: build
        this rank in full)."""

    def build(self, rank: int) -> dict[str, Any]:
        """The state dict rank ``rank`` would load into (meta tensors), under :func:`fake_rank`."""

    def options(self, rank: int) -> dict[str, Any]:
        """``UCPLoadPlanner`` keyword options of rank ``rank`` (patterns, stage_map, ...)."""


def load_function(spec: str) -> Callable[..., Any]:
    """``"pkg.mod:fn"`` -> the function (imported: only code the user names runs)."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise UCPError(
            f"--target {spec!r}: expected 'package.module:function'",
            hint="e.g. --target docs.examples.plan_fsdp2:target --world-size 8",
        )
    obj: Any = _import_target(spec, mod)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UCPError(f"--target {spec!r}: {mod!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UCPError(f"--target {spec!r}: {attr!r} is not callable")
    return obj


def _import_target(spec: str, mod: str) -> Any:
    """Import ``mod`` as ``python -m ucp_dcp`` would: the current folder first on ``sys.path`` (the
    ``ucp-dcp`` console script does not put it there), with a hint that says what was searched."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(mod)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        top = mod.split(".")[0]
        if missing and missing != top and not mod.startswith(missing + ".") and missing != mod:
            hint = f"{mod!r} was found, but a module it imports is not installed ({missing!r}): install it"
        else:
            hint = (
                f"no {top!r} package or {top}.py in the current folder ({cwd}) nor on sys.path: run from the "
                f"folder that holds {top!r}, add that folder to PYTHONPATH, or install the package"
            )
        raise UCPError(f"--target {spec!r}: cannot import {mod!r} ({e})", hint=hint) from None


@dataclass
class FunctionTarget:
    """A user job: ``fn(rank, world_size)`` returns the state dict that rank would load, or
    ``(state_dict, options)`` with ``UCPLoadPlanner`` keyword options. It runs under a fake default
    process group of ``world_size`` ranks (so ``init_device_mesh("cpu", ...)`` and ``fully_shard``
    work) and should build its modules on the meta device. An optional attribute
    ``fn.plan_symmetry(rank, world_size) -> key`` declares classes of ranks with the same state-dict
    structure (e.g. the pipeline stage), so only one rank per class is built; ``fn.plan_device = "cpu"``
    (or ``"cuda"``) says where the job's state lives when its tensors, built on the meta device, cannot."""

    fn: Callable[..., Any]
    world_size: int
    name: str = ""
    extra_options: dict[str, Any] = field(default_factory=dict)
    _options: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    _class_options: dict[Hashable, dict[str, Any]] = field(default_factory=dict, repr=False)

    @property
    def device(self) -> str | None:
        return getattr(self.fn, "plan_device", None)

    def symmetry(self, rank: int) -> Hashable | None:
        sym = getattr(self.fn, "plan_symmetry", None)
        return None if sym is None else sym(rank, self.world_size)

    def build(self, rank: int) -> dict[str, Any]:
        out = self.fn(rank, self.world_size)
        sd, opts = out if isinstance(out, tuple) else (out, {})
        if not isinstance(sd, dict):
            raise UCPError(f"target {self.name}: rank {rank}: expected a state dict, got {type(sd).__name__}")
        self._options[rank] = dict(opts or {})
        key = self.symmetry(rank)
        if key is not None:
            self._class_options.setdefault(key, self._options[rank])
        return sd

    def options(self, rank: int) -> dict[str, Any]:
        # a rank that was rebound, not built, takes its class representative's options (the first built rank
        # of its symmetry class): options may differ between classes (a pipeline stage's stage_map), but
        # within a class they must not depend on the rank (else the function must not declare plan_symmetry)
        opts = self._options.get(rank)
        if opts is None:
            key = self.symmetry(rank)
            opts = self._class_options.get(key) if key is not None else None
        if opts is None:
            opts = next(iter(self._options.values()), {})
        return {**opts, **self.extra_options}
