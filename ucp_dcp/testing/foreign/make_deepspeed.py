"""Make real DeepSpeed ZeRO-1/2/3 (and universal) checkpoints of the toy LLM, on CPU.

    flock /tmp/ucp-mp.lock python -m ucp_dcp.testing.foreign.make_deepspeed --out DIR --stage {1,2,3} \\
        [--world 2] [--steps 3] [--universal] [--untied] [--seed 0] \\
        [--param-alignment] [--round-robin]

Trains the project's dense toy Llama (one ``StageModel`` holding every layer) with the real
DeepSpeed engine, ZeRO stage 1, 2 or 3 data-parallel over ``--world`` CPU ranks (``mp.spawn``,
gloo, ``DS_ACCELERATOR=cpu``), fp32 (no fp16/bf16), ``torch.optim.AdamW`` built by DeepSpeed from
the config (``"torch_adam": true``) over two param groups (weight decay 0.1 for ndim >= 2, 0.0
otherwise), ``--steps`` steps on random tokens, then ``engine.save_checkpoint(DIR, tag="global_step<N>")``
with ``client_state={"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}`` (the
converter refuses a checkpoint without it; its ``--inject_missing_state`` only patches its in-memory
copy and the mp_rank files are copied as saved). The output head is tied to the embedding (one
``nn.Parameter``, so DeepSpeed records it in ``shared_params``) unless ``--untied``.

Written under DIR:

* ``latest`` and ``global_step<N>/`` with DeepSpeed's files (``mp_rank_00_model_states.pt`` and
  ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` for stages 1/2;
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` and ``..._optim_states.pt`` for stage 3);
* ``universal/`` (``--universal``): DeepSpeed's own converter, ``python -m deepspeed.checkpoint.ds_to_universal``
  run after training (``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``,
  ``zero/optimizer_state.pt``, the mp_rank files copied);
* ``ds_view_fp32.pt``: ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(DIR)``
  (full fp32 params by name, shared names included);
* ``ds_view_optim.pt``: ``{name: {"exp_avg", "exp_avg_sq", "step", "fp32"}, "__groups__": [...]}``
  as the live engine sees it right after the save: full tensors from DeepSpeed's public
  ``deepspeed.utils.safe_get_full_optimizer_state`` / ``safe_get_full_fp32_param`` (collective for
  ZeRO-3), ``step`` from the base optimizer's state of the parameter's group, and per group its
  hyperparameters (every param-group key except ``params``) and ``"names"`` (its members, in
  DeepSpeed's group order);
* ``meta.json``: stage, world, steps, seed, model config, the DeepSpeed config, timings.

``python -m ucp_dcp.testing.foreign.verify_deepspeed_layout DIR`` rebuilds every parameter and both Adam moments
from the raw flat partitions (without importing deepspeed) and checks them bit for bit against
these views. ``--round-robin`` (``round_robin_gradients``) reorders the flat group; DeepSpeed 0.19.8
then records ``param_shapes`` in the flat (reordered) order but computes its fragment addresses
(``param_slice_mappings``, ``safe_get_full_*``, hence ``ds_view_optim.pt`` and the universal atoms)
as if the group were in its original order, so those are wrong for most parameters; only
``ds_view_fp32.pt`` (``zero_to_fp32``) and the saved module weights are right there.

What works on CPU (deepspeed 0.19.8, torch 2.13 CPU): ZeRO stages 1, 2 and 3 all train and save
with the CPU accelerator over gloo in fp32, with DeepSpeed's ``torch_adam`` option (FusedAdam
needs CUDA, DeepSpeedCPUAdam a compiled op); ``ds_to_universal`` converts all three stages.
Each run JIT-builds DeepSpeed's small ``deepspeed_shm_comm`` C++ op once (cached under
``~/.cache/torch_extensions``; needs a C++ compiler). Not used: fp16 (the CPU accelerator reports it
only where ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, False on this machine) and bf16 (not
tried: a bf16 run saves bf16 module weights and the same fp32 partitions, but the recipe keeps the
module weights equal to the master weights); CPU optimizer offload (DeepSpeedCPUAdam JIT-builds a
larger C++ op; not tried); the ``ccl`` backend (oneCCL is not installed; gloo is used).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

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


def ds_config(stage: int, world: int, param_alignment: bool = False, round_robin: bool = False) -> dict:
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


def build_model(seed: int, tied: bool):
    from ucp_dcp.toy.model import Groups, ModelConfig, StageModel, logical_params

    cfg = ModelConfig(**CFG_KW)
    m = StageModel(cfg, list(range(cfg.n_layers)), first=True, last=True, tp=1, ep_size=1)
    m.load_logical(logical_params(cfg, seed), 1, 0, 1)
    if tied:
        m.output.weight = m.tok_embeddings.weight
    m.groups = Groups(
        tp=None, ep=None, ep_rank=0, ep_size=1, loss_scale=1.0, global_tokens=BATCH_PER_RANK * cfg.seq_len
    )
    return cfg, m


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
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    cfg, m = build_model(args.seed, not args.untied)
    decay = [p for p in m.parameters() if p.ndim >= 2]
    no_decay = [p for p in m.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    conf = ds_config(args.stage, args.world, args.param_alignment, args.round_robin)
    engine, opt, _, _ = deepspeed.initialize(model=m, model_parameters=groups, config=conf)

    t0 = time.time()
    g = torch.Generator().manual_seed(1234 + args.seed)
    for _ in range(args.steps):
        tokens = torch.randint(0, cfg.vocab, (BATCH_PER_RANK * args.world, cfg.seq_len + 1), generator=g)
        local = tokens[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        logits = engine(local[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {engine.global_steps} loss {loss.item():.4f}", flush=True)
    t_train = time.time() - t0

    t0 = time.time()
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(
        args.out, tag=tag, client_state={"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}
    )
    dist.barrier()
    t_save = time.time() - t0

    # DeepSpeed's view of the live optimizer state, by parameter name (collective under ZeRO-3).
    names = {p: n for n, p in engine.module.named_parameters()}
    if args.stage < 3:
        # DeepSpeed 0.19.8 links the optimizer-state views of ZeRO-1/2 parameters once, right after the
        # step of group 0 (``_optimizer_step`` steps one group at a time), so the parameters of group 1
        # get an empty view and ``safe_get_full_optimizer_state`` raises "exp_avg not found in optimizer
        # state fragment" for them. Linking again with DeepSpeed's own routine fixes the view.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    zo = engine.optimizer
    base = zo.optimizer  # the torch AdamW DeepSpeed steps, on flat fp32 partitions
    if args.stage == 3:  # ZeRO-3 steps sub-groups (one per param group at the default sub_group_size)
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
            view["__groups__"][gi]["names"].append(names[p])
            view[names[p]] = {
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
                "fp32": safe_get_full_fp32_param(p).clone(),
                "step": step,
            }
    if rank == 0:
        torch.save(view, os.path.join(args.out, "ds_view_optim.pt"))
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        torch.save(get_fp32_state_dict_from_zero_checkpoint(args.out), os.path.join(args.out, "ds_view_fp32.pt"))
        with open(os.path.join(args.out, "meta.json"), "w") as f:
            json.dump(
                {
                    "stage": args.stage,
                    "world": args.world,
                    "steps": args.steps,
                    "seed": args.seed,
                    "tag": tag,
                    "tied": not args.untied,
                    "param_alignment": args.param_alignment,
                    "round_robin": args.round_robin,
                    "model_config": CFG_KW,
                    "ds_config": conf,
                    "deepspeed": deepspeed.__version__,
                    "torch": torch.__version__,
                    "seconds": {
                        "train": round(t_train, 2),
                        "save": round(t_save, 2),
                    },
                },
                f,
                indent=1,
            )
    dist.barrier()
    dist.destroy_process_group()
    # Done (every rank passed the barrier). Skip interpreter teardown: about 1 in 10 world-3 ZeRO-3 runs
    # aborted there (SIGABRT in a native thread's destructor) after all work had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--universal", action="store_true", help="also run DeepSpeed's ds_to_universal into OUT/universal")
    ap.add_argument("--untied", action="store_true", help="separate output head (no shared_params)")
    ap.add_argument(
        "--param-alignment",
        action="store_true",
        help="ZeRO-1/2: zero_optimization.parameter_alignment (params start 16-byte aligned in the flat)",
    )
    ap.add_argument(
        "--round-robin",
        action="store_true",
        help="ZeRO-1/2: zero_optimization.round_robin_gradients (params reordered in the flat group)",
    )
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    mp.spawn(_worker, args=(args, port), nprocs=args.world, join=True)
    if args.universal:
        with open(os.path.join(args.out, "meta.json")) as f:
            meta = json.load(f)
        t1 = time.time()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                os.path.join(args.out, meta["tag"]),
                "--output_folder",
                os.path.join(args.out, "universal"),
                "--num_extract_workers",
                "1",
                "--num_merge_workers",
                "1",
            ],
            check=True,
        )
        meta["seconds"]["universal"] = round(time.time() - t1, 2)
        with open(os.path.join(args.out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    print(f"wrote {args.out} in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
