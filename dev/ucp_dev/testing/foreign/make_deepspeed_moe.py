"""Make real DeepSpeed MoE (expert-parallel) ZeRO-1/2 checkpoints of the toy LLM, on CPU.

    flock /tmp/ucp-mp.lock python -m ucp_dev.testing.foreign.make_deepspeed_moe --out DIR --stage {1,2} \\
        [--world 4] [--ep 2] [--steps 3] [--seed 0]

The toy Llama of ``make_deepspeed.py`` (fp32, ``torch_adam`` AdamW, two param groups, tied head) with
layers ``MOE_LAYERS`` made of DeepSpeed's own ``deepspeed.moe.layer.MoE`` (top-2 ``TopKGate``,
``N_EXPERTS`` experts, ``ep_size=--ep``; each expert is the toy's ``Expert``: ``w1``/``w3``/``w2``
without bias), initialised from the toy's logical parameters (expert ``g`` of the toy is DeepSpeed's
global expert ``g``, the router is the gate ``wg``). The param groups are split by DeepSpeed's
``split_params_into_different_moe_groups_for_optimizer`` (the expert params of each group move to a
``moe=True`` group named ``ep_size_<ep>``, partitioned over the expert-data-parallel ranks). Trained
``--steps`` steps on ``--world`` gloo ranks and saved with ``engine.save_checkpoint``, so the tag
folder holds DeepSpeed's MoE layout:

* ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``: one file per MoE layer (``L`` counts MoE
  layers in module order) and *global* expert ``E``, written by the first expert-data-parallel rank
  of each expert-parallel rank; keys ``<module>.deepspeed_moe.experts.deepspeed_experts.<E>.<w>``;
* ``mp_rank_00_model_states.pt``: the rest of the module (gate included) and ``param_shapes``, the
  expert group's names in *local* numbering (``deepspeed_experts.<j>``) as rank 0 sees them;
* ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: every rank's flat fp32 partitions and moments; the
  expert group of rank ``r`` is partition ``r // ep`` of the local experts of EP rank ``r % ep``.
  (DeepSpeed writes ``expp_rank_<e>_..._optim_states.pt`` only without ZeRO. ZeRO-3 is not offered:
  deepspeed 0.19.8 refuses native MoE with it in ``engine._validate_zero3_moe_compatibility``.)

Also written: ``ds_view_moe.pt`` -- the live engine's view after the save, gathered from every rank:
``{ds_name: {"fp32", "exp_avg", "exp_avg_sq", "step"}, "__groups__": [...]}`` with expert params
under their *global* names (``deepspeed_experts.<ep_rank * local + j>``), tensors from DeepSpeed's
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (full over the param's ZeRO group);
and ``meta.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any

import torch

from . import deepspeed_job as job

AUX_WEIGHT = 0.01
EXPERT_PREFIX = ".deepspeed_moe.experts.deepspeed_experts."


def build_model(seed: int, ep: int, ep_rank: int) -> tuple[Any, Any]:
    """The toy model with DeepSpeed MoE layers, this EP rank's experts set from the logical params."""
    from deepspeed.moe.layer import MoE

    from ucp_dev.toy.model import Expert

    class ToyDSMoE(MoE):
        """DeepSpeed's MoE with the toy block's call signature; keeps the gate loss for the step."""

        def forward(self, x, groups=None):  # type: ignore[override]
            out, l_aux, _ = super().forward(x)
            self.l_aux = l_aux
            return out

    def swap_in_moe(cfg: Any, m: Any, p: dict) -> None:
        n_local = cfg.n_experts // ep
        for i in job.MOE_LAYERS:
            layer = ToyDSMoE(cfg.dim, Expert(cfg), num_experts=cfg.n_experts, ep_size=ep, k=cfg.top_k)
            with torch.no_grad():
                layer.deepspeed_moe.gate.wg.weight.copy_(p[f"layers.{i}.moe.router.weight"])
                for j, ex in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
                    for w in ("w1", "w2", "w3"):
                        ex.get_submodule(w).weight.copy_(
                            p[f"layers.{i}.moe.experts.{ep_rank * n_local + j}.{w}.weight"]
                        )
            m.layers[i].moe = layer

    return job.toy_model(job.MOE_CFG_KW, seed, edit=swap_in_moe)


def global_name(name: str, ep_rank: int, n_local: int) -> str:
    """A DeepSpeed expert param's local name as the global one its expert file uses."""
    return re.sub(
        re.escape(EXPERT_PREFIX) + r"(\d+)\.",
        lambda x: f"{EXPERT_PREFIX}{ep_rank * n_local + int(x.group(1))}.",
        name,
    )


def _merged(views: list[dict]) -> dict:
    """Every rank's view as one: group members in first-seen order; a param several ranks hold (dense,
    or an expert on several expert-DP ranks) must agree."""
    merged: dict = {"__groups__": views[0]["__groups__"]}
    for v in views:
        for gi, gr in enumerate(v["__groups__"]):
            seen = merged["__groups__"][gi]["names"]
            seen += [n for n in gr["names"] if n not in seen]
        for k, st in v.items():
            if k == "__groups__":
                continue
            if k in merged:
                assert all(torch.equal(merged[k][s], st[s]) for s in ("exp_avg", "exp_avg_sq", "fp32")), k
            merged.setdefault(k, st)
    return merged


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    job.join(rank, args.world, port)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups as ds_groups

    ep_rank = rank % args.ep  # DeepSpeed's expert-parallel groups are runs of ep consecutive ranks (checked below)
    torch.manual_seed(args.seed)  # the gate's token sampling (use_rts) draws from the global generator
    cfg, m = build_model(args.seed, args.ep, ep_rank)
    groups = split_params_into_different_moe_groups_for_optimizer(job.decay_groups(m, named=True))
    groups = [g for g in groups if g["params"]]
    conf = job.ds_config(args.stage, args.world)
    engine, _, _, _ = deepspeed.initialize(model=m, model_parameters=groups, config=conf)
    assert ds_groups._get_expert_parallel_rank(f"ep_size_{args.ep}") == ep_rank

    def aux() -> Any:
        return AUX_WEIGHT * sum(engine.module.layers[i].moe.l_aux for i in job.MOE_LAYERS)

    t_train = job.train(engine, cfg, rank, args.world, args.steps, args.seed, aux)
    tag, t_save = job.save(engine, args.out)  # (MoE saves refuse a universal_checkpoint_info client_state)
    n_local = cfg.n_experts // args.ep
    view = job.live_view(engine, args.stage, lambda name: global_name(name, ep_rank, n_local))
    views: list = [None] * args.world
    dist.all_gather_object(views, view)
    if rank == 0:
        torch.save(_merged(views), os.path.join(args.out, "ds_view_moe.pt"))
        run = {k: getattr(args, k) for k in ("stage", "world", "ep", "steps", "seed")}
        run.update(tag=tag, moe_layers=list(job.MOE_LAYERS))
        job.write_meta(args.out, run, job.MOE_CFG_KW, conf, {"train": t_train, "save": t_save})
    job.finish()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, choices=(1, 2), required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.world % args.ep or job.N_EXPERTS % args.ep:
        ap.error(f"--ep must divide --world and the {job.N_EXPERTS} experts")
    t0 = time.time()
    job.spawn(_worker, args)
    print(f"wrote {args.out} in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
