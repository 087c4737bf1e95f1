"""Make a REAL Megatron-Core ``torch_dist`` checkpoint on CPU (fixture for issue 15).

Usage (the venv with torch + megatron-core)::

    python -m ucp_dev.testing.foreign.make_megatron --out DIR [--tp 2] [--steps 3] [--dist-opt none|dp|full]

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

The model: local spec (``get_gpt_layer_local_spec(normalization="RMSNorm")``, torch RMSNorm),
``use_cpu_initialization=True``, gloo, TP=2, GQA, SwiGLU, no biases, RoPE with ``rotary_interleaved=True``
(unfused path), tied embeddings, fp32, dropout 0; Megatron's code runs unchanged on the CPU
(:mod:`.megatron_cpu` says how). Loading a DistributedOptimizer checkpoint on the torch-Adam path needs
two workarounds (load side only; the saved files are untouched: :func:`.megatron_job.load`).
dp_reshardable loads only at the saved TP, so the view re-saves it as fully_reshardable at the saved TP
(Megatron's code) into a temporary folder and loads that at tp=1.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from . import megatron_job as job

SHARDING = {"dp": "dp_reshardable", "full": "fully_reshardable"}


def _metadata(sharding: str) -> dict:
    """The content metadata Megatron-LM passes to sharded_state_dict (and stores in the ckpt)."""
    md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding != "none":
        md["distrib_optim_sharding_type"] = SHARDING[sharding]
    return md


def _rng_state() -> Any:
    """Megatron-LM's ``rng_state``: this rank's generators as a ShardedObject over the TP ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rng = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": None,
            "rng_tracker_states": {},
        }
    ]
    return ShardedObject(
        "rng_state",
        rng,
        (1, ps.get_tensor_model_parallel_world_size()),
        (0, ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(),
    )


def _save(args: argparse.Namespace, out: dict) -> None:
    cfg, model = job.gpt_model(args.tp, 0, args.padded)
    ddp, opt, sched = job.optimizer(cfg, model, args.dist_opt)
    job.train(ddp, opt, sched, args.steps)
    md = _metadata(args.dist_opt)
    saved_args = job.saved_args(
        dict(tensor_model_parallel_size=args.tp, **job.GEOMETRY, ffn_hidden_size=job.FFN),
        model.vocab_size,
        dict(untie_embeddings_and_output_weights=False, position_embedding_type="rope", iteration=args.steps),
    )
    rest = dict(num_floating_point_operations_so_far=0, args=saved_args, rng_state=_rng_state())
    job.save(job.envelope(model, opt, sched, md, args.steps, **rest), args.out, md, model, out)


def _loaded(tp: int, sharding: str, ckpt: str, padded: int) -> tuple[Any, Any]:
    """A fresh model + optimizer at ``tp`` loading ``ckpt`` through Megatron's own code."""
    cfg, model = job.gpt_model(tp, 7, padded)
    _, opt, _ = job.optimizer(cfg, model, sharding)
    job.load(model, opt, _metadata(sharding), ckpt, distributed=sharding != "none")
    return model, opt


def _reshard(args: argparse.Namespace, out: dict) -> None:
    """dp_reshardable checkpoints load only at the saved TP: load there, re-save fully_reshardable
    (Megatron's code both ways) so the view can load it at tp=1."""
    from megatron.core import dist_checkpointing

    model, opt = _loaded(args.tp, args.dist_opt, args.out, args.padded)
    md = _metadata("full")
    dist_checkpointing.save(
        {
            "model": model.sharded_state_dict(metadata=md),
            "optimizer": opt.sharded_state_dict(model.sharded_state_dict(metadata=md), metadata=md),
        },
        args.tmp,
        content_metadata=md,
    )


def _view(args: argparse.Namespace, out: dict) -> None:
    sharding = "full" if args.dist_opt == "dp" else args.dist_opt
    ckpt = args.tmp if args.dist_opt == "dp" else args.out
    model, opt = _loaded(1, sharding, ckpt, args.padded)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    inner = opt.chained_optimizers if hasattr(opt, "chained_optimizers") else [opt]
    assert len(inner) == 1, inner
    if sharding == "none":
        optim = {
            n: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in inner[0].optimizer.state[p].items()}
            for n, p in model.named_parameters()
        }
    else:
        optim = job.distributed_state(model, inner)
    out["eval_loss_view"] = job.eval_loss(model)
    torch.save(
        {
            "params": params,
            "optim": optim,
            "meta": {
                "padded_vocab": args.padded,
                "vocab": job.VOCAB,
                "tp_saved": args.tp,
                "dp_saved": args.dp,
                "dist_opt": args.dist_opt,
                "sharding": SHARDING.get(args.dist_opt),
                "steps": args.steps,
                "eval_loss_saved": out["eval_loss_saved"],
                "eval_loss_view": out["eval_loss_view"],
            },
        },
        os.path.join(args.out, "mcore_view.pt"),
    )


def main(argv: list[str] | None = None) -> None:
    ap = job.arguments(__doc__, tp=2, port=29517)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument(
        "--dist-opt",
        choices=["none", "dp", "full"],
        default="none",
        help="none: use_distributed_optimizer=False; dp / full: distributed optimizer "
        "saved as dp_reshardable / fully_reshardable",
    )
    args = ap.parse_args(argv)
    args.padded = job.padded_vocab(args.vocab_divisor, args.tp)
    t0 = time.time()
    job.fresh_out(args.out)
    print(f"save: tp={args.tp} dp={args.dp} dist_opt={args.dist_opt} padded_vocab={args.padded}")
    phases = [(_save, args.tp * args.dp), (_view, 1)]
    if args.dist_opt == "dp":
        args.tmp = tempfile.mkdtemp(prefix=".mcore-reshard-", dir=os.path.dirname(os.path.abspath(args.out)))
        phases.insert(1, (_reshard, args.tp))
    job.run(args, phases, "tp=1")
    if args.dist_opt == "dp":
        shutil.rmtree(args.tmp)
    print(f"done in {time.time() - t0:.1f}s: {args.out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
