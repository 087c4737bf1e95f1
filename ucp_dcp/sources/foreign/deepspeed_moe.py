"""DeepSpeed's MoE layout (``deepspeed.moe.layer.MoE``, expert parallel) as names, ranks and files.

What :class:`~ucp_dcp.sources.foreign.deepspeed.DeepSpeedReader` needs to read a ZeRO-1/2 checkpoint
of a model with DeepSpeed MoE layers (``engine.save_checkpoint``, deepspeed 0.19.8):

* expert params are named ``<layer>.deepspeed_moe.experts.deepspeed_experts.<j>.<rest>`` with ``j``
  the *local* expert of an EP rank; the *global* expert is ``ep_rank * n_local + j``. The model
  file's ``param_shapes`` lists the expert group in rank 0's local names;
* ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` holds global expert ``E`` of the ``L``-th MoE
  layer (module order) under its global name: the expert *weights* (DeepSpeed's module copy, which
  its ``load_checkpoint`` loads; an fp32 run's master weights bit for bit);
* the optimizer files: rank ``r`` is EP rank ``r % ep`` and expert-data-parallel rank ``r // ep``
  (DeepSpeed's ``_create_expert_and_data_parallel``: EP groups are runs of ``ep`` consecutive ranks);
  its flat partition of a ``moe`` param group is partition ``r // ep`` (of ``dp / ep``) of its EP
  rank's local experts, the moments of those experts;
* the gate (``deepspeed_moe.gate.wg``) is a dense (replicated) param.

:data:`TOY_NAMES` maps DeepSpeed's names to the toy LLM's list-of-experts MoE (``moe.router``,
``moe.experts.<E>.w1``); another target passes its own :class:`NameRule` s. :class:`MoEReading` is
the reader's MoE part (its expert files and expert partitions); the rest are pure functions.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointNotFoundError, CorruptCheckpointError, UCPError
from .inert import TorchFile, load_inert

__all__ = [
    "EXPERTS",
    "MoELayout",
    "MoEReading",
    "NameRule",
    "TOY_NAMES",
    "expert_file",
    "moe_layout",
    "rename",
    "to_global",
]

EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
"""What DeepSpeed's ``MoE`` puts between a layer's path and its expert number."""

_EXPERT = re.compile(r"(.*)" + re.escape(EXPERTS) + r"(\d+)\.(.*)")


@dataclass(frozen=True)
class NameRule:
    """A DeepSpeed parameter name (``re.fullmatch``) and the target's name for it (``re.Match.expand``)."""

    pattern: str
    """Regular expression over the DeepSpeed name (global expert numbers)."""
    target: str
    """Template of the target's name (``\\1`` ... groups of ``pattern``)."""


TOY_NAMES: tuple[NameRule, ...] = (
    NameRule(r"(.*)\.deepspeed_moe\.gate\.wg\.(.*)", r"\1.router.\2"),
    NameRule(r"(.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.*)", r"\1.experts.\2.\3"),
)
"""DeepSpeed MoE -> the toy LLM's list MoE (the checkout's ``ucp_dev.toy.model.MoE`` with ``ListExperts``)."""


def rename(name: str, rules: Sequence[NameRule]) -> str:
    """``name`` under the first rule matching it, else unchanged."""
    for r in rules:
        m = re.fullmatch(r.pattern, name)
        if m:
            return m.expand(r.target)
    return name


def to_global(name: str, ep_rank: int, n_local: int) -> str:
    """A local expert param name (``...deepspeed_experts.<j>.w1.weight``) as its global name."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return name
    j = int(m.group(2))
    if j >= n_local:
        raise CorruptCheckpointError(f"'{name}': local expert {j} of {n_local}", atom=name)
    return f"{m.group(1)}{EXPERTS}{ep_rank * n_local + j}.{m.group(3)}"


@dataclass(frozen=True)
class MoELayout:
    """The experts of a DeepSpeed MoE checkpoint, from its model file."""

    layers: tuple[str, ...]
    """Module path of each MoE layer, in module order (the ``L`` of the expert files)."""
    rests: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    """Per layer: the params of one expert (name after the expert number, shape), in order."""
    n_experts: int
    """Global experts per layer."""
    n_local: int
    """Experts per EP rank."""

    @property
    def ep(self) -> int:
        """The expert-parallel degree of the run."""
        return self.n_experts // self.n_local

    def names(self, layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """The global names and shapes of one expert's params."""
        return [(f"{self.layers[layer]}{EXPERTS}{expert}.{r}", s) for r, s in self.rests[layer]]


def moe_layout(expert_shapes: dict[str, tuple[int, ...]], num_experts: Sequence[int], where: str) -> MoELayout:
    """The layout from the expert group's ``param_shapes`` (rank 0's local names) and the model
    file's ``num_experts`` (one entry per MoE layer)."""
    layers: dict[str, dict[int, list[tuple[str, tuple[int, ...]]]]] = {}
    for name, shape in expert_shapes.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            raise UCPError(
                f"{where}: '{name}' is in a moe param group but is not a DeepSpeed MoE expert param",
                atom=name,
                hint="only deepspeed.moe.layer.MoE experts are read",
            )
        layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append((m.group(3), shape))
    counts = {len(v) for v in layers.values()}
    totals = {int(n) for n in num_experts}
    if len(counts) != 1 or len(totals) != 1 or len(num_experts) != len(layers):
        raise UCPError(
            f"{where}: MoE layers with different expert counts (local {sorted(counts)}, global "
            f"{list(num_experts)} over {len(layers)} layers) are not read",
            hint="one ep_size and expert count for every MoE layer",
        )
    n_local, n_experts = counts.pop(), totals.pop()
    rests = []
    for path, experts in layers.items():
        first = experts[0] if 0 in experts else []
        if sorted(experts) != list(range(n_local)) or any(experts[j] != first for j in experts):
            raise CorruptCheckpointError(f"{where}: the experts of '{path}' differ in their params", atom=path)
        rests.append(tuple(first))
    if n_experts % n_local:
        raise CorruptCheckpointError(f"{where}: {n_experts} experts do not split into EP ranks of {n_local}")
    return MoELayout(tuple(layers), tuple(rests), n_experts, n_local)


def expert_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    """DeepSpeed's file of one expert (``_get_expert_ckpt_name``)."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


class MoEReading:
    """The MoE part of :class:`~ucp_dcp.sources.foreign.deepspeed.DeepSpeedReader` (a mixin: it uses
    the reader's ``path``, ``kind``, ``_layout`` and ``_whole``)."""

    path: str | os.PathLike
    kind: str
    moe: MoELayout | None = None
    """The experts of a MoE checkpoint (set when the metadata is read); None: no MoE layers."""
    _is_moe: list[bool]

    def _layout(self, name: str, shape: tuple[int, ...], suffix: str) -> Any:
        raise NotImplementedError

    def _whole(self, tf: TorchFile, name: str, ref: Any, suffix: str, shape: tuple | None = None) -> None:
        raise NotImplementedError

    def _moe_groups(self, model: TorchFile, shapes: list[dict[str, tuple[int, ...]]], names: list[str]) -> None:
        """Find the ``moe`` param groups (their params hold \"deepspeed_experts\") and the expert layout."""
        self.moe = None
        self._is_moe = [any(".deepspeed_experts." in n for n in g) for g in shapes]
        has_files = any(re.fullmatch(r"layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt", n) for n in names)
        if not any(self._is_moe) and not has_files:
            return
        if self.kind != "zero12":
            raise UCPError(
                f"{self.path}: a DeepSpeed MoE checkpoint in the {self.kind} form is not read",
                saved=self.kind,
                wanted="zero12",
                hint="MoE checkpoints of ZeRO stage 1 or 2 are read (docs/migrating.md says why not ZeRO-3/universal)",
            )
        if model.obj.get("ds_autoep_layers") or not any(self._is_moe):
            raise UCPError(
                f"{self.path} has expert files but no deepspeed.moe.layer.MoE expert params: DeepSpeed AutoEP "
                "layers (stacked experts.w1/w2/w3) are not read",
                hint="only checkpoints of deepspeed.moe.layer.MoE layers are read (docs/migrating.md)",
            )
        expert = {n: s for g, m in zip(shapes, self._is_moe) if m for n, s in g.items()}
        self.moe = moe_layout(expert, list(model.obj.get("num_experts") or []), model.path)

    def _global(self, g: int, group: dict[str, tuple[int, ...]], ep_rank: int | None = None) -> dict:
        """Group ``g``'s params under global names: of one EP rank, or (None) of every EP rank."""
        if self.moe is None or not self._is_moe[g]:
            return group
        ranks = range(self.moe.ep) if ep_rank is None else [ep_rank]
        return {to_global(n, e, self.moe.n_local): s for e in ranks for n, s in group.items()}

    def _expert_files(self) -> None:
        """Every expert's weights from its ``layer_<L>_expert_<E>`` file (each must be there, whole)."""
        moe = self.moe
        assert moe is not None
        for layer in range(len(moe.layers)):
            for e in range(moe.n_experts):
                want = moe.names(layer, e)
                path = os.path.join(self.path, expert_file(layer, e))
                atom = self._layout(want[0][0], want[0][1], "").atoms[0]
                if not os.path.isfile(path):
                    raise CheckpointNotFoundError(
                        f"{self.path} has no {expert_file(layer, e)}: expert {e} of MoE layer "
                        f"'{moe.layers[layer]}' (atom '{atom}') is missing",
                        atom=atom,
                        hint="the checkpoint is incomplete (each expert-parallel rank writes its experts' files)",
                    )
                tf = load_inert(path)
                have = sorted(map(str, tf.obj)) if isinstance(tf.obj, dict) else None
                if have != sorted(n for n, _ in want):
                    raise CorruptCheckpointError(
                        f"{path} holds {have}, expected the params of expert {e}: {[n for n, _ in want]}",
                        atom=atom,
                        hint="the file is not this checkpoint's expert file",
                    )
                for name, shape in want:
                    self._whole(tf, name, tf.obj[name], "", shape)

    def _expert_partition(
        self, fname: str, g: int, group: dict[str, tuple[int, ...]], r: int, dp: int, counts: Sequence[Any]
    ) -> tuple[int, int, dict[str, tuple[int, ...]]]:
        """Rank ``r``'s partition of the expert group ``g``: ``(index, count, params by global name)``."""
        assert self.moe is not None
        ep = self.moe.ep
        if dp % ep or int(counts[g]) != dp // ep:
            raise CorruptCheckpointError(
                f"{fname}: the expert group {g} is split {counts[g]} ways; {dp} ranks at ep={ep} split it "
                f"{dp // ep} ways",
                hint="the checkpoint is incomplete or not expert-parallel as DeepSpeed's MoE lays it out",
            )
        return r // ep, dp // ep, self._global(g, group, r % ep)
