"""Checks of the arguments that pattern rules, index maps and name rules are built with.

A rule built with an impossible argument (``Padded(size=-1)``, a regex that does not compile, a
reduction op outside the allowed set, a bare string where a sequence of strings goes) is refused by
its constructor, where the mistake is, with a :class:`~ucp_dcp.errors.RuleArgumentError` that names
the rule, the argument, what was given and what is allowed; not by a plan much later, far from it
(or never: a string taken for a sequence of one-letter regexes). Each check returns the value in the
form the rule keeps (an ``int`` for a numpy integer, a tuple for a list), so what is recorded in a
checkpoint's catalog is plain JSON.
"""

from __future__ import annotations

import functools
import numbers
import operator
import re
from collections.abc import Iterable
from typing import Any

from ..errors import RuleArgumentError

__all__ = [
    "refuse",
    "integer",
    "real",
    "flag",
    "text",
    "regex",
    "strings",
    "one_of",
    "template",
    "regexes",
    "fused_parts",
    "DIM",
]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def refuse(what: str, arg: str, value: Any, allowed: str, hint: str | None = None) -> RuleArgumentError:
    """The error for argument ``arg`` of ``what`` (``"Padded('emb')"``) given ``value``; ``allowed``: what it takes."""
    return RuleArgumentError(f"{what}: {arg}={_shown(value)}: expected {allowed}", wanted=allowed, hint=hint)


def integer(what: str, arg: str, value: Any, low: int = 0, allowed: str | None = None) -> int:
    """``value`` as an ``int`` >= ``low`` (any integer type: numpy's, a 0-d integer tensor; not a bool or a float)."""
    allowed = allowed or f"an int >= {low}"
    if isinstance(value, bool):
        raise refuse(what, arg, value, allowed)
    try:
        n = operator.index(value)
    except TypeError:
        raise refuse(what, arg, value, allowed) from None
    if n < low:
        raise refuse(what, arg, value, allowed)
    return n


def real(what: str, arg: str, value: Any) -> float:
    """``value`` as a ``float`` (an int or float of any numeric type, numpy's too; not a bool or a complex)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise refuse(what, arg, value, "a real number (an int or a float)")
    return float(value)


def flag(what: str, arg: str, value: Any) -> bool:
    """``value``, which must be ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise refuse(what, arg, value, "True or False")
    return value


def text(what: str, arg: str, value: Any, allowed: str = "a non-empty string", empty: bool = False) -> str:
    """``value``, a string (non-empty unless ``empty``)."""
    if not isinstance(value, str) or (not value and not empty):
        raise refuse(what, arg, value, allowed)
    return value


def regex(what: str, arg: str, value: Any) -> re.Pattern[str]:
    """``value`` compiled: a regex string (its text is what the catalog records, so not a compiled pattern)."""
    if isinstance(value, re.Pattern):
        raise refuse(
            what,
            arg,
            value,
            "a regex string",
            hint=f"pass its text ({value.pattern!r}); write flags inline, e.g. '(?i)...'",
        )
    if not isinstance(value, str):
        raise refuse(what, arg, value, "a regex string")
    try:
        return re.compile(value)
    except re.error as e:
        raise refuse(what, arg, value, f"a regex that compiles (this one does not: {e})") from None


def strings(what: str, arg: str, value: Any, allowed: str, low: int = 0, empty: bool = False) -> tuple[str, ...]:
    """``value`` as a tuple of (non-empty unless ``empty``) strings, at least ``low`` of them; a bare string
    (a sequence of its letters) is refused."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        hint = f"wrap it: ({value!r},)" if isinstance(value, str) else None
        raise refuse(what, arg, value, allowed, hint=hint)
    out = tuple(value)
    if len(out) < low or not all(isinstance(s, str) and (empty or s) for s in out):
        raise refuse(what, arg, out, allowed)
    return out


def regexes(what: str, arg: str, value: Any, low: int = 0) -> tuple[str, ...]:
    """``value`` as a tuple of regex strings that compile, at least ``low`` of them (a bare string is refused)."""
    allowed = "a sequence of regex strings" if low == 0 else f"a sequence of {low} or more regex strings"
    out = strings(what, arg, value, allowed, low=low, empty=True)
    for i, rx in enumerate(out):
        regex(what, f"{arg}[{i}]", rx)
    return out


def one_of(what: str, arg: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value``, one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise refuse(what, arg, value, f"one of {choices}")
    return value


def template(what: str, arg: str, value: Any, pattern: re.Pattern[str]) -> str:
    """``value``, a ``match.expand`` template whose group references (``\\1``, ``\\g<name>``) name groups of
    ``pattern``: checked by expanding it against an empty match of a regex with the same groups."""
    if not isinstance(value, str) or not value:
        raise refuse(what, arg, value, "a non-empty name template (a string)")
    problem = _template_problem(value, pattern.pattern, pattern.flags)
    if problem:
        raise refuse(
            what, arg, value, f"a template whose group references are groups of {pattern.pattern!r} ({problem})"
        )
    return value


@functools.lru_cache(maxsize=1024)
def _template_problem(value: str, pattern: str, flags: int) -> str | None:
    """Why ``value`` is no template for matches of ``pattern`` (None: it is one); remembered, as the same rules are
    built again for every rank a dry run plans."""
    rx = re.compile(pattern, flags)
    names = {i: n for n, i in rx.groupindex.items()}
    m = re.fullmatch("".join(f"(?P<{names[i]}>)" if i in names else "()" for i in range(1, rx.groups + 1)), "")
    assert m is not None
    try:
        m.expand(value)
    except (re.error, IndexError) as e:
        return str(e)
    return None


DIM = "an int >= 0 (a dim of the parameter, counted from the first; negative dims are not taken)"
FUSED_BLOCKS = "an int >= 1 (the number of interleaved blocks) or the name of a mesh dim (e.g. 'tp')"
_PARTS = "two or more (name template, size) pairs, each size an int >= 1, no two templates alike"


def fused_blocks(what: str, value: Any) -> int | str:
    """A ``Fused`` rule's ``blocks``: a block count >= 1, or the name of the mesh dim whose size gives it."""
    return (
        text(what, "blocks", value, FUSED_BLOCKS)
        if isinstance(value, str)
        else integer(what, "blocks", value, 1, FUSED_BLOCKS)
    )


def fused_parts(what: str, parts: Any, rx: re.Pattern[str]) -> tuple[tuple[str, int], ...]:
    """A ``Fused`` rule's parts, checked: at least two ``(template, size)`` pairs, each template naming only
    groups of the rule's regex, each size >= 1, the templates distinct (two parts cannot be one atom)."""
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Iterable):
        raise refuse(what, "parts", parts, _PARTS)
    out: list[tuple[str, int]] = []
    for i, part in enumerate(parts):
        if isinstance(part, (str, bytes)) or not isinstance(part, Iterable) or len(pair := tuple(part)) != 2:
            raise refuse(what, f"parts[{i}]", part, "a (name template, size) pair")
        tmpl = template(what, f"parts[{i}] template", pair[0], rx)
        out.append((tmpl, integer(what, f"parts[{i}] size", pair[1], 1, "an int >= 1 (the part's size along dim)")))
    if len(out) < 2:
        raise refuse(what, "parts", parts, _PARTS, hint="a single part is no fusion: declare no rule for it")
    seen = [t for t, _ in out]
    if len(set(seen)) < len(seen):
        raise refuse(what, "parts", parts, _PARTS, hint="each part is an atom of its own: give each its own name")
    return tuple(out)
