"""From a user state dict to named entries (one per leaf), shared by the save and load planners.

Flattening is DCP's own (``flatten_state_dict``), so keys and mappings match what the default
planner would produce. Two UCP-specific steps happen around it:

* optimizer containers are found and their entries are named after their parameter;
* nested ``param_groups`` lists (keyed by list index in DCP, which differs per pipeline stage) become
  per-parameter hyperparameter entries ``<optim>.param_groups.<param>.<hp>`` -- the same names that
  ``flatten_optimizer_state_dict`` uses, so both forms load into each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, flatten_state_dict, is_checkpointable_tensor, set_element
from .._compat import local_tensor as dtensor_local
from ..errors import ParamGroupError
from ..layout.fragments import LocalShards
from ..layout.naming import AtomName, NameRules, OptimizerForm, Path, find_optimizer_containers, parse_path
from ..layout.placements import LocalShard, sharded_tensor_shards

__all__ = [
    "Entry",
    "GroupTarget",
    "GROUP_ONLY_KEYS",
    "collect_entries",
    "raw_optimizers",
    "set_value",
    "is_sharded",
    "local_tensor",
    "shard_memory",
]

GROUP_ONLY_KEYS = ("params", "param_names")
"""Param-group keys that describe membership, not hyperparameters."""


@dataclass
class Entry:
    """One leaf of the state dict."""

    key: str
    """DCP's flattened key of the live state dict."""
    atom: AtomName
    """Canonical name parts."""
    value: Any
    """The live value: DTensor, ShardedTensor, tensor or any picklable object."""
    path: Path = ()
    """DCP's (raw) flatten path of the live state dict, for writing loaded objects back."""
    stock: bool = False
    """A copy in DCP's own form written only for stock readers (``param_groups.<i>.<hp>`` of a
    nested optimizer state dict): never checked across ranks, never read by ucp_dcp when its
    per-parameter atoms exist."""

    @property
    def name(self) -> str:
        return self.atom.name

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, torch.Tensor)


@dataclass
class GroupTarget:
    """A nested ``param_groups[i]`` dict of a target optimizer state dict, filled at load."""

    group: dict[str, Any]
    """The user's group dict (updated in place)."""
    prefix: Path
    """Canonical path of the optimizer container."""
    index: int
    """Position in the ``param_groups`` list (fallback name for stock-DCP checkpoints)."""
    params: list[str]
    """Canonical parameter names of the group."""
    hyperparams: list[str] = field(default_factory=list)
    """Keys of the group to load (everything but membership keys)."""

    def atom(self, param: str, hp: str) -> str:
        return ".".join([*map(str, self.prefix), "param_groups", param, hp])

    def legacy_atom(self, hp: str) -> str:
        return ".".join([*map(str, self.prefix), "param_groups", str(self.index), hp])


def _replace_at(d: Mapping[str, Any], path: Path, fn) -> dict[str, Any]:
    """Copy of ``d`` with the value at ``path`` replaced by ``fn(value)``; ``d`` is not mutated."""
    new = dict(d)
    if not path:
        return fn(new)
    key = next(k for k in d if str(k) == path[0])
    new[key] = _replace_at(d[key], path[1:], fn)
    return new


def _per_param_groups(groups: list[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for g in groups:
        hps = {k: v for k, v in g.items() if k not in GROUP_ONLY_KEYS}
        for p in g["params"]:
            if str(p) in out:
                raise ParamGroupError(f"parameter '{p}' appears in two optimizer param groups", atom=str(p))
            out[str(p)] = hps
    return out


def collect_entries(
    state_dict: Mapping[str, Any],
    rules: NameRules,
    *,
    for_load: bool,
    rewrite: Callable[[Path], Path] | None = None,
) -> tuple[list[Entry], list[GroupTarget]]:
    """Flatten ``state_dict`` into entries named by canonical atoms.

    ``rewrite`` maps a canonical path to its global form (pipeline/expert renumbering). At load,
    nested param groups are returned separately (they are filled from per-parameter entries).
    """
    rw = rewrite or (lambda p: p)
    containers = find_optimizer_containers(state_dict)
    canon_containers = {rw(rules.canonical_path(c)): form for c, form in containers.items()}
    groups: list[GroupTarget] = []
    index: dict[tuple[Path, str], int] = {}  # (optimizer path, raw parameter name) -> its group's position
    stock: set[tuple[Path, str]] = set()  # (optimizer path, "<i>") of DCP's own param_groups.<i> entries
    work: Mapping[str, Any] = state_dict
    for cpath, form in containers.items():
        if form != OptimizerForm.NESTED:
            continue
        if for_load:
            canon = rules.canonical_path(cpath)
            prefix = rw(canon)
            opt = _get(state_dict, cpath)
            for i, g in enumerate(opt["param_groups"]):
                # a parameter's global name: rewrite a representative path through the group
                params = [str(rw(canon + ("param_groups", rules.canonical_elem(str(p)), "_"))[-2]) for p in g["params"]]
                hps = [k for k in g if k not in GROUP_ONLY_KEYS]
                groups.append(GroupTarget(g, prefix, i, params, hps))
            work = _replace_at(work, cpath, lambda o: {k: v for k, v in o.items() if k != "param_groups"})
        else:
            # per-parameter entries (what ucp_dcp reads), plus DCP's own list-index entries so that
            # stock dcp.load at the same layout finds ``param_groups.<i>.<hp>`` too
            opt = _get(state_dict, cpath)
            index.update({(cpath, str(p)): i for i, g in enumerate(opt["param_groups"]) for p in g["params"]})
            # not for an optimizer an index map renames (pipeline chunks): its list positions are per
            # chunk, stock DCP cannot load such a checkpoint anyway, and the copies would collide
            copies = rw(rules.canonical_path(cpath)) == rules.canonical_path(cpath)
            mine = {(cpath, str(i)) for i in range(len(opt["param_groups"]))} if copies else set()
            if any(k in index for k in mine):
                raise ParamGroupError(
                    f"a parameter of {'.'.join(map(str, cpath))} is named like a param group position",
                    hint="rename the parameter",
                )
            stock |= mine
            work = _replace_at(
                work,
                cpath,
                lambda o, copies=copies: {
                    **o,
                    "param_groups": {
                        **_per_param_groups(o["param_groups"]),
                        **(dict(enumerate(o["param_groups"])) if copies else {}),
                    },
                },
            )
    flat, raw_paths = flatten_state_dict(work)
    nested = [c for c, form in containers.items() if form == OptimizerForm.NESTED]
    entries: list[Entry] = []
    for key, value in flat.items():
        raw = raw_paths[key]
        atom = parse_path(rw(rules.canonical_path(raw)), canon_containers)
        entry = Entry(key, atom, value, raw)
        cpath = (
            next(
                (c for c in nested if raw[: len(c)] == c and len(raw) > len(c) + 2 and raw[len(c)] == "param_groups"),
                None,
            )
            if not for_load
            else None
        )
        if cpath is not None and atom.kind == "param_group":
            member = raw[len(cpath) + 1]
            if (cpath, str(member)) in stock:  # DCP flattens dict keys to strings; its lists use ints
                entry.stock = True
                entry.atom = dataclasses.replace(atom, path=tuple(atom.prefix) + (int(member),) + tuple(atom.suffix))
            elif (cpath, str(member)) in index:
                # flatten mapping = DCP's own path of the group's value: dcp_to_torch_save rebuilds
                # ``param_groups`` as the list set_state_dict takes (every parameter of a group agrees)
                i = index[(cpath, str(member))]
                entry.atom = dataclasses.replace(atom, path=tuple(atom.prefix) + (i,) + tuple(atom.suffix))
        entries.append(entry)
    return entries, groups


def raw_optimizers(
    state_dict: Mapping[str, Any], rules: NameRules, rewrite: Callable[[Path], Path] | None = None
) -> dict[str, list[list[int]]]:
    """Per raw ``optimizer.state_dict()`` in ``state_dict`` (by canonical dotted path), its groups'
    parameter positions: what tells, without names, whether two optimizers list the same parameters."""
    rw = rewrite or (lambda p: p)
    return {
        ".".join(map(str, rw(rules.canonical_path(c)))): [
            list(g["params"]) for g in _get(state_dict, c)["param_groups"]
        ]
        for c, form in find_optimizer_containers(state_dict).items()
        if form == OptimizerForm.RAW
    }


def _get(d: Mapping[str, Any], path: Path) -> Any:
    for p in path:
        d = d[next(k for k in d if str(k) == p)]
    return d


def is_sharded(value: Any) -> bool:
    """A tensor whose ranks hold different pieces (DTensor, ShardedTensor, torch 2.14's
    ``CheckpointableTensor``): never compared whole across ranks, always saved as pieces."""
    return isinstance(value, (DTensor, ShardedTensor)) or is_checkpointable_tensor(value)


def local_tensor(value: torch.Tensor) -> torch.Tensor | LocalShards:
    """The memory a value's fragments live in: a DTensor's local tensor; a ShardedTensor's single
    local shard, or a :class:`LocalShards` of all of them when there are none or several (the
    fragments then name theirs); a plain tensor itself."""
    if isinstance(value, DTensor):
        return dtensor_local(value)
    if isinstance(value, ShardedTensor):
        return shard_memory(value, sharded_tensor_shards(value, ""))
    return value


def shard_memory(value: torch.Tensor, shards: Sequence[LocalShard]) -> torch.Tensor | LocalShards:
    """The local memory of ShardedTensor ``value`` whose pieces here are ``shards``: the tensor of a
    single piece, else a :class:`LocalShards` of all (``shard_fragments(..., indexed=True)``)."""
    if len(shards) == 1:
        return shards[0].tensor
    return LocalShards(
        [s.tensor for s in shards],
        shards[0].tensor.dtype if shards else value.dtype,
        shards[0].tensor.device if shards else torch.device("cpu"),
    )


def set_value(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Put a loaded object at its flatten ``path`` in the target. DCP's paths hold dict keys as
    strings: the existing key that prints as the segment (``1`` for ``"1"``) is the one replaced,
    where DCP's ``set_element`` adds a second key ``"1"`` and leaves ``1`` as it was."""
    node: Any = root
    for i, seg in enumerate(path):
        if isinstance(node, dict):
            key = seg if seg in node else next((k for k in node if str(k) == seg), _ABSENT)
        elif isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node):
            key = seg
        else:
            key = _ABSENT
        if key is _ABSENT:
            break
        if i == len(path) - 1:
            node[key] = value
            return
        node = node[key]
    set_element(root, path, value)  # a path the target lacks: DCP's way (it creates it)


_ABSENT = object()
