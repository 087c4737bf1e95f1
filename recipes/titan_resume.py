"""A real torchtitan job resumes at a new scale (``make titan-demo``).

For each transition, the save job runs torchtitan's Trainer (llama3 debug model with grouped-query
attention, generated tokenizer and data, fp32, CPU/gloo under torchrun) for N steps with ucp_dcp
(``--module ucp_dcp.testing --config llama3_debugmodel_gqa_ucp``), checkpointing at step K; it is
also the uninterrupted reference. The resume job starts from the step-K checkpoint at another
layout and trains to step N. The full training state right after the save and right after the load
is written by the CPU launcher with plain ``torch.save`` (the oracle uses no ucp_dcp code) and must
be bitwise equal; the losses must continue the reference within fp32 tolerances.

    python recipes/titan_resume.py [--only dp4-dp2] [--steps N] [--save-step K] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "titan"))
from assets import make_assets  # noqa: E402

TOL_FIRST, TOL_LAST = 1e-5, 1e-4  # relative loss difference at the first resumed and the last step

UCP_CONFIG = "llama3_debugmodel_gqa_ucp"  # registry entry: UCP manager + global-cursor dataloader
STOCK_CONFIG = "llama3_debugmodel_gqa"  # stock torchtitan checkpointer and dataloader
ONE_FLAG = "ucp_dcp.torchtitan.overrides.checkpointer"  # the --override.imports switch on a stock config

# name -> (save topology, load topology, save config, load config, extra --override.imports at load,
#          extra save flags[, (save spmd_backend, load spmd_backend)])
TRANSITIONS = {
    "dp4-dp2": ({"dp": 4}, {"dp": 2}, UCP_CONFIG, UCP_CONFIG, [], []),
    "pp2dp2-dp2": ({"pp": 2, "dp": 2}, {"dp": 2}, UCP_CONFIG, UCP_CONFIG, [], []),
    "tp2-dp2": ({"tp": 2}, {"dp": 2}, UCP_CONFIG, UCP_CONFIG, [], []),
    # async (thread) checkpointing, resumed at a smaller DP degree
    "dp2async-dp1": ({"dp": 2}, {"dp": 1}, UCP_CONFIG, UCP_CONFIG, [], ["--checkpoint.async_mode", "async"]),
    # async checkpointing in a separate checkpoint process (DCP's PROCESS type: planner and storage
    # writer are pickled into it); on CPU without pinned memory or non-blocking copies (launcher (p))
    "dp2pinned-dp1": (
        {"dp": 2},
        {"dp": 1},
        UCP_CONFIG,
        UCP_CONFIG,
        [],
        ["--checkpoint.async_mode", "async_with_pinned_mem"],
    ),
    # torchtitan's default SPMD backend: FSDP at dp=2 (launcher (s)), resumed under pipeline parallelism
    "spmd-dp2-pp2": ({"dp": 2}, {"pp": 2}, UCP_CONFIG, UCP_CONFIG, [], [], ("spmd_types", "spmd_types")),
    # a checkpoint written by stock torchtitan (no UCP) resumes with the one-flag UCP switch on
    "stock-dp2-dp2": ({"dp": 2}, {"dp": 2}, STOCK_CONFIG, STOCK_CONFIG, [ONE_FLAG], []),
}
DEMO = ["dp4-dp2", "pp2dp2-dp2", "tp2-dp2"]


def _topology_flags(topo: dict[str, int]) -> list[str]:
    names = {
        "dp": "data_parallel_shard_degree",
        "tp": "tensor_parallel_degree",
        "pp": "pipeline_parallel_degree",
        "ep": "expert_parallel_degree",
    }
    out = []
    for k, v in topo.items():
        out += [f"--parallelism.{names[k]}", str(v)]
    return out


def _world(topo: dict[str, int]) -> int:
    n = 1
    for k, v in topo.items():
        if k != "ep":  # expert parallelism borrows the dp_shard x tp ranks (torchtitan's ParallelDims)
            n *= v
    return n


def _run(
    topo: dict[str, int],
    out: Path,
    assets: Path,
    steps: int,
    extra: list[str],
    env: dict[str, str],
    config: str = UCP_CONFIG,
    overrides: list[str] = (),
    backend: str | None = "partial_dtensor",
) -> subprocess.CompletedProcess:
    """One torchrun job of the launcher; ``backend=None`` leaves torchtitan's default SPMD backend."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={_world(topo)}",
        "--local-ranks-filter=0",
        str(HERE / "titan" / "cpu_launch.py"),
        "--module",
        "ucp_dcp.testing",
        "--config",
        config,
        "--hf_assets_path",
        str(assets / "tokenizer"),
        "--dataloader.dataset_path",
        str(assets / "dataset"),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "8",
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "float32",
        "--debug.seed",
        "0",
        *(["--parallelism.spmd_backend", backend] if backend else []),
        "--override.imports",
        "cpu_attention.sdpa_attention",
        *overrides,
        "--training.disable_cuda_graphs",
        "--checkpoint.enable",
        "--dump_folder",
        str(out),
        *_topology_flags(topo),
        *extra,
    ]
    out.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE / "titan"), os.environ.get("PYTHONPATH", "")]),
        **env,
    }
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 and not env.get("UCP_TITAN_EXPECT_FAILURE"):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"torchtitan run {topo} failed (exit {proc.returncode}):\n{tail}")
    return proc


def _losses(prefix: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for f in prefix.parent.glob(prefix.name + ".rank*"):
        out.update({int(k): v for k, v in json.loads(f.read_text()).items()})
    return out


def _diffs(a: dict, b: dict) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        same = (
            isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            if isinstance(x, torch.Tensor)
            else x == y
        )
        if not same:
            bad.append(k)
    return bad


def resume_flags(save: Path, k: int, steps: int) -> list[str]:
    """Start from the save job's step-k checkpoint (full state, not model-only)."""
    return [
        "--checkpoint.interval",
        str(steps),
        "--checkpoint.initial_load_path",
        str((save / "checkpoint" / f"step-{k}").resolve()),
        "--checkpoint.no-initial_load_model_only",
    ]


def transition(name: str, root: Path, assets: Path, steps: int, k: int) -> tuple[bool, str]:
    save_topo, load_topo, save_cfg, load_cfg, overrides, save_flags, *rest = TRANSITIONS[name]
    save_backend, load_backend = rest[0] if rest else ("partial_dtensor", "partial_dtensor")
    save, load = root / name / "save", root / name / "resume"
    for d in (save, load):  # torchtitan resumes from any checkpoint already in its folder: start clean
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    t0 = time.perf_counter()
    _run(
        save_topo,
        save,
        assets,
        steps,
        ["--checkpoint.interval", str(k), *save_flags],
        {
            "UCP_TITAN_METRICS": str(save / "loss.json"),
            "UCP_TITAN_STATE": str(save / "oracle.pt"),
            "UCP_TITAN_STATE_STEP": str(k),
        },
        config=save_cfg,
        backend=save_backend,
    )
    _run(
        load_topo,
        load,
        assets,
        steps,
        resume_flags(save, k, steps),
        {"UCP_TITAN_METRICS": str(load / "loss.json"), "UCP_TITAN_STATE": str(load / "loaded.pt")},
        config=load_cfg,
        overrides=overrides,
        backend=load_backend,
    )
    dt = time.perf_counter() - t0
    ref, res = _losses(save / "loss.json"), _losses(load / "loss.json")
    oracle = torch.load(save / "oracle.pt", weights_only=False)
    loaded = torch.load(load / "loaded.pt", weights_only=False)
    bad = _diffs(oracle, loaded)
    print(f"\n{name}: save {save_topo} -> resume {load_topo}, step-{k} checkpoint, {dt:.0f}s")
    print(f"{'step':>5} {'reference':>12} {'resumed':>12} {'rel diff':>9}")
    rels = []
    for s in range(1, steps + 1):
        r = ref.get(s, float("nan"))
        if s <= k:
            print(f"{s:>5} {r:>12.6f}")
            continue
        x = res.get(s, float("nan"))
        rel = abs(x - r) / abs(r)
        rels.append(rel)
        print(f"{s:>5} {r:>12.6f} {x:>12.6f} {rel:>9.1e}")
    problems = []
    if bad:
        problems.append(f"{len(bad)} of {len(oracle)} state entries differ ({', '.join(bad[:4])})")
    if not rels or not rels[0] <= TOL_FIRST:
        problems.append(f"first resumed step rel diff {rels[0] if rels else 'missing'} > {TOL_FIRST:g}")
    elif not rels[-1] <= TOL_LAST:
        problems.append(f"step {steps} rel diff {rels[-1]:.1e} > {TOL_LAST:g}")
    if problems:
        return False, f"{name}: " + "; ".join(problems)
    return True, (
        f"{name}: {len(oracle)} state entries bitwise equal, loss rel diff {rels[0]:.1e} at step {k + 1}, "
        f"{rels[-1]:.1e} at step {steps}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", action="append", choices=sorted(TRANSITIONS), help="transition(s) to run (default: demo set)"
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-step", type=int, default=2)
    ap.add_argument("--out", default="runs/titan_resume")
    a = ap.parse_args(argv)
    root = Path(a.out)
    assets = make_assets(root / "assets")
    results = [transition(n, root, assets, a.steps, a.save_step) for n in (a.only or DEMO)]
    ok = all(r[0] for r in results)
    print()
    for good, line in results:
        print(("  ok   " if good else "  FAIL ") + line)
    print(("RESUME OK: " if ok else "RESUME MISMATCH: ") + "; ".join(r[1] for r in results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
