"""How Hugging Face tensor names and orders map to ucp_dcp atoms (both ways).

A rule pairs an HF name template with an atom template, e.g.
``HFRule("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight", rotary_heads=32)``;
``{name}`` placeholders match a decimal index and carry it across, so one rule serves every layer
and reads in both directions (import and export). Fused targets need no rule of their own: the
target's ``Fused`` pattern already names its parts (``wq``, ``wk``, ``wv``) as atoms, which the
rules find in separate HF tensors.

``rotary_heads`` marks a projection whose rows HF keeps in *rotate-half* order (per head: the first
halves of all rotary pairs, then the second halves) while the atom is in the interleaved-pair order
of Meta's checkpoints and torchtitan's llama (per head: ``x0, y0, x1, y1, ...``). The permutation
stays inside each head, so any box of atom rows is a set of HF rows (:func:`hf_rows`): a rank
reads exactly the rows its box needs, whatever the sharding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import UCPError
from ...layout.patterns import integer, refuse, regexes, text

__all__ = ["HFRule", "HFMapping", "hf_rows", "atom_rows", "zero_fill"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")


def _compile(template: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in _PLACEHOLDER.finditer(template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


@dataclass(frozen=True)
class HFRule:
    """One HF tensor name template and the atom it holds."""

    hf: str
    """HF name template, e.g. ``model.layers.{i}.mlp.gate_proj.weight``."""
    atom: str
    """Atom template (without the mapping's ``prefix``), e.g. ``layers.{i}.feed_forward.w1.weight``."""
    rotary_heads: int | None = None
    """Heads of a q/k projection stored by HF in rotate-half order (rows permuted within each head)."""
    stack: str | None = None
    """A placeholder of the HF template only: the HF tensors for its values ``0..n-1`` are the
    slices ``[v]`` along dim 0 of one stacked atom (experts saved one tensor each by HF, held as
    ``[E, ...]`` by the target). Each is one saved chunk of the atom."""
    _hf_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    """The HF template as a pattern (set from ``hf``)."""
    _atom_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    """The atom template as a pattern (set from ``atom``)."""

    def __post_init__(self) -> None:
        text("HFRule", "hf", self.hf, "an HF tensor name template (a non-empty string)")
        text("HFRule", "atom", self.atom, "an atom name template (a non-empty string)")
        what = f"HFRule({self.hf!r}, {self.atom!r})"
        hf, atom = sorted(_PLACEHOLDER.findall(self.hf)), sorted(_PLACEHOLDER.findall(self.atom))
        if self.stack is not None:
            if not isinstance(self.stack, str) or self.stack not in hf or self.stack in atom:
                raise refuse(what, "stack", self.stack, "a placeholder of the HF template only, or None")
            hf.remove(self.stack)
        if hf != atom:
            raise refuse(what, "atom", self.atom, f"the HF template's placeholders {sorted(set(hf))}")
        if self.rotary_heads is not None:
            allowed = "an int >= 1 (the projection's heads), or None (or 0) for rows in HF's order"
            heads = integer(what, "rotary_heads", self.rotary_heads, 0, allowed)
            object.__setattr__(self, "rotary_heads", heads)
            if self.stack is not None and heads:
                raise refuse(what, "rotary_heads", heads, "None for a stacked atom (it cannot have rotary rows)")
        object.__setattr__(self, "_hf_re", _compile(self.hf))
        object.__setattr__(self, "_atom_re", _compile(self.atom))

    def match_hf(self, name: str) -> tuple[str, int | None] | None:
        """The atom an HF name holds, and (stacked rules) its index along the atom's dim 0."""
        m = self._hf_re.fullmatch(name)
        if m is None:
            return None
        vals = {k: int(v) for k, v in m.groupdict().items()}
        index = vals.pop(self.stack) if self.stack is not None else None
        return self.atom.format(**vals), index

    def match_atom(self, name: str) -> dict[str, int] | None:
        """The placeholder values of an atom name this rule produces (None: not this rule's)."""
        m = self._atom_re.fullmatch(name)
        return None if m is None else {k: int(v) for k, v in m.groupdict().items()}

    def hf_name(self, values: dict[str, int], index: int | None = None) -> str:
        """The HF name for placeholder ``values`` (and, stacked, the slice ``index``)."""
        return self.hf.format(**values, **({self.stack: index} if self.stack is not None else {}))


@dataclass(frozen=True)
class HFMapping:
    """The rules between one model family's HF checkpoints and its atoms."""

    rules: tuple[HFRule, ...]
    """Name (and row-order) rules; the first matching rule wins."""
    prefix: str = ""
    """Prefix of the atoms in the target state dict (``"model."`` when the model sits under a
    ``"model"`` key; torchtitan's model state is at the top level: ``""``)."""
    ignore: tuple[str, ...] = ()
    """Regexes of HF tensor names an import skips (e.g. buffers HF once saved); any other HF tensor
    no rule maps is an error, so a forgotten rule cannot drop weights silently."""
    config: dict[str, Any] = field(default_factory=dict)
    """The HF ``config.json`` an export writes (``architectures``, ``model_type``, sizes...)."""
    name: str = "custom"
    """Family name, for messages."""
    zero: tuple[str, ...] = ()
    """Regexes of target atoms HF's format has no tensor for and whose HF meaning is *zero*
    (torchtitan's load-balancing ``expert_bias_E``: HF's router is torchtitan's with a zero bias).
    :func:`~ucp_dcp.sources.hf.load_hf` sets them to zero (:func:`zero_fill`); an export writes
    nothing for them and refuses a checkpoint where they are not all zero (the HF model would
    compute something else)."""

    def __post_init__(self) -> None:
        what = f"HFMapping(name={self.name!r})"
        if isinstance(self.rules, (str, bytes, HFRule)) or not isinstance(self.rules, Iterable):
            raise refuse(what, "rules", self.rules, "a sequence of HFRule", hint="wrap it: (rule,)")
        object.__setattr__(self, "rules", tuple(self.rules))
        if not all(isinstance(r, HFRule) for r in self.rules):
            raise refuse(what, "rules", self.rules, "a sequence of HFRule")
        text(what, "prefix", self.prefix, "a string (the atoms' prefix, e.g. 'model.' or '')", empty=True)
        for arg in ("ignore", "zero"):
            object.__setattr__(self, arg, regexes(what, arg, getattr(self, arg)))
        if not isinstance(self.config, Mapping):
            raise refuse(what, "config", self.config, "a dict (the HF config.json an export writes)")

    def atom_of(self, hf_name: str) -> tuple[str, HFRule, int | None] | None:
        """The atom an HF tensor holds (with prefix), the rule, and the slice index of a stacked
        rule; None if no rule maps it."""
        for rule in self.rules:
            hit = rule.match_hf(hf_name)
            if hit is not None:
                return self.prefix + hit[0], rule, hit[1]
        return None

    def hf_of(self, atom: str) -> tuple[HFRule, dict[str, int]] | None:
        """The rule and placeholder values of an atom (with prefix) that has HF names
        (``rule.hf_name(values[, index])``), or None (optimizer state, ...)."""
        if not atom.startswith(self.prefix):
            return None
        for rule in self.rules:
            values = rule.match_atom(atom[len(self.prefix) :])
            if values is not None:
                return rule, values
        return None

    def ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignore)

    def zeroed(self, atom: str) -> bool:
        """Whether ``atom`` (with prefix) is one of the :attr:`zero` atoms."""
        return atom.startswith(self.prefix) and any(re.fullmatch(p, atom[len(self.prefix) :]) for p in self.zero)


def zero_fill(state_dict: dict[str, Any], mapping: HFMapping) -> tuple[dict[str, Any], list[str]]:
    """Zero the :attr:`HFMapping.zero` entries of ``state_dict`` in place (DTensors: their local
    shards) and return the state dict without them -- what an HF load plans -- and their names."""
    zeroed = [k for k, v in state_dict.items() if mapping.zeroed(k) and hasattr(v, "zero_")]
    with torch.no_grad():
        for k in zeroed:
            state_dict[k].zero_()
    return {k: v for k, v in state_dict.items() if k not in zeroed}, zeroed


def _head_dim(rows: int, heads: int, name: str) -> int:
    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise UCPError(
            f"'{name}': {rows} rows cannot be {heads} rotary heads of an even size",
            atom=name,
            saved=rows,
            wanted=heads,
            hint="check rotary_heads of its HF rule (n_heads for q, n_kv_heads for k)",
        )
    return rows // heads


def hf_rows(atom_rows_: np.ndarray, rows: int, heads: int, name: str = "") -> np.ndarray:
    """HF (rotate-half) row of each atom (interleaved-pair) row: within head ``h`` the atom row
    ``2i + j`` is HF row ``j * hd/2 + i``."""
    hd = _head_dim(rows, heads, name)
    h, r = np.divmod(np.asarray(atom_rows_, dtype=np.int64), hd)
    i, j = np.divmod(r, 2)
    return h * hd + j * (hd // 2) + i


def atom_rows(hf_rows_: np.ndarray, rows: int, heads: int, name: str = "") -> np.ndarray:
    """Inverse of :func:`hf_rows`: the atom row of each HF row."""
    hd = _head_dim(rows, heads, name)
    h, r = np.divmod(np.asarray(hf_rows_, dtype=np.int64), hd)
    j, i = np.divmod(r, hd // 2)
    return h * hd + 2 * i + j
