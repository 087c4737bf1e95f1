"""What both planners are told about the layout: one dataclass, shared by save and load.

The same rules must describe a job at save and at load, so they are given once
(``UCPOptions(...)``) and passed to both planners, or as keyword arguments to either. Also here:
the checks both planners share on DCP's own arguments (``flatten_state_dict``) and on DCP's call
order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._compat import flatten_state_dict
from .errors import UCPError, UnexpectedArgumentError
from .layout.index_maps import IndexMap
from .layout.naming import NameRules
from .layout.patterns import Patterns, Rule

__all__ = ["UCPOptions", "split_options", "options_first", "require_flat", "protocol_error"]


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
        raise UnexpectedArgumentError(
            f"unexpected planner argument(s): {', '.join(sorted(kwargs))}",
            wanted=list(_FIELDS),
            hint="the planners take DCP's parameters, their own keyword options and UCPOptions' fields",
        )
    if options is not None and shared:
        raise UnexpectedArgumentError(f"pass either options=UCPOptions(...) or {', '.join(sorted(shared))}, not both")
    return options if options is not None else UCPOptions(**shared)


def options_first(first: Any, options: UCPOptions | None, planner: str) -> UCPOptions | None:
    """The planners' first positional parameter is DCP's ``flatten_state_dict``; a ``UCPOptions``
    passed there (the old first parameter) is refused with the spelling that works."""
    if isinstance(first, UCPOptions):
        raise UnexpectedArgumentError(
            f"{planner}'s first positional argument is DCP's flatten_state_dict; "
            f"pass the layout as {planner}(options=UCPOptions(...))"
        )
    return options


def require_flat(state_dict: Mapping[str, Any], what: str) -> None:
    """``flatten_state_dict=False``: DCP keeps every top-level value whole, so a nested dict or list
    would be one pickled object. ucp_dcp plans leaves (atoms), so it takes only state dicts that
    flattening leaves as they are, where both settings mean the same."""
    _, paths = flatten_state_dict(state_dict)
    nested = [str(k) for k in state_dict if paths.get(k) != (k,)]
    if nested:
        shown = ", ".join(repr(k) for k in nested[:5]) + (f" and {len(nested) - 5} more" if len(nested) > 5 else "")
        raise UCPError(
            f"flatten_state_dict=False, but the state dict holds nested containers under {shown}: DCP would "
            f"{what} each as one pickled object, which ucp_dcp cannot reshard, rename or check (it plans "
            "every tensor and value under its flattened key)",
            wanted="a flat state dict",
            saved=nested[:20],
            hint="pass flatten_state_dict=True (the default: the keys are DCP's dotted keys), or flatten the "
            "state dict yourself (torch.distributed.checkpoint._nested_dict.flatten_state_dict)",
        )


def protocol_error(step: str, missing: str) -> UCPError:
    """The error for a planner method called before the step it depends on (DCP's call order:
    set_up_planner -> create_local_plan -> [coordinator: create_global_plan] -> finish_plan -> data)."""
    return UCPError(
        f"{step} was called before {missing}: the planner has nothing to work from",
        hint=f"call {missing} first (DCP's order: set_up_planner -> create_local_plan -> [coordinator: "
        "create_global_plan] -> finish_plan -> resolve/load calls), or let dcp.save / dcp.load drive the planner",
    )
