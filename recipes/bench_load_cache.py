"""What the load-plan cache saves: ``ucp_dcp.load`` of one checkpoint again and again into one layout, with
``cache_plans`` (the default: the first load plans, the others reuse it) against ``cache_plans=False`` (every
load plans), one run.

    python recipes/bench_load_cache.py [--layers 64] [--world 4] [--reps 5]

``world`` gloo ranks save a transformer-shaped state once -- per layer two matrices sharded ``Shard(0)``, one
sharded ``Shard(1)``, two replicated norms; an embedding; a step counter -- then load it ``reps`` times each
way, interleaved (off, on, on, off, ...), after a first cached load that plans. Tensors are small: planning, not
reading, is what is measured. Reported per mode: the median load's seconds (slowest rank), its seconds outside
``read_data`` (planning and DCP's collectives), the CPU seconds a rank spent (the steadier figure when ranks
share cores), and the bytes each rank handed DCP's plan gather (``dist.gather_object``, pickled). The last line
is ``LOAD CACHE: ...``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta


def _worker(rank: int, world: int, port: int, cfg: dict, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.environ["UCP_DCP_HOST"] = f"host{rank}"  # one host per rank: read-once sends the replicated bytes
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ucp_dcp
    from ucp_dcp import UCPFileSystemReader, UCPLoadPlanner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    d = 8 * world
    state: dict = {"tok_embeddings.weight": distribute_tensor(torch.randn(4 * d, d, generator=g), mesh, [Shard(0)])}
    for i in range(cfg["layers"]):
        p = f"layers.{i}."
        state[p + "attention.wq.weight"] = distribute_tensor(torch.randn(d, d, generator=g), mesh, [Shard(0)])
        state[p + "feed_forward.w1.weight"] = distribute_tensor(torch.randn(2 * d, d, generator=g), mesh, [Shard(0)])
        state[p + "attention.wo.weight"] = distribute_tensor(torch.randn(d, d, generator=g), mesh, [Shard(1)])
        state[p + "attention_norm.weight"] = torch.randn(d, generator=g)
        state[p + "ffn_norm.weight"] = torch.randn(d, generator=g)
    state["step"] = 7
    path = f"{cfg['out']}/ckpt"
    ucp_dcp.save(state, path, sync_files=False)
    sizes: list[int] = []
    real = dist.gather_object

    def spy(obj, *args, **kwargs):
        sizes.append(len(pickle.dumps(obj)))
        return real(obj, *args, **kwargs)

    dist.gather_object = spy  # DCP's plan gather (torch.distributed.checkpoint.utils calls dist.gather_object)
    spent = {"local": 0.0, "global": 0.0}  # seconds in the planning steps the cache skips, this load

    def timed(cls, name: str, step: str) -> None:
        fn = getattr(cls, name)

        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[step] += time.perf_counter() - t0

        setattr(cls, name, run)

    timed(UCPLoadPlanner, "create_local_plan", "local")
    timed(UCPFileSystemReader, "prepare_local_plan", "local")
    timed(UCPLoadPlanner, "create_global_plan", "global")
    timed(UCPFileSystemReader, "prepare_global_plan", "global")
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    rows: dict[str, list[tuple[float, ...]]] = {"first": [], "off": [], "on": []}

    def one(mode: str) -> None:
        sizes.clear()
        spent.update({"local": 0.0, "global": 0.0})
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        stats = ucp_dcp.load(target, path, cache_plans=mode != "off")
        t, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert stats.plan_cached == (mode == "on"), (mode, stats)
        rows[mode].append((t, t - stats.seconds, cpu, sum(sizes), spent["local"], spent["global"]))

    one("first")
    for rep in range(cfg["reps"]):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            one(mode)
    ok = all(
        torch.equal(
            target[k].full_tensor() if hasattr(target[k], "full_tensor") else target[k],
            v.full_tensor() if hasattr(v, "full_tensor") else v,
        )
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    )
    q.put((rank, rows, ok))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="ucp-bench-load-cache-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cfg = {"layers": a.layers, "reps": a.reps, "out": out}
    procs = [ctx.Process(target=_worker, args=(r, a.world, port, cfg, q)) for r in range(a.world)]
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    shutil.rmtree(out, ignore_errors=True)
    per_rank = {r: rows for r, rows, _ in results}
    assert all(ok for *_, ok in results), "a load did not load the saved values"
    tensors = 1 + 5 * a.layers
    print(f"{a.world} gloo ranks, {tensors} tensors ({a.layers} layers), median of {a.reps} loads per mode")
    print(
        f"{'mode':<18} {'load s':>7} {'outside read s':>14} {'CPU s/rank':>10} {'local plan ms':>13} "
        f"{'global plan ms':>14} {'gathered B/rank':>15}"
    )
    med = {}
    for mode, label in (("first", "first (plans)"), ("off", "cache_plans=False"), ("on", "cached")):
        n = len(per_rank[0][mode])

        def col(j: int, over) -> float:
            return statistics.median(over(per_rank[r][mode][i][j] for r in per_rank) for i in range(n))

        # a call's time is its slowest rank's, its CPU and local planning the ranks' mean, the bytes the largest
        # rank's; the global step runs on the coordinator only
        load, outside, cpu, sent = col(0, max), col(1, max), col(2, statistics.mean), col(3, max)
        local, glob = col(4, statistics.mean) * 1e3, statistics.median(x[5] for x in per_rank[0][mode]) * 1e3
        med[mode] = (load, outside, cpu, sent, local, glob)
        print(f"{label:<18} {load:7.3f} {outside:14.3f} {cpu:10.3f} {local:13.1f} {glob:14.1f} {sent:15.0f}")
    off, on = med["off"], med["on"]
    print(
        f"LOAD CACHE: local planning {off[4]:.1f} -> {on[4]:.1f} ms/rank, global {off[5]:.1f} -> {on[5]:.1f} ms, "
        f"plan gather {off[3]:.0f} -> {on[3]:.0f} B/rank, load {off[0]:.3f} -> {on[0]:.3f} s (noisy on shared cores)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
