"""Param groups of a checkpoint written by stock DCP, matched to the target's groups by membership.

Stock DCP keys a nested optimizer's groups by list position (``optim.param_groups.<i>.lr``) and
saves each group's parameter names beside them (``optim.param_groups.<i>.params``). The position
depends on how the new job lists its groups, so matching by it silently swaps hyperparameters
(lr, weight decay) between groups. Here every saved group's ``params`` list and hyperparameters are
read, and each target group takes the values of the saved group(s) holding its parameters:
``set_state_dict`` after a stock ``dcp.load`` does the same through the names. Groups whose
parameters are saved as list positions (a raw ``optimizer.state_dict()``) carry no names and keep
DCP's positional matching.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.planner import ReadItem

from ..errors import ParamGroupError
from ..layout.naming import NameRules
from .entries import GroupTarget
from .load_steps import GROUP_SINK, SavedIndex, bytes_read, group_atom, same_value
from .resolve import Resolver

__all__ = ["StockGroups", "split_stock_groups"]


class StockGroups:
    """The reads and sinks that fill one optimizer's target groups from a stock checkpoint."""

    def __init__(
        self, prefix: str, targets: Sequence[GroupTarget], saved: dict[int, dict[str, str]], names: NameRules
    ) -> None:
        self.prefix, self.targets, self.saved, self.names = prefix, list(targets), saved, names
        self.values: dict[int, dict[str, Any]] = {i: {} for i in saved}
        self.reads: list[ReadItem] = []
        self.sinks: dict[str, Callable[[Any], None]] = {}
        wanted = {hp for g in self.targets for hp in g.hyperparams} | {"params"}
        for i, keys in sorted(saved.items()):
            for hp, skey in keys.items():
                if hp in wanted:
                    sink = f"{GROUP_SINK}:stock:{prefix}:{i}:{hp}"
                    self.sinks[sink] = lambda v, i=i, hp=hp: self._add(i, hp, v)
                    self.reads.append(bytes_read(sink, skey))
        self.pending = len(self.reads)

    @classmethod
    def find(
        cls, prefix: str, targets: Sequence[GroupTarget], saved_keys: dict[str, str], names: NameRules
    ) -> StockGroups | None:
        """The matcher for the optimizer at ``prefix`` when the checkpoint keys its groups by position
        and lists their parameters (``saved_keys``: atom name -> saved key); else None."""
        rx = re.compile(re.escape(prefix) + r"\.param_groups\.(\d+)\.([^.]+)")
        saved: dict[int, dict[str, str]] = {}
        for atom, key in saved_keys.items():
            m = rx.fullmatch(atom)
            if m:
                saved.setdefault(int(m.group(1)), {})[m.group(2)] = key
        if not saved or not all("params" in g for g in saved.values()):
            return None
        return cls(prefix, targets, saved, names)

    def missing(self) -> list[str]:
        """Hyperparameters some target group wants that no saved group holds."""
        have = {hp for keys in self.saved.values() for hp in keys}
        return sorted(
            {f"{self.prefix}.param_groups.<i>.{hp}" for g in self.targets for hp in g.hyperparams if hp not in have}
        )

    def _add(self, i: int, hp: str, value: Any) -> None:
        self.values[i][hp] = value
        self.pending -= 1
        if self.pending == 0:
            self._match()

    def _match(self) -> None:
        lists = {i: v.get("params") for i, v in self.values.items()}
        if not all(isinstance(p, (list, tuple)) and all(isinstance(x, str) for x in p) for p in lists.values()):
            self._by_position()
            return
        owner: dict[str, int] = {}
        for i, params in sorted(lists.items()):
            for p in params:
                owner[self.names.canonical_elem(str(p)) or str(p)] = i
        for g in self.targets:
            homes = {p: owner.get(p) for p in g.params}
            lost = [p for p, i in homes.items() if i is None]
            if lost:
                raise ParamGroupError(
                    f"param group {g.index} of '{self.prefix}': parameter '{lost[0]}' is in none of the "
                    f"checkpoint's {len(lists)} param groups ({len(lost)} such parameter(s))",
                    atom=f"{self.prefix}.param_groups.{g.index}",
                    saved=sorted(owner)[:20],
                    wanted=lost[:20],
                    hint="the checkpoint's groups list other parameters: load into the model it was saved from",
                )
            self._assign(g, sorted(set(homes.values())))

    def _by_position(self) -> None:
        if len(self.values) != len(self.targets):
            raise ParamGroupError(
                f"'{self.prefix}': the checkpoint has {len(self.values)} param groups listed by position, the "
                f"target {len(self.targets)}",
                atom=f"{self.prefix}.param_groups",
                saved=len(self.values),
                wanted=len(self.targets),
                hint="build the optimizer with the groups it was saved with",
            )
        for g in self.targets:
            self._assign(g, [g.index])

    def _assign(self, g: GroupTarget, homes: list[int]) -> None:
        for hp in g.hyperparams:
            found = {i: self.values[i][hp] for i in homes if hp in self.values[i]}
            if len(found) < len(homes):
                raise ParamGroupError(
                    f"param group {g.index} of '{self.prefix}': the checkpoint's group(s) "
                    f"{[i for i in homes if i not in found]} hold no '{hp}'",
                    atom=f"{self.prefix}.param_groups.{hp}",
                    hint="load into an optimizer of the kind that was saved, or pass allow_partial_load=True",
                )
            vals = list(found.values())
            if any(not same_value(v, vals[0]) for v in vals[1:]):
                raise ParamGroupError(
                    f"param group {g.index} of '{self.prefix}' holds parameters of the checkpoint's groups {homes}, "
                    f"whose '{hp}' differ: " + ", ".join(f"group {i}: {v!r}" for i, v in found.items()),
                    atom=f"{self.prefix}.param_groups.{g.index}.{hp}",
                    saved=found,
                    wanted=f"one '{hp}'",
                    hint="group the target optimizer's parameters the way they were grouped at save",
                )
            g.group[hp] = vals[0]


def split_stock_groups(
    groups: list[GroupTarget], saved: SavedIndex, resolver: Resolver, rules: NameRules
) -> tuple[list[GroupTarget], list[StockGroups]]:
    """The optimizers whose groups a stock-DCP checkpoint keys by position, matched by membership
    (:class:`StockGroups`), and the target groups left to the per-parameter path."""
    rest: list[GroupTarget] = []
    found: list[StockGroups] = []
    by_prefix: dict[str, list[GroupTarget]] = {}
    for g in groups:
        by_prefix.setdefault(".".join(map(str, g.prefix)), []).append(g)
    for prefix, members in by_prefix.items():
        per_param = any(
            saved.lookup(group_atom(resolver, g, p, hp))
            for g in members
            for p in g.params[:1]
            for hp in g.hyperparams[:1]
        )
        stock = None if per_param else StockGroups.find(prefix, members, saved.by_atom, rules)
        if stock is None:
            rest.extend(members)
        else:
            found.append(stock)
    return rest, found
