"""Where a memory-tier load spends its time, in one process (no peers: the fixed costs and the copy).

    python recipes/profile_memory_load.py [--mib 128] [--top 25]

One gloo rank saves ``mib`` MiB (8 fp32 tensors and a step) into a ``MemoryTier`` on ``/dev/shm`` (k = 0),
loads it back three times (the first warms up), then once under ``cProfile``, and prints the load times,
the time of cloning the state (the least a copy costs) and the profile by cumulative time. The loaded
state is checked bitwise. The reads run on the reader's threads: their time shows as lock waits in
``read_data``; what is not ``read_data`` is planning, collectives and the choice of the source.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import socket
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from ucp_dcp.memory import MemoryTier
from ucp_dcp.memory import load as memory_load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    warnings.simplefilter("ignore")  # k = 0 on one host: the tier says so
    root = tempfile.mkdtemp(prefix="profile-memory-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        side = int((args.mib << 20) / 8 / 4 / 2048)
        sd = {f"t{i}": torch.randn(side, 2048) for i in range(8)}
        sd["step"] = torch.tensor(3)
        with MemoryTier(root, replicas=0) as tier:
            tier.save(sd, step=1)
            tier.wait()
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            memory_load(got, root)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        [v.clone() for v in sd.values()]
        clone = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        memory_load(got, root)
        prof.disable()
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        print(
            f"torch {torch.__version__}, {args.mib} MiB, 1 rank: loads {', '.join(f'{t:.3f}' for t in times)} s; "
            f"clone {clone:.3f} s"
        )
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
