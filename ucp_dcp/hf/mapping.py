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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UCPError

__all__ = ["HFRule", "HFMapping", "hf_rows", "atom_rows"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")


def _compile(template: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in _PLACEHOLDER.finditer(template):
        out.append(re.escape(template[pos:m.start()]))
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

    def __post_init__(self) -> None:
        if sorted(_PLACEHOLDER.findall(self.hf)) != sorted(_PLACEHOLDER.findall(self.atom)):
            raise UCPError(f"HF rule {self.hf!r} -> {self.atom!r}: both sides need the same placeholders")
        object.__setattr__(self, "_hf_re", _compile(self.hf))
        object.__setattr__(self, "_atom_re", _compile(self.atom))

    def match_hf(self, name: str) -> str | None:
        m = self._hf_re.fullmatch(name)  # type: ignore[attr-defined]
        return None if m is None else self.atom.format(**{k: int(v) for k, v in m.groupdict().items()})

    def match_atom(self, name: str) -> str | None:
        m = self._atom_re.fullmatch(name)  # type: ignore[attr-defined]
        return None if m is None else self.hf.format(**{k: int(v) for k, v in m.groupdict().items()})


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

    def atom_of(self, hf_name: str) -> tuple[str, HFRule] | None:
        """The atom an HF tensor holds (with prefix), or None if no rule maps it."""
        for rule in self.rules:
            atom = rule.match_hf(hf_name)
            if atom is not None:
                return self.prefix + atom, rule
        return None

    def hf_of(self, atom: str) -> tuple[str, HFRule] | None:
        """The HF name of an atom (with prefix), or None if it has none (optimizer state, ...)."""
        if not atom.startswith(self.prefix):
            return None
        for rule in self.rules:
            name = rule.match_atom(atom[len(self.prefix):])
            if name is not None:
                return name, rule
        return None

    def ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignore)


def _head_dim(rows: int, heads: int, name: str) -> int:
    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise UCPError(f"'{name}': {rows} rows cannot be {heads} rotary heads of an even size",
                       atom=name, saved=rows, wanted=heads,
                       hint="check rotary_heads of its HF rule (n_heads for q, n_kv_heads for k)")
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
