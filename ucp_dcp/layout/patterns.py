"""Pattern rules: declared layouts that DTensor placements cannot describe.

Rules are matched with ``re.fullmatch`` against canonical *parameter* names (wrappers stripped,
pipeline layers and experts renumbered), so one rule covers a weight and all of its optimizer
state; :class:`Reduce` rules match full atom names instead (they concern single values such as
``train_state.ntokens_seen``). Every rule is recorded in the checkpoint's catalog, so a load
applies the saved rules automatically; rules passed at load add to them.

Strict mode (default): a rule that matches nothing is an error, judged on the union over all
ranks at save and on saved + target names at load. A rule declared ``optional=True`` applies where
it matches and is not counted by strict mode (state that only some saves hold). Optionality belongs
to the declaration, not to the layout: it is not recorded in the catalog.
"""

from __future__ import annotations

import functools
import numbers
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from ..errors import InvalidArgumentError, PatternError, RuleArgumentError

__all__ = [
    "DIM",
    "Fused",
    "Padded",
    "Patterns",
    "REDUCE_OPS",
    "Reduce",
    "Replicated",
    "Rule",
    "Tied",
    "anchored_in",
    "flag",
    "fused_parts",
    "integer",
    "literal_prefix",
    "one_of",
    "real",
    "refuse",
    "regex",
    "regexes",
    "strings",
    "template",
    "text",
]

ReduceOp = Literal["sum", "mean", "max", "equal"]
"""How a :class:`Reduce` rule combines the ranks' values."""
ReplicaCheck = Literal["error", "warn", "average", "off"]
"""What a :class:`Replicated` rule does when replicas differ at save."""
REDUCE_OPS: tuple[str, ...] = get_args(ReduceOp)
REPLICA_CHECKS: tuple[str, ...] = get_args(ReplicaCheck)


@dataclass(frozen=True)
class _Rule:
    """What every rule has besides its own fields."""

    optional: bool = field(default=False, compare=False, kw_only=True)
    """Strict mode does not count this rule when it matches nothing (it still applies where it
    matches). Not part of the rule's identity, and not recorded in the catalog."""

    def _checked(self, pattern: str = "pattern") -> tuple[str, re.Pattern[str]]:
        """The rule's name for messages (``"Padded('emb')"``) and its regex ``pattern``, compiled; the fields every
        rule has checked (:mod:`ucp_dcp.layout.patterns`)."""
        name = type(self).__name__
        rx = regex(name, pattern, getattr(self, pattern))
        what = f"{name}({rx.pattern!r})"
        flag(what, "optional", self.optional)
        return what, rx


@dataclass(frozen=True)
class Fused(_Rule):
    """A parameter holding several logical parameters side by side along ``dim``.

    ``parts`` are ``(name template, logical size)``; templates may use the pattern's groups
    (``r"\\1.wq.weight"``). ``blocks`` says how the parts interleave: ``1`` plain concatenation
    ``[A; B]``; an int ``n``: ``n`` blocks ``[A_0; B_0; A_1; B_1; ...]`` (group-major QKV, one block
    per KV head); a mesh dim name such as ``"tp"``: one block per rank of that mesh dim
    (Megatron's per-rank ``[q_r; k_r; v_r]``), 1 when the value is not sharded over it.
    """

    pattern: str
    """Regex, full match against the parameter name."""
    parts: tuple[tuple[str, int], ...]
    """``(atom name template, size along dim)`` per sub-parameter, in layout order."""
    dim: int = 0
    """The fused dim."""
    blocks: int | str = 1
    """Number of interleaved blocks, or the mesh dim whose size gives it."""
    kind: ClassVar[str] = "fused"

    def __post_init__(self) -> None:
        what, rx = self._checked()
        object.__setattr__(self, "parts", fused_parts(what, self.parts, rx))
        object.__setattr__(self, "dim", integer(what, "dim", self.dim, 0, DIM))
        object.__setattr__(self, "blocks", fused_blocks(what, self.blocks))


@dataclass(frozen=True)
class Padded(_Rule):
    """A dim padded beyond its logical ``size`` (e.g. vocabulary padded to a multiple of TP x 128).
    Atoms store the logical size; load fills the padding of any padded size."""

    pattern: str
    """Regex, full match against the parameter name."""
    size: int
    """Logical size of the padded dim."""
    dim: int = 0
    """The padded dim."""
    fill: float = 0.0
    """Value written into the padding of model tensors at load."""
    state_fill: float = 0.0
    """Value written into the padding of optimizer state at load."""
    discard: bool = False
    """The padding may hold other values than ``fill``/``state_fill`` (it was trained, or holds
    garbage) and is dropped at save anyway. By default a save refuses padding that holds anything
    else: a wrong ``size`` would otherwise drop real rows without a word."""
    kind: ClassVar[str] = "padded"

    def __post_init__(self) -> None:
        what, _ = self._checked()
        object.__setattr__(self, "size", integer(what, "size", self.size, 1, "an int >= 1 (the dim's logical size)"))
        object.__setattr__(self, "dim", integer(what, "dim", self.dim, 0, DIM))
        object.__setattr__(self, "fill", real(what, "fill", self.fill))
        object.__setattr__(self, "state_fill", real(what, "state_fill", self.state_fill))
        flag(what, "discard", self.discard)


@dataclass(frozen=True)
class Replicated(_Rule):
    """Values replicated over some mesh dims (TP-replicated norms and row-parallel biases): saved
    once; ``check`` what to do if the replicas differ at save: ``"error"``, ``"warn"``, ``"average"``
    (save their mean, like DeepSpeed's params-to-average) or ``"off"``."""

    pattern: str
    """Regex, full match against the parameter name."""
    check: ReplicaCheck = "error"
    """``error`` | ``warn`` | ``average`` | ``off``."""
    kind: ClassVar[str] = "replicated"

    def __post_init__(self) -> None:
        what, _ = self._checked()
        one_of(what, "check", self.check, REPLICA_CHECKS)


@dataclass(frozen=True)
class Reduce(_Rule):
    """A per-rank scalar/object (a token counter each rank keeps) reduced across ranks at save.

    On load, ``sum`` gives the total to the coordinator rank and 0 to the others (so the next save
    sums right); ``mean``/``max``/``equal`` give every rank the value. ``equal`` refuses to save
    values that differ.
    """

    pattern: str
    """Regex, full match against the atom name (e.g. ``r"train_state\\.ntokens_seen"``)."""
    op: ReduceOp = "sum"
    """``sum`` | ``mean`` | ``max`` | ``equal``."""
    kind: ClassVar[str] = "reduce"

    def __post_init__(self) -> None:
        what, _ = self._checked()
        one_of(what, "op", self.op, REDUCE_OPS)


@dataclass(frozen=True)
class Tied(_Rule):
    """Parameters that are one logical tensor (input embedding and output head on the first and
    last pipeline stage): saved once under ``param``, loaded into every alias; save checks that
    the copies agree."""

    param: str
    """Canonical parameter name of the tied atom."""
    aliases: tuple[str, ...]
    """Regexes (full match) of parameter names that are copies of it."""
    kind: ClassVar[str] = "tied"

    def __post_init__(self) -> None:
        what = f"Tied({text('Tied', 'param', self.param, 'a canonical parameter name (a non-empty string)')!r})"
        object.__setattr__(self, "aliases", regexes(what, "aliases", self.aliases, low=1))
        flag(what, "optional", self.optional)

    @property
    def pattern(self) -> str:
        return "|".join([re.escape(self.param), *self.aliases])


Rule = Fused | Padded | Replicated | Reduce | Tied
_KINDS: dict[str, type] = {c.kind: c for c in (Fused, Padded, Replicated, Reduce, Tied)}


def rule_to_json(rule: Rule) -> dict[str, Any]:
    """The catalog record of a rule: its layout (``optional`` is a property of the declaration and is
    left out, so a catalog reads the same in every ucp_dcp that knows the kind)."""
    d: dict[str, Any] = {"kind": rule.kind}
    for k, v in rule.__dict__.items():
        if k == "optional":
            continue
        d[k] = [list(p) for p in v] if k == "parts" else (list(v) if isinstance(v, tuple) else v)
    return d


def rule_from_json(d: dict[str, Any]) -> Rule:
    d = dict(d)
    cls = _KINDS.get(d.pop("kind", None))
    if cls is None:
        raise PatternError(f"unknown rule kind in catalog: {d}")
    if "parts" in d:
        d["parts"] = tuple(tuple(p) for p in d["parts"])
    if "aliases" in d:
        d["aliases"] = tuple(d["aliases"])
    try:
        return cls(**d)
    except TypeError as e:  # missing or unknown fields (a catalog is untrusted input)
        raise PatternError(f"rule {cls.__name__} in catalog: {e}", saved=d) from None
    except InvalidArgumentError as e:  # a field its constructor refuses
        raise PatternError(f"rule {cls.__name__} in catalog: {e.message}", saved=d, wanted=e.wanted) from None


def literal_prefix(pattern: str) -> str:
    """Text that every full match of ``pattern`` starts with (``"train_state."`` for
    ``r"train_state\\.ntokens_seen"``); ``""`` when that cannot be read off simply (a top-level
    alternation, or a metacharacter first). Conservative: a prefix it returns is always right."""
    depth, i, in_class = 0, 0, False
    while i < len(pattern):  # a top-level "|" means several possible starts
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            return ""
        i += 1
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            out.append(pattern[i + 1])
            i += 2
        elif c in ".^$*+?{}[]()|\\":
            break
        else:
            out.append(c)
            i += 1
    if out and i < len(pattern) and pattern[i] in "*?{":  # the last literal may be repeated 0 times
        out.pop()
    return "".join(out)


def anchored_in(rule: Rule, namespace: str) -> bool:
    """Whether every name ``rule`` can match lies under ``namespace``: its pattern starts with
    ``namespace`` and a literal dot (``r"train_state\\.ntokens_seen"`` in ``"train_state"``)."""
    return literal_prefix(rule.pattern).startswith(namespace + ".")


def describe(rule: Rule) -> str:
    if isinstance(rule, Tied):
        return f"tied({rule.param!r} <- {list(rule.aliases)})"
    return f"{rule.kind}({rule.pattern!r})"


_MATCHES: dict[tuple[Any, ...], tuple[dict[str, Any], dict[Any, Any]]] = {}
"""The regexes and kinds of a :class:`Patterns`' rules -> (name -> the rules matching it, ``(kind, name, declared
rules)`` -> the one rule of that kind it takes): pure functions of the rules, shared by every ``Patterns`` of
those rules (``plan`` makes one per simulated rank, each asking the same names)."""


@dataclass
class Patterns:
    """A set of rules with strictness; tracks which rules matched (for the strict check)."""

    rules: Sequence[Rule] = ()
    """The rules, in declaration order."""
    strict: bool = True
    """A declared rule that matches nothing is an error."""
    used: set[int] = field(default_factory=set)
    """Indices of rules that matched some name (this rank)."""

    def __post_init__(self) -> None:
        self.rules = tuple(self.rules)
        self._re: list[re.Pattern[str]] = []
        for r in self.rules:
            if not isinstance(r, tuple(_KINDS.values())):
                raise PatternError(f"not a pattern rule: {r!r}")
            try:
                self._re.append(re.compile(r.pattern))
            except re.error as e:
                raise PatternError(f"rule {describe(r)}: bad regex ({e})") from None
        regexes = tuple((rx.pattern, rx.flags) for rx in self._re)
        kinds = tuple(r.kind for r in self.rules)
        shared = _MATCHES.get((regexes, kinds))
        if shared is None:
            if len(_MATCHES) > 64:
                _MATCHES.clear()
            shared = _MATCHES[(regexes, kinds)] = ({}, {})
        self._match_cache, self._one_cache = shared

    def merged(self, other: Iterable[Rule]) -> Patterns:
        """These rules plus ``other`` (duplicates dropped); strictness applies to ours only."""
        extra = [r for r in other if r not in self.rules]
        merged = Patterns([*self.rules, *extra], strict=self.strict)
        merged._declared = len(self.rules)
        return merged

    @property
    def declared(self) -> range:
        return range(getattr(self, "_declared", len(self.rules)))

    def _matches(self, kind: str | tuple[str, ...], name: str) -> list[tuple[int, re.Match[str]]]:
        kinds = (kind,) if isinstance(kind, str) else kind
        return [(i, m) for i, m in self._all_matches(name) if self.rules[i].kind in kinds]

    def _all_matches(self, name: str) -> list[tuple[int, re.Match[str]]]:
        """Every rule matching ``name``: resolving a name asks for several kinds, one scan serves them."""
        cache = self._match_cache
        hit = cache.get(name)
        if hit is None:
            if len(cache) > 65536:  # bounded: names are a state dict's, asked a few times each
                cache.clear()
            hit = cache[name] = [(i, m) for i, rx in enumerate(self._re) if (m := rx.fullmatch(name))]
        return hit

    def _one(self, kind: str | tuple[str, ...], name: str, what: str) -> tuple[Rule, re.Match[str]] | None:
        key = (kind, name, len(self.declared))
        hit = self._one_cache.get(key)
        if hit is None:
            hit = self._one_cache[key] = self._first(kind, name, what)  # a conflict raises, and is not kept
            if len(self._one_cache) > 65536:
                self._one_cache.clear()
        if not hit:
            return None
        self.used.add(hit[0])
        return self.rules[hit[0]], hit[1]

    def _first(self, kind: str | tuple[str, ...], name: str, what: str) -> tuple[int, re.Match[str]] | tuple[()]:
        """The one rule of ``kind`` matching ``name`` (``()``: none), or the conflict :class:`PatternError`."""
        hits = self._matches(kind, name)
        declared = [h for h in hits if h[0] in self.declared]
        if declared and len(declared) < len(hits):
            hits = declared  # rules passed at load override the ones recorded at save
        if len(hits) > 1:
            rules = ", ".join(describe(self.rules[i]) for i, _ in hits)
            raise PatternError(
                f"{what} '{name}' matches conflicting rules: {rules}",
                atom=name,
                hint="make the patterns disjoint; one layout rule per parameter",
            )
        return hits[0] if hits else ()

    def expand(self, match: re.Match[str], template: str) -> str:
        """``match.expand(template)`` for a match this object returned (a ``fullmatch`` of one of its rules: its
        groups are those of the rule's regex over the whole name), remembered with the rule's other answers."""
        key = ("expand", match.re.pattern, match.re.flags, match.string, template)
        hit = self._one_cache.get(key)
        if hit is None:
            hit = self._one_cache[key] = match.expand(template)
        return hit

    def tie(self, param: str) -> str:
        """The canonical name of a tied parameter (``param`` itself if it is not tied)."""
        hit = self._one("tied", param, "parameter")
        return hit[0].param if hit else param

    def tensor_rule(self, param: str) -> tuple[Fused | Padded, re.Match[str]] | None:
        return self._one(("fused", "padded"), param, "parameter")  # type: ignore[return-value]

    def replicated(self, param: str) -> Replicated | None:
        hit = self._one("replicated", param, "parameter")
        return hit[0] if hit else None  # type: ignore[return-value]

    def reduce(self, atom: str) -> Reduce | None:
        hit = self._one("reduce", atom, "atom")
        return hit[0] if hit else None  # type: ignore[return-value]

    def note_names(self, names: Iterable[str]) -> None:
        """Mark rules matching any of ``names`` as used (names seen only in a saved catalog)."""
        for name in names:
            for i, _ in self._all_matches(name):
                self.used.add(i)

    def check_used(self, used: set[int], where: str) -> None:
        """Strict mode: every declared rule must have matched somewhere."""
        if not self.strict:
            return
        unused = [self.rules[i] for i in self.declared if i not in used and not self.rules[i].optional]
        if unused:
            first = unused[0]
            raise PatternError(
                f"{len(unused)} declared rule(s) matched no name {where}: " + ", ".join(describe(r) for r in unused),
                atom=first.param if isinstance(first, Tied) else first.pattern,
                hint="fix the regex (it must match the whole canonical parameter name, e.g. "
                r"'layers\.\d+\.attn\.wqkv\.weight'), declare the rule optional=True if it concerns state "
                "that only some saves hold, or pass strict=False",
            )

    def to_json(self) -> list[dict[str, Any]]:
        return [rule_to_json(r) for r in self.rules]


# -- checks of the arguments that pattern rules, index maps and name rules are built with ----------------------------
# A rule built with an impossible argument (``Padded(size=-1)``, a regex that does not compile, a
# reduction op outside the allowed set, a bare string where a sequence of strings goes) is refused by
# its constructor, where the mistake is, with a :class:`~ucp_dcp.errors.RuleArgumentError` that names
# the rule, the argument, what was given and what is allowed; not by a plan much later, far from it
# (or never: a string taken for a sequence of one-letter regexes). Each check returns the value in the
# form the rule keeps (an ``int`` for a numpy integer, a tuple for a list), so what is recorded in a
# checkpoint's catalog is plain JSON.


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
