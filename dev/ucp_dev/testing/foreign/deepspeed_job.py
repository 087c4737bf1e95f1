"""The toy LLM trained by the real DeepSpeed engine on CPU ranks: what the dense and MoE writers share.

The model configs, DeepSpeed's config, joining the gloo world, the training loop on random tokens, the
save, the live engine's view of its optimizer state, ``meta.json`` and the launch (``mp.spawn`` on a
free port). :mod:`.make_deepspeed` (dense, ZeRO-1/2/3) and :mod:`.make_deepspeed_moe` (DeepSpeed MoE,
ZeRO-1/2) are the programs; their docstrings say what they write. deepspeed itself is imported only
inside the ranks, so :mod:`.views` can read the configs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks its accelerator

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# Sizes a TP=2 target can take (even KV heads, even FFN) whose flat groups do not divide evenly: at
# dp=3, ZeRO-1/2 pad the end of group 0 (aligned to 2 * dp elements) and ZeRO-3 pads every
# 56-element norm (ceil(56 / 3) = 19 per rank).
CFG_KW = dict(
    vocab=61,
    vocab_multiple=7,
    dim=56,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=54,
    stacked_moe_layers=(),
    list_moe_layers=(),
    rope_theta=10000.0,
    res_gain=False,
)
BATCH_PER_RANK = 4
MOE_LAYERS = (1, 3)
"""The layers :mod:`.make_deepspeed_moe` builds from DeepSpeed's own ``MoE``."""
N_EXPERTS = 4
MOE_CFG_KW = dict(CFG_KW, list_moe_layers=MOE_LAYERS, n_experts=N_EXPERTS, top_k=2, expert_dim=24)


def ds_config(stage: int, world: int, param_alignment: bool = False, round_robin: bool = False) -> dict:
    """fp32, ``torch_adam`` AdamW (FusedAdam needs CUDA), ZeRO ``stage`` over ``world`` data-parallel ranks."""
    return {
        "train_batch_size": BATCH_PER_RANK * world,
        "train_micro_batch_size_per_gpu": BATCH_PER_RANK,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "zero_optimization": dict(
            {"stage": stage},
            **({"parameter_alignment": True} if param_alignment else {}),
            **({"round_robin_gradients": True} if round_robin else {}),
        ),
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def toy_model(
    cfg_kw: dict, seed: int, tied: bool = True, edit: Callable[[Any, Any, dict], None] | None = None
) -> tuple[Any, Any]:
    """The toy Llama (one ``StageModel`` with every layer) set from its logical parameters of ``seed``;
    ``edit(cfg, model, logical)`` swaps modules before the head is tied to the embedding."""
    from ucp_dev.toy.model import Groups, ModelConfig, StageModel, logical_params

    cfg = ModelConfig(**cfg_kw)
    logical = logical_params(cfg, seed)
    m = StageModel(cfg, list(range(cfg.n_layers)), first=True, last=True, tp=1, ep_size=1)
    m.load_logical(logical, 1, 0, 1)
    if edit is not None:
        edit(cfg, m, logical)
    if tied:  # one nn.Parameter: DeepSpeed records it in shared_params
        m.output.weight = m.tok_embeddings.weight
    m.groups = Groups(
        tp=None, ep=None, ep_rank=0, ep_size=1, loss_scale=1.0, global_tokens=BATCH_PER_RANK * cfg.seq_len
    )
    return cfg, m


def decay_groups(m: torch.nn.Module, named: bool = False) -> list[dict]:
    """Two param groups: weight decay 0.1 for ndim >= 2, 0.0 otherwise (named for DeepSpeed's MoE split)."""
    groups: list[dict] = [
        {"params": [p for p in m.parameters() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    if named:
        groups[0]["name"], groups[1]["name"] = "decay", "no_decay"
    return groups


def join(rank: int, world: int, port: int) -> None:
    """Make this process rank ``rank`` of a gloo world for DeepSpeed (one thread: 2-core machines)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def train(
    engine: Any, cfg: Any, rank: int, world: int, steps: int, seed: int, aux: Callable[[], Any] | None = None
) -> float:
    """``steps`` steps on random tokens (the same global batches at any world), ``aux()`` added to the
    loss when given; returns the seconds taken."""
    t0 = time.time()
    g = torch.Generator().manual_seed(1234 + seed)
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab, (BATCH_PER_RANK * world, cfg.seq_len + 1), generator=g)
        local = tokens[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        logits = engine(local[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local[:, 1:].reshape(-1))
        engine.backward(loss if aux is None else loss + aux())
        engine.step()
        if rank == 0:
            print(f"step {engine.global_steps} loss {loss.item():.4f}", flush=True)
    return time.time() - t0


def save(engine: Any, out: str, client_state: dict | None = None) -> tuple[str, float]:
    """``engine.save_checkpoint`` under tag ``global_step<N>`` on every rank; returns the tag and seconds."""
    import torch.distributed as dist

    t0 = time.time()
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(out, tag=tag, client_state=client_state or {})
    dist.barrier()
    return tag, time.time() - t0


def live_view(engine: Any, stage: int, rename: Callable[[str], str] = str) -> dict:
    """DeepSpeed's view of the live optimizer state (collective under ZeRO-3): ``{name: {"exp_avg",
    "exp_avg_sq", "fp32", "step"}, "__groups__": [...]}``, full tensors from DeepSpeed's public
    ``safe_get_full_*``, ``step`` from the base optimizer's state of the parameter's group, per group its
    hyperparameters and member names in DeepSpeed's order; ``rename`` maps the module's names."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zo = engine.optimizer
    if stage < 3:
        # DeepSpeed 0.19.8 links the optimizer-state views of ZeRO-1/2 parameters once, right after the
        # step of group 0 (``_optimizer_step`` steps one group at a time), so the parameters of group 1
        # get an empty view and ``safe_get_full_optimizer_state`` raises "exp_avg not found in optimizer
        # state fragment" for them. Linking again with DeepSpeed's own routine fixes the view.
        zo._hp_optimizer_states_linked = False
        zo._lazy_init_hp_params_optimizer_state()
    names = {p: n for n, p in engine.module.named_parameters()}
    base = zo.optimizer  # the torch AdamW DeepSpeed steps, on flat fp32 partitions
    if stage == 3:  # ZeRO-3 steps sub-groups (one per param group at the default sub_group_size)
        subs = [
            (zo.sub_group_to_group_id[i], zo.fp16_groups[i], zo.fp32_partitioned_groups_flat[i])
            for i in range(len(zo.fp16_groups))
        ]
    else:
        subs = [(i, zo.bit16_groups[i], zo.single_partition_of_fp32_groups[i]) for i in range(len(zo.bit16_groups))]
    view: dict = {
        "__groups__": [dict({k: v for k, v in pg.items() if k != "params"}, names=[]) for pg in base.param_groups]
    }
    for gi, members, flat in subs:
        step = base.state[flat]["step"].clone() if "step" in base.state.get(flat, {}) else None
        for p in members:
            name = rename(names[p])
            view["__groups__"][gi]["names"].append(name)
            view[name] = {
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
                "fp32": safe_get_full_fp32_param(p).clone(),
                "step": step,
            }
    return view


def write_meta(out: str, run: dict, model_config: dict, conf: dict, seconds: dict) -> None:
    """``meta.json``: the run's arguments, the model and DeepSpeed configs, versions and timings."""
    import deepspeed

    meta = dict(
        run,
        model_config=model_config,
        ds_config=conf,
        deepspeed=deepspeed.__version__,
        torch=torch.__version__,
        seconds={k: round(v, 2) for k, v in seconds.items()},
    )
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def finish() -> None:
    """Leave the world once every rank is done, skipping interpreter teardown: about 1 in 10 world-3
    ZeRO-3 runs aborted there (SIGABRT in a native thread's destructor) after all work had succeeded."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: Callable[[int, argparse.Namespace, int], None], args: argparse.Namespace) -> None:
    """Run ``worker(rank, args, port)`` on ``args.world`` processes; ``args.out`` made absolute and created."""
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.world, join=True)
