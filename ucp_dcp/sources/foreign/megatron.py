"""``MegatronReader``: Megatron-Core ``torch_dist`` checkpoints inside ``dcp.load``, no conversion.

``torch_dist`` is DCP underneath: ``.metadata`` lists every key's global shape and saved chunks, the
``__<rank>_<k>.distcp`` files hold each chunk as a ``torch.save`` item, ``common.pt`` the rest
(``args``, the optimizer's param groups, the step), ``metadata.json`` the backend. What differs from
our atoms is the naming and the layout:

* transformer layers are *stacked* on a leading layer axis under one key
  (``decoder.layers.self_attention.linear_qkv.weight`` is ``[L, rows, hidden]``): every layer of a
  chunk is one piece of ``layers.<l>...``;
* ``linear_qkv`` is group-major (per query group: its query heads, its key head, its value head) and
  ``linear_fc1`` is SwiGLU ``[W1; W3]`` (TP-invariant in the saved global layout): the target's own
  ``Fused`` rules split them (at ``tp=1``: the global layout);
* the vocabulary is padded (to a multiple of 128 x TP): the target's ``Padded`` rule drops the rows;
* norms are stored under the fused linear layers (``linear_qkv.layer_norm_weight``);
* MoE expert keys add a global expert axis after the layer axis (``[L, E, 2F, D]``); with
  ``singleton_local_shards`` every layer, expert and SwiGLU half is its own key. Each (layer, expert)
  slice is one parameter or a slice of a stacked ``[E, ...]`` target atom.

Names map by declared rules (:mod:`.megatron_rules`: :data:`GPT_RULES`, ``moe_rules``, biases,
QK-norm, ``expert_bias``); optimizer state (``optimizer.state.{exp_avg,exp_avg_sq}.<key>``, plain or
``fully_reshardable``, one optimizer or a ChainedOptimizer's dense + expert-parallel pair) lands in
the target's torch AdamW atoms, the step from ``common.pt``, param groups by Megatron's default split
(no weight decay for 1-D parameters and biases; expert parameters from the expert-parallel groups).
``dp_reshardable`` distributed-optimizer state (flat buffers with no parameter names) is refused with
the fix. Every file is parsed inertly (megatron need not be installed; nothing in the files runs).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from ..._compat import _create_file_view
from ...errors import CheckpointNotFoundError, CorruptCheckpointError, UCPError
from ...layout.patterns import Rule
from ...planning.device import StagingMode
from ...planning.payloads import ReadOnceMode
from ...storage.format import parse_tensor_record
from .base import ForeignReader
from .inert import Opaque, TensorRef, dig, load_inert, parse_pickle
from .megatron_rules import GPT_RULES, MegatronRule, rule_layout, unstack_key
from .pieces import Piece, RowLayout, split_rows

__all__ = ["MegatronReader", "MegatronRule", "GPT_RULES"]


_OPT = "optimizer.state."


class MegatronReader(ForeignReader):
    """Reads a Megatron-Core ``torch_dist`` checkpoint (see module doc) into any target layout.

    Args:
        path: the checkpoint folder (``.metadata``, ``*.distcp``, ``common.pt``, ``metadata.json``).
        patterns: the *target's* pattern rules (its ``Fused`` QKV/SwiGLU and ``Padded`` vocabulary).
        rules: Megatron key -> parameter name (default :data:`GPT_RULES`). Keys no rule maps are an
            error unless listed in ``ignore`` (regexes).
        prefix: where the model sits in the target state dict (``"model."``); ``optim``: where the
            optimizer state dict sits (``"optim."``; None: no optimizer atoms).
        master_weights: take parameters from the optimizer's fp32 copies
            (``optimizer.state.param.<key>``, ``fully_reshardable``) when present.
        target_rotary: the target's rotary convention, ``"interleaved"`` (Meta/torchtitan llama, the
            toy) or ``"rotate_half"``; a checkpoint trained with the other one is refused (its q/k
            rows would need a permutation). None: not checked.
    """

    source = "Megatron-Core torch_dist"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        patterns: Sequence[Rule] = (),
        rules: Sequence[MegatronRule] = GPT_RULES,
        ignore: Sequence[str] = (r".*\._extra_state.*", r"rng_state.*"),
        prefix: str = "model.",
        optim: str | None = "optim.",
        master_weights: bool = True,
        target_rotary: str | None = "interleaved",
        thread_count: int | None = None,
        staging: StagingMode | None = None,
        read_once: ReadOnceMode | None = None,
    ) -> None:
        super().__init__(path, thread_count=thread_count, staging=staging, read_once=read_once)
        self.patterns, self.ignore = list(patterns), tuple(ignore)
        self.rules: dict[str, list[MegatronRule]] = {}
        for r in rules:
            self.rules.setdefault(r.key, []).append(r)
        self._expert_params: set[str] = set()
        self.prefix, self.optim, self.master_weights, self.target_rotary = prefix, optim, master_weights, target_rotary

    def describe(self) -> tuple[list[Piece], dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, Any]]:
        self._check_backend()
        common = load_inert(os.path.join(self.path, "common.pt"))
        self._check_args(common.obj.get("args"))
        md = self._metadata_file()
        state = dig(md, "state_dict_metadata")
        storage = _storage_index(dig(md, "storage_data"))
        optimizer = common.obj.get("optimizer") or {}
        if _sharding(optimizer) == "dp_reshardable" or any(str(k).startswith("optimizer.distributed.") for k in state):
            raise UCPError(
                f"{self.path}: distributed-optimizer state saved as 'dp_reshardable' flat buffers (no "
                "parameter names) is not read",
                saved="dp_reshardable",
                hint="save with --dist-ckpt-optim-fully-reshardable (fully_reshardable), or load the "
                "model alone (optim=None)",
            )
        pieces: list[Piece] = []
        atoms: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        unmapped: list[str] = []
        masters = {str(k)[len(_OPT + "param.") :] for k in state if str(k).startswith(_OPT + "param.")}
        n_experts: dict[str, int] = {}  # per-expert keys: experts per stacked key
        for key in state:
            base, _, e, _ = unstack_key(_split_key(str(key))[1])
            if e is not None:
                n_experts[base] = max(n_experts.get(base, 0), e + 1)
        for key, smd in sorted(state.items(), key=lambda kv: str(kv[0])):
            key = str(key)
            kind, base = _split_key(key)
            where: tuple[int | None, int | None, int | None] = (None, None, None)
            if base not in self.rules:
                base, *rest = unstack_key(base)
                where = (rest[0], rest[1], rest[2])
            rules = self.rules.get(base)
            if rules is None:
                if not any(re.fullmatch(p, key) for p in self.ignore) and not (kind and self.optim is None):
                    unmapped.append(key)
                continue
            if kind is None and key in masters and self.master_weights:
                continue  # the fp32 master copy (optimizer.state.param.<key>) is the parameter
            if kind == "param":
                if not self.master_weights:
                    continue
                kind = None
            if kind is not None and self.optim is None:
                continue
            if not hasattr(smd, "field") or "chunks" not in (smd.state or {}):
                raise CorruptCheckpointError(f"{self.path}/.metadata: '{key}' is not a tensor entry", atom=key)
            self._key_pieces(key, rules, kind, smd, storage, pieces, atoms, where, n_experts.get(base))
        if unmapped:
            raise UCPError(
                f"{len(unmapped)} key(s) of the Megatron checkpoint match no rule: {unmapped[:6]}",
                atom=unmapped[0],
                saved=unmapped,
                hint="add a MegatronRule for them (key -> parameter name), or list them in ignore",
            )
        values = self._optimizer_values(common, optimizer, atoms) if self.optim is not None else {}
        return pieces, atoms, values

    # -- checks --------------------------------------------------------------------------------------

    def _check_backend(self) -> None:
        meta = os.path.join(self.path, "metadata.json")
        if not os.path.isfile(meta):
            raise CheckpointNotFoundError(
                f"no Megatron distributed checkpoint at {self.path}: no metadata.json",
                hint="pass the folder dist_checkpointing.save wrote",
            )
        with open(meta) as f:
            try:
                body = json.load(f)
            except json.JSONDecodeError as e:
                raise CorruptCheckpointError(f"{meta} is not JSON ({e})") from None
        if body.get("sharded_backend") != "torch_dist":
            raise UCPError(
                f"{self.path}: sharded_backend {body.get('sharded_backend')!r} is not read (only torch_dist)",
                saved=body.get("sharded_backend"),
                wanted="torch_dist",
            )

    def _check_args(self, args: Any) -> None:
        if not isinstance(args, Opaque) or self.target_rotary is None:
            return
        try:
            interleaved = bool(args.field("rotary_interleaved"))
            rope = args.field("position_embedding_type")
        except KeyError:
            return
        saved = "interleaved" if interleaved else "rotate_half"
        if rope == "rope" and saved != self.target_rotary:
            raise UCPError(
                f"{self.path} was trained with {saved} rotary embeddings, the target uses "
                f"{self.target_rotary}: its q/k rows would need a permutation",
                saved=saved,
                wanted=self.target_rotary,
                hint="load into a model with the same rotary convention (or pass target_rotary=None if "
                "the target applies the checkpoint's convention)",
            )

    def _metadata_file(self) -> Any:
        path = os.path.join(self.path, ".metadata")
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"no .metadata in {self.path}")
        with open(path, "rb") as f:
            return parse_pickle(f.read(), path)

    # -- pieces --------------------------------------------------------------------------------------

    def _key_pieces(
        self,
        key: str,
        rules: list[MegatronRule],
        kind: str | None,
        smd: Any,
        storage: Any,
        pieces: list[Piece],
        atoms: dict,
        where: tuple[int | None, int | None, int | None],
        n_experts: int | None,
    ) -> None:
        """Pieces of one key. Its leading axes (layer if stacked, expert if an expert key) pick the
        parameter, the rest is the parameter's own box; ``where``: the layer, expert and SwiGLU half a
        per-layer/per-expert/per-half key (``singleton_local_shards``) names instead."""
        size = tuple(int(x) for x in dig(smd, "size"))
        dtype = _dtype(dig(smd, "properties"), key)
        layer0, expert, half = where
        stacked, expert_axis = rules[0].stacked and layer0 is None, rules[0].experts and expert is None
        lead = int(stacked) + int(expert_axis)
        shape = size[lead:]
        full = (2 * shape[0], *shape[1:]) if half is not None else shape  # both halves: the parameter
        shift = half * shape[0] if half else 0
        n_e = size[int(stacked)] if expert_axis else (n_experts or 1)
        suffix = f".{kind}" if kind else ""
        base = f"{self.optim}state." if kind else self.prefix
        layouts: dict[tuple[int, int], tuple[RowLayout, bool]] = {}

        def layout(layer: int, e: int) -> tuple[RowLayout, bool]:
            if (layer, e) not in layouts:
                lay, keep, expert_params = rule_layout(key, rules, layer, e, full, self.patterns, base, suffix)
                self._expert_params.update(expert_params)
                layouts[(layer, e)] = lay, keep
            return layouts[(layer, e)]

        for layer in (layers := range(size[0]) if stacked else [layer0 or 0]):
            for e in range(n_e) if expert_axis else [expert or 0]:
                lay, keep = layout(layer, e)
                for k, atom in enumerate(lay.atoms):
                    rows = sum(s.length for s in lay.segments if s.part == k) if len(lay.atoms) > 1 else lay.size
                    one = (rows, *full[1:]) if full else ()
                    atoms.setdefault(atom, (dtype, (n_e, *one) if keep else one))
        for chunk in dig(smd, "chunks"):
            offs = tuple(int(x) for x in dig(chunk, "offsets"))
            sizes = tuple(int(x) for x in dig(chunk, "sizes"))
            info = storage.get((key, offs))
            if info is None:
                raise CorruptCheckpointError(
                    f".metadata lists chunk {list(offs)} of '{key}' but no storage entry for it",
                    atom=key,
                    hint="the checkpoint's metadata is damaged",
                )
            rel = str(dig(info, "relative_path"))
            at = self._item_data(rel, int(dig(info, "offset")), int(dig(info, "length")), key, dtype, sizes)
            o, s = offs[lead:], sizes[lead:]
            o = (o[0] + shift, *o[1:]) if o else o
            stride = int(torch.Size(s).numel())
            chunk_layers = range(offs[0], offs[0] + sizes[0]) if stacked else layers
            experts = range(offs[lead - 1], offs[lead - 1] + sizes[lead - 1]) if expert_axis else [expert or 0]
            for j, (layer, e) in enumerate((a, b) for a in chunk_layers for b in experts):
                lay, keep = layout(layer, e)
                for atom, ao, asz, elem in split_rows(lay, o, s, full):
                    if keep:  # the target keeps the experts stacked: the expert is the atom's dim 0
                        ao, asz = (e, *ao), (1, *asz)
                    pieces.append(Piece(atom, ao, asz, rel, at + (j * stride + elem) * dtype.itemsize, dtype))

    def _item_data(
        self, rel: str, offset: int, length: int, key: str, dtype: torch.dtype, sizes: tuple[int, ...]
    ) -> int:
        """Absolute offset of a saved item's tensor data (its torch.save record, parsed inertly)."""
        path = os.path.join(self.path, rel)
        if os.path.basename(rel) != rel or not os.path.isfile(path):
            raise CheckpointNotFoundError(
                f"{self.path}: '{key}' is in {rel!r}, which is not a file of the folder", atom=key
            )
        with open(path, "rb") as f:
            rec = parse_tensor_record(_create_file_view(f, offset, length))
        if rec is None or not rec.contiguous or rec.dtype != dtype or tuple(rec.shape) != sizes:
            raise CorruptCheckpointError(
                f"{rel}: the item of '{key}' at {offset} is not a contiguous {dtype} tensor of {list(sizes)}",
                atom=key,
                hint="the file is damaged",
            )
        if rec.data_offset + rec.nbytes > length:
            raise CorruptCheckpointError(f"{rel}: the item of '{key}' reaches past its extent", atom=key)
        return offset + rec.data_offset

    def _optimizer_values(self, common: Any, optimizer: Any, atoms: dict) -> dict[str, Any]:
        """Steps and param-group hyperparameters; groups by Megatron's default split (``wd_mult`` 0
        for 1-D parameters and biases, 1 for the rest), expert parameters from the expert-parallel
        groups (with MoE a ChainedOptimizer saves ``{0: dense, 1: expert}``)."""
        if not isinstance(optimizer, dict) or not optimizer:
            return {}
        subs = [optimizer[k] for k in sorted(optimizer) if isinstance(k, int)] or [optimizer]
        groups: dict[tuple[bool, float], dict] = {}
        steps: dict[bool, Any] = {}
        for sub in subs:
            inner = sub.get("optimizer", sub) if isinstance(sub, dict) else {}
            for g in list(inner.get("param_groups") or []):
                k = (bool(g.get("is_expert_parallel", False)), float(g.get("wd_mult", 1.0)))
                if k in groups or k[1] not in (0.0, 1.0):
                    raise UCPError(
                        f"{self.path}: param groups beyond Megatron's default split (wd_mult "
                        f"{k[1]}, expert-parallel {k[0]}, twice or not 0/1): cannot be assigned",
                        hint="load the model alone (optim=None) and set the groups yourself",
                    )
                groups[k] = g
            step = (inner.get("state") or {}).get("common_step")
            if isinstance(step, TensorRef):
                steps.setdefault(False, step)
        values: dict[str, Any] = {}
        state = f"{self.optim}state."
        for atom, (_, shape) in list(atoms.items()):
            if not atom.startswith(state) or not atom.endswith(".exp_avg"):
                continue
            param = atom[len(state) : -len(".exp_avg")]
            mult = 0.0 if len(shape) <= 1 or param.endswith(".bias") else 1.0
            expert = param in self._expert_params and any(k[0] for k in groups)
            group = groups.get((expert, mult))
            if group is None:
                raise UCPError(
                    f"no param group for '{param}' (groups {sorted(groups)}: expert-parallel, wd_mult)", atom=param
                )
            values.update({f"{self.optim}param_groups.{param}.{k}": v for k, v in group.items() if k not in _SKIP})
            s = steps.get(False, group.get("step"))
            if s is None:
                raise CorruptCheckpointError(f"{self.path}/common.pt has no optimizer step", atom=param)
            values[f"{state}{param}.step"] = _step_tensor(common, s)
        return values


_SKIP = {
    "params",
    "step",
    "wd_mult",
    "lr_mult",
    "is_expert_parallel",
    "default_config",
    "is_decoupled_lr",
    "max_lr",
    "min_lr",
}
"""Megatron's own group fields: not torch AdamW hyperparameters."""


def _sharding(optimizer: Any) -> str | None:
    """``param_state_sharding_type`` of a (chained: ``{0: ..., 1: ...}``) optimizer's common state."""
    if not isinstance(optimizer, dict):
        return None
    subs = [optimizer[k] for k in optimizer if isinstance(k, int)] or [optimizer]
    kinds = {s.get("param_state_sharding_type") for s in subs if isinstance(s, dict)}
    return "dp_reshardable" if "dp_reshardable" in kinds else next(iter(kinds), None)


def _step_tensor(common: Any, s: Any) -> torch.Tensor:
    if isinstance(s, TensorRef):
        with open(common.path, "rb") as f:
            f.seek(common.byte_offset(s))
            raw = f.read(s.dtype.itemsize)
        return torch.frombuffer(bytearray(raw), dtype=s.dtype).reshape(())
    return torch.tensor(float(s), dtype=torch.float32)


def _dtype(props: Any, key: str) -> torch.dtype:
    """``TensorProperties`` pickles its fields as a tuple (dtype first)."""
    state = props.state if isinstance(props, Opaque) else None
    dtype = (
        state[0]
        if isinstance(state, tuple) and state
        else (state or {}).get("dtype")
        if isinstance(state, dict)
        else None
    )
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f".metadata: '{key}' has no dtype", atom=key)
    return dtype


def _split_key(key: str) -> tuple[str | None, str]:
    """``optimizer.state.exp_avg.<key>`` -> ("exp_avg", key); a model key -> (None, key)."""
    if key.startswith(_OPT):
        kind, _, base = key[len(_OPT) :].partition(".")
        return kind, base
    return None, key


def _storage_index(storage: Any) -> dict[tuple[str, tuple[int, ...]], Any]:
    """``(key, chunk offsets) -> storage info`` of an inertly parsed ``storage_data``."""
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(".metadata has no storage_data table")
    out = {}
    for index, info in storage.items():
        if isinstance(index, Opaque):
            offset = (index.state or {}).get("offset") if isinstance(index.state, dict) else None
            out[(str(dig(index, "fqn")), tuple(int(x) for x in (offset or ())))] = info
    return out
