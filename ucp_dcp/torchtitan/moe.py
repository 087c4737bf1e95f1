"""torchtitan mixture-of-experts models under ucp_dcp: small qwen3 MoE and deepseek_v3 debug models
and the checkpoint rules for MoE state.

torchtitan's ``qwen3_moe_debug`` (8 layers, 64 experts of hidden 768: over 300M parameters) is too large
for CPU tests; :func:`qwen3_moe_small_model` builds the same architecture (torchtitan's own
``_build_qwen3_moe_layers``: fused QKV with QK-norm, token-choice top-k router with softmax scores,
stacked ``GroupedExperts``, auxiliary-loss-free load balancing) at a CPU-friendly size.
:func:`deepseek_v3_small_model` does the same for ``deepseek_v3`` (torchtitan's ``_build_dsv3_layers``:
MLA attention with a low-rank query, a dense first layer, routed plus shared experts, DeepSeek V3's
sigmoid router with group-limited routing).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ._compat import deepseek_v3_builders, qwen3_builders

if TYPE_CHECKING:
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    from torchtitan.models.qwen3 import Qwen3Model

__all__ = [
    "qwen3_moe_small_model",
    "qwen3_moe_small_trainer",
    "deepseek_v3_small_model",
    "deepseek_v3_small_trainer",
    "moe_rules",
    "MOE_SMALL",
    "DSV3_SMALL",
    "EXPERT_BIAS",
]

MOE_SMALL = {
    "n_layers": 4,
    "dim": 256,
    "n_heads": 8,
    "n_kv_heads": 4,
    "head_dim": 32,
    "moe_hidden_dim": 128,
    "num_experts": 8,
    "top_k": 2,
    "vocab_size": 2048,
}
"""Geometry of :func:`qwen3_moe_small_model` (8 experts: divisible by every EP degree up to 8)."""


def qwen3_moe_small_model(attn_backend: str = "flex") -> Qwen3Model.Config:
    """torchtitan's qwen3 MoE debug architecture at :data:`MOE_SMALL` size."""
    # imported here, not at the top: the manager imports this module for its rules, and torchtitan's
    # models need torch >= 2.12 while its checkpointer and loaders import on 2.11
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model

    Q = qwen3_builders()
    g = MOE_SMALL
    dim, vocab = g["dim"], g["vocab_size"]
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=Q["norm"](dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=Q["embedding_init"]),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=Q["linear_init"]),
        layers=Q["moe_layers"](
            fuse_qkv=True,
            n_layers=g["n_layers"],
            dim=dim,
            n_heads=g["n_heads"],
            n_kv_heads=g["n_kv_heads"],
            head_dim=g["head_dim"],
            moe_hidden_dim=g["moe_hidden_dim"],
            num_experts=g["num_experts"],
            top_k=g["top_k"],
            attn_backend=attn_backend,
            rope=CosSinRoPE.Config(dim=g["head_dim"], max_seq_len=4096, theta=1000000.0),
            moe_comm_backend="standard",
        ),
    )


def qwen3_moe_small_trainer():
    """torchtitan's ``qwen3_moe_debug`` Trainer config with the :func:`qwen3_moe_small_model` model."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    cfg = qwen3_moe_debug()
    spec = model_registry("debugmodel_moe")
    cfg.model_spec = dataclasses.replace(spec, flavor="debugmodel_moe_small", model=qwen3_moe_small_model())
    return cfg


DSV3_SMALL = {
    "n_layers": 4,
    "n_dense_layers": 1,
    "dim": 128,
    "n_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "dense_hidden_dim": 256,
    "moe_hidden_dim": 64,
    "num_experts": 8,
    "num_shared_experts": 2,
    "top_k": 2,
    "expert_groups": 4,
    "limited_groups": 2,
    "vocab_size": 2048,
}
"""Geometry of :func:`deepseek_v3_small_model`: layer 0 dense, layers 1-3 MoE with 8 routed experts in 4
groups (top-2 of the 2 best groups) and 2 shared experts' worth of dense FFN."""


def deepseek_v3_small_model(attn_backend: str = "flex") -> DeepSeekV3Model.Config:
    """torchtitan's deepseek_v3 architecture at :data:`DSV3_SMALL` size, routed as DeepSeek V3 (671B)
    is: sigmoid scores, group-limited top-k, normalized and scaled weights (torchtitan's debug model
    uses softmax without groups)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    D = deepseek_v3_builders()
    g = DSV3_SMALL
    dim, vocab = g["dim"], g["vocab_size"]
    layers = D["layers"](
        n_layers=g["n_layers"],
        n_dense_layers=g["n_dense_layers"],
        dim=dim,
        n_heads=g["n_heads"],
        q_lora_rank=g["q_lora_rank"],
        kv_lora_rank=g["kv_lora_rank"],
        qk_nope_head_dim=g["qk_nope_head_dim"],
        qk_rope_head_dim=g["qk_rope_head_dim"],
        v_head_dim=g["v_head_dim"],
        mscale=1.0,
        dense_hidden_dim=g["dense_hidden_dim"],
        moe_hidden_dim=g["moe_hidden_dim"],
        num_experts=g["num_experts"],
        num_shared_experts=g["num_shared_experts"],
        router_top_k=g["top_k"],
        router_score_func="sigmoid",
        router_num_expert_groups=g["expert_groups"],
        router_num_limited_groups=g["limited_groups"],
        router_route_scale=2.5,
        router_route_norm=True,
        attn_backend=attn_backend,
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=g["qk_rope_head_dim"],
            max_seq_len=4096 * 4,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=4096,
        ),
    )
    return DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=D["embedding_init"]),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=D["norm_init"]),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=D["output_init"](dim)),
        layers=layers,
    )


def deepseek_v3_small_trainer(num_mtp_layers: int = 0):
    """torchtitan's ``deepseek_v3_debugmodel`` Trainer config with the :func:`deepseek_v3_small_model` model;
    with ``num_mtp_layers``, multi-token-prediction layers (copies of the last layer's config) and
    their loss, as torchtitan's ``deepseek_v3_debugmodel_mtp`` adds them."""
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.deepseek_v3 import MTPLoss, model_registry
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    cfg = deepseek_v3_debugmodel()
    spec = model_registry("debugmodel")
    model = deepseek_v3_small_model()
    if num_mtp_layers:
        model.mtp_layers = deepseek_v3_builders()["mtp_layers"](
            model.layers[-1], dim=model.dim, num_mtp_layers=num_mtp_layers
        )
    cfg.model_spec = dataclasses.replace(spec, flavor="debugmodel_small", model=model)
    if num_mtp_layers:
        cfg.loss = MTPLoss.Config(global_vocab_size=decoder_vocab_size(cfg.model_spec))
    return cfg


EXPERT_BIAS = r"(.+\.)?expert_bias_E"
"""The load-balancing bias of torchtitan's ``MoE`` layers (persistent buffer ``[num_experts]``)."""


def moe_rules(model_parts: list) -> list:
    """The rules for torchtitan MoE state, declared only when some rank's model holds it:

    * ``expert_bias_E`` (auxiliary-loss-free load balancing) is updated before each optimizer step
      from the token counts summed over the whole batch mesh, so every rank holding a layer holds the
      same values: ``Replicated(check="error")`` -- saved once, the copies compared bitwise at save,
      loaded into every rank at any layout;
    * ``tokens_per_expert_E`` is a non-persistent buffer zeroed by that same hook: torchtitan never
      saves it, and at every step boundary (where checkpoints are taken) it is zero, so a resumed
      run holds what an uninterrupted one holds. Nothing to declare (without load balancing nothing
      zeroes it, and every resume restarts it at zero, as stock torchtitan does);
    * expert weights (stacked ``[E, ...]``, EP shards dim 0, FSDP the EP region), the router gate,
      deepseek_v3's shared experts and dense first layers are parameters resharded by their DTensor
      placements like any other; no rule. An MTP layer's ``expert_bias_E`` matches the same pattern
      (torchtitan's hook never updates it: it stays zero on every rank).
    """
    import torch.distributed as dist
    from torchtitan.models.common.moe import MoE

    from ..layout.patterns import Replicated

    holds = any(
        isinstance(m, MoE) and getattr(m, "expert_bias_E", None) is not None
        for model in model_parts
        for m in model.modules()
    )
    if dist.is_initialized() and dist.get_world_size() > 1:  # a pipeline stage may hold no MoE layer
        flag = [None] * dist.get_world_size()
        dist.all_gather_object(flag, holds)
        holds = any(flag)
    return [Replicated(EXPERT_BIAS, check="error")] if holds else []
