"""Make a REAL Megatron-Core MoE ``torch_dist`` checkpoint on CPU (issue 26).

Usage (the venv with torch + megatron-core)::

    python -m ucp_dev.testing.foreign.make_megatron_moe --out DIR [--ep 2] [--tp 1] [--steps 3] [--extras]

Phase 1 (``tp x ep`` gloo processes; Megatron carves EP out of DP, so dense weights are replicated
over the ``ep`` ranks): a tiny Megatron-Core ``GPTModel`` with every layer MoE, built from the local
spec (``SequentialMLP`` experts, ``allgather`` dispatcher), trained ``steps`` steps with Megatron's
own optimizer (DistributedOptimizer, saved ``fully_reshardable``) and saved with
``dist_checkpointing.save``. Its sizes are the toy's :data:`~ucp_dev.toy.hf_presets.TOY_MIXTRAL`
(hidden 48, 6 heads, 2 query groups, 4 experts of 24, top-2, vocabulary 61 padded), so the plain
variant loads into the toy. ``--extras`` adds what the toy does not have: linear biases
(``add_bias_linear``, experts' too), QK layer norms (``qk_layernorm``) and an aux-loss-free router
(sigmoid scores, ``moe_router_enable_expert_bias``: the ``expert_bias`` buffer).
Phase 2 (one process, tp=ep=1): a fresh model and optimizer load it back through Megatron's own
``dist_checkpointing.load``; the full tensors are written by Megatron name to ``DIR/mcore_view.pt``
(``{"params", "buffers", "optim": {name: {"exp_avg", "exp_avg_sq", "step"}}, "meta"}``), Megatron's
own view of its checkpoint for the tests. Every run checks that view's loss on a fixed batch equals
the saved model's. About 20-40 s on 2 CPU cores.

Runs Megatron unchanged under :class:`.megatron_cpu.CpuAsCuda` (see that module for what needs it),
plus two MoE-path workarounds on the CPU build (the saved files are untouched): ``te_general_gemm``
(unbound without Transformer Engine: ``NameError`` in the router) is bound to None, and
``torch.cuda.current_device()`` returns ``"cpu"`` (the allgather dispatcher allocates with it in
backward, where the thread-local function mode is not active). With MoE, ``get_megatron_optimizer``
returns a ChainedOptimizer (dense and expert-parallel parameters, ``common.pt`` holds ``{0: ..., 1:
...}``); both are DistributedOptimizers here. At tp=ep=1 Megatron builds one optimizer, and its
``load_state_dict`` cannot take the two saved group lists (``KeyError: 'optimizer'``): the view merges
them and keeps the param state ``dist_checkpointing.load`` resharded. Keys: ``singleton_local_shards``
off (the metadata default: ``decoder.layers.mlp.experts.experts.linear_fc1.weight``
``[L, E, 2F, D]``) or, with ``--singleton``, on (one key per layer, expert and SwiGLU half:
``decoder.layers.<i>.mlp.experts.experts.<e>.linear_fc1.weight_w``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

from . import megatron_job as job

EXPERTS = 4
TOPK = 2
EXPERT_DIM = 24
EXTRAS = dict(
    add_bias_linear=True,
    qk_layernorm=True,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2,
    moe_router_load_balancing_type="none",
)
"""``--extras``: what the toy does not have (biases, QK norms, the aux-loss-free sigmoid router)."""


def build(args: argparse.Namespace, tp: int, ep: int, seed: int) -> tuple[Any, Any]:
    """The MoE GPT (every layer 4 ``SequentialMLP`` experts, allgather dispatcher) at ``tp`` x ``ep``."""
    moe = dict(
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=EXPERT_DIM,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_grouped_gemm=False,
    )
    spec = dict(num_experts=EXPERTS, moe_grouped_gemm=False, qk_layernorm=args.extras)
    cfg, model = job.gpt_model(tp, seed, args.padded, ep, spec, **{**moe, **(EXTRAS if args.extras else {})})
    if args.extras:  # non-zero biases and expert bias, so a mix-up cannot pass by zeros
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            for n, b in model.named_buffers():
                if n.endswith("expert_bias"):
                    b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return cfg, model


def _metadata(args: argparse.Namespace) -> dict:
    return {
        "singleton_local_shards": args.singleton,
        "chained_optim_avoid_prefix": True,
        "distrib_optim_sharding_type": "fully_reshardable",
    }


def _save(args: argparse.Namespace, out: dict) -> None:
    import torch.distributed as dist

    cfg, model = build(args, args.tp, args.ep, seed=0)
    ddp, opt, sched = job.optimizer(cfg, model, "full")
    job.train(ddp, opt, sched, args.steps)
    md = _metadata(args)
    parallel = dict(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep)
    sizes = dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_DIM)
    saved_args = job.saved_args(
        {**parallel, **job.GEOMETRY, **sizes},
        args.padded,
        dict(
            position_embedding_type="rope", add_bias_linear=args.extras, qk_layernorm=args.extras, iteration=args.steps
        ),
    )
    state = job.envelope(model, opt, sched, md, args.steps, args=saved_args)
    if args.dump and dist.get_rank() == 0:
        for k, v in sorted(state["model"].items()):
            print("KEY", k, getattr(v, "key", None), tuple(getattr(v, "global_shape", ())), flush=True)
    job.save(state, args.out, md, model, out)


def _merged_groups(opt: Any, state: dict) -> dict:
    """Saved at ep>1, common.pt holds two optimizers' groups (dense, expert-parallel); at ep=1 Megatron
    builds one optimizer, and its load_state_dict finds no "optimizer" key. The sharded param state
    (what dist_checkpointing resharded) is kept; the groups are merged."""
    if not (len(opt.chained_optimizers) == 1 and 0 in state):
        return state
    groups = [g for i in sorted(k for k in state if isinstance(k, int)) for g in state[i]["optimizer"]["param_groups"]]
    return {
        "optimizer": {"param_groups": groups},
        "param_state": state["param_state"],
        "param_state_sharding_type": state[0]["param_state_sharding_type"],
    }


def _view(args: argparse.Namespace, out: dict) -> None:
    cfg, model = build(args, 1, 1, seed=7)
    _, opt, _ = job.optimizer(cfg, model, "full")
    job.load(model, opt, _metadata(args), args.out, distributed=True, adapt=_merged_groups)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    optim = job.distributed_state(model, opt.chained_optimizers)
    out["eval_loss_view"] = job.eval_loss(model)
    meta = {k: getattr(args, k) for k in ("tp", "ep", "steps", "extras", "singleton", "padded")}
    saved = out.get("eval_loss_saved", float("nan"))
    meta.update(eval_loss_saved=saved, eval_loss_view=out["eval_loss_view"], vocab=job.VOCAB)
    torch.save(
        {"params": params, "buffers": buffers, "optim": optim, "meta": meta}, os.path.join(args.out, "mcore_view.pt")
    )


def main(argv: list[str] | None = None) -> None:
    ap = job.arguments(__doc__, tp=1, port=29537)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--extras", action="store_true", help="biases, QK layer norms, expert bias (sigmoid router)")
    ap.add_argument("--singleton", action="store_true", help="singleton_local_shards: one key per expert")
    ap.add_argument("--dump", action="store_true", help="print the model's sharded keys")
    ap.add_argument("--skip-save", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.padded = job.padded_vocab(args.vocab_divisor, args.tp)
    t0 = time.time()
    job.fresh_out(args.out, reuse=args.skip_save)
    print(f"save: tp={args.tp} ep={args.ep} (dp={args.ep}) extras={args.extras} padded_vocab={args.padded}")
    phases = [] if args.skip_save else [(_save, args.tp * args.ep)]
    job.run(args, [*phases, (_view, 1)], "tp=ep=1", moe=True)
    print(f"done in {time.time() - t0:.1f}s: {args.out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
