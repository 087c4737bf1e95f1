"""torchtitan's deepseek_v3 <-> Hugging Face ``DeepseekV3ForCausalLM`` (transformers 5), declared as rules.

The names are those of torchtitan's ``deepseek_v3/state_dict_adapter.py``; the mapping is one to one
(no row permutation) because the two codes lay the rotary dims out alike:

* MLA attention: ``q_proj`` (``q_lora_rank`` 0) or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` are ``wq`` or
  ``wq_a``/``q_norm``/``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``. The rotary part of each q
  head (its last ``qk_rope_head_dim`` rows) and of ``wkv_a`` is in interleaved-pair order in
  DeepSeek's weights; HF rotates it as such with ``rope_interleave=True``, torchtitan's
  ``ComplexRoPE`` too. (HF's interleaved rotation returns the pairs de-interleaved, for q and k
  alike: the scores q.k are unchanged.) torchtitan's ``CosSinRoPE`` rotates halves: HF with
  ``rope_interleave=False``. Either way the weights are copied unpermuted.
* YaRN: torchtitan's rope is a pure rotation and folds ``mscale`` into the softmax scale; HF the
  same with ``mscale_all_dim`` = torchtitan's ``mscale`` and ``attention_factor`` 1.
* The first ``first_k_dense_replace`` layers are dense (``mlp.{gate,up,down}_proj`` = ``feed_forward``);
  the others MoE: ``mlp.gate.weight`` = ``moe.router.gate.weight``, ``mlp.experts.{e}.*`` the slices
  ``[e]`` of the stacked ``w1_EFD``/``w3_EFD``/``w2_EDF`` (``stack="e"``), ``mlp.shared_experts.*``
  = ``moe.shared_experts.w1/w3/w2``.
* ``mlp.gate.e_score_correction_bias`` = ``moe.expert_bias_E``: both are added to the sigmoid
  scores to choose the experts (group scores included) and neither weighs the outputs -- same sign,
  same meaning, copied as is (unlike Qwen3-MoE, which has no such tensor).
* ``tokens_per_expert_E`` is non-persistent: in no checkpoint.

HF's DeepSeek-V3 router is sigmoid, group-limited (``n_group``/``topk_group``; torchtitan without
groups = one group), optionally renormalised (``norm_topk_prob`` = ``route_norm``), scaled
(``routed_scaling_factor`` = ``route_scale``), with shared experts and the correction bias, its
``q_a_layernorm``/``kv_a_layernorm`` at eps 1e-6. Any other torchtitan setting (softmax scores, no
shared experts, no load-balancing bias, other latent-norm eps, dense layers not first, MTP layers,
a gate bias, debug routing) computes something HF cannot: refused by name.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import UCPError
from ..sources.hf.mapping import HFMapping, HFRule
from ._compat import router_forces_round_robin

__all__ = ["HF_LATENT_EPS", "deepseek_mapping", "is_deepseek_v3"]

_ROPE = "HF's DeepSeek-V3 rotates interleaved pairs or halves, unscaled or with YaRN"
HF_LATENT_EPS = 1e-6
"""HF builds ``q_a_layernorm``/``kv_a_layernorm`` with ``DeepseekV3RMSNorm``'s default eps."""


def is_deepseek_v3(cfg: Any) -> bool:
    """Whether ``cfg`` is a torchtitan deepseek_v3 model config. Imports nothing: such a config exists
    only once torchtitan's deepseek_v3 package is imported (which needs torch >= 2.12)."""
    module = sys.modules.get("torchtitan.models.deepseek_v3.model")
    return module is not None and isinstance(cfg, module.DeepSeekV3Model.Config)


def _refuse(what: str, atom: str, saved: Any, wanted: Any, hint: str) -> UCPError:
    return UCPError(
        f"{what}: found {saved!r}, Hugging Face's DeepSeek-V3 needs {wanted!r}",
        atom=atom,
        saved=saved,
        wanted=wanted,
        hint=hint,
    )


def _one(values: dict[int, Any], what: str, atom: str) -> Any:
    """The one value every layer shares, or a refusal naming the first layer that differs."""
    first = next(iter(values.values()))
    for i, v in values.items():
        if v != first:
            raise _refuse(
                f"layer {i} {what} differs from the other layers'",
                atom.format(i=i),
                v,
                first,
                "a Hugging Face config has one value for all layers",
            )
    return first


def _attention_key(i: int, att: Any) -> tuple[Any, ...]:
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    at = f"layers.{i}.attention"
    rope = att.rope
    kinds = {ComplexRoPE.Config: True, CosSinRoPE.Config: False}
    interleave = next((v for k, v in kinds.items() if isinstance(rope, k)), None)
    if interleave is None:
        raise _refuse(f"layer {i} RoPE", f"{at}.rope", type(rope).__qualname__, "ComplexRoPE/CosSinRoPE", _ROPE)
    if rope.dim != att.qk_rope_head_dim:
        raise _refuse(
            f"layer {i} rotary dim", f"{at}.rope", rope.dim, att.qk_rope_head_dim, "rotate qk_rope_head_dim dims"
        )
    norms = [("kv_norm", att.kv_norm.eps)] + ([("q_norm", att.q_norm.eps)] if att.q_lora_rank else [])
    for name, eps in norms:
        if eps != HF_LATENT_EPS:
            raise _refuse(
                f"layer {i} {name} eps",
                f"{at}.{name}",
                eps,
                HF_LATENT_EPS,
                "HF's q_a_layernorm/kv_a_layernorm use eps 1e-6 whatever rms_norm_eps is; set the latent "
                "norms' (kv_norm, q_norm) eps to 1e-6",
            )
    linears = [att.wkv_a, att.wkv_b, att.wo] + ([att.wq_a, att.wq_b] if att.q_lora_rank else [att.wq])
    if any(getattr(lin, "bias", False) for lin in linears):
        raise _refuse(f"layer {i} attention biases", at, True, False, "DeepSeek-V3's projections have no bias")
    if rope.scaling == "yarn" and rope.rope_factor > 1.0:
        rope_parameters: dict[str, Any] = {
            "rope_type": "yarn",
            "rope_theta": float(rope.theta),
            "factor": float(rope.rope_factor),
            "original_max_position_embeddings": int(rope.original_seq_len),
            "beta_fast": float(rope.beta_fast),
            "beta_slow": float(rope.beta_slow),
            "mscale": float(att.mscale),
            "mscale_all_dim": float(att.mscale),  # HF's softmax scale times mscale^2, as torchtitan's
            "attention_factor": 1.0,  # torchtitan's rope is a pure rotation
            "truncate": bool(rope.truncate),
        }
    elif rope.scaling in ("none", "yarn"):  # yarn at factor <= 1 is no scaling in torchtitan
        rope_parameters = {"rope_type": "default", "rope_theta": float(rope.theta)}
    else:
        raise _refuse(f"layer {i} RoPE scaling", f"{at}.rope", rope.scaling, "yarn or none", _ROPE)
    return (
        att.n_heads,
        att.q_lora_rank or None,
        att.kv_lora_rank,
        att.qk_nope_head_dim,
        att.qk_rope_head_dim,
        att.v_head_dim,
        interleave,
        repr(sorted(rope_parameters.items())),
        int(rope.max_seq_len),
    ), rope_parameters


def _moe_key(i: int, moe: Any, dim: int) -> tuple[Any, ...]:
    """The HF-relevant routing and sizes of MoE layer ``i``, refusing what HF computes differently."""
    from torchtitan.models.common.moe import GroupedExperts

    at = f"layers.{i}.moe"
    router, inner, shared = moe.router, moe.routed_experts.inner_experts, moe.shared_experts
    if router.score_func != "sigmoid":
        raise _refuse(
            f"layer {i} router scoring",
            f"{at}.router",
            router.score_func,
            "sigmoid",
            "HF's DeepSeek-V3 router is sigmoid then group-limited top-k; a softmax router routes differently "
            "(torchtitan's deepseek_v3 debugmodel/16B/236B flavors use softmax)",
        )
    if router.gate.bias:
        raise _refuse(f"layer {i} router gate bias", f"{at}.router.gate.bias", True, False, "HF's gate has no bias")
    if router_forces_round_robin(router):
        raise _refuse(f"layer {i} debug routing", f"{at}.router", True, False, "turn _debug_force_load_balance off")
    if moe.load_balance_coeff is None:
        raise _refuse(
            f"layer {i} load balancing",
            f"{at}.expert_bias_E",
            None,
            "a load_balance_coeff",
            "HF's router always adds e_score_correction_bias to the scores: without torchtitan's expert_bias_E a "
            "non-zero HF bias would be dropped and the routing would change",
        )
    if shared is None or shared.w1.out_features % inner.hidden_dim:
        raise _refuse(
            f"layer {i} shared experts",
            f"{at}.shared_experts",
            None if shared is None else shared.w1.out_features,
            f"a multiple of the expert hidden size {inner.hidden_dim}",
            "HF's DeepSeek-V3 MoE always has shared experts of n_shared_experts * moe_intermediate_size",
        )
    if not isinstance(inner, GroupedExperts.Config):
        kind = type(inner).__qualname__
        raise _refuse(f"layer {i} experts", f"{at}.routed_experts", kind, "GroupedExperts", "stacked experts only")
    counts = (moe.num_experts, router.num_experts, router.gate.out_features, inner.num_experts)
    if len(set(counts)) != 1 or inner.dim != dim or router.gate.in_features != dim:
        raise _refuse(f"layer {i} expert counts / sizes", at, counts, "one count", "one num_experts, inputs of dim")
    groups = (router.num_expert_groups or 1, router.num_limited_groups or 1)
    if router.num_expert_groups is None and router.num_limited_groups is not None:
        raise _refuse(f"layer {i} groups", f"{at}.router", groups, "num_expert_groups", "set both or neither")
    return (moe.num_experts, router.top_k, *groups, bool(router.route_norm), float(router.route_scale),
            inner.hidden_dim, shared.w1.out_features // inner.hidden_dim)  # fmt: skip


_L = "model.layers.{i}."
_A = "layers.{i}.attention."
_M = "layers.{i}.moe."


def deepseek_mapping(cfg: Any, *, max_position_embeddings: int | None = None) -> HFMapping:
    """The :class:`~ucp_dcp.sources.hf.HFMapping` of a torchtitan deepseek_v3 model config (through
    :func:`~ucp_dcp.torchtitan.mappings.hf_mapping`), refusing by name what HF computes differently."""
    layers = list(cfg.layers)
    if getattr(cfg, "mtp_layers", None):
        raise _refuse(
            "multi-token-prediction layers",
            "mtp_layers",
            len(cfg.mtp_layers),
            0,
            "transformers' DeepseekV3ForCausalLM builds no MTP modules: build the model with num_mtp_layers=0",
        )
    att = {i: _attention_key(i, layer.attention) for i, layer in enumerate(layers)}
    akey = _one({i: a[0] for i, a in att.items()}, "attention geometry / RoPE", "layers.{i}.attention")
    n_heads, q_rank, kv_rank, nope, rope_dim, v_dim, interleave, _, max_pos = akey
    moe_ids = [i for i, layer in enumerate(layers) if getattr(layer, "moe", None) is not None]
    k = len(layers) - len(moe_ids)
    if moe_ids != list(range(k, len(layers))):
        raise _refuse(
            "dense layers are not the first ones",
            "layers",
            [i for i in range(len(layers)) if i not in moe_ids],
            list(range(k)),
            "HF's DeepSeek-V3 builds dense layers below first_k_dense_replace and MoE layers above",
        )
    if not moe_ids:
        raise _refuse("no MoE layer", "layers", 0, ">= 1", "map a dense model with the llama3/qwen3 mappings")
    mkey = _one({i: _moe_key(i, layers[i].moe, cfg.dim) for i in moe_ids}, "MoE routing / sizes", "layers.{i}.moe")
    n_exp, top_k, n_group, topk_group, route_norm, route_scale, hidden, n_shared = mkey
    ffn = _one({i: layers[i].feed_forward.w1.out_features for i in range(k)}, "FFN size", "layers.{i}") if k else hidden
    eps = {float(n.eps) for layer in layers for n in (layer.attention_norm, layer.ffn_norm)} | {float(cfg.norm.eps)}
    if len(eps) > 1:
        raise _refuse(
            "layer norm eps differ",
            "norm",
            sorted(eps),
            "one rms_norm_eps",
            "build every RMSNorm but the latent ones with one eps",
        )
    tied = bool(cfg.enable_weight_tying)
    rules = [
        HFRule("model.embed_tokens.weight", "tok_embeddings.weight"),
        HFRule("model.norm.weight", "norm.weight"),
        HFRule(_L + "input_layernorm.weight", "layers.{i}.attention_norm.weight"),
        HFRule(_L + "post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
        HFRule(_L + "self_attn.kv_a_proj_with_mqa.weight", _A + "wkv_a.weight"),
        HFRule(_L + "self_attn.kv_a_layernorm.weight", _A + "kv_norm.weight"),
        HFRule(_L + "self_attn.kv_b_proj.weight", _A + "wkv_b.weight"),
        HFRule(_L + "self_attn.o_proj.weight", _A + "wo.weight"),
        HFRule(_L + "mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
        HFRule(_L + "mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
        HFRule(_L + "mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
        HFRule(_L + "mlp.gate.weight", _M + "router.gate.weight"),
        HFRule(_L + "mlp.gate.e_score_correction_bias", _M + "expert_bias_E"),
        HFRule(_L + "mlp.experts.{e}.gate_proj.weight", _M + "routed_experts.inner_experts.w1_EFD", stack="e"),
        HFRule(_L + "mlp.experts.{e}.up_proj.weight", _M + "routed_experts.inner_experts.w3_EFD", stack="e"),
        HFRule(_L + "mlp.experts.{e}.down_proj.weight", _M + "routed_experts.inner_experts.w2_EDF", stack="e"),
        HFRule(_L + "mlp.shared_experts.gate_proj.weight", _M + "shared_experts.w1.weight"),
        HFRule(_L + "mlp.shared_experts.up_proj.weight", _M + "shared_experts.w3.weight"),
        HFRule(_L + "mlp.shared_experts.down_proj.weight", _M + "shared_experts.w2.weight"),
    ]
    if q_rank:
        rules += [
            HFRule(_L + "self_attn.q_a_proj.weight", _A + "wq_a.weight"),
            HFRule(_L + "self_attn.q_a_layernorm.weight", _A + "q_norm.weight"),
            HFRule(_L + "self_attn.q_b_proj.weight", _A + "wq_b.weight"),
        ]
    else:
        rules.append(HFRule(_L + "self_attn.q_proj.weight", _A + "wq.weight"))
    ignore = [r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"]
    if tied:
        ignore.append(r"lm_head\.weight")
    else:
        rules.append(HFRule("lm_head.weight", "lm_head.weight"))
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": ffn,
        "moe_intermediate_size": hidden,
        "num_hidden_layers": len(layers),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_heads,  # MLA expands k and v per head from the latent
        "n_shared_experts": n_shared,
        "n_routed_experts": n_exp,
        "routed_scaling_factor": route_scale,
        "kv_lora_rank": kv_rank,
        "q_lora_rank": q_rank,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_dim,
        "qk_nope_head_dim": nope,
        "n_group": n_group,
        "topk_group": topk_group,
        "num_experts_per_tok": top_k,
        "first_k_dense_replace": k,
        "norm_topk_prob": route_norm,
        "hidden_act": "silu",
        "max_position_embeddings": int(max_position_embeddings or max_pos),
        "rms_norm_eps": eps.pop(),
        "tie_word_embeddings": tied,
        "rope_parameters": att[0][1],
        "rope_interleave": interleave,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_mtp_layers": 0,
        "initializer_range": 0.02,
        "output_router_logits": False,
        "torch_dtype": "float32",
    }
    return HFMapping(tuple(rules), prefix="", ignore=tuple(ignore), config=config, name="torchtitan-deepseek_v3")
