"""Hugging Face mappings for torchtitan's llama3, qwen3, qwen3 MoE and deepseek_v3 models.

:func:`hf_mapping` derives, from a torchtitan model config (or a built model, or a model spec), the
:class:`~ucp_dcp.sources.hf.HFMapping` between the model's canonical parameter names (torchtitan's model
state sits at the top level: ``prefix=""``) and the names and row orders of the matching
``transformers`` model (``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``), plus the ``config.json`` an
export writes so that ``from_pretrained`` builds that model. The names are those of torchtitan's
own state-dict adapters (``models/{llama3,qwen3}/state_dict_adapter.py``):

* llama3's ``ComplexRoPE`` rotates interleaved pairs, HF's Llama rotates halves: the q and k rows
  are permuted within each head (``rotary_heads`` = query heads for q, KV heads for k), as
  torchtitan's ``_permute``/``_reverse_permute`` do;
* qwen3's ``CosSinRoPE`` already rotates halves: no permutation; its ``q_norm``/``k_norm`` map too;
* with ``enable_weight_tying`` the output head is the embedding: there is no ``lm_head`` rule (an
  export writes ``embed_tokens`` only; an ``lm_head.weight`` in a tied HF folder is ignored), and
  the load fills ``lm_head.weight`` from the embedding through :func:`tied_rules`.

Mixture-of-experts qwen3 models map to ``Qwen3MoeForCausalLM`` (:mod:`ucp_dcp.torchtitan.hf_moe`): the
router gate one to one, the stacked ``[E, ...]`` expert weights one HF tensor per expert (``stack``
rules), routing settings HF cannot express refused by name, and the load-balancing
``expert_bias_E`` a ``zero`` atom (zeroed on load, an export refuses it non-zero). deepseek_v3
models map to ``DeepseekV3ForCausalLM`` (:mod:`ucp_dcp.torchtitan.hf_deepseek`: MLA, shared experts,
``expert_bias_E`` = ``e_score_correction_bias``).
"""

from __future__ import annotations

from typing import Any

from ..errors import UCPError
from ..layout.patterns import Tied
from ..sources.hf.mapping import HFMapping, HFRule
from .hf_deepseek import deepseek_mapping, is_deepseek_v3
from .hf_moe import moe_part

__all__ = ["hf_mapping", "tied_rules", "model_config_of"]

_L = "model.layers.{i}."
_A = "layers.{i}.attention."


def model_config_of(obj: Any) -> Any:
    """The torchtitan model ``Config`` of ``obj``: a model config, a built model (its ``config``), a
    model spec (its ``model``) or a state-dict adapter (its ``model_config``)."""
    for attr in (None, "model_config", "config", "model"):
        cfg = obj if attr is None else getattr(obj, attr, None)
        if cfg is not None and hasattr(cfg, "layers") and hasattr(cfg, "enable_weight_tying"):
            return cfg
    raise UCPError(
        f"{type(obj).__name__} is not a torchtitan decoder model config, model, model spec or state-dict adapter",
        hint="pass e.g. model_registry('debugmodel').model",
    )


def _family(cfg: Any) -> str:
    from torchtitan.models.llama3.model import Llama3Model

    if isinstance(cfg, Llama3Model.Config):
        return "llama3"
    try:
        from torchtitan.models.qwen3.model import Qwen3Model
    except ImportError:  # pragma: no cover - torchtitan without qwen3
        Qwen3Model = None
    if Qwen3Model is not None and isinstance(cfg, Qwen3Model.Config):
        return "qwen3"
    raise UCPError(
        f"no Hugging Face mapping for torchtitan model config {type(cfg).__qualname__}",
        hint="hf_mapping knows llama3, qwen3 and qwen3 MoE; declare an HFMapping for other models",
    )


def _rope_kind(rope: Any) -> str:
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    for cls in (ComplexRoPE, CosSinRoPE):
        if isinstance(rope, cls.Config):
            return cls.__name__
    return type(rope).__qualname__


def _geometry(cfg: Any, family: str) -> dict[str, Any]:
    """The sizes every layer shares (the mapping and config.json are per model, not per layer)."""
    layers = list(cfg.layers)
    if not layers:
        raise UCPError("the model config has no layers")
    seen, ffns = set(), set()
    for layer in layers:
        att = layer.attention
        if getattr(layer, "moe", None) is None:  # MoE layers' sizes: hf_moe.moe_part
            ffns.add(layer.feed_forward.w1.out_features)
        qkv = getattr(att, "qkv_linear", None)
        bias = bool(getattr(getattr(qkv, "wqkv", None), "bias", False)) or bool(
            getattr(getattr(att, "wo", None), "bias", False)
        )
        n_heads = att.n_heads
        n_kv = att.n_kv_heads if att.n_kv_heads is not None else n_heads
        head_dim = att.head_dim or cfg.dim // n_heads
        rope = att.rope
        qk_norm = getattr(att, "qk_norm", None)
        seen.add(
            (
                n_heads,
                n_kv,
                head_dim,
                _rope_kind(rope),
                rope.dim,
                rope.theta,
                rope.scaling,
                rope.scaling_factor,
                rope.low_freq_factor,
                rope.high_freq_factor,
                rope.original_max_position_embeddings,
                rope.max_seq_len,
                bias,
                qk_norm is not None,
                getattr(qk_norm, "eps", None),
                layer.attention_norm.eps,
            )
        )
    if len(seen) > 1:
        raise UCPError(
            f"{family} layers differ in attention geometry ({len(seen)} kinds); a Hugging "
            "Face config has one geometry for all layers"
        )
    if len(ffns) > 1:
        raise UCPError(
            f"{family} layers differ in feed-forward size {sorted(ffns)}; Hugging Face's intermediate_size is one size"
        )
    (
        n_heads,
        n_kv,
        head_dim,
        rope_cls,
        rope_dim,
        theta,
        scaling,
        factor,
        low,
        high,
        orig,
        max_pos,
        bias,
        has_qk_norm,
        qk_eps,
        eps,
    ) = seen.pop()
    if bias:
        raise UCPError(f"{family} attention with biases: not mapped (Llama and Qwen3 have no attention bias)")
    if rope_dim != head_dim:
        raise UCPError(f"rotary dim {rope_dim} != head_dim {head_dim}: partial rotary embeddings are not mapped")
    want_rope = {"llama3": "ComplexRoPE", "qwen3": "CosSinRoPE"}[family]
    if rope_cls != want_rope:
        raise UCPError(
            f"{family} with {rope_cls}: the HF mapping assumes torchtitan's {want_rope}",
            hint="the rotary row order of q/k depends on the RoPE kind",
        )
    if scaling == "llama":
        if max_pos <= orig:  # transformers wants the scaled context above the original one
            max_pos = int(orig * factor)
        rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": float(theta),
            "factor": float(factor),
            "low_freq_factor": float(low),
            "high_freq_factor": float(high),
            "original_max_position_embeddings": int(orig),
        }
    elif scaling == "none":
        rope_parameters = {"rope_type": "default", "rope_theta": float(theta)}
    else:
        raise UCPError(f"{family} RoPE scaling {scaling!r}: no Hugging Face config mapping (llama and none only)")
    return dict(
        n_layers=len(layers),
        n_heads=n_heads,
        n_kv=n_kv,
        head_dim=head_dim,
        ffn=ffns.pop() if ffns else None,
        eps=eps,
        qk_norm=has_qk_norm,
        qk_eps=qk_eps,
        rope_parameters=rope_parameters,
        max_pos=max_pos,
    )


def hf_mapping(model: Any, *, max_position_embeddings: int | None = None) -> HFMapping:
    """The :class:`~ucp_dcp.sources.hf.HFMapping` of a torchtitan llama3, qwen3, qwen3 MoE or deepseek_v3 model.

    Args:
        model: the model config (``model_registry("debugmodel").model``), a built model, a model spec
            or torchtitan's state-dict adapter for the model.
        max_position_embeddings: written to config.json (default: the RoPE's ``max_seq_len``).
    """
    cfg = model_config_of(model)
    if is_deepseek_v3(cfg):
        return deepseek_mapping(cfg, max_position_embeddings=max_position_embeddings)
    family = _family(cfg)
    g = _geometry(cfg, family)
    tied = bool(cfg.enable_weight_tying)
    llama = family == "llama3"
    rules = [
        HFRule("model.embed_tokens.weight", "tok_embeddings.weight"),
        HFRule("model.norm.weight", "norm.weight"),
        HFRule(_L + "input_layernorm.weight", "layers.{i}.attention_norm.weight"),
        HFRule(_L + "post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
        HFRule(
            _L + "self_attn.q_proj.weight", _A + "qkv_linear.wq.weight", rotary_heads=g["n_heads"] if llama else None
        ),
        HFRule(_L + "self_attn.k_proj.weight", _A + "qkv_linear.wk.weight", rotary_heads=g["n_kv"] if llama else None),
        HFRule(_L + "self_attn.v_proj.weight", _A + "qkv_linear.wv.weight"),
        HFRule(_L + "self_attn.o_proj.weight", _A + "wo.weight"),
    ]
    if g["ffn"] is not None:  # some dense layer
        rules += [
            HFRule(_L + "mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
            HFRule(_L + "mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
            HFRule(_L + "mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
        ]
    moe = moe_part(cfg, family)
    if g["qk_norm"]:
        rules += [
            HFRule(_L + "self_attn.q_norm.weight", _A + "q_norm.weight"),
            HFRule(_L + "self_attn.k_norm.weight", _A + "k_norm.weight"),
        ]
    if not tied:
        rules.append(HFRule("lm_head.weight", "lm_head.weight"))
    ignore = [r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"]
    if tied:
        ignore.append(r"lm_head\.weight")  # a tied model's head is its embedding
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if llama else "Qwen3ForCausalLM"],
        "model_type": "llama" if llama else "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": g["ffn"],
        "num_hidden_layers": g["n_layers"],
        "num_attention_heads": g["n_heads"],
        "num_key_value_heads": g["n_kv"],
        "head_dim": g["head_dim"],
        "rms_norm_eps": float(cfg.norm.eps),
        "hidden_act": "silu",
        "rope_parameters": g["rope_parameters"],
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": int(max_position_embeddings or g["max_pos"]),
        "torch_dtype": "float32",
    }
    zero: tuple[str, ...] = ()
    if llama:
        config["mlp_bias"] = False
    elif moe is not None:
        rules += moe[0]
        config.update(moe[1], use_sliding_window=False, sliding_window=None)
        zero = moe[2]
    else:
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": g["n_layers"]})
    if g["eps"] != cfg.norm.eps or (g["qk_norm"] and g["qk_eps"] != cfg.norm.eps):
        raise UCPError(
            f"{family}: layer norm eps {g['eps']} / qk-norm eps {g['qk_eps']} differ from the final "
            f"norm's {cfg.norm.eps}; Hugging Face has one rms_norm_eps"
        )
    name = f"torchtitan-{family}" + ("-moe" if moe is not None else "")
    return HFMapping(tuple(rules), prefix="", ignore=tuple(ignore), config=config, name=name, zero=zero)


def tied_rules(model: Any) -> list[Tied]:
    """The ``Tied`` rule of a model with ``enable_weight_tying`` (``lm_head.weight`` is
    ``tok_embeddings.weight``: one atom, both names filled on load), else none."""
    cfg = model_config_of(model)
    return [Tied("tok_embeddings.weight", (r"lm_head\.weight",))] if cfg.enable_weight_tying else []
