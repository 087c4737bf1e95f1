"""Resume from DeepSpeed and Megatron-Core checkpoints inside ``dcp.load``, no conversion step.

    python recipes/foreign_demo.py [--out DIR] [--layout dp=2,tp=2]

1. The real libraries write the checkpoints, on CPU (``ucp_dev.testing.foreign``): DeepSpeed ZeRO-1 and
   ZeRO-3 runs of the toy LLM on 3 ranks (plus DeepSpeed's own ``ds_to_universal`` of the ZeRO-3
   one), and a Megatron-Core GPT trained at tp=2 and saved in ``torch_dist``. Each writes its
   library's own view of the checkpoint (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` and
   live optimizer; Megatron's reload at tp=1).
2. Fresh processes build the toy trainer at ``--layout`` (FSDP2 x TP, fused QKV/SwiGLU, padded
   vocabulary) and load each checkpoint straight from its folder with ``DeepSpeedReader`` /
   ``MegatronReader`` and ``UCPLoadPlanner``: model weights, fp32 master weights, Adam moments and
   step into ``torch.optim.AdamW``, group hyperparameters. The loaded logical state is compared
   bitwise with the library's own view, and the job trains one step from it.

The last line is ``FOREIGN OK: ...`` (exit 0) or ``FOREIGN MISMATCH: ...`` (exit 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ucp_dev


def _make(module: str, *args: str) -> float:
    t0 = time.perf_counter()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ucp_dev.code_path())
    res = subprocess.run(
        [sys.executable, "-m", f"ucp_dev.testing.foreign.{module}", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode:
        print(res.stdout[-2000:], res.stderr[-4000:])
        raise SystemExit(f"FOREIGN MISMATCH: {module} {' '.join(args)} failed (exit {res.returncode})")
    return time.perf_counter() - t0


def _job(rank: int, world: int, port: int, topo: str, cases: list, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # the oracle's gathers
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    from ucp_dev.testing.foreign.views import load_into_toy
    from ucp_dev.toy import Topology, build_job, build_trainer, train_step, ucp_options  # noqa: F401

    results = {}
    for name, kind, path, options in cases:
        t0 = time.perf_counter()
        state = load_into_toy(topo, kind, path, options)
        results[name] = (state, time.perf_counter() - t0)
    # train one step from a loaded state (DeepSpeed ZeRO-3): the resumed optimizer steps
    import torch.distributed.checkpoint as dcp

    from ucp_dcp import UCPLoadPlanner
    from ucp_dcp.sources.foreign.deepspeed import DeepSpeedReader
    from ucp_dev.testing.foreign.views import deepspeed_config

    cfg = deepspeed_config()
    job = build_job(Topology.parse(topo))
    tr = build_trainer(cfg, job, seed=99)
    opts = ucp_options(cfg, job.topo, job.coord, model_only=True)
    sd = tr.state_dict()
    sd.pop("train_state")
    dcp.load(sd, storage_reader=DeepSpeedReader(cases[1][2], patterns=opts["patterns"]), planner=UCPLoadPlanner(**opts))
    tr.load_state_dict({**sd, "train_state": {"step": 0, "tokens_seen": 0}})
    loss = train_step(tr)
    step = float(next(iter(tr.optims[0].state.values()))["step"])
    if rank == 0:
        torch.save({"results": results, "loss": loss, "step": step}, Path(out) / "loaded.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/foreign_demo")
    ap.add_argument("--layout", default="dp=2,tp=2", help="the toy trainer's layout that loads them")
    a = ap.parse_args(argv)
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    made = {
        "DeepSpeed ZeRO-1": _make("make_deepspeed", "--out", str(out / "zero1"), "--stage", "1", "--world", "3"),
        "DeepSpeed ZeRO-3 (+ds_to_universal)": _make(
            "make_deepspeed", "--out", str(out / "zero3"), "--stage", "3", "--world", "3", "--universal"
        ),
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    made["Megatron-Core torch_dist (tp=2)"] = _make(
        "make_megatron", "--out", str(out / "megatron"), "--tp", "2", "--port", port
    )
    for what, sec in made.items():
        print(f"  made by the real library: {what:38s} {sec:5.1f} s")
    cases = [
        ("DeepSpeed ZeRO-1", "deepspeed", str(out / "zero1"), {}),
        ("DeepSpeed ZeRO-3", "deepspeed", str(out / "zero3"), {}),
        ("DeepSpeed universal (from ZeRO-3)", "deepspeed", str(out / "zero3"), {"universal": True}),
        ("Megatron-Core torch_dist tp=2", "megatron", str(out / "megatron"), {}),
    ]
    from ucp_dev.toy import Topology

    world = Topology.parse(a.layout).world
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port2 = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_job, args=(r, world, port2, a.layout, cases, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print(f"FOREIGN MISMATCH: the load job at {a.layout} failed (exit codes {[p.exitcode for p in procs]})")
        return 1
    from ucp_dev.testing.foreign.views import compare, deepspeed_view, megatron_view

    got = torch.load(out / "loaded.pt", weights_only=False)
    problems, total = [], 0
    for name, kind, path, _ in cases:
        state, sec = got["results"][name]
        view = deepspeed_view(path) if kind == "deepspeed" else megatron_view(path)
        n, bad = compare(view, state)
        total += n
        print(
            f"  {name:34s} -> toy at {a.layout}: {n} tensors bitwise equal to the library's own view"
            f"{'' if not bad else f', {len(bad)} NOT'}; {state['__bytes_read__']} bytes read by rank 0, {sec:.2f} s"
        )
        if bad:
            problems.append(f"{name}: {bad[:3]}")
    if not torch.isfinite(torch.tensor(got["loss"])) or got["step"] != 4.0:
        problems.append(f"one step after loading ZeRO-3 gave loss {got['loss']}, AdamW step {got['step']} (want 4)")
    print(f"  one training step from the loaded ZeRO-3 state: loss {got['loss']:.4f}, AdamW step {got['step']:.0f}")
    if problems:
        print("FOREIGN MISMATCH: " + "; ".join(problems))
        return 1
    print(
        f"FOREIGN OK: DeepSpeed ZeRO-1, ZeRO-3 and universal and Megatron-Core torch_dist checkpoints written by the "
        f"real libraries load at {a.layout} inside dcp.load, {total} tensors bitwise equal to the libraries' own views "
        "(params, fp32 master, Adam moments, step, group hyperparameters); training continues from them"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
