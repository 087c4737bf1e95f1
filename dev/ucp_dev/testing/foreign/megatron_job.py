"""A tiny Megatron-Core GPT trained, saved and loaded back by Megatron's own code on CPU: what the dense
and MoE writers share.

The model geometry and data, building a ``GPTModel`` from the local (non-Transformer-Engine) spec,
Megatron's DDP, optimizer and scheduler, the training loop, the ``torch_dist`` envelope and save, the
load back (with the torch-Adam workaround of :func:`keep_step_on_load`), the distributed optimizer's
state by parameter name, and the phases: each a function run on a fresh gloo world under
:class:`~.megatron_cpu.CpuAsCuda`, sharing one managed dict. :mod:`.make_megatron` (dense) and
:mod:`.make_megatron_moe` (every layer MoE) are the programs. megatron is imported only inside the ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ..processes import free_port
from .megatron_cpu import CpuAsCuda, install_cuda_stubs

warnings.filterwarnings("ignore")

VOCAB = 61
SEQ = 12
BATCH = 2
LR = 1e-3
POS = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
GEOMETRY = dict(num_layers=4, hidden_size=48, num_attention_heads=6, num_query_groups=2)
"""The toy's sizes (``ucp_dev.toy.hf_presets.TOY_LLAMA``), also recorded in the saved ``args``."""
FFN = 52
"""The dense MLP's hidden size (the MoE GPT's experts have their own)."""
CONFIG = dict(
    GEOMETRY,
    ffn_hidden_size=FFN,
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
    params_dtype=torch.float32,
    init_method_std=0.02,
)
"""``TransformerConfig`` of the dense GPT: GQA, SwiGLU, RMSNorm, no biases, interleaved RoPE, fp32, no
dropout, and none of the fused kernels (they need CUDA)."""


def padded_vocab(divisor: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: a multiple of ``divisor`` x ``tp``."""
    m = divisor * tp
    return -(-VOCAB // m) * m


def gpt_model(tp: int, seed: int, padded: int, ep: int = 1, spec: dict | None = None, **config: Any) -> tuple[Any, Any]:
    """Parallel state at ``tp`` x ``ep`` and a tied-embedding ``GPTModel`` initialised from ``seed``;
    ``config`` overrides :data:`CONFIG`, ``spec`` adds to the local layer spec's arguments."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)
    cfg = TransformerConfig(**{**CONFIG, "tensor_model_parallel_size": tp, **config})
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(**(spec or {}), normalization="RMSNorm"),
        vocab_size=padded,
        max_sequence_length=SEQ,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )
    return cfg, model


def batches(steps: int, dp_rank: int = 0, dp: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``BATCH * dp`` sequences; this DP rank's slice of each."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        toks = torch.randint(0, VOCAB, (BATCH * dp, SEQ + 1), generator=g)
        toks = toks[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        yield toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def eval_loss(model: Any) -> float:
    """Mean loss of the (global) model on a fixed batch: equal at every layout if loads are right."""
    inp, lab = next(batches(1, 0, 1))
    with torch.no_grad():
        return model(inp, POS, None, labels=lab).mean().item()


def optimizer(cfg: Any, model: Any, dist_opt: str) -> tuple[Any, Any, Any]:
    """Megatron's DDP, Adam (``get_megatron_optimizer``; distributed unless ``dist_opt == "none"``) and
    cosine scheduler, as Megatron-LM sets them up."""
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


def train(ddp: Any, opt: Any, sched: Any, steps: int) -> None:
    """``steps`` steps, each DP rank on its slice of the same global batches."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
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


def envelope(model: Any, opt: Any, sched: Any, md: dict, iteration: int, **rest: Any) -> dict:
    """A state dict shaped like Megatron-LM's ``torch_dist`` checkpoints: model, optimizer, scheduler,
    iteration, checkpoint version, then ``rest`` (its ``args``, ...)."""
    sd = model.sharded_state_dict(metadata=md)
    return {
        "model": sd,
        "optimizer": opt.sharded_state_dict(sd, metadata=md),
        "opt_param_scheduler": sched.state_dict(),
        "iteration": iteration,
        "checkpoint_version": 3.0,
        **rest,
    }


def saved_args(head: dict, padded: int, tail: dict) -> argparse.Namespace:
    """Megatron-LM's ``args`` as its checkpoints carry them (readers check sizes, vocabulary, rotary):
    ``head`` (parallel and model sizes), the fields both GPTs share, then ``tail``, in that order."""
    return argparse.Namespace(
        **head,
        swiglu=True,
        normalization="RMSNorm",
        vocab_size=VOCAB,
        padded_vocab_size=padded,
        rotary_interleaved=True,
        **tail,
    )


def save(state: dict, path: str, md: dict, model: Any, out: dict) -> None:
    """``dist_checkpointing.save`` of ``state``; the saved model's :func:`eval_loss` into ``out``."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, path, content_metadata=md)
    loss = eval_loss(model)  # every rank: the forward has TP collectives
    if dist.get_rank() == 0:
        out["eval_loss_saved"] = loss


def keep_step_on_load(o: Any) -> None:
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


def load(
    model: Any, opt: Any, md: dict, ckpt: str, distributed: bool, adapt: Callable[[Any, dict], dict] | None = None
) -> None:
    """``model`` and ``opt`` load ``ckpt`` as Megatron-LM does, the optimizer's ``load_state_dict``
    taking ``adapt(opt, state)`` when given.

    The optimizer's sharded state dict is built with ``is_loading=True`` (which also creates the Adam
    state to load into). Without Apex/TE (torch Adam), ``DistributedOptimizer.state_dict()`` asserts
    one common "step" in the state, which only exists after a step: Megatron's own helper takes a
    zero-gradient step first, and :func:`keep_step_on_load` keeps the checkpoint's step."""
    from megatron.core import dist_checkpointing

    assert dist_checkpointing.load_content_metadata(ckpt) == md, dist_checkpointing.load_content_metadata(ckpt)
    if distributed:
        for o in getattr(opt, "chained_optimizers", [opt]):
            o._init_optimizer_states_with_dummy_values()
            keep_step_on_load(o)
    sd = model.sharded_state_dict(metadata=md)
    template = {"model": sd, "optimizer": opt.sharded_state_dict(sd, is_loading=True, metadata=md)}
    loaded = dist_checkpointing.load(template, ckpt)
    model.load_state_dict(loaded["model"], strict=True)
    state = loaded["optimizer"] if adapt is None else adapt(opt, loaded["optimizer"])
    with torch.no_grad():  # fp32 main params are views of leaf params (dp_reshardable copy_)
        opt.load_state_dict(state)


def model_name(model: Any, p: torch.Tensor) -> str:
    for n, q in model.named_parameters():
        if q is p:
            return n
    raise KeyError("parameter not in model")


def distributed_state(model: Any, optimizers: list) -> dict:
    """``{name: Adam state}`` of distributed optimizers at dp=1, where one shard per param holds all its
    elements (1-D): the moments reshaped to the param's shape."""
    optim = {}
    for o in optimizers:
        for mg, sg in zip(
            o.model_float16_groups + o.model_fp32_groups, o.shard_fp32_from_float16_groups + o.shard_fp32_groups
        ):
            for p, sp in zip(mg, sg):
                st = o.optimizer.state[sp]
                optim[model_name(model, p)] = {
                    k: (v.detach().clone().view(p.shape) if torch.is_tensor(v) and v.numel() == p.numel() else v)
                    for k, v in st.items()
                }
    return optim


Phase = Callable[[argparse.Namespace, dict], None]


def worker(rank: int, world: int, port: int, phase: Phase, args: argparse.Namespace, out: dict, moe: bool) -> None:
    """Rank ``rank`` of a fresh gloo world of ``world``: ``phase(args, out)`` under :class:`CpuAsCuda`."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    install_cuda_stubs(moe)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with CpuAsCuda():
            phase(args, out)
        dist.barrier()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def arguments(doc: str, tp: int, port: int) -> argparse.ArgumentParser:
    """The options both writers take; each adds its own."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=tp)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--vocab-divisor",
        type=int,
        default=128,
        help="Megatron-LM's make_vocab_size_divisible_by (padded to a multiple of it x tp)",
    )
    ap.add_argument(
        "--port",
        type=int,
        default=port,
        help="the first phase's master port, each later phase the next; 0: a free port for each phase, picked as it starts",
    )
    return ap


def fresh_out(path: str, reuse: bool = False) -> None:
    """Create ``path``; a non-empty one is refused unless ``reuse``."""
    if os.path.exists(path) and os.listdir(path) and not reuse:
        sys.exit(f"{path} is not empty")
    os.makedirs(path, exist_ok=True)


def run(args: argparse.Namespace, phases: list[tuple[Phase, int]], view: str, moe: bool = False) -> None:
    """Each phase on its own world (``args.port`` + its index), in turn; then the check that Megatron's
    ``view`` load (``out["eval_loss_view"]``) has the saved model's loss (``out["eval_loss_saved"]``)."""
    with mp.Manager() as mgr:
        out = mgr.dict()
        for i, (phase, world) in enumerate(phases):
            # a port picked as the phase starts: a base port's neighbours (args.port + i) may be taken by then
            port = args.port + i if args.port else free_port()
            mp.spawn(worker, args=(world, port, phase, args, out, moe), nprocs=world)
        saved, loaded = out.get("eval_loss_saved", math.nan), out["eval_loss_view"]
    print(f"eval loss: saved model {saved:.6f}, Megatron's {view} view {loaded:.6f}")
    assert abs(loaded - saved) < 1e-4, f"the {view} load disagrees with the saved model"
