"""Atom names: canonical, parallelism-independent names for state-dict entries.

A state-dict entry is addressed by the path DCP's flattening produces, e.g.
``("model", "_orig_mod.layers.0._checkpoint_wrapped_module.attn.wq.weight")`` or
``("optim", "state", "layers.0.attn.wq.weight", "exp_avg")``. We split it into

* ``prefix``: the container path (``("model",)``, ``("optim", "state")``),
* ``param``: the canonical module/parameter FQN with wrapper segments removed, and
* ``suffix``: what follows the parameter (``("exp_avg",)`` for optimizer moments),

so that optimizer state is keyed by its parameter and pattern rules match ``param`` once for a
weight and all of its moments. The atom name is the dotted join of the three parts, which is
exactly DCP's flattened key whenever no wrapper was present (default-planner compatible).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .patterns import refuse, strings

__all__ = [
    "AtomName",
    "NameRules",
    "OptimizerForm",
    "find_optimizer_containers",
    "parse_path",
]

PathElem = str | int
Path = tuple[PathElem, ...]


@dataclass(frozen=True)
class NameRules:
    """Which path segments are wrappers, not part of a parameter's identity."""

    wrapper_segments: tuple[str, ...] = (
        "_orig_mod",  # torch.compile
        "_checkpoint_wrapped_module",  # activation checkpointing
        "_fsdp_wrapped_module",  # FSDP1
        "_fpw_module",  # FSDP1 FlattenParamsWrapper
    )
    """Segments removed wherever they appear."""
    leading_segments: tuple[str, ...] = ("module",)
    """Segments removed only as the first segment of a key (DDP's ``module.`` prefix)."""

    def __post_init__(self) -> None:
        for arg in ("wrapper_segments", "leading_segments"):
            segs = strings("NameRules", arg, getattr(self, arg), _SEGMENTS)
            if any("." in s for s in segs):
                raise refuse("NameRules", arg, segs, _SEGMENTS, hint="a dotted path is several segments: list each")
            object.__setattr__(self, arg, segs)

    def canonical_elem(self, elem: PathElem) -> PathElem | None:
        """Strip wrapper segments from one path element; None if nothing is left."""
        if isinstance(elem, int):
            return elem
        parts = elem.split(".")
        kept = [p for p in parts if p not in self.wrapper_segments]
        while kept and kept[0] in self.leading_segments and len(kept) > 1:
            kept = kept[1:]
        return ".".join(kept) if kept else None

    def canonical_path(self, path: Sequence[PathElem]) -> Path:
        return _canonical_path(self, tuple(path))


_SEGMENTS = "a sequence of path segments (non-empty strings without dots)"


@functools.lru_cache(maxsize=1 << 16)
def _canonical_path(rules: NameRules, path: Path) -> Path:
    """:meth:`NameRules.canonical_path`, remembered: a pure function of the rules and the path, asked again for
    every key of every rank ``plan`` simulates."""
    out = []
    for e in path:
        c = rules.canonical_elem(e)
        if c is not None and c != "":
            out.append(c)
    return tuple(out)


class OptimizerForm:
    """How an optimizer state dict is laid out inside the user's state dict."""

    NESTED = "nested"
    """``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}`` (``get_state_dict``'s default)."""
    RAW = "raw"
    """``optimizer.state_dict()`` itself: the nested layout with parameters keyed by their integer
    position in the optimizer (``{"state": {0: {...}}, "param_groups": [{..., "params": [0, 1]}]}``).
    A position names no parameter, so it is saved and loaded as DCP does, key by key."""
    FLAT = "flat"
    """``{"state.<fqn>.<k>": ..., "param_groups.<fqn>.<hp>": ...}`` (``flatten_optimizer_state_dict``)."""


def _looks_nested_optimizer(d: Mapping[str, Any]) -> bool:
    groups = d.get("param_groups")
    return (
        "state" in d
        and isinstance(d.get("state"), Mapping)
        and isinstance(groups, list)
        and all(isinstance(g, Mapping) and "params" in g for g in groups)
    )


def _keyed_by_position(d: Mapping[str, Any]) -> bool:
    """A nested optimizer state dict whose groups list parameters by integer position (``optimizer.state_dict()``)."""
    params = [p for g in d["param_groups"] for p in g["params"]]
    return bool(params) and all(isinstance(p, int) and not isinstance(p, bool) for p in params)


def _looks_flat_optimizer(d: Mapping[str, Any]) -> bool:
    keys = [k for k in d.keys() if isinstance(k, str)]
    return (
        bool(keys)
        and any(k.startswith("param_groups.") for k in keys)
        and all(k.startswith("state.") or k.startswith("param_groups.") for k in keys)
    )


def find_optimizer_containers(state_dict: Mapping[str, Any]) -> dict[Path, str]:
    """Paths (as DCP flattening spells them) of every optimizer state dict nested in
    ``state_dict``, with their form. The root itself may be one."""
    found: dict[Path, str] = {}

    def visit(path: Path, d: Mapping[str, Any]) -> None:
        if _looks_nested_optimizer(d):
            found[path] = OptimizerForm.RAW if _keyed_by_position(d) else OptimizerForm.NESTED
            return
        if _looks_flat_optimizer(d):
            found[path] = OptimizerForm.FLAT
            return
        for k, v in d.items():
            if isinstance(v, Mapping):
                visit(path + (str(k),), v)

    visit((), state_dict)
    return found


@dataclass(frozen=True)
class AtomName:
    """A parsed, canonical state-dict path."""

    prefix: tuple[PathElem, ...]
    """Container path before the parameter, e.g. ``("optim", "state")``."""
    param: str
    """Canonical parameter/module FQN (what pattern rules match)."""
    suffix: tuple[PathElem, ...] = ()
    """Path after the parameter, e.g. ``("exp_avg",)``."""
    kind: str = "model"
    """``"model"`` (weights, buffers, other entries), ``"optim_state"`` or ``"param_group"``."""
    path: Path = field(default=(), compare=False)
    """Canonical DCP path (wrapper segments removed), used for the flatten mapping."""
    form: str = field(default="", compare=False)
    """Optimizer form (``nested``/``flat``) or empty for model entries; needed to rebuild ``path``."""

    @property
    def name(self) -> str:
        name = self.__dict__.get("_name")  # made once: a load asks for an entry's name many times
        if name is None:
            parts = [*map(str, self.prefix)]
            if self.param:
                parts.append(self.param)
            parts.extend(map(str, self.suffix))
            name = ".".join(parts)
            object.__setattr__(self, "_name", name)
        return name

    def renamed(self, param: str) -> AtomName:
        """The same entry of another parameter (tied alias -> canonical, fused -> part)."""
        if param == self.param:
            return self
        if self.form == OptimizerForm.FLAT:
            path = tuple(self.prefix[:-1]) + (".".join([str(self.prefix[-1]), param, *map(str, self.suffix)]),)
        else:
            path = tuple(self.prefix) + ((param,) if param else ()) + tuple(self.suffix)
        return AtomName(self.prefix, param, self.suffix, self.kind, path, self.form)


def parse_path(path: Sequence[PathElem], containers: Mapping[Path, str]) -> AtomName:
    """:class:`AtomName` of one canonical DCP flatten path; ``containers`` are the canonical paths
    of the optimizer state dicts inside the state dict."""
    path = tuple(path)
    for cpath, form in containers.items():
        n = len(cpath)
        if path[:n] != cpath or len(path) <= n:
            continue
        rest = path[n:]
        if form in (OptimizerForm.NESTED, OptimizerForm.RAW):
            for head, kind in (("state", "optim_state"), ("param_groups", "param_group")):
                if rest[0] == head and len(rest) >= 3:
                    prefix = cpath + (head,)
                    return AtomName(prefix, str(rest[1]), tuple(rest[2:]), kind, path, form)
        else:
            key = str(rest[0])
            for marker, kind in (("state.", "optim_state"), ("param_groups.", "param_group")):
                if key.startswith(marker) and len(rest) == 1:
                    fqn, _, last = key[len(marker) :].rpartition(".")
                    if fqn:
                        return AtomName(cpath + (marker[:-1],), fqn, (last,), kind, path, form)
        break
    if len(path) <= 1:
        return AtomName((), ".".join(map(str, path)), (), "model", path)
    return AtomName((path[0],), ".".join(map(str, path[1:])), (), "model", path)
