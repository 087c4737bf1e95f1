"""Fused QKV under ucp_dcp: ``wqkv`` kept fused in the model state and saved as ``wq``/``wk``/``wv`` atoms.

Stock torchtitan splits ``wqkv`` in a state-dict hook, which redistributes the weight to ``Replicate`` (an
all-gather on every save and load) while its optimizer moments stay fused. With ``fused_qkv_atoms`` the
manager bypasses that hook (:class:`FusedQKVModelWrapper`, :func:`without_qkv_split_hooks`) and declares a
``Fused`` rule per geometry (:func:`fused_qkv_rules`, group-major: one block per KV head), so each rank
writes its local shard, moments included, as pieces of the ``wq``/``wk``/``wv`` atoms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.models.common.attention import FusedQKVLinear

from .._compat import state_dict_hooks
from ..errors import PatternError
from ..layout.patterns import Fused
from ._compat import qkv_split_hook

__all__ = ["FusedQKVModelWrapper", "fused_qkv_rules", "without_qkv_split_hooks"]


class FusedQKVModelWrapper(ModelWrapper):
    """torchtitan's model state, but with fused ``wqkv`` left fused: its state-dict hook (which
    redistributes wqkv to Replicate to split it) is bypassed, and ucp_dcp's ``Fused`` rule writes the
    local shards as ``wq``/``wk``/``wv`` atoms. On load the fused key arrives directly, so the merge
    hook has nothing to merge."""

    def _get_state_dict(self) -> dict[str, Any]:
        with without_qkv_split_hooks(self.model):
            return super()._get_state_dict()


@contextlib.contextmanager
def without_qkv_split_hooks(models: list[nn.Module]) -> Iterator[None]:
    """Within: torchtitan's ``wqkv`` split hook taken off every fused QKV module of ``models`` (put back on exit)."""
    removed: list[tuple[nn.Module, int, Any]] = []
    split = qkv_split_hook()
    for model in models:
        for m in model.modules():
            if isinstance(m, FusedQKVLinear):
                for hid, hook in list(state_dict_hooks(m).items()):
                    if hook is split:
                        removed.append((m, hid, hook))
                        del state_dict_hooks(m)[hid]
    try:
        yield
    finally:
        for m, hid, hook in removed:
            state_dict_hooks(m)[hid] = hook


def fused_qkv_rules(model_parts: list[nn.Module]) -> list[Fused]:
    """One ``Fused`` rule per distinct fused-QKV geometry (identical on every rank: each rank's
    geometries are gathered, since a pipeline stage sees only its own layers)."""
    shapes = set()
    for model in model_parts:
        for m in model.modules():
            if isinstance(m, FusedQKVLinear):
                hd, hpk = m.head_dim, m.heads_per_kv
                n_kv = m.wqkv.weight.shape[0] // (m.r_dim * hd)
                shapes.add((n_kv, hpk, hd))
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(shapes))
        shapes = {tuple(s) for g in gathered for s in g}
    if len(shapes) > 1:
        raise PatternError(
            f"fused QKV modules with different geometries {sorted(shapes)} are not supported by "
            "fused_qkv_atoms; declare one Fused rule per geometry in checkpoint.rules"
        )
    rules = []
    for n_kv, hpk, hd in sorted(shapes):
        rules.append(
            Fused(
                r"(.*)\.qkv_linear\.wqkv\.(weight|bias)",
                (
                    (r"\1.qkv_linear.wq.\2", n_kv * hpk * hd),
                    (r"\1.qkv_linear.wk.\2", n_kv * hd),
                    (r"\1.qkv_linear.wv.\2", n_kv * hd),
                ),
                blocks=n_kv,  # group-major: per KV head, its query heads then its key and value head
            )
        )
    return rules
