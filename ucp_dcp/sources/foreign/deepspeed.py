"""``DeepSpeedReader``: DeepSpeed ZeRO-1/2/3 and universal checkpoints inside ``dcp.load``, no conversion.

Three on-disk forms, detected from the folder:

* **ZeRO-1/2** (``mp_rank_00_model_states.pt`` + ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``):
  each rank's file holds one flat fp32 partition per param group (``single_partition_of_fp32_groups``)
  and the torch optimizer's flat moments (``base_optimizer_state``). The params of group ``g`` are
  laid out in ``param_shapes[g]`` order, each followed by its ``param_alignment_paddings``, the group
  padded to a multiple of ``2 x dp`` and cut into ``dp`` equal partitions;
* **ZeRO-3** (``zero_pp_rank_<r>_mp_rank_00_{model,optim}_states.pt``): every param is cut into ``dp``
  pieces of ``ceil(numel / dp)`` (the last one padded); rank ``r``'s flat group (``fp32_flat_groups``)
  is its pieces in ``param_shapes`` order;
* **universal** (``ds_to_universal``'s ``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``): one file per
  param and state (ZeRO-3's are flat, shaped by ``param_shapes``);
* **MoE, ZeRO-1/2** (``deepspeed.moe.layer.MoE``, expert parallel): expert files and ``moe`` groups under
  global expert numbers (:mod:`~ucp_dcp.sources.foreign.deepspeed_moe`), renamed by ``names``.

Every slice of a param in a flat buffer becomes a few contiguous boxes of its atoms (partial rows,
whole rows: :func:`~ucp_dcp.sources.foreign.pieces.flat_boxes`), cut again where the param fuses several atoms
(the target's own ``Fused`` rules, at the source's degrees: a DeepSpeed run is data-parallel, so
``tp=1``) or pads them (``Padded``). Parameters land in ``<prefix><param>`` atoms, fp32 master weights
being what is loaded (the training weights of an fp32 run, the master copy of a bf16/fp16 one); Adam
moments and the step in ``<optim>state.<param>.{exp_avg,exp_avg_sq,step}`` and every param group's
hyperparameters in ``<optim>param_groups.<param>.<name>`` — the atoms a ``torch.optim.AdamW`` state
dict of the target has. Tied aliases (``shared_params``) are not atoms of their own (the target's
``Tied`` rule reads them from their source). Files are parsed inertly
(:mod:`~ucp_dcp.sources.foreign.inert`): deepspeed need not be installed and nothing in them runs.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import CheckpointNotFoundError, CorruptCheckpointError, UCPError
from ...layout.patterns import Rule
from ...planning.device import StagingMode
from ...planning.payloads import ReadOnceMode
from .base import ForeignReader, row_layout
from .deepspeed_moe import MoEReading, NameRule, rename
from .inert import Opaque, TensorRef, TorchFile, dig, load_inert
from .pieces import Piece, flat_boxes, split_rows

__all__ = ["DeepSpeedReader", "STATES"]

STATES = ("exp_avg", "exp_avg_sq")
"""The Adam moments read (the flat buffers of ``torch.optim.Adam``/``AdamW``)."""


class DeepSpeedReader(MoEReading, ForeignReader):
    """Reads a DeepSpeed checkpoint (see module doc) into any target layout inside ``dcp.load``.

    Args:
        path: a ``save_checkpoint`` folder (its ``latest`` tag is read), a tag folder
            (``global_step<N>``), or a universal folder (``ds_to_universal``'s output, or a folder
            whose ``latest_universal`` names it; pass ``universal=True`` to prefer it).
        patterns: the *target's* pattern rules (``Fused``, ``Padded`` ...): they say how the
            DeepSpeed params (the model's own, e.g. a fused ``wqkv``) hold the target's atoms.
        degrees: the source's mesh degrees for rules whose ``blocks`` name a mesh dim (default 1).
        prefix: where the model sits in the target state dict (``"model."``).
        optim: where the optimizer state dict sits (``"optim."``); None: no optimizer atoms.
        tag: the tag folder to read instead of ``latest``'s.
        universal: read the universal folder that ``latest_universal`` names.
        names: rules from DeepSpeed's parameter names (global expert numbers) to the target's
            (``deepspeed_moe.TOY_NAMES`` for the toy LLM); unmatched names are kept.
    """

    source = "DeepSpeed"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        patterns: Sequence[Rule] = (),
        degrees: dict[str, int] | None = None,
        prefix: str = "model.",
        optim: str | None = "optim.",
        tag: str | None = None,
        universal: bool = False,
        names: Sequence[NameRule] = (),
        thread_count: int | None = None,
        staging: StagingMode | None = None,
        read_once: ReadOnceMode | None = None,
    ) -> None:
        super().__init__(
            _resolve(os.fspath(path), tag, universal), thread_count=thread_count, staging=staging, read_once=read_once
        )
        self.rules = list(patterns)
        self.degrees = dict(degrees or {})
        self.prefix, self.optim = prefix, optim
        self.names = tuple(names)
        self.kind = ""
        """``"zero12"``, ``"zero3"`` or ``"universal"`` (set when the metadata is read)."""

    # -- what the folder holds -------------------------------------------------------------------------

    def describe(self) -> tuple[list[Piece], dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, Any]]:
        names = os.listdir(self.path)
        if os.path.isdir(os.path.join(self.path, "zero")):
            self.kind = "universal"
        elif any(re.fullmatch(r"zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt", n) for n in names):
            self.kind = "zero3"
        elif any(n.endswith("_optim_states.pt") for n in names):
            self.kind = "zero12"
        else:
            raise CheckpointNotFoundError(
                f"no DeepSpeed checkpoint in {self.path}: neither ZeRO optimizer files nor a universal zero/ folder",
                hint="pass the save_checkpoint folder or a tag",
            )
        model_files = sorted(n for n in names if re.fullmatch(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt", n))
        if not model_files:
            raise CheckpointNotFoundError(f"{self.path} has no *_model_states.pt file")
        model = load_inert(os.path.join(self.path, model_files[0]))
        self._check_model(model)
        shapes = [{str(k): tuple(int(x) for x in v) for k, v in _items(g)} for g in dig(model.obj, "param_shapes")]
        self._shared = set(_items_dict(model.obj.get("shared_params") or {}))
        self._atoms: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._pieces: list[Piece] = []
        values: dict[str, Any] = {}
        self._moe_groups(model, shapes, names)
        if self.kind == "universal":
            groups = self._universal(shapes)
        else:
            groups = self._zero(shapes)
        if self.optim is not None:
            for g, group in enumerate(groups):
                hp = {k: v for k, v in _items(group) if k != "params"}
                for name, shape in self._global(g, shapes[g]).items():
                    for atom in self._layout(name, shape, "").atoms:
                        part = atom[len(self.prefix) :]
                        values.update({f"{self.optim}param_groups.{part}.{k}": v for k, v in hp.items()})
        for name in map(str, model.obj.get("buffer_names") or []):
            self._whole(model, name, dig(model.obj, "module", name), "")
        if self.moe is not None:
            self._expert_files()
        return self._pieces, self._atoms, values

    def _check_model(self, model: TorchFile) -> None:
        o = model.obj
        if not isinstance(o, dict) or "param_shapes" not in o:
            raise CorruptCheckpointError(
                f"{model.path} is not a DeepSpeed model-states file (no param_shapes)",
                hint="pass the folder or tag save_checkpoint wrote (expert files are read from it)",
            )
        if (
            int(o.get("mp_world_size") or 1) != 1
            or int(dig(o.get("checkpoint_parallel_dimensions") or {"pp_degree": 1}, "pp_degree")) != 1
        ):
            raise UCPError(
                f"{model.path}: a DeepSpeed checkpoint with model parallelism (mp_world_size="
                f"{o.get('mp_world_size')}) is not read yet",
                hint="data-parallel ZeRO-1/2/3 checkpoints and universal folders are (docs/migrating.md)",
            )
        frozen = o.get("frozen_param_shapes")
        groups = frozen if isinstance(frozen, (list, tuple)) else [frozen]
        if any(g and _items_dict(g) for g in groups):
            raise UCPError(
                f"{model.path} has frozen parameters (frozen_param_shapes): not read yet",
                hint="unfreeze them before saving, or load them from the model weights separately",
            )

    def _layout(self, name: str, shape: tuple[int, ...], suffix: str) -> Any:
        prefix = self.prefix if not suffix else f"{self.optim}state."
        name = rename(name, self.names)
        return row_layout(name, shape[0] if shape else 1, self.rules, self.degrees, prefix=prefix, suffix=suffix)

    def _add(
        self,
        name: str,
        shape: tuple[int, ...],
        suffix: str,
        start: int,
        numel: int,
        file: str,
        base: int,
        dtype: torch.dtype,
    ) -> None:
        """Pieces of ``name``'s flat elements ``[start, start + numel)``, element ``start`` at byte ``base``."""
        layout = self._layout(name, shape, suffix)
        for k, atom in enumerate(layout.atoms):
            rows = sum(s.length for s in layout.segments if s.part == k) if len(layout.atoms) > 1 else layout.size
            self._atoms.setdefault(atom, (dtype, (rows, *shape[1:]) if shape else ()))
        for offs, sizes, first in flat_boxes(shape, start, numel):
            for atom, o, s, elem in split_rows(layout, offs, sizes, shape):
                at = base + (first - start + elem) * dtype.itemsize
                self._pieces.append(Piece(atom, o, s, file, at, dtype))

    def _whole(self, tf: TorchFile, name: str, ref: Any, suffix: str, shape: tuple | None = None) -> None:
        if not isinstance(ref, TensorRef) or not ref.contiguous:
            raise CorruptCheckpointError(f"{tf.path}: '{name}' is not a contiguous tensor", atom=name)
        shape = tuple(ref.shape) if shape is None else shape
        if math.prod(shape) != ref.numel:
            raise CorruptCheckpointError(
                f"{tf.path}: '{name}' has {ref.numel} elements, param_shapes says {list(shape)}", atom=name
            )
        self._add(
            name, shape, suffix, 0, ref.numel, os.path.relpath(tf.path, self.path), tf.byte_offset(ref), ref.dtype
        )

    def _step(self, tf: TorchFile, name: str, shape: tuple[int, ...], ref: Any) -> None:
        if self.optim is None:
            return
        if not isinstance(ref, TensorRef) or ref.numel != 1:
            raise CorruptCheckpointError(f"{tf.path}: the step of '{name}' is not a one-element tensor", atom=name)
        rel = os.path.relpath(tf.path, self.path)
        for atom in self._layout(name, shape, ".step").atoms:
            self._atoms[atom] = (ref.dtype, ())
            self._pieces.append(Piece(atom, (), (), rel, tf.byte_offset(ref), ref.dtype))

    # -- ZeRO-1/2 and ZeRO-3 ---------------------------------------------------------------------------

    def _zero(self, shapes: list[dict[str, tuple[int, ...]]]) -> list[Any]:
        files = sorted(
            (int(m.group(1)), n)
            for n in os.listdir(self.path)
            if (m := re.fullmatch(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt", n))
        )
        dp = len(files)
        if [r for r, _ in files] != list(range(dp)):
            raise CheckpointNotFoundError(
                f"{self.path}: optimizer files of ranks {[r for r, _ in files]}; expected 0..{dp - 1}",
                hint="the checkpoint is incomplete",
            )
        groups: list[Any] = []
        for r, fname in files:
            tf = load_inert(os.path.join(self.path, fname))
            osd = dig(tf.obj, "optimizer_state_dict")
            if self.kind == "zero3":
                fp32, base = dig(osd, "fp32_flat_groups"), dig(osd, "optimizer_state_dict")
                count = int(dig(osd, "partition_count"))
            else:
                fp32, base = dig(osd, "single_partition_of_fp32_groups"), dig(osd, "base_optimizer_state")
                count = int(dig(osd, "partition_count")[0])
            if count != dp:
                raise CorruptCheckpointError(
                    f"{fname} was written by one of {count} ranks, the folder has {dp} files",
                    hint="the checkpoint is incomplete or mixes two saves",
                )
            if len(fp32) != len(shapes):
                raise UCPError(
                    f"{fname}: {len(fp32)} flat groups for {len(shapes)} param groups (ZeRO-3 sub-groups "
                    "smaller than a group are not read)",
                    hint="save with a sub_group_size above the model size",
                )
            state = dig(base, "state")
            for g, group in enumerate(shapes):
                st = state[g] if g in state else state[str(g)]
                bufs = {"": fp32[g], **{"." + k: dig(st, k) for k in STATES}}
                part, parts = r, dp
                if self.moe is not None and self._is_moe[g]:
                    part, parts, group = self._expert_partition(fname, g, group, r, dp, dig(osd, "partition_count"))
                    del bufs[""]  # the weights come from the expert files
                if self.kind == "zero3":
                    self._zero3_group(tf, r, dp, group, bufs)
                else:
                    pads = dig(osd, "param_alignment_paddings")[g]
                    self._zero12_group(tf, part, parts, group, pads, bufs)
                if part == 0:
                    for name, shape in group.items():
                        self._step(tf, name, shape, dig(st, "step"))
            if r == 0:
                groups = list(dig(base, "param_groups"))
        return groups

    def _zero12_group(
        self,
        tf: TorchFile,
        r: int,
        dp: int,
        group: dict[str, tuple[int, ...]],
        pads: Sequence[int],
        bufs: dict[str, Any],
    ) -> None:
        sizes = [math.prod(s) for s in group.values()]
        total = sum(n + int(p) for n, p in zip(sizes, pads))
        align = 2 * dp
        ps = -(-total // align) * align // dp
        lo, hi = r * ps, (r + 1) * ps
        off = 0
        for (name, shape), n, pad in zip(group.items(), sizes, pads):
            a, b = max(lo, off), min(hi, off + n)
            if b > a:
                for suffix, ref in bufs.items():
                    if suffix and self.optim is None:
                        continue
                    self._check_flat(tf, ref, ps if suffix else None, name, need=b - lo)
                    base = tf.byte_offset(ref) + (a - lo) * ref.dtype.itemsize
                    self._add(name, shape, suffix, a - off, b - a, os.path.basename(tf.path), base, ref.dtype)
            off += n + int(pad)

    def _zero3_group(
        self, tf: TorchFile, r: int, dp: int, group: dict[str, tuple[int, ...]], bufs: dict[str, Any]
    ) -> None:
        pos = 0
        for name, shape in group.items():
            n = math.prod(shape)
            c = -(-n // dp)
            a, b = r * c, min((r + 1) * c, n)
            if b > a:
                for suffix, ref in bufs.items():
                    if suffix and self.optim is None:
                        continue
                    self._check_flat(tf, ref, None, name, need=pos + b - a)
                    base = tf.byte_offset(ref) + pos * ref.dtype.itemsize
                    self._add(name, shape, suffix, a, b - a, os.path.basename(tf.path), base, ref.dtype)
            pos += c

    @staticmethod
    def _check_flat(tf: TorchFile, ref: Any, length: int | None, name: str, need: int = 0) -> None:
        if not isinstance(ref, TensorRef) or len(ref.shape) != 1 or not ref.contiguous:
            raise CorruptCheckpointError(f"{tf.path}: the flat buffer holding '{name}' is not a 1-D tensor", atom=name)
        if (length is not None and ref.numel != length) or ref.numel < need:
            raise CorruptCheckpointError(
                f"{tf.path}: the flat buffer holding '{name}' has {ref.numel} elements, the "
                f"layout needs {length or need}",
                atom=name,
                hint="the file does not match its param_shapes (damaged, or another layout)",
            )

    # -- universal ------------------------------------------------------------------------------------

    def _universal(self, shapes: list[dict[str, tuple[int, ...]]]) -> list[Any]:
        zero = os.path.join(self.path, "zero")
        opt = load_inert(os.path.join(zero, "optimizer_state.pt"))
        groups = list(dig(opt.obj, "param_groups"))
        for g, group in enumerate(shapes):
            for name, shape in group.items():
                folder = os.path.join(zero, name)
                if not os.path.isdir(folder) or os.path.realpath(folder) != os.path.join(os.path.realpath(zero), name):
                    raise CheckpointNotFoundError(
                        f"universal checkpoint {self.path} has no atom folder for '{name}'",
                        atom=name,
                        hint="the conversion did not finish",
                    )
                states = [("fp32", "")] + ([(k, "." + k) for k in STATES] if self.optim is not None else [])
                for fname, suffix in states:
                    tf = load_inert(os.path.join(folder, fname + ".pt"))
                    ref = tf.obj["param"] if isinstance(tf.obj, dict) else tf.obj
                    self._whole(tf, name, ref, suffix, shape)
                step_file = os.path.join(folder, "step.pt")
                if os.path.exists(step_file):
                    tf = load_inert(step_file)
                    self._step(tf, name, shape, tf.obj)
                else:  # ZeRO-3 universal: the step of the group in the optimizer state
                    st = dig(opt.obj, "optimizer_state_dict", "state")
                    self._step(opt, name, shape, dig(st[g] if g in st else st[str(g)], "step"))
        return groups


def _items(d: Any) -> list[tuple[Any, Any]]:
    if isinstance(d, dict):
        return list(d.items())
    if isinstance(d, Opaque):
        return list(d.entries.items()) or list((d.state or {}).items())
    raise CorruptCheckpointError(f"expected a mapping, found {type(d).__name__}")


def _items_dict(d: Any) -> dict:
    return dict(_items(d)) if d else {}


def _resolve(path: str, tag: str | None, universal: bool) -> str:
    """The folder holding the files: a tag folder, the universal folder, or ``path`` itself."""

    def _pointer(name: str) -> str | None:
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return None
        with open(f) as fh:
            sub = fh.read(4096).strip()
        if not sub or os.sep in sub or sub in (".", "..") or "/" in sub:
            raise CorruptCheckpointError(f"{f} names {sub!r}, not a folder of {path}")
        return os.path.join(path, sub)

    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"no DeepSpeed checkpoint at {path}: not a folder", saved=path)
    if tag is not None:
        if not os.path.isdir(os.path.join(path, tag)):
            raise CheckpointNotFoundError(f"no DeepSpeed checkpoint tag folder {os.path.join(path, tag)}")
        return os.path.join(path, tag)
    if universal:
        found = _pointer("latest_universal")
        if found is None:
            raise CheckpointNotFoundError(f"{path} has no latest_universal file", hint="run ds_to_universal first")
        return found
    if os.path.isdir(os.path.join(path, "zero")) or any(n.endswith("_optim_states.pt") for n in os.listdir(path)):
        return path
    found = _pointer("latest")
    if found is None:
        raise CheckpointNotFoundError(
            f"no DeepSpeed checkpoint at {path}: no 'latest' file and no ZeRO files",
            hint="pass the folder save_checkpoint wrote, or a tag folder",
        )
    return found
