"""The README's example, runnable: an FSDP2 model and AdamW on N CPU ranks save; M ranks load them back.

    torchrun --nproc-per-node 2 docs/examples/quickstart.py save /tmp/ckpt
    torchrun --nproc-per-node 4 docs/examples/quickstart.py load /tmp/ckpt     # any other world size

``save`` also writes the full state (``/tmp/ckpt.ref.pt``, plain ``torch.save``); ``load`` compares every loaded
entry with it bit for bit and prints ``QUICKSTART OK: N of N entries bitwise`` on rank 0.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import ucp_dcp


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every entry of model and optimizer as one flat dict of whole tensors (the reference)."""
    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v for k, v in m.items()}
    for fqn, st in o["state"].items():
        flat.update({f"optim.{fqn}.{k}": torch.as_tensor(v) for k, v in st.items()})
    return flat


def main(what: str, path: str) -> None:
    dist.init_process_group("gloo")
    model, opt = build()
    if what == "save":
        model(torch.randn(4, 16)).sum().backward()  # one step: Adam moments to save
        opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)  # FSDP2 DTensors
        ucp_dcp.save({"model": model_sd, "optim": optim_sd}, path)  # collective, like dcp.save
        ref = full_state(model, opt)
        if dist.get_rank() == 0:
            torch.save(ref, path + ".ref.pt")
    else:
        model(torch.randn(4, 16)).sum().backward()  # the optimizer state must exist to be loaded into
        opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        ucp_dcp.load(sd, path)  # reshards inside dcp.load, at this world size
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got, ref = full_state(model, opt), torch.load(path + ".ref.pt", weights_only=True)
        same = [k for k in ref if k in got and torch.equal(got[k], ref[k])]
        if dist.get_rank() == 0:
            ok = len(same) == len(ref) == len(got)
            print(f"QUICKSTART {'OK' if ok else 'MISMATCH'}: {len(same)} of {len(ref)} entries bitwise "
                  f"at {dist.get_world_size()} ranks")
    # A barrier as the last collective: gloo's worker threads drop each finished collective's tensors after the
    # caller has moved on, and torch 2.13's gloo did so for the last all-gather while Python was finalizing: the
    # worker took the GIL back, was ended by pthread_exit, and the process aborted after all work had succeeded
    # ("terminate called without an active exception", about 1 run in 5). A barrier holds no Python tensors.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
