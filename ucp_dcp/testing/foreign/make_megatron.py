"""Make a REAL Megatron-Core ``torch_dist`` checkpoint on CPU (fixture for issue 15).

Usage (a venv with torch + megatron-core, e.g. /tmp/fvenv)::

    python -m ucp_dcp.testing.foreign.make_megatron --out DIR [--tp 2] [--steps 3] [--dist-opt none|dp|full]

Phase 1 (``tp`` gloo processes): a tiny Megatron-Core ``GPTModel`` built from the local
(non-Transformer-Engine) layer spec; trained ``steps`` steps with Megatron's own optimizer; saved
with ``megatron.core.dist_checkpointing.save`` in the default ``torch_dist`` format.
Phase 2 (one process, tp=1): a fresh model and optimizer load the checkpoint back with
``dist_checkpointing.load``; the full tensors are written by Megatron name to ``DIR/mcore_view.pt``
(``{"params": {name: tensor}, "optim": {name: {"exp_avg", "exp_avg_sq", "step"}}, "meta": {...}}``),
so tests compare a foreign reader against Megatron's own view of its checkpoint.

Variants: ``--dist-opt none`` (FP32Optimizer: ``optimizer.state.{exp_avg,exp_avg_sq}.<key>`` in the
model's layout, ``common_step`` in common.pt), ``--dist-opt full`` (DistributedOptimizer,
``fully_reshardable``: also ``optimizer.state.param.<key>``), ``--dist-opt dp`` (DistributedOptimizer,
``dp_reshardable``: flat per-bucket buffers ``optimizer.distributed.dp_group_idx_<mp rank>...``;
Megatron-LM's default for --use-distributed-optimizer). ``--dp`` adds data parallelism (world tp x dp).
The padded vocabulary follows Megatron-LM (multiple of 128 x tp: 61 -> 256 at tp=2); the tp=1 view
model is built with the saved padded size. Every run checks that the tp=1 view's loss on a fixed
batch equals the saved model's (the resharding load went right). About 10-30 s on 2 CPU cores.

What runs on CPU (megatron-core 0.16.1, torch 2.13 CPU, no Apex/TE) and what does not
---------------------------------------------------------------------------------------
* The model: local spec (``get_gpt_layer_local_spec(normalization="RMSNorm")``, torch RMSNorm),
  ``use_cpu_initialization=True``, gloo, TP=2, GQA, SwiGLU, no biases, RoPE with
  ``rotary_interleaved=True`` (unfused path), tied embeddings, fp32. Dropout 0.
* Megatron hard-codes CUDA on the paths a CPU step reaches, each raising
  ``AssertionError: Torch not compiled with CUDA enabled`` on a CPU torch: the default causal mask
  (``transformer/utils.py``: ``torch.ones(sq, sq, device="cuda")``), TP gathers
  (``tensor_parallel/mappings.py``: ``device=torch.cuda.current_device()``), DDP grad/param buffers
  (``distributed/param_and_grad_buffer.py``), ``FP32Optimizer.__init__``
  (``torch.tensor([1.0], device='cuda')``), and DistributedOptimizer accepts only
  ``torch.cuda.{Float,Half,BFloat16}Tensor`` params (``TypeError: Wrapped parameters must be one of
  ...``). The CUDA RNG tracker's ``fork()`` needs CUDA generators. So Megatron's code runs unchanged
  under :class:`CpuAsCuda` (a ``TorchFunctionMode`` mapping CUDA device arguments to CPU, ``.cuda()``
  to a no-op, and reporting CPU float tensors as ``torch.cuda.*Tensor`` to ``Tensor.type()``) with
  Megatron's own no-op "inference" RNG tracker. With it, Megatron's DDP, ``get_megatron_optimizer``
  (Adam, decoupled weight decay; torch.optim fallback as Apex/TE are absent), OptimizerParamScheduler,
  ``sharded_state_dict`` and ``dist_checkpointing.save/load`` all run; nothing in Megatron is edited.
* Loading a DistributedOptimizer checkpoint on the torch-Adam path needs two workarounds (load side
  only; the saved files are untouched): ``DistributedOptimizer.state_dict()`` asserts a common "step"
  that exists only after a step (``assert len(steps) == 1``), so Megatron's
  ``_init_optimizer_states_with_dummy_values()`` runs first; and the step is lost or missing on load
  (see :func:`_keep_step_on_load`: ``KeyError: 'step'`` for fully_reshardable, step silently 1 instead
  of 3 for dp_reshardable). dp_reshardable loads only at the saved TP, so the view re-saves it as
  fully_reshardable at the saved TP (Megatron's code) into a temporary folder and loads that at tp=1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

warnings.filterwarnings("ignore")

VOCAB = 61
SEQ = 12
BATCH = 2
LR = 1e-3
POS = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
SHARDING = {"dp": "dp_reshardable", "full": "fully_reshardable"}


# ----------------------------------------------------------------------------------------- CPU shim
def _is_cuda(dev) -> bool:
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


_CPU_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class CpuAsCuda(TorchFunctionMode):
    """Run CUDA-hard-coded Megatron code on CPU: every CUDA device argument becomes CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            args = tuple(
                "cpu" if (i > 0 and _is_cuda(a) and not isinstance(a, bool)) else a for i, a in enumerate(args)
            )
        if name == "type" and args and isinstance(args[0], torch.Tensor) and len(args) == 1 and not kwargs:
            t = func(*args)
            return _CPU_TYPES.get(t, t)
        if name == "is_cuda":  # property getter
            return True
        return func(*args, **kwargs)


def _install_cuda_stubs() -> None:
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None


# --------------------------------------------------------------------------------------- the model
def build(tp: int, seed: int, padded: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)
    cfg = TransformerConfig(
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
        params_dtype=torch.float32,
        init_method_std=0.02,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded,
        max_sequence_length=SEQ,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )
    return cfg, model, padded


def batches(steps: int, dp_rank: int = 0, dp: int = 1):
    """``steps`` global batches of ``BATCH * dp`` sequences; this DP rank's slice of each."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        toks = torch.randint(0, VOCAB, (BATCH * dp, SEQ + 1), generator=g)
        toks = toks[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        yield toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def eval_loss(model) -> float:
    """Mean loss of the (global) model on a fixed batch: equal at every layout if loads are right."""
    inp, lab = next(batches(1, 0, 1))
    with torch.no_grad():
        return model(inp, POS, None, labels=lab).mean().item()


def worker(rank: int, world: int, args, port: int, phase: str, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    _install_cuda_stubs()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with CpuAsCuda():
            {"save": _save, "reshard": _reshard, "view": _view}[phase](args, out)
        dist.barrier()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _optimizer(cfg, model, dist_opt: str):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    use = dist_opt != "none"
    ddp = DistributedDataParallel(
        cfg,
        DistributedDataParallelConfig(
            use_distributed_optimizer=use, grad_reduce_in_fp32=True, overlap_grad_reduce=False, bucket_size=None
        ),
        module=model,
    )
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        min_lr=LR / 10,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
        bf16=False,
        fp16=False,
        params_dtype=torch.float32,
        use_distributed_optimizer=use,
    )
    opt = get_megatron_optimizer(ocfg, [ddp])
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=LR,
        min_lr=LR / 10,
        lr_warmup_steps=1,
        lr_decay_steps=100,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )
    return ddp, opt, sched


def _metadata(sharding: str) -> dict:
    """The content metadata Megatron-LM passes to sharded_state_dict (and stores in the ckpt)."""
    md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding != "none":
        md["distrib_optim_sharding_type"] = SHARDING[sharding]
    return md


def _envelope(model, opt, sched, md: dict, iteration: int, tp: int) -> dict:
    """A state dict shaped like Megatron-LM's torch_dist checkpoints (model, optimizer, scheduler,
    iteration, checkpoint_version, args, rng_state as a ShardedObject)."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = model.sharded_state_dict(metadata=md)
    rng = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": None,
            "rng_tracker_states": {},
        }
    ]
    return {
        "model": sd,
        "optimizer": opt.sharded_state_dict(sd, metadata=md),
        "opt_param_scheduler": sched.state_dict(),
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "num_floating_point_operations_so_far": 0,
        "args": argparse.Namespace(
            tensor_model_parallel_size=tp,
            num_layers=4,
            hidden_size=48,
            num_attention_heads=6,
            num_query_groups=2,
            ffn_hidden_size=52,
            swiglu=True,
            normalization="RMSNorm",
            vocab_size=VOCAB,
            padded_vocab_size=model.vocab_size,
            rotary_interleaved=True,
            untie_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            iteration=iteration,
        ),
        "rng_state": ShardedObject(
            "rng_state",
            rng,
            (1, ps.get_tensor_model_parallel_world_size()),
            (0, ps.get_tensor_model_parallel_rank()),
            replica_id=ps.get_data_parallel_rank(),
        ),
    }


def _train_and_save(args, tp: int, dp: int, sharding: str, out_dir: str, steps: int, out: dict):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    cfg, model, padded = build(tp, seed=0, padded=args.padded)
    ddp, opt, sched = _optimizer(cfg, model, sharding)
    for inp, lab in batches(steps, ps.get_data_parallel_rank(), dp):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(inp, POS, None, labels=lab).mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, gnorm, _ = opt.step()
        sched.step(increment=BATCH * dp)
        if dist.get_rank() == 0:
            print(f"  step loss={loss.item():.5f} grad_norm={gnorm:.4f} ok={ok}", flush=True)
    md = _metadata(sharding)
    dist_checkpointing.save(_envelope(model, opt, sched, md, steps, tp), out_dir, content_metadata=md)
    loss = eval_loss(model)  # every rank: the forward has TP collectives
    if dist.get_rank() == 0:
        out["eval_loss_saved"] = loss


def _save(args, out: dict) -> None:
    _train_and_save(args, args.tp, args.dp, args.dist_opt, args.out, args.steps, out)


def _load(tp: int, sharding: str, ckpt: str, padded: int):
    """A fresh model + optimizer at ``tp`` loading ``ckpt`` through Megatron's own code."""
    from megatron.core import dist_checkpointing

    cfg, model, _ = build(tp, seed=7, padded=padded)
    ddp, opt, sched = _optimizer(cfg, model, sharding)
    md = _metadata(sharding)
    assert dist_checkpointing.load_content_metadata(ckpt) == md, dist_checkpointing.load_content_metadata(ckpt)
    # As Megatron-LM loads: the optimizer's sharded state dict is built with is_loading=True
    # (which also creates the Adam state to load into). Without Apex/TE (torch Adam),
    # DistributedOptimizer.state_dict() asserts one common "step" in the state, which only
    # exists after a step: Megatron's own helper takes a zero-gradient step first.
    if sharding != "none":
        for o in getattr(opt, "chained_optimizers", [opt]):
            o._init_optimizer_states_with_dummy_values()
            _keep_step_on_load(o)
    sd = model.sharded_state_dict(metadata=md)
    template = {"model": sd, "optimizer": opt.sharded_state_dict(sd, is_loading=True, metadata=md)}
    loaded = dist_checkpointing.load(template, ckpt)
    model.load_state_dict(loaded["model"], strict=True)
    with torch.no_grad():  # fp32 main params are views of leaf params (dp_reshardable copy_)
        opt.load_state_dict(loaded["optimizer"])
    return model, opt, sched


def _keep_step_on_load(o) -> None:
    """Work around two MCore 0.16.1 bugs of the torch-Adam path (no Apex/TE), where Adam keeps a
    per-param "step": DistributedOptimizer.load_state_dict first puts the checkpoint's common step
    (param_groups[*]["step"]) into every param's state, then

    * fully_reshardable: load_parameter_state_from_fully_reshardable drops "step" from the loaded
      tensors while _set_main_param_and_optimizer_states copies every key of the destination
      state: ``KeyError: 'step'``;
    * dp_reshardable: the loaded bucket entries carry the "step" of the load template (the
      pre-load state), which then overwrites the checkpoint's step (3 -> 1, silently).

    Both: copy the step load_state_dict took from the checkpoint's param groups."""
    orig = o._set_main_param_and_optimizer_states

    def patched(model_param, tensors):
        gi, go = o.model_param_group_index_map[model_param]
        st = o.optimizer.state[o.optimizer.param_groups[gi]["params"][go]]
        if "step" in st:
            tensors = {**tensors, "step": st["step"].clone()}
        return orig(model_param, tensors)

    o._set_main_param_and_optimizer_states = patched


def _reshard(args, out: dict) -> None:
    """dp_reshardable checkpoints load only at the saved TP: load there, re-save fully_reshardable
    (Megatron's code both ways) so the view can load it at tp=1."""
    from megatron.core import dist_checkpointing

    model, opt, sched = _load(args.tp, args.dist_opt, args.out, args.padded)
    md = _metadata("full")
    dist_checkpointing.save(
        {
            "model": model.sharded_state_dict(metadata=md),
            "optimizer": opt.sharded_state_dict(model.sharded_state_dict(metadata=md), metadata=md),
        },
        args.tmp,
        content_metadata=md,
    )


def _view(args, out: dict) -> None:
    sharding = "full" if args.dist_opt == "dp" else args.dist_opt
    ckpt = args.tmp if args.dist_opt == "dp" else args.out
    model, opt, _ = _load(1, sharding, ckpt, args.padded)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    inner = opt.chained_optimizers if hasattr(opt, "chained_optimizers") else [opt]
    assert len(inner) == 1, inner
    opt = inner[0]
    optim = {}
    if sharding == "none":
        for n, p in model.named_parameters():
            st = opt.optimizer.state[p]
            optim[n] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    else:
        # Distributed optimizer at dp=1: one shard per param holding all its elements (1-D).
        for mg, sg in zip(
            opt.model_float16_groups + opt.model_fp32_groups, opt.shard_fp32_from_float16_groups + opt.shard_fp32_groups
        ):
            for p, sp in zip(mg, sg):
                st = opt.optimizer.state[sp]
                optim[model_name(model, p)] = {
                    k: (v.detach().clone().view(p.shape) if torch.is_tensor(v) and v.numel() == p.numel() else v)
                    for k, v in st.items()
                }
    out["eval_loss_view"] = eval_loss(model)
    torch.save(
        {
            "params": params,
            "optim": optim,
            "meta": {
                "padded_vocab": args.padded,
                "vocab": VOCAB,
                "tp_saved": args.tp,
                "dp_saved": args.dp,
                "dist_opt": args.dist_opt,
                "sharding": SHARDING.get(args.dist_opt),
                "steps": args.steps,
                "eval_loss_saved": args.eval_loss_saved,
                "eval_loss_view": out["eval_loss_view"],
            },
        },
        os.path.join(args.out, "mcore_view.pt"),
    )


def model_name(model, p) -> str:
    for n, q in model.named_parameters():
        if q is p:
            return n
    raise KeyError("parameter not in model")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--dist-opt",
        choices=["none", "dp", "full"],
        default="none",
        help="none: use_distributed_optimizer=False; dp / full: distributed optimizer "
        "saved as dp_reshardable / fully_reshardable",
    )
    ap.add_argument(
        "--vocab-divisor",
        type=int,
        default=128,
        help="Megatron-LM's make_vocab_size_divisible_by (padded to a multiple of it x tp)",
    )
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args(argv)
    m = args.vocab_divisor * args.tp
    args.padded = -(-VOCAB // m) * m  # Megatron-LM's _vocab_size_with_padding
    t0 = time.time()
    if os.path.exists(args.out) and os.listdir(args.out):
        sys.exit(f"{args.out} is not empty")
    os.makedirs(args.out, exist_ok=True)
    with mp.Manager() as mgr:
        out = mgr.dict()
        world = args.tp * args.dp
        print(f"save: tp={args.tp} dp={args.dp} dist_opt={args.dist_opt} padded_vocab={args.padded}")
        mp.spawn(worker, args=(world, args, args.port, "save", out), nprocs=world)
        args.eval_loss_saved = out["eval_loss_saved"]
        if args.dist_opt == "dp":
            args.tmp = tempfile.mkdtemp(prefix=".mcore-reshard-", dir=os.path.dirname(os.path.abspath(args.out)))
            mp.spawn(worker, args=(args.tp, args, args.port + 1, "reshard", out), nprocs=args.tp)
        mp.spawn(worker, args=(1, args, args.port + 2, "view", out), nprocs=1)
        view = out["eval_loss_view"]
    if args.dist_opt == "dp":
        shutil.rmtree(args.tmp)
    print(f"eval loss: saved model {args.eval_loss_saved:.6f}, Megatron's tp=1 view {view:.6f}")
    assert abs(view - args.eval_loss_saved) < 1e-4, "the tp=1 load disagrees with the saved model"
    print(f"done in {time.time() - t0:.1f}s: {args.out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
