"""Which ucp_dcp modules one save and one resharding load pass through, in the order they are first entered.

    python recipes/call_path.py [--ranks 2]

``ranks`` gloo processes save a small FSDP-style state (three ``Shard(0)`` DTensors, one replicated tensor and
an AdamW-like moment each) with ``ucp_dcp.save``, then load it resharded (``Shard(1)``) with ``ucp_dcp.load``.
Every Python call on every thread of the coordinator (rank 0) and of rank 1 is traced with
``sys.setprofile``/``threading.setprofile``, and the files under ``ucp_dcp/`` are listed in first-entry order
for each call. The loaded state is checked bitwise. This is the count the code map in ``docs/concepts.md``
describes ("the files a save and a load pass through"); it says nothing about time.
The last line is ``CALL PATH: save N files, load M files (union over the traced ranks)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from typing import Any

from ucp_dev.testing.processes import run_ranks


def _trace(fn: Any) -> list[str]:
    """``fn()`` run with every thread's calls traced: the ucp_dcp files entered, first entry first."""
    import ucp_dcp

    root = os.path.dirname(ucp_dcp.__file__) + os.sep
    seen: dict[str, None] = {}

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(root) and f not in seen:
                seen[f] = None

    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return [os.path.relpath(f, root) for f in seen]


def _rank(rank: int, world: int, path: str) -> dict[str, list[str]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ucp_dcp

    mesh = init_device_mesh("cpu", (world,))

    def state(placement: Any, seed: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        out: dict[str, Any] = {}
        for i in range(3):
            full = torch.randn(8 * world, 6, generator=g)
            out[f"model.layers.{i}.weight"] = distribute_tensor(full, mesh, [placement])
            out[f"optim.state.model.layers.{i}.weight.exp_avg"] = distribute_tensor(full * 2, mesh, [placement])
        out["model.norm.weight"] = distribute_tensor(torch.randn(6, generator=g), mesh, [Replicate()])
        return out

    saved = state(Shard(0), 0)
    traced = {"save": _trace(lambda: ucp_dcp.save(saved, path))}
    target = state(Shard(1), 1)  # other values, other sharding: the load must reshard and overwrite them
    traced["load"] = _trace(lambda: ucp_dcp.load(target, path))
    for k, v in saved.items():
        assert torch.equal(v.full_tensor(), target[k].full_tensor()), k
    return traced if rank in (0, 1) else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        results = run_ranks(_rank, args.ranks, os.path.join(d, "ckpt"), timeout=300)
    counts = {}
    for call in ("save", "load"):
        union: dict[str, None] = {}
        for r in results:
            for f in r.get(call, []):
                union.setdefault(f, None)
        print(f"{call}: {len(union)} files")
        for i, f in enumerate(union, 1):
            print(f"  {i:2d}. {f}")
        counts[call] = len(union)
    print(f"CALL PATH: save {counts['save']} files, load {counts['load']} files (union over the traced ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
