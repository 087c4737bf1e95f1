"""Megatron-Core ``torch_dist`` key -> parameter-name rules (dense GPT, MoE, biases, QK-norm).

A ``torch_dist`` key stacks every transformer layer on a leading axis; MoE expert keys
(``SequentialMLP``, ``singleton_local_shards=False``) add a global expert axis after it
(``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is ``[L, E, 2F, D]``). With
``singleton_local_shards=True`` Megatron saves one key per layer, per expert and per SwiGLU half
(``decoder.layers.<i>.mlp.experts.experts.<e>.linear_fc1.weight_w``): :func:`unstack_key` names the
stacked key, layer, expert and half, so the same rules read both forms. A rule may hold for some
layers only (the toy keeps experts stacked ``[E, F, D]`` in some layers and as one module per expert
in others) and may split a SwiGLU ``linear_fc1`` (``[W1; W3]`` in the saved global layout) into two
parameters itself, for targets whose experts keep ``w1``/``w3`` apart.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import CorruptCheckpointError, UCPError
from ...layout.fragments import Segment
from ...layout.patterns import Rule
from .base import row_layout
from .pieces import RowLayout

__all__ = ["MegatronRule", "GPT_RULES", "moe_rules", "EXTRA_RULES", "rule_layout", "unstack_key"]


@dataclass(frozen=True)
class MegatronRule:
    """A Megatron key and the parameter it holds."""

    key: str
    """The ``torch_dist`` key (without the ``optimizer.state.<kind>.`` prefix of optimizer state)."""
    param: str
    """The parameter name, with ``{i}`` for the layer of a stacked key and ``{e}`` for the expert of an
    expert key; an expert key's rule without ``{e}`` keeps the experts stacked (``[E, ...]``)."""
    stacked: bool = False
    """The key has a leading layer axis (one slice per transformer layer)."""
    experts: bool = False
    """The key has a global expert axis after the layer axis (MoE ``SequentialMLP`` weights)."""
    glu: str | None = None
    """A SwiGLU ``linear_fc1``: the first half of its rows is ``param``, the second half this one."""
    layers: tuple[int, ...] | None = None
    """The layers the rule holds for (None: all); the key's other layers need another rule."""

    def applies(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


def _r(key: str, param: str, **kw: object) -> MegatronRule:
    return MegatronRule("decoder.layers." + key, "layers.{i}." + param, stacked=True, **kw)  # type: ignore[arg-type]


GPT_RULES: tuple[MegatronRule, ...] = (
    MegatronRule("embedding.word_embeddings.weight", "tok_embeddings.weight"),
    MegatronRule("output_layer.weight", "output.weight"),
    MegatronRule("decoder.final_layernorm.weight", "norm.weight"),
    _r("self_attention.linear_qkv.layer_norm_weight", "attn_norm.weight"),
    _r("input_layernorm.weight", "attn_norm.weight"),
    _r("self_attention.linear_qkv.weight", "attn.wqkv.weight"),
    _r("self_attention.linear_proj.weight", "attn.wo.weight"),
    _r("mlp.linear_fc1.layer_norm_weight", "ffn_norm.weight"),
    _r("pre_mlp_layernorm.weight", "ffn_norm.weight"),
    _r("mlp.linear_fc1.weight", "ffn.w13.weight"),
    _r("mlp.linear_fc2.weight", "ffn.w2.weight"),
)
"""Megatron-Core GPT (local or Transformer Engine spec, no biases) -> the toy LLM's parameter names
(Llama-style: ``attn.wqkv`` group-major, ``ffn.w13`` = ``[w1; w3]``)."""

_EXP = "mlp.experts.experts."


def moe_rules(stacked_layers: Sequence[int] = (), list_layers: Sequence[int] = ()) -> tuple[MegatronRule, ...]:
    """Rules of a Megatron MoE GPT (every layer MoE, ``SequentialMLP`` experts) into the toy's MoE
    layers: the router (``moe.router.weight``), experts stacked ``[E, F, D]``
    (``moe.experts.w1``/``w3``/``w2``) in ``stacked_layers``, one module per global expert
    (``moe.experts.<e>.w1.weight``) in ``list_layers``. The attention and norms follow
    :data:`GPT_RULES`; there is no dense ``linear_fc1``/``linear_fc2``."""
    stacked, listed = tuple(stacked_layers), tuple(list_layers)
    dense = tuple(r for r in GPT_RULES if ".mlp.linear_fc" not in r.key or "layer_norm" in r.key)
    out = [*dense, _r("mlp.router.weight", "moe.router.weight")]
    if stacked:
        out += [
            _r(
                _EXP + "linear_fc1.weight",
                "moe.experts.w1",
                experts=True,
                glu="layers.{i}.moe.experts.w3",
                layers=stacked,
            ),
            _r(_EXP + "linear_fc2.weight", "moe.experts.w2", experts=True, layers=stacked),
        ]
    if listed:
        e = "moe.experts.{e}."
        out += [
            _r(
                _EXP + "linear_fc1.weight",
                e + "w1.weight",
                experts=True,
                glu="layers.{i}." + e + "w3.weight",
                layers=listed,
            ),
            _r(_EXP + "linear_fc2.weight", e + "w2.weight", experts=True, layers=listed),
        ]
    return tuple(out)


EXTRA_RULES: tuple[MegatronRule, ...] = (
    _r("self_attention.linear_qkv.bias", "attn.wqkv.bias"),
    _r("self_attention.linear_proj.bias", "attn.wo.bias"),
    _r("self_attention.q_layernorm.weight", "attn.q_norm.weight"),
    _r("self_attention.k_layernorm.weight", "attn.k_norm.weight"),
    _r("mlp.linear_fc1.bias", "ffn.w13.bias"),
    _r("mlp.linear_fc2.bias", "ffn.w2.bias"),
    _r("mlp.router.bias", "moe.router.bias"),
    _r("mlp.router.expert_bias", "moe.router.expert_bias"),
    _r(_EXP + "linear_fc1.bias", "moe.experts.{e}.w1.bias", experts=True, glu="layers.{i}.moe.experts.{e}.w3.bias"),
    _r(_EXP + "linear_fc2.bias", "moe.experts.{e}.w2.bias", experts=True),
)
"""Biases (``add_bias_linear``; the QKV bias group-major like its weight), QK layer norms
(``qk_layernorm``) and the aux-loss-free router's ``expert_bias`` buffer, by Llama/Qwen-style names:
the toy has none of them, so a target that has them declares its own parameters by these names."""


def rule_layout(
    key: str,
    rules: Sequence[MegatronRule],
    layer: int,
    e: int,
    shape: tuple[int, ...],
    patterns: Sequence[Rule],
    base: str,
    suffix: str,
) -> tuple[RowLayout, bool, tuple[str, ...]]:
    """The atoms of the (``layer``, expert ``e``) slice of ``key`` (``shape``: the slice's), whether
    they keep an expert axis (``[E, ...]`` atoms), and the expert parameters among them. A fused
    target parameter is split by the target's own ``patterns`` (at tp=1: the saved global layout)."""
    rule = next((r for r in rules if r.applies(layer)), None)
    if rule is None:
        raise UCPError(
            f"'{key}': no rule for layer {layer} (rules for layers {[r.layers for r in rules]})",
            atom=key,
            hint="give every layer of the key a MegatronRule",
        )
    param = rule.param.format(i=layer, e=e)
    rows = shape[0] if shape else 1
    keep = rule.experts and "{e}" not in rule.param
    if rule.glu is None:
        return row_layout(param, rows, patterns, {"tp": 1}, base, suffix), keep, (param,) if rule.experts else ()
    if rows % 2:
        raise CorruptCheckpointError(f"'{key}' has {rows} rows: not a SwiGLU [W1; W3]", atom=key)
    glu, half = rule.glu.format(i=layer, e=e), rows // 2
    layout = RowLayout(
        (base + param + suffix, base + glu + suffix), (Segment(0, half, 0, 0), Segment(half, half, 1, 0)), rows
    )
    return layout, keep, (param, glu) if rule.experts else ()


_LAYER = re.compile(r"(decoder\.layers)\.(\d+)\.(.*)")
_EXPERT = re.compile(r"(.*\.experts\.experts)\.(\d+)\.(.*)")
_HALF = re.compile(r"(.*\.linear_fc1\.(?:weight|bias))_([wv])")


def unstack_key(key: str) -> tuple[str, int | None, int | None, int | None]:
    """A key saved with ``singleton_local_shards=True`` as ``(stacked key, layer, expert, SwiGLU
    half)``: one key per layer (``decoder.layers.<i>.``), per expert (``experts.experts.<e>.``) and
    per ``linear_fc1`` half (``weight_w`` = W1, ``weight_v`` = W3); the parts not in the key: None."""
    layer = expert = half = None
    if m := _LAYER.fullmatch(key):
        key, layer = f"{m[1]}.{m[3]}", int(m[2])
    if m := _EXPERT.fullmatch(key):
        key, expert = f"{m[1]}.{m[3]}", int(m[2])
    if m := _HALF.fullmatch(key):
        key, half = m[1], "wv".index(m[2])
    return key, layer, expert, half
