"""FSDP1 -> FSDP2 migration: resume an FSDP1 ``SHARDED_STATE_DICT`` checkpoint with FSDP2 at another world size.

    python recipes/fsdp1_to_fsdp2.py --save-ranks 4 --load-ranks 3 [--steps K] [--writer ucp|dcp] [--out DIR]

The save job (N gloo processes) trains a small model K steps with FSDP1 (``FullyShardedDataParallel``,
one unit per Linear), takes FSDP1's own sharded state dict (``StateDictType.SHARDED_STATE_DICT``:
``ShardedTensor`` parameters and optimizer moments), and saves it with ``ucp_dcp.save`` (``--writer
ucp``) or with plain ``dcp.save`` and DCP's default planner (``--writer dcp``: the FSDP1 checkpoints
teams already hold). It writes an oracle of every logical value (full parameters, optimizer state,
hyperparameters, gathered from the ShardedTensors without ucp_dcp) with ``torch.save``, then trains
to step 2K as the uninterrupted reference. The load job (M fresh processes) builds the same model
with FSDP2 (``fully_shard``) from another seed, loads the checkpoint into its DTensor state dict
(``get_state_dict``) with ucp_dcp, checks every loaded value bitwise against the oracle and trains to
step 2K. The last line is ``RESUME OK: ...`` (exit 0) or ``RESUME MISMATCH: ...`` (exit 1).

Every rank takes an equal slice of one global batch per step, so the N- and M-rank runs optimize the
same loss; only the order of gradient reductions differs (losses agree to fp32 rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

import ucp_dcp
from ucp_dev.testing.checks import loss_note, loss_problems, rel_diffs, state_diffs, state_problem
from ucp_dev.testing.processes import RanksFailed, run_ranks

GLOBAL_BATCH = 24
"""Rows per step, split evenly over the ranks (so the world size must divide it)."""
HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}


class Net(nn.Module):
    """A small MLP with uneven widths (shards differ in size at 3 and 4 ranks) and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 30)
        self.hidden = nn.Linear(30, 22)
        self.norm = nn.LayerNorm(22)
        self.out = nn.Linear(22, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.hidden(torch.relu(self.inp(x))))))


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save-ranks", type=int, default=4, help="N: FSDP1 ranks of the save job")
    ap.add_argument("--load-ranks", type=int, default=3, help="M: FSDP2 ranks of the resumed job")
    ap.add_argument("--steps", type=int, default=3, help="K: steps before the save, and after the resume")
    ap.add_argument(
        "--writer",
        choices=["ucp", "dcp"],
        default="ucp",
        help="save with ucp_dcp.save, or with dcp.save and DCP's default planner (a stock FSDP1 checkpoint)",
    )
    ap.add_argument("--out", default=None, help="output folder (default runs/fsdp1_to_fsdp2/<N>_to_<M>)")
    ap.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)  # test hook: flip one loaded element
    a = ap.parse_args(argv)
    for n in (a.save_ranks, a.load_ranks):
        if n < 1 or GLOBAL_BATCH % n:
            ap.error(f"world sizes must divide the global batch of {GLOBAL_BATCH}, got {n}")
    if a.out is None:
        a.out = str(Path("runs") / "fsdp1_to_fsdp2" / f"{a.writer}_{a.save_ranks}_to_{a.load_ranks}")
    return a


# -- training ---------------------------------------------------------------------------------------------


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal slice of the global batch of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
    n = GLOBAL_BATCH // dist.get_world_size()
    r = dist.get_rank()
    return x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One step; returns the global mean loss (FSDP averages the gradients over the ranks)."""
    x, y = _batch(step)
    opt.zero_grad()
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def fsdp1_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = FSDP(
        Net(), device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
    )
    return model, torch.optim.AdamW(model.parameters(), **HYPER)


def fsdp2_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in (model.inp, model.hidden, model.out):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)  # the checkpoint's hyperparameters must win


# -- logical state (no ucp_dcp code) ------------------------------------------------------------------------


def _full(v):
    """The logical value of a state-dict entry: ShardedTensors gathered from every rank's local shards."""
    if isinstance(v, DTensor):
        return v.full_tensor()
    if hasattr(v, "local_shards"):  # a ShardedTensor
        mine = [(list(s.metadata.shard_offsets), s.tensor) for s in v.local_shards()]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        full = torch.zeros(tuple(v.size()), dtype=v.dtype)
        for offs, t in (p for ps in everyone for p in ps):
            full[tuple(slice(o, o + n) for o, n in zip(offs, t.shape))] = t
        return full
    return v.clone() if isinstance(v, torch.Tensor) else v


def logical_state(sd: dict) -> dict:
    """``{"model": ..., "optim": ...}`` (FQN-keyed, nested optimizer form) as full values by name."""
    out = {f"model/{k}": _full(v) for k, v in sd["model"].items()}
    for p, state in sd["optim"]["state"].items():
        out.update({f"optim/{p}/{k}": _full(v) for k, v in state.items()})
    for g in sd["optim"]["param_groups"]:
        for p in g["params"]:
            out.update({f"group/{p}/{k}": v for k, v in g.items() if k in HYPER})
    return out


# -- the two jobs -------------------------------------------------------------------------------------------


def save_phase(a: argparse.Namespace) -> None:
    out, lead = Path(a.out), dist.get_rank() == 0
    model, opt = fsdp1_model(seed=0)
    losses = [train_step(model, opt, s) for s in range(1, a.steps + 1)]
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):  # FSDP1's own sharded state dict
        sd = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    if a.writer == "ucp":
        ucp_dcp.save(sd, out / "ckpt")
    else:  # what an FSDP1 job has always written: DCP's default planner
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out / "ckpt")))
    oracle = logical_state(sd)
    if lead:
        torch.save(oracle, out / "oracle.pt")
    losses += [train_step(model, opt, s) for s in range(a.steps + 1, 2 * a.steps + 1)]
    if lead:
        kinds = sorted({type(v).__name__ for v in sd["model"].values()})
        (out / "save.json").write_text(json.dumps({"ranks": dist.get_world_size(), "losses": losses, "kinds": kinds}))


def load_phase(a: argparse.Namespace) -> None:
    out, lead = Path(a.out), dist.get_rank() == 0
    model, opt = fsdp2_model(seed=1)  # another init: every value must come from the checkpoint
    msd, osd = get_state_dict(model, opt)  # DTensors (and the optimizer state, created empty)
    sd = {"model": msd, "optim": osd}
    if a.writer == "ucp":
        ucp_dcp.load(sd, out / "ckpt")
    else:  # a stock checkpoint has no checksums: DCP's reader, ucp_dcp's planner
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(out / "ckpt")), planner=ucp_dcp.UCPLoadPlanner())
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if a.corrupt and lead:
        with torch.no_grad():
            model.inp.weight.to_local().view(-1)[0] += 1.0
    msd, osd = get_state_dict(model, opt)
    loaded = logical_state({"model": msd, "optim": osd})
    diffs = state_diffs(torch.load(out / "oracle.pt", weights_only=False), loaded) if lead else []
    losses = [train_step(model, opt, s) for s in range(a.steps + 1, 2 * a.steps + 1)]
    if lead:
        (out / "load.json").write_text(
            json.dumps({"ranks": dist.get_world_size(), "losses": losses, "state_diffs": diffs, "entries": len(loaded)})
        )


def report(a: argparse.Namespace) -> int:
    out = Path(a.out)
    saved = json.loads((out / "save.json").read_text())
    loaded = json.loads((out / "load.json").read_text())
    k = a.steps
    ref, res = saved["losses"], loaded["losses"]
    what = f"FSDP1 on {saved['ranks']} ranks -> FSDP2 on {loaded['ranks']} ranks"
    print(
        f"\n{what}, K={k}, checkpoint written by {'ucp_dcp.save' if a.writer == 'ucp' else 'dcp.save (default planner)'}"
        f" from {'/'.join(saved['kinds'])} values ({out})"
    )
    print(f"{'step':>5} {'reference':>14} {'resumed':>14} {'rel diff':>10}")
    rels = rel_diffs(ref[k:], res)
    for i, r in enumerate(ref, start=1):
        if i <= k:
            print(f"{i:>5} {r:>14.8f}")
        else:
            print(f"{i:>5} {r:>14.8f} {res[i - k - 1]:>14.8f} {rels[i - k - 1]:>10.2e}")
    problems = state_problem(loaded["state_diffs"], loaded["entries"]) + loss_problems(rels, k + 1, 2 * k)
    if problems:
        print(f"RESUME MISMATCH: {what}: " + "; ".join(problems))
        return 1
    print(
        f"RESUME OK: {what}: {loaded['entries']} model and optimizer entries bitwise equal, "
        f"{loss_note(rels, k + 1, 2 * k)}"
    )
    return 0


# -- processes ----------------------------------------------------------------------------------------------


def _phase_on_ranks(rank: int, world: int, a: argparse.Namespace, phase: str) -> None:
    warnings.filterwarnings("ignore")  # FSDP1 and ShardedTensor deprecation notices, per call
    (save_phase if phase == "save" else load_phase)(a)


def main(argv: list[str] | None = None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for phase, world in (("save", a.save_ranks), ("load", a.load_ranks)):
        try:
            run_ranks(_phase_on_ranks, world, a, phase)
        except RanksFailed as e:
            raise SystemExit(f"{phase} phase failed: {e}") from None
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
