"""The training loop of docs/guide.md: FSDP2 / TP / PP, saved at one layout, resumed at another.

    python docs/examples/train_loop.py                                 # the guide's transitions
    python docs/examples/train_loop.py --save dp=2,tp=2 --load dp=3    # one transition
    python docs/examples/train_loop.py --checkpointer dcp              # the same with stock DCP

A layout is ``pp=,dp=,tp=`` (missing keys are 1; world size = pp * dp * tp). Each phase runs on
its own gloo ranks on the CPU (spawned here, or one ``torchrun`` launch per phase):

    torchrun --nproc-per-node 4 docs/examples/train_loop.py --phase save --save dp=2,tp=2 --load dp=3
    torchrun --nproc-per-node 3 docs/examples/train_loop.py --phase load --save dp=2,tp=2 --load dp=3

The save job builds the model (seed 0), trains K steps, saves, writes the *logical* state (every
parameter, optimizer entry and param-group setting as a full tensor under its global name) with
plain ``torch.save``, and trains one more step as the uninterrupted reference. The load job
builds the model at the other layout from another seed, loads, compares the logical state with
the saved one bitwise, and trains that step too. Its last line is ``RESUME OK`` or
``RESUME MISMATCH`` (exit 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import re
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ucp_dcp
from ucp_dcp import Reduce, stage_map

# save -> load layouts run by default (docs/guide.md, "Run it")
TRANSITIONS = [("dp=4", "dp=2"), ("dp=2,tp=2", "dp=3"), ("pp=2,dp=2", "dp=2,tp=2")]
TOL = 1e-5  # relative loss difference allowed at another layout (reduction order differs); same layout: bitwise


# -- the model ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    vocab: int = 50
    dim: int = 16
    hidden: int = 32
    n_layers: int = 4
    seq_len: int = 8
    batch: int = 24  # global batch: divisible by every dp degree (x 2 microbatches under PP)


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.relu(self.w1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm: nn.Module | None = nn.RMSNorm(cfg.dim)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h)) if self.output is not None else h


# -- layouts ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    tp: int = 1

    @staticmethod
    def parse(text: str) -> "Layout":
        kw = {}
        for part in filter(None, text.split(",")):
            key, _, val = part.partition("=")
            if key not in ("pp", "dp", "tp") or not val.isdigit() or int(val) < 1:
                raise SystemExit(f"bad layout item {part!r} in {text!r} (keys pp, dp, tp)")
            kw[key] = int(val)
        return Layout(**kw)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def __str__(self) -> str:
        return ",".join(f"{k}={getattr(self, k)}" for k in ("pp", "dp", "tp") if getattr(self, k) > 1) or "dp=1"


@dataclass
class Trainer:
    cfg: Config
    lay: Layout
    model: nn.Module
    opt: torch.optim.Optimizer
    layer_ids: list[int]  # global index of each local layer
    pp_rank: int
    dp_rank: int
    tp_rank: int
    schedule: ScheduleGPipe | None
    step: int = 0
    tokens_seen: int = 0  # tokens this rank's data-parallel slot trained on


def build(cfg: Config, lay: Layout, seed: int) -> Trainer:
    mesh = init_device_mesh("cpu", (lay.pp, lay.dp, lay.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
    torch.manual_seed(seed)
    model = Model(cfg)  # same initial values at every layout
    # pipeline stage pp_rank keeps its layers, renumbered from 0: stage-local names
    layer_ids = torch.arange(cfg.n_layers).tensor_split(lay.pp)[pp_rank].tolist()
    model.layers = nn.ModuleList(model.layers[i] for i in layer_ids)
    first, last = pp_rank == 0, pp_rank == lay.pp - 1
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = None
    # tensor parallel: w1 column-wise, w2 row-wise
    if lay.tp > 1:
        for block in model.layers:
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    # FSDP2 over dp: each block, then the rest
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2)
    schedule = None
    if lay.pp > 1:
        stage = PipelineStage(model, pp_rank, lay.pp, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=_loss)
    return Trainer(cfg, lay, model, opt, layer_ids, pp_rank, dp_rank, tp_rank, schedule)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def train_step(tr: Trainer) -> float:
    """One AdamW step on the global batch of step ``tr.step + 1``; returns the global mean loss."""
    cfg, lay = tr.cfg, tr.lay
    tr.step += 1
    g = torch.Generator().manual_seed(tr.step)  # the data depends on the step only, not on the layout
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=g)
    per = cfg.batch // lay.dp
    local = tokens[tr.dp_rank * per:(tr.dp_rank + 1) * per]
    inp, tgt = local[:, :-1], local[:, 1:]
    last = tr.pp_rank == lay.pp - 1
    if tr.schedule is None:
        loss = _loss(tr.model(inp), tgt)
        loss.backward()
    else:
        losses: list[torch.Tensor] = []
        tr.schedule.step(inp if tr.pp_rank == 0 else None, target=tgt if last else None,
                         losses=losses if last else None)
        loss = torch.stack(losses).mean() if last else torch.zeros(())
    tr.opt.step()
    tr.opt.zero_grad()
    tr.tokens_seen += tgt.numel()
    total = (loss.detach() / lay.dp if last and tr.tp_rank == 0 else torch.zeros(())).reshape(1).double()
    dist.all_reduce(total)
    return float(total)


# -- checkpointing: the part docs/guide.md is about ----------------------------------------------------

def state_dict(tr: Trainer) -> dict:
    model_sd, optim_sd = get_state_dict(tr.model, tr.opt)
    return {"model": model_sd, "optim": optim_sd,
            "train_state": {"step": tr.step, "tokens_seen": tr.tokens_seen}}


def apply_state_dict(tr: Trainer, sd: dict) -> None:
    set_state_dict(tr.model, tr.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    tr.step, tr.tokens_seen = sd["train_state"]["step"], sd["train_state"]["tokens_seen"]


def ucp_options(tr: Trainer) -> dict:
    """What this model's layout needs declared: a per-slot counter, and stage-local layer names
    (``--forget-stage-map``: the mistake of leaving the map out, which ucp_dcp refuses)."""
    opts = {"patterns": [Reduce(r"train_state\.tokens_seen", "sum")], "data_slot": tr.dp_rank}
    if tr.lay.pp > 1 and not FORGET_STAGE_MAP:
        opts["stage_map"] = stage_map(tr.layer_ids, total=tr.cfg.n_layers, stage=tr.pp_rank)
    return opts


FORGET_STAGE_MAP = False
"""``--forget-stage-map``."""


def save(a: argparse.Namespace, tr: Trainer, path: Path):
    sd = state_dict(tr)
    if a.checkpointer == "dcp":
        dcp.save(sd, checkpoint_id=path)
        return None
    if a.async_save:
        return ucp_dcp.async_save(sd, path, process_group=a.ckpt_group, **ucp_options(tr))
    ucp_dcp.save(sd, path, **ucp_options(tr))
    return None


def load(a: argparse.Namespace, tr: Trainer, path: Path) -> None:
    sd = state_dict(tr)
    if a.checkpointer == "dcp":
        dcp.load(sd, checkpoint_id=path)
    else:
        ucp_dcp.load(sd, path, **ucp_options(tr))
    apply_state_dict(tr, sd)


# -- the check: logical state, independent of ucp_dcp ------------------------------------------------------

def logical_state(tr: Trainer) -> dict:
    """Every parameter, optimizer entry and param-group setting as a full tensor or value under its
    global name, plus the train state; the same dict on every rank. Collective."""
    out: dict = {}

    def global_name(local: str) -> str:
        return re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{tr.layer_ids[int(m[1])]}.", local)

    def full(v):
        return v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() if isinstance(v, torch.Tensor) else v

    names = {p: global_name(n) for n, p in tr.model.named_parameters()}
    for p, name in names.items():
        out[f"param/{name}"] = full(p)
        for k, v in tr.opt.state.get(p, {}).items():
            out[f"state/{name}/{k}"] = full(v)
    for group in tr.opt.param_groups:
        settings = repr(sorted((k, v) for k, v in group.items() if k != "params"))
        for p in group["params"]:
            out[f"group/{names[p]}"] = settings
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (out, tr.step, tr.tokens_seen, tr.dp_rank, tr.pp_rank, tr.tp_rank))
    merged: dict = {}
    for part, *_ in everyone:
        for k, v in part.items():
            if k in merged and not _same(merged[k], v):
                v = "<copies differ>"
            merged[k] = v
    steps = {s for _, s, *_ in everyone}
    merged["train_state/step"] = steps.pop() if len(steps) == 1 else "<copies differ>"
    # a data-parallel slot's count is held by each of its pp x tp ranks: count it once
    merged["train_state/tokens_seen (sum over slots)"] = sum(
        n for _, _, n, _, pp, tp in everyone if pp == 0 and tp == 0)
    return merged


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return a == b


def differing(saved: dict, loaded: dict) -> list[str]:
    bad = sorted(set(saved) ^ set(loaded))
    bad += sorted(k for k in set(saved) & set(loaded)
                  if "<copies differ>" in (saved[k], loaded[k]) or not _same(saved[k], loaded[k]))
    return bad


# -- the two phases ---------------------------------------------------------------------------------------

def save_phase(a: argparse.Namespace) -> None:
    out, lay, lead = Path(a.out), Layout.parse(a.save), dist.get_rank() == 0
    tr = build(Config(), lay, seed=0)
    losses = [train_step(tr) for _ in range(a.steps)]
    sd_view = state_dict(tr)["model"]["layers.0.w1.weight"]
    saved = logical_state(tr)
    pending = save(a, tr, out / "ckpt")
    losses.append(train_step(tr))  # the uninterrupted run goes on (overlapping the write under --async-save)
    if pending is not None:
        pending.result()
    if lead:
        torch.save(saved, out / "saved_state.pt")
        (out / "save.json").write_text(json.dumps({"layout": str(lay), "losses": losses}))
        how = ("ucp_dcp.async_save" if a.async_save
               else "dcp.save" if a.checkpointer == "dcp" else "ucp_dcp.save")
        print(f"save  {lay} ({lay.world} ranks): {a.steps} steps, {how} -> {out / 'ckpt'}; "
              f"layers.0.w1.weight placements {sd_view.placements}", flush=True)


def load_phase(a: argparse.Namespace) -> int:
    out, lay, lead = Path(a.out), Layout.parse(a.load), dist.get_rank() == 0
    tr = build(Config(), lay, seed=1)  # other initial values: everything must come from the checkpoint
    try:
        load(a, tr, out / "ckpt")
    except (Exception, CheckpointException) as e:  # reported as the verdict (CheckpointException is a BaseException)
        lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [""]
        # DCP's CheckpointException holds every rank's traceback: its last line is the cause
        error = lines[-1][:300] if isinstance(e, CheckpointException) else f"{type(e).__name__}: {lines[0][:300]}"
        if lead:
            print(f"load  {lay} ({lay.world} ranks): load failed: {error}")
            print(f"RESUME MISMATCH: {a.save} -> {lay}: the load raised")
            (out / "load.json").write_text(json.dumps({"ok": False, "error": error}))
        return 1
    loaded = logical_state(tr)
    loss = train_step(tr)
    if not lead:
        return 0
    saved_info = json.loads((out / "save.json").read_text())
    bad = differing(torch.load(out / "saved_state.pt", weights_only=True), loaded)
    ref = saved_info["losses"][-1]
    rel = abs(loss - ref) / abs(ref)
    same_layout = saved_info["layout"] == str(lay)
    loss_ok = loss == ref if same_layout else rel <= TOL
    print(f"load  {lay} ({lay.world} ranks): {len(loaded) - len(bad)} of {len(loaded)} state entries bitwise equal "
          f"to the saved state; step {a.steps + 1} loss {loss:.8f}, uninterrupted {ref:.8f} (rel diff {rel:.1e})")
    problems = []
    if bad:
        problems.append(f"{len(bad)} entries differ ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
    if not loss_ok:
        problems.append("loss not bitwise equal at the same layout" if same_layout else f"loss rel diff > {TOL:g}")
    verdict = "RESUME MISMATCH" if problems else "RESUME OK"
    print(f"{verdict}: {saved_info['layout']} -> {lay}" + (": " + "; ".join(problems) if problems else ""), flush=True)
    (out / "load.json").write_text(json.dumps({"ok": not problems, "problems": problems}))
    return 1 if problems else 0


def run_phase(a: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    # the check's full_tensor() of FSDP x TP weights logs a performance warning per call
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    lay = Layout.parse(a.save if a.phase == "save" else a.load)
    if dist.get_world_size() != lay.world:
        raise SystemExit(f"--phase {a.phase} at {lay} needs {lay.world} processes, got {dist.get_world_size()}")
    # async_save runs DCP's collectives on a thread while training runs its own: give it its own group
    a.ckpt_group = dist.new_group(backend="gloo") if a.async_save else None
    if a.phase == "save":
        save_phase(a)
        rc = 0
    else:
        rc = load_phase(a)
    dist.barrier()
    dist.destroy_process_group()
    return rc


# -- launching ---------------------------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    rc = run_phase(_args(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # the phase is over on every rank: skip interpreter teardown


def _spawn(argv: list[str], world: int) -> bool:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, port, argv)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return all(p.exitcode == 0 for p in procs)


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", help="layout of the save job, e.g. dp=2,tp=2 (default: the guide's transitions)")
    ap.add_argument("--load", help="layout of the resumed job, e.g. dp=3")
    ap.add_argument("--steps", type=int, default=3, help="training steps before the save")
    ap.add_argument("--checkpointer", choices=["ucp", "dcp"], default="ucp",
                    help="ucp_dcp.save/load, or dcp.save/load with DCP's default planners and storage")
    ap.add_argument("--async-save", action="store_true", help="save with ucp_dcp.async_save")
    ap.add_argument("--phase", choices=["save", "load", "all"], default="all",
                    help="under torchrun: one phase per launch; otherwise both, on spawned ranks")
    ap.add_argument("--out", default=None, help="output folder (default runs/guide/<save>_to_<load>)")
    ap.add_argument("--forget-stage-map", action="store_true", help="leave the stage_map out (a mistake ucp_dcp refuses)")
    a = ap.parse_args(argv)
    global FORGET_STAGE_MAP
    FORGET_STAGE_MAP = a.forget_stage_map
    if a.async_save and a.checkpointer == "dcp":
        ap.error("--async-save uses ucp_dcp's planner and writer")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _args(argv)
    if (a.save is None) != (a.load is None):
        raise SystemExit("give both --save and --load, or neither")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        if a.phase == "all" or a.save is None:
            raise SystemExit("under torchrun pass --phase save or --phase load, with --save and --load")
        a.out = a.out or _default_out(a)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        return run_phase(a)
    pairs = [(a.save, a.load)] if a.save else TRANSITIONS
    phases = ["save", "load"] if a.phase == "all" else [a.phase]
    failed = []
    for save_lay, load_lay in pairs:
        child = ["--save", save_lay, "--load", load_lay, "--steps", str(a.steps), "--checkpointer", a.checkpointer]
        child += ["--async-save"] if a.async_save else []
        child += ["--forget-stage-map"] if a.forget_stage_map else []
        out = a.out if a.out and a.save else _default_out(_args(child))
        Path(out).mkdir(parents=True, exist_ok=True)
        for phase in phases:
            world = Layout.parse(save_lay if phase == "save" else load_lay).world
            if not _spawn(child + ["--phase", phase, "--out", out], world):
                failed.append(f"{save_lay} -> {load_lay}")
                break
    if len(pairs) > 1:
        print(f"\n{len(pairs) - len(failed)} of {len(pairs)} transitions resumed OK" +
              (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _default_out(a: argparse.Namespace) -> str:
    tag = f"{a.save}_to_{a.load}".replace(",", "_").replace("=", "")
    suffix = "_dcp" if a.checkpointer == "dcp" else "_async" if a.async_save else ""
    return str(Path("runs") / "guide" / f"{tag}{suffix}")


if __name__ == "__main__":
    sys.exit(main())
