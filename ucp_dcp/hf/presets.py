"""Declared HF mappings: the recipe's toy LLM (as a Llama) and torchtitan's llama3 and qwen3.

Each preset is a function of the model's sizes (rotary rows are permuted per head, so the head
counts are part of the rule) returning an :class:`~ucp_dcp.hf.mapping.HFMapping` whose ``config``
is the ``config.json`` an export writes for ``transformers``.
"""

from __future__ import annotations

from typing import Any

from .mapping import HFMapping, HFRule

__all__ = ["toy_llama", "TOY_LLAMA"]

_L = "model.layers.{i}."


def _llama_config(*, vocab: int, dim: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                  eps: float, theta: float, tied: bool, max_pos: int, **extra: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": dim,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": eps, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "tie_word_embeddings": tied,
            "attention_bias": False, "mlp_bias": False, "max_position_embeddings": max_pos,
            "torch_dtype": "float32", **extra}


def toy_llama(cfg: Any, prefix: str = "model.") -> HFMapping:
    """The recipe's toy model (:class:`ucp_dcp.toy.ModelConfig` with ``rope_theta`` set, no MoE
    layers, ``res_gain=False``) as a Hugging Face ``LlamaForCausalLM`` with tied embeddings; its
    fused ``wqkv``/``w13`` and padded vocabulary come from the toy's own pattern rules."""
    if cfg.rope_theta is None or cfg.res_gain or cfg.stacked_moe_layers or cfg.list_moe_layers:
        raise ValueError("toy_llama needs a toy config with rope_theta set, res_gain=False and no MoE layers "
                         "(see ucp_dcp.hf.presets.TOY_LLAMA)")
    rules = (
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
    )
    config = _llama_config(vocab=cfg.vocab, dim=cfg.dim, ffn=cfg.ffn_dim, layers=cfg.n_layers, heads=cfg.n_heads,
                           kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, eps=1e-5, theta=cfg.rope_theta,
                           tied=True, max_pos=max(64, cfg.seq_len))
    return HFMapping(rules, prefix=prefix, ignore=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
                     config=config, name="toy-llama")


def _toy_llama_config():
    from ..toy.model import ModelConfig

    return ModelConfig(vocab=61, vocab_multiple=7, dim=48, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=52,
                       stacked_moe_layers=(), list_moe_layers=(), rope_theta=10000.0, res_gain=False)


def __getattr__(name: str) -> Any:
    if name == "TOY_LLAMA":  # lazily: the toy package imports torch.distributed pieces
        return _toy_llama_config()
    raise AttributeError(name)
