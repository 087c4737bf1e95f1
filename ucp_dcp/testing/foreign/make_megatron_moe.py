"""Make a REAL Megatron-Core MoE ``torch_dist`` checkpoint on CPU (issue 26).

Usage (the venv with torch + megatron-core)::

    python -m ucp_dcp.testing.foreign.make_megatron_moe --out DIR [--ep 2] [--tp 1] [--steps 3] [--extras]

Phase 1 (``tp x ep`` gloo processes; Megatron carves EP out of DP, so dense weights are replicated
over the ``ep`` ranks): a tiny Megatron-Core ``GPTModel`` with every layer MoE, built from the local
spec (``SequentialMLP`` experts, ``allgather`` dispatcher), trained ``steps`` steps with Megatron's
own optimizer (DistributedOptimizer, saved ``fully_reshardable``) and saved with
``dist_checkpointing.save``. Its sizes are the toy's :data:`~ucp_dcp.toy.hf_presets.TOY_MIXTRAL`
(hidden 48, 6 heads, 2 query groups, 4 experts of 24, top-2, vocabulary 61 padded), so the plain
variant loads into the toy. ``--extras`` adds what the toy does not have: linear biases
(``add_bias_linear``, experts' too), QK layer norms (``qk_layernorm``) and an aux-loss-free router
(sigmoid scores, ``moe_router_enable_expert_bias``: the ``expert_bias`` buffer).
Phase 2 (one process, tp=ep=1): a fresh model and optimizer load it back through Megatron's own
``dist_checkpointing.load``; the full tensors are written by Megatron name to ``DIR/mcore_view.pt``
(``{"params", "buffers", "optim": {name: {"exp_avg", "exp_avg_sq", "step"}}, "meta"}``), Megatron's
own view of its checkpoint for the tests. Every run checks that view's loss on a fixed batch equals
the saved model's. About 20-40 s on 2 CPU cores.

Runs Megatron unchanged under :class:`make_megatron.CpuAsCuda` (see that module for what needs it),
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
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from .make_megatron import (
    POS,
    VOCAB,
    CpuAsCuda,
    _install_cuda_stubs,
    _keep_step_on_load,
    _optimizer,
    batches,
    model_name,
)

warnings.filterwarnings("ignore")

EXPERTS = 4
TOPK = 2
EXPERT_DIM = 24


def build(args, tp: int, ep: int, seed: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)
    extras = dict(
        add_bias_linear=True,
        qk_layernorm=True,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-2,
        moe_router_load_balancing_type="none",
    )
    kw = dict(
        num_layers=4,
        hidden_size=48,
        num_attention_heads=6,
        num_query_groups=2,
        ffn_hidden_size=52,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        rotary_interleaved=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=EXPERT_DIM,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_grouped_gemm=False,
        params_dtype=torch.float32,
        init_method_std=0.02,
    )
    cfg = TransformerConfig(**{**kw, **(extras if args.extras else {})})
    spec = get_gpt_layer_local_spec(
        num_experts=EXPERTS, moe_grouped_gemm=False, qk_layernorm=args.extras, normalization="RMSNorm"
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=args.padded,
        max_sequence_length=POS.shape[1],
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )
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


def _metadata(args) -> dict:
    return {
        "singleton_local_shards": args.singleton,
        "chained_optim_avoid_prefix": True,
        "distrib_optim_sharding_type": "fully_reshardable",
    }


def eval_loss(model) -> float:
    inp, lab = next(batches(1, 0, 1))
    with torch.no_grad():
        return model(inp, POS, None, labels=lab).mean().item()


def _save(args, out: dict) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    cfg, model = build(args, args.tp, args.ep, seed=0)
    ddp, opt, sched = _optimizer(cfg, model, "full")
    dp = ps.get_data_parallel_world_size()
    for inp, lab in batches(args.steps, ps.get_data_parallel_rank(), dp):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(inp, POS, None, labels=lab).mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, gnorm, _ = opt.step()
        sched.step(increment=inp.shape[0] * dp)
        if dist.get_rank() == 0:
            print(f"  step loss={loss.item():.5f} grad_norm={gnorm:.4f} ok={ok}", flush=True)
    md = _metadata(args)
    sd = model.sharded_state_dict(metadata=md)
    if args.dump and dist.get_rank() == 0:
        for k, v in sorted(sd.items()):
            print("KEY", k, getattr(v, "key", None), tuple(getattr(v, "global_shape", ())), flush=True)
    envelope = {
        "model": sd,
        "optimizer": opt.sharded_state_dict(sd, metadata=md),
        "opt_param_scheduler": sched.state_dict(),
        "iteration": args.steps,
        "checkpoint_version": 3.0,
        "args": argparse.Namespace(
            tensor_model_parallel_size=args.tp,
            expert_model_parallel_size=args.ep,
            num_layers=4,
            hidden_size=48,
            num_attention_heads=6,
            num_query_groups=2,
            num_experts=EXPERTS,
            moe_router_topk=TOPK,
            moe_ffn_hidden_size=EXPERT_DIM,
            swiglu=True,
            normalization="RMSNorm",
            vocab_size=VOCAB,
            padded_vocab_size=args.padded,
            rotary_interleaved=True,
            position_embedding_type="rope",
            add_bias_linear=args.extras,
            qk_layernorm=args.extras,
            iteration=args.steps,
        ),
    }
    dist_checkpointing.save(envelope, args.out, content_metadata=md)
    loss = eval_loss(model)
    if dist.get_rank() == 0:
        out["eval_loss_saved"] = loss


def _view(args, out: dict) -> None:
    from megatron.core import dist_checkpointing

    cfg, model = build(args, 1, 1, seed=7)
    ddp, opt, _ = _optimizer(cfg, model, "full")
    for o in opt.chained_optimizers:
        o._init_optimizer_states_with_dummy_values()
        _keep_step_on_load(o)
    md = _metadata(args)
    sd = model.sharded_state_dict(metadata=md)
    tmpl = opt.sharded_state_dict(sd, is_loading=True, metadata=md)
    loaded = dist_checkpointing.load({"model": sd, "optimizer": tmpl}, args.out)
    model.load_state_dict(loaded["model"], strict=True)
    state = loaded["optimizer"]
    if len(opt.chained_optimizers) == 1 and 0 in state:
        # Saved at ep>1: common.pt holds two optimizers' groups (dense, expert-parallel); at ep=1
        # Megatron builds one optimizer, and its load_state_dict finds no "optimizer" key. The
        # sharded param state (what dist_checkpointing resharded) is kept; the groups are merged.
        groups = [
            g for i in sorted(k for k in state if isinstance(k, int)) for g in state[i]["optimizer"]["param_groups"]
        ]
        state = {
            "optimizer": {"param_groups": groups},
            "param_state": state["param_state"],
            "param_state_sharding_type": state[0]["param_state_sharding_type"],
        }
    with torch.no_grad():
        opt.load_state_dict(state)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    optim = {}
    for o in opt.chained_optimizers:  # distributed optimizer at dp=1: one shard holds a whole param
        for mg, sg in zip(
            o.model_float16_groups + o.model_fp32_groups, o.shard_fp32_from_float16_groups + o.shard_fp32_groups
        ):
            for p, sp in zip(mg, sg):
                st = o.optimizer.state[sp]
                optim[model_name(model, p)] = {
                    k: (v.detach().clone().view(p.shape) if torch.is_tensor(v) and v.numel() == p.numel() else v)
                    for k, v in st.items()
                }
    out["eval_loss_view"] = eval_loss(model)
    meta = {k: getattr(args, k) for k in ("tp", "ep", "steps", "extras", "singleton", "padded")}
    meta.update(eval_loss_saved=args.eval_loss_saved, eval_loss_view=out["eval_loss_view"], vocab=VOCAB)
    torch.save(
        {"params": params, "buffers": buffers, "optim": optim, "meta": meta}, os.path.join(args.out, "mcore_view.pt")
    )


def worker(rank: int, world: int, args, port: int, phase: str, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    _install_cuda_stubs()
    # The allgather dispatcher's backward allocates with device=torch.cuda.current_device(); autograd
    # runs backward nodes outside CpuAsCuda (a thread-local mode), so the device itself must be CPU.
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.transformer.moe import moe_utils

    # MCore 0.16.1 without Transformer Engine: router_gating_linear tests ``te_general_gemm is not
    # None``, a name bound only when TE imports (NameError otherwise). Bind it to None: torch's path.
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with CpuAsCuda():
            {"save": _save, "view": _view}[phase](args, out)
        dist.barrier()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--extras", action="store_true", help="biases, QK layer norms, expert bias (sigmoid router)")
    ap.add_argument("--singleton", action="store_true", help="singleton_local_shards: one key per expert")
    ap.add_argument("--dump", action="store_true", help="print the model's sharded keys")
    ap.add_argument("--skip-save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vocab-divisor", type=int, default=128)
    ap.add_argument("--port", type=int, default=29537)
    args = ap.parse_args(argv)
    m = args.vocab_divisor * args.tp
    args.padded = -(-VOCAB // m) * m
    t0 = time.time()
    if os.path.exists(args.out) and os.listdir(args.out) and not args.skip_save:
        sys.exit(f"{args.out} is not empty")
    os.makedirs(args.out, exist_ok=True)
    with mp.Manager() as mgr:
        out = mgr.dict()
        world = args.tp * args.ep
        print(f"save: tp={args.tp} ep={args.ep} (dp={args.ep}) extras={args.extras} padded_vocab={args.padded}")
        if not args.skip_save:
            mp.spawn(worker, args=(world, args, args.port, "save", out), nprocs=world)
        args.eval_loss_saved = out.get("eval_loss_saved", float("nan"))
        mp.spawn(worker, args=(1, args, args.port + 2, "view", out), nprocs=1)
        view = out["eval_loss_view"]
    print(f"eval loss: saved model {args.eval_loss_saved:.6f}, Megatron's tp=ep=1 view {view:.6f}")
    assert abs(view - args.eval_loss_saved) < 1e-4, "the tp=ep=1 load disagrees with the saved model"
    print(f"done in {time.time() - t0:.1f}s: {args.out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
