"""``--override.imports ucp_dev.testing.titan.cpu_attention.sdpa_attention``: causal SDPA on local shards
instead of FlexAttention (which has no CPU backward). Causal over the packed sequence rather than per
document, which is fine for checkpoint tests. A test/recipe aid, not library code; it imports no other
ucp_dcp module (a stock torchtitan job with the library blocked uses it too)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import DTensor
from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention


class LocalSDPA(ScaledDotProductAttention):
    """SDPA on the local shards of TP-sharded q/k/v (CPU SDPA has no DTensor sharding rule)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, **kwargs):  # parent's argument names: TP plans key on them
        kwargs.pop("attention_masks", None)
        if isinstance(q_BLNH, DTensor):
            mesh, placements = q_BLNH.device_mesh, q_BLNH.placements
            out = super().forward(q_BLNH.to_local(), k_BLNH.to_local(), v_BLNH.to_local(), **kwargs)
            return DTensor.from_local(out, mesh, placements, run_check=False)
        return super().forward(q_BLNH, k_BLNH, v_BLNH, **kwargs)


@override(target=FlexAttention.Config, description="CPU: causal SDPA on local shards")
def sdpa_attention(cfg):
    return LocalSDPA.Config()
