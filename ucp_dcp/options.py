"""What both planners are told about the layout: one dataclass, shared by save and load.

The same rules must describe a job at save and at load, so they are given once
(``UCPOptions(...)``) and passed to both planners, or as keyword arguments to either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .index_maps import IndexMap
from .naming import NameRules
from .patterns import Patterns, Rule

__all__ = ["UCPOptions", "split_options"]


@dataclass(frozen=True)
class UCPOptions:
    """Layout description shared by :class:`UCPSavePlanner` and :class:`UCPLoadPlanner`."""

    patterns: tuple[Rule, ...] = ()
    """Pattern rules (``Fused``, ``Padded``, ``Replicated``, ``Reduce``, ``Tied``) for layouts DTensor
    placements cannot describe. At load, the rules recorded in the checkpoint apply too."""
    strict: bool = True
    """A declared rule that matches nothing (on any rank at save; neither a saved nor a target name
    at load) is an error."""
    stage_map: IndexMap | None = None
    """This rank's local -> global layer numbering (pipeline stages with stage-local names)."""
    expert_map: IndexMap | None = None
    """This rank's local -> global expert numbering (expert-local module lists)."""
    name_rules: NameRules = field(default_factory=NameRules)
    """Wrapper segments stripped from names (``_orig_mod.``, ...); must be the same at save and load."""
    data_slot: int | None = None
    """This rank's data-parallel slot for ``Reduce`` rules: ranks of one slot hold copies of one
    value (which must agree and count once). Default: every rank is its own slot at save; at load
    only the coordinator takes a ``sum`` total."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", tuple(self.patterns))
        if self.name_rules is None:
            object.__setattr__(self, "name_rules", NameRules())
        Patterns(self.patterns)  # bad regexes fail here, not in the middle of a save

    @property
    def maps(self) -> tuple[IndexMap, ...]:
        """The index maps in use."""
        return tuple(m for m in (self.stage_map, self.expert_map) if m is not None)


_FIELDS = ("patterns", "strict", "stage_map", "expert_map", "name_rules", "data_slot")


def split_options(options: UCPOptions | None, kwargs: dict[str, Any]) -> UCPOptions:
    """``options``, or one built from the shared keyword arguments a planner was given (not both)."""
    shared = {k: kwargs.pop(k) for k in _FIELDS if k in kwargs}
    if kwargs:
        raise TypeError(f"unexpected planner argument(s): {', '.join(sorted(kwargs))}")
    if options is not None and shared:
        raise TypeError(f"pass either options=UCPOptions(...) or {', '.join(sorted(shared))}, not both")
    return options if options is not None else UCPOptions(**shared)
