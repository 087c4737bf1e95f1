"""Make real DeepSpeed ZeRO-1/2/3 (and universal) checkpoints of the toy LLM, on CPU.

    flock /tmp/ucp-mp.lock python -m ucp_dev.testing.foreign.make_deepspeed --out DIR --stage {1,2,3} \\
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

``python -m ucp_dev.testing.foreign.verify_deepspeed_layout DIR`` rebuilds every parameter and both Adam moments
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
import subprocess
import sys
import time

import torch

from . import deepspeed_job as job


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    job.join(rank, args.world, port)
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg, m = job.toy_model(job.CFG_KW, args.seed, tied=not args.untied)
    conf = job.ds_config(args.stage, args.world, args.param_alignment, args.round_robin)
    engine, _, _, _ = deepspeed.initialize(model=m, model_parameters=job.decay_groups(m), config=conf)
    t_train = job.train(engine, cfg, rank, args.world, args.steps, args.seed)
    # the converter refuses a checkpoint without universal_checkpoint_info
    tag, t_save = job.save(engine, args.out, {"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}})
    view = job.live_view(engine, args.stage)
    if rank == 0:
        torch.save(view, os.path.join(args.out, "ds_view_optim.pt"))
        torch.save(get_fp32_state_dict_from_zero_checkpoint(args.out), os.path.join(args.out, "ds_view_fp32.pt"))
        run = {k: getattr(args, k) for k in ("stage", "world", "steps", "seed")}
        run.update(tag=tag, tied=not args.untied, param_alignment=args.param_alignment, round_robin=args.round_robin)
        job.write_meta(args.out, run, job.CFG_KW, conf, {"train": t_train, "save": t_save})
    job.finish()


def _universal(out: str) -> None:
    """DeepSpeed's own converter into ``out/universal``; its time added to ``meta.json``."""
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    t1 = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            os.path.join(out, meta["tag"]),
            "--output_folder",
            os.path.join(out, "universal"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        check=True,
    )
    meta["seconds"]["universal"] = round(time.time() - t1, 2)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


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
    t0 = time.time()
    job.spawn(_worker, args)
    if args.universal:
        _universal(args.out)
    print(f"wrote {args.out} in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
