"""The mixture-of-experts part of torchtitan's Hugging Face mappings: qwen3 MoE <-> ``Qwen3MoeForCausalLM``.

torchtitan's qwen3 MoE layer (``models/common/moe.py``) and HF's ``Qwen3MoeSparseMoeBlock`` compute
the same function when the router is softmax over ``gate(x)``, top-k, optionally renormalised over
the k chosen (``route_norm`` = ``norm_topk_prob``), unscaled, with no shared expert and no group
limit; anything else is refused here, by name, rather than exported as a model that routes
differently. The weights map one to one (torchtitan's ``qwen3/state_dict_adapter.py`` names):

* ``mlp.gate.weight`` [E, D] is ``moe.router.gate.weight``;
* ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` are the slices ``[e]`` of the stacked
  ``w1_EFD``/``w3_EFD`` [E, F, D] and ``w2_EDF`` [E, D, F] (:class:`~ucp_dcp.sources.hf.HFRule`
  with ``stack="e"``): no transpose, expert ``e`` is row ``e``;
* ``moe.expert_bias_E`` (auxiliary-loss-free load balancing, added to the scores before top-k) has
  no HF tensor: HF's router is torchtitan's with that bias at zero. It is an
  :attr:`~ucp_dcp.sources.hf.HFMapping.zero` atom: a load from HF sets it to zero (exactly HF's
  routing; training then learns it again as in any run), an export refuses a non-zero bias --
  dropping it would change which experts tokens go to, so the HF model would compute something
  else (torchtitan's stock ``to_hf`` drops it silently);
* ``tokens_per_expert_E`` is a non-persistent buffer: in no checkpoint.

Layouts: HF builds a sparse block at layer ``i`` unless ``i`` is in ``mlp_only_layers`` (with
``decoder_sparse_step=1``), so any mix of dense and MoE layers is written as the list of dense
ones; every MoE layer must share one geometry and routing, every dense layer one FFN size.
"""

from __future__ import annotations

from typing import Any

from ..errors import UCPError
from ..sources.hf.mapping import HFRule
from ._compat import router_forces_round_robin

__all__ = ["moe_part", "EXPERT_BIAS_ATOM"]

_L = "model.layers.{i}."
_M = "layers.{i}.moe."
EXPERT_BIAS_ATOM = r"layers\.\d+\.moe\.expert_bias_E"
"""The load-balancing bias atoms (an :attr:`~ucp_dcp.sources.hf.HFMapping.zero` entry)."""


def _refuse(what: str, atom: str, saved: Any, wanted: Any, hint: str) -> UCPError:
    return UCPError(
        f"{what}: found {saved!r}, Hugging Face's Qwen3-MoE needs {wanted!r}",
        atom=atom,
        saved=saved,
        wanted=wanted,
        hint=hint,
    )


def _moe_key(i: int, moe: Any, dim: int) -> tuple[Any, ...]:
    """The HF-relevant geometry and routing of MoE layer ``i``, refusing what HF cannot express."""
    from torchtitan.models.common.moe import GroupedExperts

    at = f"layers.{i}.moe"
    router, inner = moe.router, moe.routed_experts.inner_experts
    if moe.shared_experts is not None:
        raise _refuse(
            f"layer {i} has shared experts",
            f"{at}.shared_experts",
            "a shared-expert FFN",
            None,
            "Qwen3-MoE has none (Qwen2-MoE's gated shared expert is another model); build the "
            "layers without shared_experts or map the model with your own HFMapping",
        )
    if router.score_func != "softmax":
        raise _refuse(
            f"layer {i} router scoring",
            f"{at}.router",
            router.score_func,
            "softmax",
            "HF's Qwen3-MoE router is softmax then top-k; a sigmoid router routes differently",
        )
    if router.num_expert_groups is not None or router.num_limited_groups is not None:
        raise _refuse(
            f"layer {i} node-limited routing",
            f"{at}.router",
            (router.num_expert_groups, router.num_limited_groups),
            (None, None),
            "HF's Qwen3-MoE picks the top-k over all experts",
        )
    if float(router.route_scale) != 1.0:
        raise _refuse(
            f"layer {i} route_scale",
            f"{at}.router",
            router.route_scale,
            1.0,
            "Qwen3-MoE's config has no routing scale: the expert outputs would be scaled differently",
        )
    if router.gate.bias:
        raise _refuse(
            f"layer {i} router gate bias",
            f"{at}.router.gate.bias",
            True,
            False,
            "HF's Qwen3-MoE router has a weight only",
        )
    if router_forces_round_robin(router):
        raise _refuse(
            f"layer {i} debug round-robin routing",
            f"{at}.router",
            True,
            False,
            "turn _debug_force_load_balance off: HF routes by score",
        )
    if not isinstance(inner, GroupedExperts.Config):
        raise _refuse(
            f"layer {i} experts",
            f"{at}.routed_experts.inner_experts",
            type(inner).__qualname__,
            "GroupedExperts.Config",
            "the mapping knows torchtitan's stacked GroupedExperts only",
        )
    counts = (moe.num_experts, router.num_experts, router.gate.out_features, inner.num_experts)
    if len(set(counts)) != 1:
        raise _refuse(
            f"layer {i} expert counts differ (moe, router, gate rows, experts)",
            at,
            counts,
            "one count",
            "build the MoE config with one num_experts",
        )
    if inner.dim != dim or router.gate.in_features != dim:
        raise _refuse(
            f"layer {i} expert/router input size",
            at,
            (inner.dim, router.gate.in_features),
            dim,
            "experts and router read the model dimension",
        )
    return (moe.num_experts, router.top_k, bool(router.route_norm), inner.hidden_dim)


def moe_part(cfg: Any, family: str) -> tuple[list[HFRule], dict[str, Any], tuple[str, ...]] | None:
    """The rules, config.json entries and zero atoms of the model's MoE layers (None: it has none).

    The config entries replace the dense model's ``architectures``/``model_type`` and
    ``intermediate_size`` (the dense layers' FFN size, or the experts' when all layers are MoE:
    HF then builds no dense MLP and the value is unused).
    """
    layers = list(cfg.layers)
    moe = [i for i, layer in enumerate(layers) if getattr(layer, "moe", None) is not None]
    if not moe:
        return None
    if family != "qwen3":
        raise UCPError(
            f"{family} model with mixture-of-experts layers {moe[:4]}: only qwen3 MoE maps to Hugging Face "
            "(Qwen3MoeForCausalLM)",
            atom=f"layers.{moe[0]}.moe",
            hint="declare an HFMapping for this model, or use torchtitan's stock HF path",
        )
    keys = {_moe_key(i, layers[i].moe, cfg.dim) for i in moe}
    if len(keys) > 1:
        raise UCPError(
            f"MoE layers differ in experts/top-k/route_norm/expert hidden size: {sorted(keys)[:3]}; a Hugging Face "
            "config has one MoE geometry for all sparse layers",
            atom=f"layers.{moe[0]}.moe",
            saved=sorted(keys),
            wanted="one (num_experts, top_k, route_norm, hidden) for every MoE layer",
            hint="build the MoE layers with one configuration",
        )
    n_experts, top_k, route_norm, hidden = keys.pop()
    dense = [i for i in range(len(layers)) if i not in moe]
    ffn = {layers[i].feed_forward.w1.out_features for i in dense}
    if len(ffn) > 1:
        raise UCPError(
            f"dense layers {dense[:4]} of a MoE model differ in FFN size {sorted(ffn)}; Hugging Face's "
            "intermediate_size is one size",
            atom=f"layers.{dense[0]}.feed_forward",
            saved=sorted(ffn),
            wanted="one FFN size",
            hint="build the dense layers with one hidden size",
        )
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": ffn.pop() if ffn else hidden,
        "num_experts": n_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": hidden,
        "norm_topk_prob": route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "output_router_logits": False,
    }
    e = "mlp.experts.{e}."
    rules = [
        HFRule(_L + "mlp.gate.weight", _M + "router.gate.weight"),
        HFRule(_L + e + "gate_proj.weight", _M + "routed_experts.inner_experts.w1_EFD", stack="e"),
        HFRule(_L + e + "up_proj.weight", _M + "routed_experts.inner_experts.w3_EFD", stack="e"),
        HFRule(_L + e + "down_proj.weight", _M + "routed_experts.inner_experts.w2_EDF", stack="e"),
    ]
    return rules, config, (EXPERT_BIAS_ATOM,)
