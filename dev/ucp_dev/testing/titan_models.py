"""CPU-sized torchtitan models the tests and recipes train (fixtures, not the library).

torchtitan's own debug models are too large or too slow for CPU jobs, or lack what a test needs; these
are the same architectures, built by torchtitan's own (private) layer builders and inits at a small size:

* :func:`llama3_gqa_trainer`: the llama3 debug model with grouped-query attention (16 query heads, 4 KV
  heads; the stock debug model has ``n_kv_heads = n_heads``, so it never exercises grouped QKV);
* :func:`qwen3_moe_small_model`: torchtitan's qwen3 MoE debug architecture (``_build_qwen3_moe_layers``:
  fused QKV with QK-norm, token-choice top-k router with softmax scores, stacked ``GroupedExperts``,
  auxiliary-loss-free load balancing) at :data:`MOE_SMALL` size; its ``qwen3_moe_debug`` has 64 experts of
  hidden 768 in 8 layers (over 300M parameters);
* :func:`deepseek_v3_small_model`: torchtitan's deepseek_v3 (``_build_dsv3_layers``: MLA attention, dense
  first layers, routed plus shared experts, DeepSeek V3's sigmoid router with group-limited routing, YaRN)
  at one of two sizes, one definition: :data:`DSV3_SMALL`, the one the Trainer runs, and :data:`DSV3_HF`,
  smaller, with the latent norms at Hugging Face's eps, for the single-process HF mapping tests.

The ``*_trainer`` functions put them into torchtitan's own debug Trainer configs; the registry entries
of :mod:`ucp_dev.testing.config_registry` are made of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ucp_dcp.torchtitan.hf_deepseek import HF_LATENT_EPS

# torchtitan's models are imported inside the builders: they need torch >= 2.12, and the tests import this
# module at collection also on older torch (where their torchtitan modules skip)

__all__ = [
    "GQA_KV_HEADS",
    "MOE_SMALL",
    "DeepSeekSmall",
    "DSV3_SMALL",
    "DSV3_HF",
    "llama3_gqa_model",
    "llama3_gqa_trainer",
    "qwen3_moe_small_model",
    "qwen3_moe_small_trainer",
    "deepseek_v3_small_model",
    "deepseek_v3_small_trainer",
]

# -- llama3 with grouped-query attention ----------------------------------------------------------------

GQA_KV_HEADS = 4
"""KV heads of :func:`llama3_gqa_model` (16 query heads: 4 per KV head)."""


def llama3_gqa_model(attn_backend: str = "flex") -> Any:
    """torchtitan's llama3 debug model (dim 256, 6 layers, 16 heads) with :data:`GQA_KV_HEADS` KV heads."""
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3.model import Llama3Model

    dim, n_heads, n_layers = 256, 16, 6
    return Llama3Model.Config(
        dim=dim,
        vocab_size=2048,
        tok_embeddings=Embedding.Config(num_embeddings=2048, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=2048, param_init=L._output_linear_init(dim)),
        layers=L._build_llama3_layers(
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


def llama3_gqa_trainer() -> Any:
    """torchtitan's ``llama3_debugmodel`` Trainer config with the :func:`llama3_gqa_model` model."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel()
    spec = model_registry("debugmodel")
    cfg.model_spec = dataclasses.replace(spec, flavor="debugmodel_gqa", model=llama3_gqa_model())
    return cfg


# -- qwen3 MoE ------------------------------------------------------------------------------------------

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


def qwen3_moe_small_model(attn_backend: str = "flex") -> Any:
    """torchtitan's qwen3 MoE debug architecture at :data:`MOE_SMALL` size."""
    from torchtitan.models import qwen3 as Q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model

    g = MOE_SMALL
    dim, vocab = g["dim"], g["vocab_size"]
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=Q._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=Q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=Q._LINEAR_INIT),
        layers=Q._build_qwen3_moe_layers(
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


def qwen3_moe_small_trainer() -> Any:
    """torchtitan's ``qwen3_moe_debug`` Trainer config with the :func:`qwen3_moe_small_model` model."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    cfg = qwen3_moe_debug()
    spec = model_registry("debugmodel_moe")
    cfg.model_spec = dataclasses.replace(spec, flavor="debugmodel_moe_small", model=qwen3_moe_small_model())
    return cfg


# -- deepseek_v3 ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeepSeekSmall:
    """Sizes and settings of a CPU-sized deepseek_v3. Every layer but the dense ones is MoE; the router is
    DeepSeek V3's (671B): sigmoid scores, group-limited top-k, normalized and scaled weights, the
    load-balancing bias (torchtitan's debug model routes by softmax top-3 without groups)."""

    n_layers: int = 4
    """Transformer layers, the dense ones included."""
    n_dense_layers: int = 1
    """The first layers, with a dense FFN instead of the MoE."""
    dim: int = 128
    """Model width."""
    n_heads: int = 4
    """Attention heads."""
    q_lora_rank: int = 64
    """0: one ``wq``; else the rank of the low-rank query ``wq_a``/``q_norm``/``wq_b``."""
    kv_lora_rank: int = 64
    """Rank of the key/value latent (``wkv_a``/``kv_norm``/``wkv_b``)."""
    qk_nope_head_dim: int = 32
    """Per-head query/key dims without rotary embedding."""
    qk_rope_head_dim: int = 16
    """Per-head query/key dims with rotary embedding."""
    v_head_dim: int = 32
    """Per-head value dims."""
    mscale: float = 1.0
    """YaRN's attention scale factor (torchtitan folds it into the softmax scale)."""
    dense_hidden_dim: int = 256
    """Hidden size of the dense layers' FFN."""
    moe_hidden_dim: int = 64
    """Hidden size of each routed expert (and the unit of the shared experts)."""
    num_experts: int = 8
    """Routed experts per MoE layer (8: EP degrees 2, 4 and 8 divide them)."""
    num_shared_experts: int = 2
    """Shared experts per MoE layer, in units of ``moe_hidden_dim``."""
    top_k: int = 2
    """Experts per token."""
    expert_groups: int = 4
    """Groups the experts are routed in."""
    limited_groups: int = 2
    """Groups searched for the top-k (the best ones)."""
    route_scale: float = 2.5
    """Factor on the routing weights."""
    vocab_size: int = 2048
    """Vocabulary."""
    rope: Literal["complex", "cossin"] = "complex"
    """torchtitan's ``ComplexRoPE`` (interleaved pairs, DeepSeek's own layout) or ``CosSinRoPE`` (halves)."""
    rope_max_seq_len: int = 4096 * 4
    """Positions the rotary cache holds."""
    rope_factor: float = 40.0
    """YaRN's factor (1: no scaling)."""
    rope_original_seq_len: int = 4096
    """YaRN's original context length."""
    latent_eps: float | None = None
    """eps of the latent norms ``kv_norm``/``q_norm``; None: torchtitan's default (1e-5). Hugging Face's
    DeepSeek-V3 builds them at 1e-6 whatever ``rms_norm_eps`` is (``HF_LATENT_EPS``)."""


DSV3_SMALL = DeepSeekSmall()
"""The size the Trainer runs (``deepseek_v3_small*`` registry entries): layer 0 dense, layers 1-3 MoE with 8
routed experts in 4 groups (top-2 of the 2 best groups) and 2 shared experts' worth of dense FFN, 1.6M
parameters; torchtitan's latent-norm eps (``deepseek_v3_small_hf`` sets HF's)."""

DSV3_HF = dataclasses.replace(
    DSV3_SMALL,
    n_layers=3,
    q_lora_rank=0,
    mscale=0.707,
    dense_hidden_dim=192,
    num_shared_experts=1,
    vocab_size=512,
    rope_max_seq_len=1024,
    rope_factor=4.0,
    rope_original_seq_len=256,
    latent_eps=HF_LATENT_EPS,
)
"""The size of the single-process HF mapping tests (tests/torchtitan/test_hf_deepseek.py): 3 layers, one
shared expert, vocabulary 512, YaRN factor 4, a non-trivial ``mscale``, and the latent norms at HF's eps,
so that ``DeepseekV3ForCausalLM`` computes the same model."""


def deepseek_v3_small_model(size: DeepSeekSmall = DSV3_SMALL, attn_backend: str = "flex") -> Any:
    """torchtitan's deepseek_v3 architecture at ``size``."""
    from torchtitan.models import deepseek_v3 as D
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    s = size
    rope_cls = {"complex": ComplexRoPE, "cossin": CosSinRoPE}[s.rope]
    layers = D._build_dsv3_layers(
        n_layers=s.n_layers,
        n_dense_layers=s.n_dense_layers,
        dim=s.dim,
        n_heads=s.n_heads,
        q_lora_rank=s.q_lora_rank,
        kv_lora_rank=s.kv_lora_rank,
        qk_nope_head_dim=s.qk_nope_head_dim,
        qk_rope_head_dim=s.qk_rope_head_dim,
        v_head_dim=s.v_head_dim,
        mscale=s.mscale,
        dense_hidden_dim=s.dense_hidden_dim,
        moe_hidden_dim=s.moe_hidden_dim,
        num_experts=s.num_experts,
        num_shared_experts=s.num_shared_experts,
        router_top_k=s.top_k,
        router_score_func="sigmoid",
        router_num_expert_groups=s.expert_groups,
        router_num_limited_groups=s.limited_groups,
        router_route_scale=s.route_scale,
        router_route_norm=True,
        attn_backend=attn_backend,
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=rope_cls.Config(
            dim=s.qk_rope_head_dim,
            max_seq_len=s.rope_max_seq_len,
            theta=10000.0,
            scaling="yarn",
            rope_factor=s.rope_factor,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=s.rope_original_seq_len,
        ),
    )
    if s.latent_eps is not None:
        for layer in layers:
            att = layer.attention
            att.kv_norm = dataclasses.replace(att.kv_norm, eps=s.latent_eps)
            if getattr(att, "q_norm", None) is not None:
                att.q_norm = dataclasses.replace(att.q_norm, eps=s.latent_eps)
    return DeepSeekV3Model.Config(
        vocab_size=s.vocab_size,
        dim=s.dim,
        tok_embeddings=Embedding.Config(num_embeddings=s.vocab_size, embedding_dim=s.dim, param_init=D._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=s.dim, param_init=D._NORM_INIT),
        lm_head=Linear.Config(in_features=s.dim, out_features=s.vocab_size, param_init=D._output_linear_init(s.dim)),
        layers=layers,
    )


def deepseek_v3_small_trainer(num_mtp_layers: int = 0, size: DeepSeekSmall = DSV3_SMALL) -> Any:
    """torchtitan's ``deepseek_v3_debugmodel`` Trainer config with the :func:`deepseek_v3_small_model` model;
    with ``num_mtp_layers``, multi-token-prediction layers (copies of the last layer's config) and
    their loss, as torchtitan's ``deepseek_v3_debugmodel_mtp`` adds them."""
    from torchtitan.models import deepseek_v3 as D
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.deepseek_v3 import MTPLoss, model_registry
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    cfg = deepseek_v3_debugmodel()
    spec = model_registry("debugmodel")
    model = deepseek_v3_small_model(size)
    if num_mtp_layers:
        model.mtp_layers = D._build_mtp_layers(model.layers[-1], dim=model.dim, num_mtp_layers=num_mtp_layers)
    cfg.model_spec = dataclasses.replace(spec, flavor="debugmodel_small", model=model)
    if num_mtp_layers:
        cfg.loss = MTPLoss.Config(global_vocab_size=decoder_vocab_size(cfg.model_spec))
    return cfg
