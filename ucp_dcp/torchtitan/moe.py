"""torchtitan mixture-of-experts models under ucp_dcp: the checkpoint rules for their MoE state.

torchtitan's ``MoE`` layers (its qwen3 MoE and deepseek_v3 models) are resharded by their DTensor
placements like any other module; what needs a rule is the load-balancing ``expert_bias_E`` buffer
(:func:`moe_rules`). The CPU-sized MoE models the tests train are fixtures of the
checkout's development package (``ucp_dev.testing.titan_models``, not shipped).
"""

from __future__ import annotations

__all__ = ["moe_rules", "EXPERT_BIAS"]


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
