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
``moe.experts.<E>.w1``); another target passes its own :class:`NameRule` s. Pure functions: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import CorruptCheckpointError, UCPError

__all__ = ["EXPERTS", "MoELayout", "NameRule", "TOY_NAMES", "expert_file", "moe_layout", "rename", "to_global"]

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
"""DeepSpeed MoE -> the toy LLM's list MoE (``ucp_dcp.toy.model.MoE`` with ``ListExperts``)."""


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
