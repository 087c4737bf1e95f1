"""The README's quickstart: an FSDP2 model and its AdamW state saved by 2 CPU ranks and loaded back by 4, every
loaded entry compared bit for bit with what was saved.

One command, no torchrun (it starts the gloo ranks on this machine itself, a free local port for each phase)::

    python -m ucp_dcp.examples.quickstart /tmp/ckpt      # or: ucp-dcp quickstart /tmp/ckpt

Or one phase per job under torchrun, at any two world sizes::

    torchrun --nproc-per-node 2 -m ucp_dcp.examples.quickstart save /tmp/ckpt
    torchrun --nproc-per-node 4 -m ucp_dcp.examples.quickstart load /tmp/ckpt

What it writes: the checkpoint folder (``/tmp/ckpt/``: DCP's ``.metadata``, one data file per saving rank and
ucp_dcp's checksum sidecar) and, beside it, ``/tmp/ckpt.ref.pt``: the same state as whole tensors (plain
``torch.save`` by rank 0), the reference the load compares with. Without a folder it makes a fresh temporary
one (``$TMPDIR/ucp-dcp-quickstart-*/ckpt``). A save over an existing checkpoint replaces it. The load prints
``QUICKSTART OK: 16 of 16 entries bitwise at 4 ranks`` (4 parameters and AdamW's ``step``, ``exp_avg`` and
``exp_avg_sq`` of each) and exits 0; a mismatch prints ``QUICKSTART MISMATCH`` and exits 1.

The load builds a fresh model and a fresh AdamW and loads into them with no training step first:
``get_state_dict`` gives a fresh optimizer its state entries (zeros) to be loaded into.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import ucp_dcp

ENTRIES = 16
"""Entries the model and optimizer hold: 4 parameters, and AdamW's step, exp_avg and exp_avg_sq of each."""


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, FSDP2-sharded over the default group's ranks, and its AdamW (no state yet)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every entry of model and optimizer as one flat dict of whole tensors (the reference), on every rank."""
    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    flat: dict[str, Any] = {f"model.{k}": v for k, v in m.items()}
    state: dict[str, dict[str, Any]] = o["state"]  # type: ignore[assignment]  # "state" is per-parameter dicts
    for fqn, st in state.items():
        flat.update({f"optim.{fqn}.{k}": torch.as_tensor(v) for k, v in st.items()})
    return flat


def save(path: str) -> None:
    """One training step (so AdamW has moments worth saving), then the README's save; rank 0 writes the
    reference ``<path>.ref.pt``."""
    model, opt = build()
    torch.manual_seed(1 + dist.get_rank())  # each rank its own batch, as in data-parallel training
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)  # FSDP2 DTensors
    ucp_dcp.save({"model": model_sd, "optim": optim_sd}, path)  # collective, like dcp.save
    ref = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(ref, path + ".ref.pt")
        print(f"QUICKSTART saved at {dist.get_world_size()} ranks: {path}", flush=True)


def load(path: str) -> bool:
    """The README's load into a fresh model and optimizer at this world size; True when every entry equals the
    reference bit for bit (rank 0 prints the verdict)."""
    model, opt = build()
    model_sd, optim_sd = get_state_dict(model, opt)  # a fresh AdamW gets its state entries here
    sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    ucp_dcp.load(sd, path)  # reshards inside dcp.load, at this world size
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got, ref = full_state(model, opt), torch.load(path + ".ref.pt", weights_only=True)
    same = [k for k in ref if k in got and torch.equal(got[k], ref[k])]
    ok = len(same) == len(ref) == len(got) == ENTRIES
    if dist.get_rank() == 0:
        print(
            f"QUICKSTART {'OK' if ok else 'MISMATCH'}: {len(same)} of {len(ref)} entries bitwise "
            f"at {dist.get_world_size()} ranks",
            flush=True,
        )
    return ok


def phase(what: str, path: str) -> bool:
    """One phase on this process's rank of the job (torchrun's environment, or :func:`_spawned_rank`'s)."""
    dist.init_process_group("gloo")
    ok = True
    if what == "save":
        save(path)
    else:
        ok = load(path)
    # A barrier as the last collective: gloo's worker threads drop each finished collective's tensors after the
    # caller has moved on, and torch 2.13's gloo did so for the last all-gather while Python was finalizing: the
    # worker took the GIL back, was ended by pthread_exit, and the process aborted after all work had succeeded
    # ("terminate called without an active exception", about 1 run in 5). A barrier holds no Python tensors.
    dist.barrier()
    dist.destroy_process_group()
    return ok


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_rank(rank: int, world: int, port: int, what: str, path: str) -> None:
    """A rank started by :func:`run`: torchrun's environment variables, then the phase; exit 1 on a mismatch."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # `world` processes share this machine's cores
    if not phase(what, path):
        sys.exit(1)


def _launch(what: str, world: int, path: str) -> bool:
    from torch.multiprocessing.spawn import ProcessException, start_processes

    try:
        start_processes(
            _spawned_rank, args=(world, _free_port(), what, path), nprocs=world, join=True, start_method="spawn"
        )
    except ProcessException as e:  # a rank raised (its traceback is printed above) or exited 1
        print(f"QUICKSTART FAILED: {what} at {world} ranks: {e}", file=sys.stderr)
        return False
    return True


def _size(folder: str) -> tuple[int, int]:
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
    return len(files), sum(os.path.getsize(f) for f in files)


def run(path: str | None = None, save_ranks: int = 2, load_ranks: int = 4) -> int:
    """The whole quickstart on this machine: ``save_ranks`` gloo processes save into ``path`` (a fresh temporary
    folder when None), then ``load_ranks`` load it; the exit status (0: every entry bitwise)."""
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="ucp-dcp-quickstart-"), "ckpt")
    path = os.path.abspath(path).rstrip(os.sep)
    print(f"QUICKSTART: an FSDP2 model and AdamW, saved by {save_ranks} CPU ranks, loaded by {load_ranks}", flush=True)
    if not _launch("save", save_ranks, path):
        return 1
    n, size = _size(path)
    print(
        f"  wrote {path}/ (the checkpoint: {n} files, {size / 1024:.1f} KiB)\n"
        f"    and {path}.ref.pt (the same state as whole tensors, plain torch.save: what the load compares with)",
        flush=True,
    )
    if not _launch("load", load_ranks, path):
        return 1
    print(
        f"  look inside: ucp-dcp inspect {path}   |   remove: rm -r {path} {path}.ref.pt\n"
        f"  the code: {os.path.abspath(__file__)}",
        flush=True,
    )
    return 0


def _ranks(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: a phase needs at least 1 rank")
    return n


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The whole run's arguments (``python -m ucp_dcp.examples.quickstart``, ``ucp-dcp quickstart``)."""
    ap.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        help="checkpoint folder to write (its reference goes to CHECKPOINT.ref.pt beside it); "
        "default: a fresh temporary folder",
    )
    ap.add_argument("--save-ranks", type=_ranks, default=2, help="processes that save (default 2)")
    ap.add_argument("--load-ranks", type=_ranks, default=4, help="processes that load (default 4)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["save"], ["load"]):  # one phase, on this rank of a torchrun job
        if len(argv) != 2 or "RANK" not in os.environ:
            print(
                f"usage: torchrun --nproc-per-node N -m ucp_dcp.examples.quickstart {argv[0]} CHECKPOINT "
                "(or, without torchrun: python -m ucp_dcp.examples.quickstart [CHECKPOINT])",
                file=sys.stderr,
            )
            return 2
        return 0 if phase(argv[0], os.path.abspath(argv[1]).rstrip(os.sep)) else 1
    ap = argparse.ArgumentParser(
        prog="python -m ucp_dcp.examples.quickstart",
        description="Save an FSDP2 model and AdamW on 2 CPU ranks, load it on 4, compare every entry bit for bit. "
        "Under torchrun, one phase per job: `torchrun --nproc-per-node N -m ucp_dcp.examples.quickstart "
        "save|load CHECKPOINT`.",
    )
    add_arguments(ap)
    a = ap.parse_args(argv)
    return run(a.checkpoint, a.save_ranks, a.load_ranks)


if __name__ == "__main__":
    sys.exit(main())
