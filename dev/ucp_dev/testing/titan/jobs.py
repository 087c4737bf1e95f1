"""Real torchtitan jobs on CPU: ``torchrun`` of the CPU launcher (:mod:`.cpu_launch`, with its CPU patches)
as a subprocess, with the Trainer flags every test and recipe run shares, and the save -> resume check at
another layout (:func:`transition`: ``make titan-demo``, tests/e2e/test_titan_trainer.py).

A check is two jobs: the save job runs N steps, checkpoints at step K and is also the uninterrupted
reference; the resume job starts from the step-K checkpoint at another layout and trains to step N. The
launcher writes the full training state right after the save and right after the load with plain
``torch.save`` (no ucp_dcp code): they must be bitwise equal, and the losses continue the reference within
the fp32 tolerances of :mod:`ucp_dev.testing.checks`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import ucp_dev
from ucp_dev.testing.checks import loss_note, loss_problems, rel_diffs, state_diffs, state_problem

CODE_PATH = ucp_dev.code_path()
"""The folders holding this ``ucp_dcp`` and this ``ucp_dev``: first on the jobs' ``PYTHONPATH``, so they run the
caller's code (the launcher, its CPU attention and configs come from ``ucp_dev``)."""
PACKAGE_ROOT = Path(CODE_PATH.split(os.pathsep)[0])
"""The folder holding this ``ucp_dcp``."""
LAUNCHER = "ucp_dev.testing.titan.cpu_launch"
"""The launcher, run with ``torchrun -m``."""
CPU_ATTENTION = "ucp_dev.testing.titan.cpu_attention.sdpa_attention"
"""The ``--override.imports`` entry that swaps FlexAttention (no CPU backward) for SDPA on local shards."""

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
"""The transitions ``make titan-demo`` runs; the others are the e2e tests' (tests/e2e/test_titan_trainer.py)."""


# -- jobs ---------------------------------------------------------------------------------------------


def titan_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launcher subprocess: this ``ucp_dcp`` and this ``ucp_dev`` first on its path (the
    launcher, the CPU attention override and the ``--module ucp_dev.testing`` configs are imported from it)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([CODE_PATH, os.environ.get("PYTHONPATH", "")]),
        **(extra or {}),
    }


def launcher_cmd(world: int) -> list[str]:
    """``torchrun`` of the launcher on ``world`` local processes (rank 0's output only); Trainer flags follow."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world}",
        "--local-ranks-filter=0",
        "-m",
        LAUNCHER,
    ]


def topology_flags(topo: dict[str, int]) -> list[str]:
    """torchtitan's ``--parallelism`` flags of a topology (keys ``dp`` (dp_shard), ``tp``, ``pp``, ``ep``)."""
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


def world_size(topo: dict[str, int]) -> int:
    n = 1
    for k, v in topo.items():
        if k != "ep":  # expert parallelism borrows the dp_shard x tp ranks (torchtitan's ParallelDims)
            n *= v
    return n


def run_job(
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
    """One torchrun job of the launcher at ``topo``, writing into ``out`` (its log in ``out/log.txt``):
    the debug model in fp32, sequences of 64, global batch 8, seed 0, CPU attention, checkpointing on;
    ``extra`` Trainer flags and ``env`` (the launcher's ``UCP_TITAN_*`` switches) on top. Raises with the
    log's tail when the job fails, unless ``env`` sets ``UCP_TITAN_EXPECT_FAILURE``. ``backend=None`` leaves
    torchtitan's default SPMD backend."""
    cmd = [
        *launcher_cmd(world_size(topo)),
        "--module",
        "ucp_dev.testing",
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
        CPU_ATTENTION,
        *overrides,
        "--training.disable_cuda_graphs",
        "--checkpoint.enable",
        "--dump_folder",
        str(out),
        *topology_flags(topo),
        *extra,
    ]
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=titan_env(env), capture_output=True, text=True)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 and not env.get("UCP_TITAN_EXPECT_FAILURE"):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"torchtitan run {topo} failed (exit {proc.returncode}):\n{tail}")
    return proc


def resume_flags(save: Path, k: int, steps: int) -> list[str]:
    """Start from the save job's step-k checkpoint (full state, not model-only)."""
    return [
        "--checkpoint.interval",
        str(steps),
        "--checkpoint.initial_load_path",
        str((save / "checkpoint" / f"step-{k}").resolve()),
        "--checkpoint.no-initial_load_model_only",
    ]


def recording_env(folder: Path, **extra: str) -> dict[str, str]:
    """The launcher's recording switches into ``folder``: losses, batch hashes, model buffers in the state
    dump (the MoE resumes check all three); ``extra`` on top (``UCP_TITAN_STATE``, ...)."""
    return {
        "UCP_TITAN_METRICS": str(folder / "loss.json"),
        "UCP_TITAN_BATCHES": str(folder / "batches.json"),
        "UCP_TITAN_STATE_BUFFERS": "1",
        **extra,
    }


def losses(prefix: Path) -> dict[int, float]:
    """``{step: loss}`` the launcher recorded (``$UCP_TITAN_METRICS``, one file per rank), merged."""
    out: dict[int, float] = {}
    for f in prefix.parent.glob(prefix.name + ".rank*"):
        out.update({int(k): v for k, v in json.loads(f.read_text()).items()})
    return out


def batches(prefix: Path) -> dict[int, list[str]]:
    """Per step, the sequences all ranks trained on (``$UCP_TITAN_BATCHES``), whatever the DP degree or
    microbatching: equal lists mean the same global batch."""
    out: dict[int, set[str]] = {}
    for f in prefix.parent.glob(prefix.name + ".rank*"):
        for step, rows in json.loads(f.read_text()).items():
            out.setdefault(int(step), set()).update(rows)
    return {s: sorted(v) for s, v in out.items()}


# -- the save -> resume check -------------------------------------------------------------------------


def transition(name: str, root: Path, assets: Path, steps: int, k: int, show: bool = False) -> tuple[bool, str]:
    """:data:`TRANSITIONS` ``name`` under ``root/name``: the save job (``steps`` steps, checkpoint and oracle
    at step ``k``), then the resume job from that checkpoint. ``(ok, verdict line)``; ``show`` prints the
    loss table (the recipe's output)."""
    save_topo, load_topo, save_cfg, load_cfg, overrides, save_flags, *rest = TRANSITIONS[name]
    save_backend, load_backend = rest[0] if rest else ("partial_dtensor", "partial_dtensor")
    save, load = root / name / "save", root / name / "resume"
    for d in (save, load):  # torchtitan resumes from any checkpoint already in its folder: start clean
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    t0 = time.perf_counter()
    run_job(
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
    run_job(
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
    seconds = time.perf_counter() - t0
    ref, res = losses(save / "loss.json"), losses(load / "loss.json")
    oracle = torch.load(save / "oracle.pt", weights_only=False)
    loaded = torch.load(load / "loaded.pt", weights_only=False)
    resumed = range(k + 1, steps + 1)
    nan = float("nan")
    rels = rel_diffs([ref.get(s, nan) for s in resumed], [res.get(s, nan) for s in resumed])
    if show:
        _table(
            f"{name}: save {save_topo} -> resume {load_topo}, step-{k} checkpoint, {seconds:.0f}s", ref, res, k, steps
        )
    problems = state_problem(state_diffs(oracle, loaded), len(oracle)) + loss_problems(rels, k + 1, steps)
    if problems:
        return False, f"{name}: " + "; ".join(problems)
    return True, f"{name}: {len(oracle)} state entries bitwise equal, {loss_note(rels, k + 1, steps)}"


def store_resume(
    root: Path, assets: Path, url: str, aws: dict[str, str], save_topo: dict[str, int], load_topo: dict[str, int]
) -> tuple[bool, str]:
    """A resume through an object store, torchtitan's way: both jobs run with ``--checkpoint.folder url``
    (``s3://bucket/run``; ``aws``: the client configuration reaching the store) checkpointing every step
    and keeping 2 (``keep_latest_k``, torchtitan's least; it does not purge at a last step). The save job
    (3 steps at ``save_topo``, its last step a full checkpoint) leaves steps 1-3; the resume job at
    ``load_topo`` finds the newest committed step in the folder itself, loads it, and trains to step 5,
    purging steps 1 and 2 when step 4 commits. The state right after the load must equal the state saved at
    step 3 bitwise. ``(ok, verdict line)``."""
    save, load = root / "save", root / "resume"
    for d in (save, load):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    flags = [
        "--checkpoint.folder",
        url,
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "2",
        "--checkpoint.no-last_save_model_only",
    ]
    run_job(
        save_topo,
        save,
        assets,
        3,
        flags,
        {**aws, "UCP_TITAN_STATE": str(save / "oracle.pt"), "UCP_TITAN_STATE_STEP": "3"},
    )
    run_job(load_topo, load, assets, 5, flags, {**aws, "UCP_TITAN_STATE": str(load / "loaded.pt")})
    oracle = torch.load(save / "oracle.pt", weights_only=False)
    loaded = torch.load(load / "loaded.pt", weights_only=False)
    problems = state_problem(state_diffs(oracle, loaded), len(oracle))
    if loaded.get("train_state/step") != 3:
        problems.append(f"resumed at step {loaded.get('train_state/step')}, not the newest committed step 3")
    if problems:
        return False, f"{save_topo} -> {load_topo} through {url}: " + "; ".join(problems)
    return True, f"{save_topo} -> {load_topo} through {url}: step 3's {len(oracle)} state entries bitwise equal"


def _table(title: str, ref: dict[int, float], res: dict[int, float], k: int, steps: int) -> None:
    nan = float("nan")
    print(f"\n{title}")
    print(f"{'step':>5} {'reference':>12} {'resumed':>12} {'rel diff':>9}")
    for s in range(1, steps + 1):
        r = ref.get(s, nan)
        if s <= k:
            print(f"{s:>5} {r:>12.6f}")
            continue
        x = res.get(s, nan)
        print(f"{s:>5} {r:>12.6f} {x:>12.6f} {abs(x - r) / max(abs(r), 1e-12):>9.1e}")
