"""The tests' and recipes' torchtitan configs: ``--module ucp_dev.testing --config <name>`` (test fixtures).

torchtitan reads ``--module M`` as the module ``M.config_registry`` and ``--config`` as a function in it, so
this module is all a job (the CPU launcher's included) needs: no registration call. The models are the
CPU-sized ones of :mod:`ucp_dev.testing.titan_models`; ``*_ucp`` entries turn ucp_dcp's option on with
:func:`~ucp_dcp.torchtitan.config_registry.with_ucp`, the others keep torchtitan's stock checkpointer.

* ``llama3_debugmodel_ucp``: the library's own entry (torchtitan's debug model with the option),
  here too so that one ``--module`` serves every test job.
* ``llama3_debugmodel_gqa``, ``llama3_debugmodel_gqa_ucp``: the debug model with grouped-query attention.
* ``qwen3_moe_small``, ``qwen3_moe_small_ucp``: torchtitan's ``qwen3_moe_debug`` Trainer config with the
  CPU-sized qwen3 MoE; ``qwen3_moe_small_hf``: the same without the load-balancing bias
  (``load_balance_coeff=None``), i.e. exactly what HF's ``Qwen3MoeForCausalLM`` computes, so a fine-tune
  started from an HF folder can be exported back to HF (a learned bias is refused there); stock checkpointer.
* ``deepseek_v3_small``, ``deepseek_v3_small_ucp``: torchtitan's ``deepseek_v3_debugmodel`` Trainer config
  with the CPU-sized deepseek_v3; ``deepseek_v3_small_mtp_ucp`` adds one multi-token-prediction layer
  (torchtitan refuses it with pipeline parallelism); ``deepseek_v3_small_hf``: stock checkpointer, the
  latent norms at HF's eps 1e-6, so that HF's ``DeepseekV3ForCausalLM`` computes the same model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ucp_dcp.torchtitan.config_registry import llama3_debugmodel_ucp, with_ucp
from ucp_dcp.torchtitan.hf_deepseek import HF_LATENT_EPS

from .titan_models import DSV3_SMALL, deepseek_v3_small_trainer, llama3_gqa_trainer, qwen3_moe_small_trainer

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


def llama3_debugmodel_gqa() -> Any:
    return llama3_gqa_trainer()


def llama3_debugmodel_gqa_ucp() -> Any:
    return with_ucp(llama3_gqa_trainer())


def qwen3_moe_small() -> Any:
    return qwen3_moe_small_trainer()


def qwen3_moe_small_ucp() -> Any:
    return with_ucp(qwen3_moe_small_trainer())


def qwen3_moe_small_hf() -> Any:
    cfg = qwen3_moe_small_trainer()
    for layer in cfg.model_spec.model.layers:
        if layer.moe is not None:
            layer.moe.load_balance_coeff = None
    return cfg


def deepseek_v3_small() -> Any:
    return deepseek_v3_small_trainer()


def deepseek_v3_small_ucp() -> Any:
    return with_ucp(deepseek_v3_small_trainer())


def deepseek_v3_small_mtp_ucp() -> Any:
    return with_ucp(deepseek_v3_small_trainer(num_mtp_layers=1))


def deepseek_v3_small_hf() -> Any:
    return deepseek_v3_small_trainer(size=dataclasses.replace(DSV3_SMALL, latent_eps=HF_LATENT_EPS))
