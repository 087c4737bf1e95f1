"""torchtitan config registry: ``--module ucp_dcp.torchtitan --config <name>``.

* ``llama3_debugmodel_ucp``: torchtitan's llama3 debug model with ``UCPCheckpointManager`` and the
  global-cursor dataloader.
* ``llama3_debugmodel_gqa``: the same debug model with grouped-query attention (16 query heads,
  4 KV heads; the stock debug model has n_kv_heads = n_heads), stock checkpointer.
* ``llama3_debugmodel_gqa_ucp``: the GQA debug model with ucp_dcp.
* ``qwen3_moe_small``: torchtitan's ``qwen3_moe_debug`` Trainer config with a CPU-sized model of the
  same architecture (:mod:`ucp_dcp.torchtitan.moe`), stock checkpointer; ``qwen3_moe_small_ucp``
  with ucp_dcp; ``qwen3_moe_small_hf``: the same without the load-balancing bias
  (``load_balance_coeff=None``), i.e. exactly what HF's ``Qwen3MoeForCausalLM`` computes, so a
  fine-tune started from an HF folder can be exported back to HF (a learned bias is refused there).
* ``deepseek_v3_small``: torchtitan's ``deepseek_v3_debugmodel`` Trainer config with a CPU-sized
  deepseek_v3 (MLA, dense first layer, routed + shared experts, sigmoid group-limited router; the same
  module), stock checkpointer; ``deepseek_v3_small_ucp`` with ucp_dcp; ``deepseek_v3_small_mtp_ucp``
  adds one multi-token-prediction layer (torchtitan refuses it with pipeline parallelism);
  ``deepseek_v3_small_hf``: stock checkpointer, the latent norms at HF's eps 1e-6, so that HF's
  ``DeepseekV3ForCausalLM`` computes the same model (:mod:`ucp_dcp.torchtitan.hf_deepseek`).
"""

from __future__ import annotations

import dataclasses

from torchtitan.config import derive
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.llama3.model import Llama3Model

from ._compat import llama3_debug_parts
from .dataloader import GlobalCursorTextDataLoader
from .hf_deepseek import HF_LATENT_EPS
from .manager import UCPCheckpointManager
from .moe import deepseek_v3_small_trainer, qwen3_moe_small_trainer

__all__ = [
    "llama3_debugmodel_ucp",
    "llama3_debugmodel_gqa",
    "llama3_debugmodel_gqa_ucp",
    "qwen3_moe_small",
    "qwen3_moe_small_ucp",
    "qwen3_moe_small_hf",
    "deepseek_v3_small",
    "deepseek_v3_small_ucp",
    "deepseek_v3_small_mtp_ucp",
    "deepseek_v3_small_hf",
]

GQA_KV_HEADS = 4


def _with_ucp(cfg):
    cfg.checkpoint = derive(cfg.checkpoint, UCPCheckpointManager.Config)
    cfg.dataloader = derive(cfg.dataloader, GlobalCursorTextDataLoader.Config)
    return cfg


def llama3_debugmodel_ucp():
    return _with_ucp(llama3_debugmodel())


def _gqa_debugmodel(attn_backend: str = "flex") -> Llama3Model.Config:
    dim, n_heads, n_layers = 256, 16, 6
    embedding_init, norm_init, output_init, build_layers = llama3_debug_parts(dim)
    return Llama3Model.Config(
        dim=dim,
        vocab_size=2048,
        tok_embeddings=Embedding.Config(num_embeddings=2048, embedding_dim=dim, param_init=embedding_init),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=2048, param_init=output_init),
        layers=build_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=GQA_KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend=attn_backend,
        ),
    )


def llama3_debugmodel_gqa():
    cfg = llama3_debugmodel()
    spec = model_registry("debugmodel")
    cfg.model_spec = dataclasses.replace(spec, flavor="debugmodel_gqa", model=_gqa_debugmodel())
    return cfg


def llama3_debugmodel_gqa_ucp():
    return _with_ucp(llama3_debugmodel_gqa())


def qwen3_moe_small():
    return qwen3_moe_small_trainer()


def qwen3_moe_small_ucp():
    return _with_ucp(qwen3_moe_small_trainer())


def qwen3_moe_small_hf():
    cfg = qwen3_moe_small_trainer()
    for layer in cfg.model_spec.model.layers:
        if layer.moe is not None:
            layer.moe.load_balance_coeff = None
    return cfg


def deepseek_v3_small():
    return deepseek_v3_small_trainer()


def deepseek_v3_small_ucp():
    return _with_ucp(deepseek_v3_small_trainer())


def deepseek_v3_small_mtp_ucp():
    return _with_ucp(deepseek_v3_small_trainer(num_mtp_layers=1))


def deepseek_v3_small_hf():
    cfg = deepseek_v3_small_trainer()
    for layer in cfg.model_spec.model.layers:  # HF's latent norms are at eps 1e-6 (hf_deepseek)
        att = layer.attention
        att.kv_norm = dataclasses.replace(att.kv_norm, eps=HF_LATENT_EPS)
        if getattr(att, "q_norm", None) is not None:
            att.q_norm = dataclasses.replace(att.q_norm, eps=HF_LATENT_EPS)
    return cfg
