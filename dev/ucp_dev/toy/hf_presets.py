"""The toy LLM as Hugging Face models: declared HF mappings (a Llama, a Mixtral) and ready configs.

Each mapping is a function of the model's sizes (rotary rows are permuted per head, so the head
counts are part of the rule) returning an :class:`~ucp_dcp.sources.hf.mapping.HFMapping` whose ``config``
is the ``config.json`` an export writes for ``transformers``. torchtitan's llama3 and qwen3:
:mod:`ucp_dcp.torchtitan.mappings`. ``python -m ucp_dcp export --to hf --mapping
ucp_dev.toy.hf_presets:toy_llama_mapping`` exports a toy checkpoint.
"""

from __future__ import annotations

from typing import Any

from ucp_dcp.sources.hf.mapping import HFMapping, HFRule

__all__ = ["toy_llama", "toy_mixtral", "toy_llama_mapping", "toy_mixtral_mapping", "TOY_LLAMA", "TOY_MIXTRAL"]

_L = "model.layers.{i}."


def _llama_config(
    *,
    vocab: int,
    dim: int,
    ffn: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    theta: float,
    tied: bool,
    max_pos: int,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": dim,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": max_pos,
        "torch_dtype": "float32",
        **extra,
    }


def _toy_rules(cfg: Any) -> list[HFRule]:
    rules = [
        HFRule("model.embed_tokens.weight", "tok_embeddings.weight"),
        HFRule("model.norm.weight", "norm.weight"),
        HFRule(_L + "input_layernorm.weight", "layers.{i}.attn_norm.weight"),
        HFRule(_L + "post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
        HFRule(_L + "self_attn.q_proj.weight", "layers.{i}.attn.wq.weight", rotary_heads=cfg.n_heads),
        HFRule(_L + "self_attn.k_proj.weight", "layers.{i}.attn.wk.weight", rotary_heads=cfg.n_kv_heads),
        HFRule(_L + "self_attn.v_proj.weight", "layers.{i}.attn.wv.weight"),
        HFRule(_L + "self_attn.o_proj.weight", "layers.{i}.attn.wo.weight"),
        HFRule(_L + "mlp.gate_proj.weight", "layers.{i}.ffn.w1.weight"),
        HFRule(_L + "mlp.up_proj.weight", "layers.{i}.ffn.w3.weight"),
        HFRule(_L + "mlp.down_proj.weight", "layers.{i}.ffn.w2.weight"),
    ]
    for i in range(cfg.n_layers):  # MoE layers by kind: stacked [E, ...] atoms or one atom per expert
        moe = f"model.layers.{i}.block_sparse_moe."
        kind = cfg.ffn_kind(i)
        if kind == "dense":
            continue
        rules.append(HFRule(moe + "gate.weight", f"layers.{i}.moe.router.weight"))
        for w in ("w1", "w2", "w3"):
            rules.append(
                HFRule(moe + f"experts.{{e}}.{w}.weight", f"layers.{i}.moe.experts.{w}", stack="e")
                if kind == "stacked"
                else HFRule(moe + f"experts.{{e}}.{w}.weight", f"layers.{i}.moe.experts.{{e}}.{w}.weight")
            )
    return rules


def _check_toy(cfg: Any, moe: bool) -> None:
    has_moe = bool(cfg.stacked_moe_layers or cfg.list_moe_layers)
    all_moe = all(cfg.ffn_kind(i) != "dense" for i in range(cfg.n_layers))
    if cfg.rope_theta is None or cfg.res_gain or (has_moe and not all_moe if moe else has_moe):
        raise ValueError(
            f"{'toy_mixtral' if moe else 'toy_llama'} needs a toy config with rope_theta set, "
            f"res_gain=False and {'every layer MoE' if moe else 'no MoE layers'} "
            "(see TOY_LLAMA / TOY_MIXTRAL)"
        )


def toy_llama(cfg: Any, prefix: str = "model.") -> HFMapping:
    """The recipe's toy model (:class:`ucp_dev.toy.ModelConfig` with ``rope_theta`` set, no MoE
    layers, ``res_gain=False``) as a Hugging Face ``LlamaForCausalLM`` with tied embeddings; its
    fused ``wqkv``/``w13`` and padded vocabulary come from the toy's own pattern rules."""
    _check_toy(cfg, moe=False)
    config = _llama_config(
        vocab=cfg.vocab,
        dim=cfg.dim,
        ffn=cfg.ffn_dim,
        layers=cfg.n_layers,
        heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        eps=1e-5,
        theta=cfg.rope_theta,
        tied=True,
        max_pos=max(64, cfg.seq_len),
    )
    return HFMapping(
        tuple(_toy_rules(cfg)),
        prefix=prefix,
        config=config,
        name="toy-llama",
        ignore=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
    )


def toy_mixtral(cfg: Any, prefix: str = "model.") -> HFMapping:
    """The toy model with every layer MoE as a Hugging Face ``MixtralForCausalLM``: the router is
    ``block_sparse_moe.gate``; experts are one HF tensor each (``experts.{e}.w1``), read as slices
    of the toy's stacked ``[E, F, D]`` atoms or as its per-expert atoms (global numbers: the expert
    map turns them into each EP rank's local ones)."""
    _check_toy(cfg, moe=True)
    config = _llama_config(
        vocab=cfg.vocab,
        dim=cfg.dim,
        ffn=cfg.expert_dim,
        layers=cfg.n_layers,
        heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        eps=1e-5,
        theta=cfg.rope_theta,
        tied=True,
        max_pos=max(64, cfg.seq_len),
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        router_jitter_noise=0.0,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    )
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
    for k in ("mlp_bias", "attention_bias"):
        config.pop(k)
    return HFMapping(tuple(_toy_rules(cfg)), prefix=prefix, config=config, name="toy-mixtral")


def _toy_configs() -> dict[str, Any]:
    from .model import ModelConfig

    base = dict(
        vocab=61,
        vocab_multiple=7,
        dim=48,
        n_layers=4,
        n_heads=6,
        n_kv_heads=2,
        ffn_dim=52,
        rope_theta=10000.0,
        res_gain=False,
    )
    return {
        "TOY_LLAMA": ModelConfig(**base, stacked_moe_layers=(), list_moe_layers=()),
        "TOY_MIXTRAL": ModelConfig(
            **base, stacked_moe_layers=(0, 2), list_moe_layers=(1, 3), n_experts=4, top_k=2, expert_dim=24
        ),
    }


_CONFIGS = _toy_configs()
TOY_LLAMA = _CONFIGS["TOY_LLAMA"]
"""The toy LLM as a Llama: rotary embeddings, no MoE, no residual gains."""
TOY_MIXTRAL = _CONFIGS["TOY_MIXTRAL"]
"""The toy LLM as a Mixtral: every layer MoE (stacked experts in layers 0 and 2, expert lists in 1 and 3)."""


def toy_llama_mapping() -> HFMapping:
    """:func:`toy_llama` of :data:`TOY_LLAMA` (for ``export --to hf --mapping``)."""
    return toy_llama(TOY_LLAMA)


def toy_mixtral_mapping() -> HFMapping:
    """:func:`toy_mixtral` of :data:`TOY_MIXTRAL`."""
    return toy_mixtral(TOY_MIXTRAL)
