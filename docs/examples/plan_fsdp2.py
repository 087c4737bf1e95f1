"""A ``plan`` target for a plain FSDP2 job: ``python -m ucp_dcp plan CKPT --target plan_fsdp2:target --world-size 64``
(run from docs/examples, or put this module on PYTHONPATH).

``target(rank, world_size)`` returns the state dict that rank of the job passes to ``dcp.load``.
It runs under torch's fake process group (``rank`` of ``world_size``), so the job's own
``init_device_mesh`` and ``fully_shard`` calls work unchanged; the model is built on the meta
device, so no weights are allocated. ``plan_symmetry`` says every rank's state dict has the same
structure (pure data parallel), so the plan builds one rank and rebinds it to the others.
"""

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Net(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)


def build(mesh=None, device="meta"):
    """The job's model and optimizer, as its training script builds them."""
    with torch.device(device):
        model = Net()
    if mesh is not None:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim


def target(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    model, optim = build(mesh)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


target.plan_symmetry = lambda rank, world_size: 0  # every rank: the same structure, its own shard


if __name__ == "__main__":  # save a checkpoint of this model from one process: python plan_fsdp2.py OUT
    import sys

    import ucp_dcp

    model, optim = build(device="cpu")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()  # the optimizer state a resume loads
    model_sd, optim_sd = get_state_dict(model, optim)
    ucp_dcp.save({"model": model_sd, "optim": optim_sd}, sys.argv[1])
