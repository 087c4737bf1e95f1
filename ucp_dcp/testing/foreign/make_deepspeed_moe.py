"""Make real DeepSpeed MoE (expert-parallel) ZeRO-1/2 checkpoints of the toy LLM, on CPU.

    flock /tmp/ucp-mp.lock python -m ucp_dcp.testing.foreign.make_deepspeed_moe --out DIR --stage {1,2} \\
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
import json
import os
import re
import socket
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from .make_deepspeed import BATCH_PER_RANK, CFG_KW, ds_config  # noqa: E402

MOE_LAYERS = (1, 3)
N_EXPERTS = 4
MOE_CFG_KW = dict(CFG_KW, list_moe_layers=MOE_LAYERS, n_experts=N_EXPERTS, top_k=2, expert_dim=24)
AUX_WEIGHT = 0.01
EXPERT_PREFIX = ".deepspeed_moe.experts.deepspeed_experts."


def build_model(seed: int, ep: int, ep_rank: int):
    """The toy model with DeepSpeed MoE layers, this EP rank's experts set from the logical params."""
    import torch.nn as nn
    from deepspeed.moe.layer import MoE

    from ucp_dcp.toy.model import Expert, Groups, ModelConfig, StageModel, logical_params

    class ToyDSMoE(MoE):
        """DeepSpeed's MoE with the toy block's call signature; keeps the gate loss for the step."""

        def forward(self, x, groups=None):  # type: ignore[override]
            out, l_aux, _ = super().forward(x)
            self.l_aux = l_aux
            return out

    cfg = ModelConfig(**MOE_CFG_KW)
    p = logical_params(cfg, seed)
    m = StageModel(cfg, list(range(cfg.n_layers)), first=True, last=True, tp=1, ep_size=1)
    m.load_logical(p, 1, 0, 1)
    n_local = cfg.n_experts // ep
    for i in MOE_LAYERS:
        blk = m.layers[i]
        layer = ToyDSMoE(cfg.dim, Expert(cfg), num_experts=cfg.n_experts, ep_size=ep, k=cfg.top_k)
        with torch.no_grad():
            layer.deepspeed_moe.gate.wg.weight.copy_(p[f"layers.{i}.moe.router.weight"])
            for j, ex in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
                for w in ("w1", "w2", "w3"):
                    ex.get_submodule(w).weight.copy_(p[f"layers.{i}.moe.experts.{ep_rank * n_local + j}.{w}.weight"])
        blk.moe = layer
    m.output.weight = m.tok_embeddings.weight
    m.groups = Groups(
        tp=None, ep=None, ep_rank=0, ep_size=1, loss_scale=1.0, global_tokens=BATCH_PER_RANK * cfg.seq_len
    )
    assert isinstance(m, nn.Module)
    return cfg, m


def global_name(name: str, ep_rank: int, n_local: int) -> str:
    """A DeepSpeed expert param's local name as the global one its expert file uses."""
    return re.sub(
        re.escape(EXPERT_PREFIX) + r"(\d+)\.",
        lambda x: f"{EXPERT_PREFIX}{ep_rank * n_local + int(x.group(1))}.",
        name,
    )


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.world),
        LOCAL_WORLD_SIZE=str(args.world),
    )
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups as ds_groups
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    ep_rank = rank % args.ep  # DeepSpeed's expert-parallel groups are runs of ep consecutive ranks (checked below)
    torch.manual_seed(args.seed)  # the gate's token sampling (use_rts) draws from the global generator
    cfg, m = build_model(args.seed, args.ep, ep_rank)
    decay = [p for p in m.parameters() if p.ndim >= 2]
    no_decay = [p for p in m.parameters() if p.ndim < 2]
    groups = split_params_into_different_moe_groups_for_optimizer(
        [
            {"params": decay, "weight_decay": 0.1, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ]
    )
    groups = [g for g in groups if g["params"]]
    conf = ds_config(args.stage, args.world)
    engine, opt, _, _ = deepspeed.initialize(model=m, model_parameters=groups, config=conf)
    assert ds_groups._get_expert_parallel_rank(f"ep_size_{args.ep}") == ep_rank

    t0 = time.time()
    g = torch.Generator().manual_seed(1234 + args.seed)
    for _ in range(args.steps):
        tokens = torch.randint(0, cfg.vocab, (BATCH_PER_RANK * args.world, cfg.seq_len + 1), generator=g)
        local = tokens[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        logits = engine(local[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local[:, 1:].reshape(-1))
        aux = sum(engine.module.layers[i].moe.l_aux for i in MOE_LAYERS)
        engine.backward(loss + AUX_WEIGHT * aux)
        engine.step()
        if rank == 0:
            print(f"step {engine.global_steps} loss {loss.item():.4f}", flush=True)
    t_train = time.time() - t0

    t0 = time.time()
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(args.out, tag=tag)  # (MoE saves refuse a universal_checkpoint_info client_state)
    dist.barrier()
    t_save = time.time() - t0

    # The live engine's view (see module doc); re-link the optimizer-state views as make_deepspeed.py does.
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    names = {p: n for n, p in engine.module.named_parameters()}
    zo = engine.optimizer
    base = zo.optimizer
    n_local = cfg.n_experts // args.ep
    view: dict = {
        "__groups__": [dict({k: v for k, v in pg.items() if k != "params"}, names=[]) for pg in base.param_groups]
    }
    for gi, members in enumerate(zo.bit16_groups):
        flat = zo.single_partition_of_fp32_groups[gi]
        step = base.state[flat]["step"].clone() if "step" in base.state.get(flat, {}) else None
        for p in members:
            name = global_name(names[p], ep_rank, n_local)
            view["__groups__"][gi]["names"].append(name)
            view[name] = {
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
                "fp32": safe_get_full_fp32_param(p).clone(),
                "step": step,
            }
    views: list = [None] * args.world
    dist.all_gather_object(views, view)
    if rank == 0:
        merged = {"__groups__": views[0]["__groups__"]}
        for v in views:
            for gi, gr in enumerate(v["__groups__"]):
                seen = merged["__groups__"][gi]["names"]
                seen += [n for n in gr["names"] if n not in seen]
            for k, st in v.items():
                if k == "__groups__":
                    continue
                if k in merged:  # a dense param, or an expert held by several expert-DP ranks: must agree
                    assert all(torch.equal(merged[k][s], st[s]) for s in ("exp_avg", "exp_avg_sq", "fp32")), k
                merged.setdefault(k, st)
        torch.save(merged, os.path.join(args.out, "ds_view_moe.pt"))
        with open(os.path.join(args.out, "meta.json"), "w") as f:
            json.dump(
                {
                    "stage": args.stage,
                    "world": args.world,
                    "ep": args.ep,
                    "steps": args.steps,
                    "seed": args.seed,
                    "tag": tag,
                    "moe_layers": list(MOE_LAYERS),
                    "model_config": MOE_CFG_KW,
                    "ds_config": conf,
                    "deepspeed": deepspeed.__version__,
                    "torch": torch.__version__,
                    "seconds": {"train": round(t_train, 2), "save": round(t_save, 2)},
                },
                f,
                indent=1,
            )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, as make_deepspeed.py does


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, choices=(1, 2), required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.world % args.ep or N_EXPERTS % args.ep:
        ap.error(f"--ep must divide --world and the {N_EXPERTS} experts")
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    mp.spawn(_worker, args=(args, port), nprocs=args.world, join=True)
    print(f"wrote {args.out} in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
