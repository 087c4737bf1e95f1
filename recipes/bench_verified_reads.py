"""Bytes a verified load reads against the bytes it needs, with each record's checksum block (issue 47) and with
the previous version's one 1 MiB block for every record, in the same run; and the cost of the rule at the
1 GiB benchmark's chunk sizes (save and load time, bytes).

    python recipes/bench_verified_reads.py [--mib 1024] [--reps 3] [--skip-big | --only-big] [--json PATH]

4 gloo processes on CPU. Each case saves twice — the writer's block rule (``format.checksum_block``) and the
old fixed block (``ucp_dcp.storage.writer.checksum_block`` patched to return 1 MiB, which writes what the
previous version wrote: one block per record up to 1 MiB) — and loads each with checksums verified and
without. Bytes read: ``ReadStats.bytes_read`` summed over the ranks; needed: the bytes of every rank's target
tensors and the saved objects it loads.

* ``fsdp2 2 -> 4``: an FSDP2 job (``fully_shard``: an embedding of 1000 x 256, 7 linears of 256 x 256, a norm;
  AdamW after a step: 8.2 MiB of tensors), saved on 2 ranks, loaded on 4;
* ``1 -> 4, 1 MiB chunks``: 16 tensors of 256 x 1024 fp32 saved on 1 rank (each a 1 MiB chunk), loaded
  ``Shard(0)`` on 4; ``... uneven``: 250 x 1048 fp32, whose cuts fall off block edges;
* ``2 -> 4, 64 KiB chunks``: 64 tensors of 250 x 131 fp32 saved ``Shard(0)`` on 2 ranks (65,500-byte chunks);
* ``benchmark``: the 1 GiB benchmark's state (16 tensors of rows x 512 fp32, ``--mib`` in all), saved on 4 ranks
  (16 MiB chunks: 256 KiB blocks now, 1 MiB before; with fsync, and without as the hashing's own cost), on 1
  rank (64 MiB chunks: 1 MiB blocks either way), and loaded 4 -> 3, 1 -> 4 and 4 -> 4 verified; median of
  ``--reps`` runs, the two rules interleaved.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _worker(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    try:
        queue.put((rank, _cases(rank, cfg)))
    except BaseException:
        import traceback

        queue.put((rank, {"error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def _cases(rank: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import ucp_dcp
    import ucp_dcp.storage.writer as writer
    from ucp_dcp.storage.format import BLOCK

    rule = writer.checksum_block
    root = cfg["out"]
    groups = {n: (dist.group.WORLD if n == 4 else dist.new_group(list(range(n)))) for n in (1, 2, 3, 4)}
    meshes = {n: DeviceMesh("cpu", torch.arange(n)) for n in (1, 2, 3, 4)}

    def use(block_rule: str) -> None:
        # the previous version: one 1 MiB block for every record (what a version-3 table records for all)
        writer.checksum_block = rule if block_rule == "new" else (lambda n: BLOCK)

    def total(x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    def needed(sd: dict, reader) -> int:
        """The bytes a rank needs: its target tensors' (local shards), and the saved objects it loads, whole
        (the planner saves an optimizer's param-group values under its own keys: the reader's items name them)."""
        n = sum(
            v.to_local().nbytes if isinstance(v, DTensor) else v.nbytes
            for v in sd.values()
            if isinstance(v, torch.Tensor)
        )
        kinds = reader.read_metadata().state_dict_metadata
        objects = {k[:-1] for k in reader.stats.items if k.endswith("|")}  # ``item_key``: "fqn|" (or a 0-dim tensor)
        objects = {k for k in objects if isinstance(kinds.get(k), BytesStorageMetadata)}
        return n + sum(int(reader.storage_data[MetadataIndex(k)].length) for k in objects)

    def timed(fn, n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if rank < n:
            fn()
        dist.barrier()
        return time.perf_counter() - t0

    def dtensor_case(name: str, shape, count: int, save_n: int, load_n: int) -> dict:
        g = torch.Generator().manual_seed(1)
        full = [torch.randn(shape, generator=g) for _ in range(count)]
        out = {}
        for block_rule in ("old", "new"):
            use(block_rule)
            path = f"{root}/{name.replace(' ', '_')}_{block_rule}"
            if rank < save_n:
                src = {
                    f"w{i}": distribute_tensor(t, meshes[save_n], [Shard(0)], src_data_rank=None)
                    for i, t in enumerate(full)
                }
                dcp.save(
                    src,
                    storage_writer=ucp_dcp.UCPFileSystemWriter(path),
                    planner=ucp_dcp.UCPSavePlanner(),
                    process_group=groups[save_n],
                )
            dist.barrier()
            for verify in (True, False):
                read = need = 0
                if rank < load_n:
                    tgt = {
                        f"w{i}": distribute_tensor(torch.zeros_like(t), meshes[load_n], [Shard(0)], src_data_rank=None)
                        for i, t in enumerate(full)
                    }
                    reader = ucp_dcp.UCPFileSystemReader(path, verify_checksums=verify)
                    dcp.load(tgt, storage_reader=reader, planner=ucp_dcp.UCPLoadPlanner(), process_group=groups[load_n])
                    want = [distribute_tensor(t, meshes[load_n], [Shard(0)], src_data_rank=None) for t in full]
                    assert all(torch.equal(tgt[f"w{i}"].to_local(), w.to_local()) for i, w in enumerate(want))
                    read, need = reader.stats.bytes_read, needed(tgt, reader)
                out[f"{block_rule} {'verified' if verify else 'unverified'}"] = {
                    "read": total(read),
                    "needed": total(need),
                }
        return out

    def fsdp2(n: int, fill: bool) -> dict | None:
        """An FSDP2 job's state on ranks 0..n-1 (``fully_shard`` per layer and at the root, AdamW after one step
        from seed 0: the same values at any ``n``); ``fill=False``: another seed, no step (a load target)."""
        import torch.nn as nn
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import fully_shard

        if rank >= n:
            return None
        torch.manual_seed(0 if fill else 1)
        model = nn.Sequential(nn.Embedding(1000, 256), *(nn.Linear(256, 256) for _ in range(7)), nn.LayerNorm(256))
        for layer in model:
            fully_shard(layer, mesh=meshes[n])
        fully_shard(model, mesh=meshes[n])
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p) if fill else torch.zeros_like(p)
        optim.step()  # the moments (and step counters) a resume loads
        model_sd, optim_sd = get_state_dict(model, optim)
        return {"model": model_sd, "optim": optim_sd}

    def fsdp2_case() -> dict:
        out = {}
        for block_rule in ("old", "new"):
            use(block_rule)
            path = f"{root}/fsdp2_{block_rule}"
            sd = fsdp2(2, True)
            if sd is not None:
                dcp.save(
                    sd,
                    storage_writer=ucp_dcp.UCPFileSystemWriter(path),
                    planner=ucp_dcp.UCPSavePlanner(),
                    process_group=groups[2],
                )
            dist.barrier()
            want, _ = flatten_state_dict(fsdp2(4, True))
            for verify in (True, False):
                tgt = fsdp2(4, False)
                reader = ucp_dcp.UCPFileSystemReader(path, verify_checksums=verify)
                dcp.load(tgt, storage_reader=reader, planner=ucp_dcp.UCPLoadPlanner())
                got, _ = flatten_state_dict(tgt)
                for k, v in want.items():
                    if isinstance(v, torch.Tensor):
                        a = got[k].to_local() if isinstance(got[k], DTensor) else got[k]
                        b = v.to_local() if isinstance(v, DTensor) else v
                        assert torch.equal(a, b), k
                need = needed(got, reader)
                out[f"{block_rule} {'verified' if verify else 'unverified'}"] = {
                    "read": total(reader.stats.bytes_read),
                    "needed": total(need),
                }
            if rank == 0:
                out[f"{block_rule} checkpoint bytes"] = sum(f.stat().st_size for f in Path(path).glob("*.distcp"))
        return out

    def bench_case() -> dict:
        mib, reps, cols, n_tensors = cfg["mib"], cfg["reps"], 512, 16
        rows = mib * (1 << 20) // (4 * cols * n_tensors)
        torch.manual_seed(0)
        full = [torch.randn(rows, cols) for _ in range(n_tensors)]

        def state(n: int, fill: bool):
            return (
                {
                    f"w{i}": distribute_tensor(
                        t if fill else torch.zeros_like(t), meshes[n], [Shard(0)], src_data_rank=None
                    )
                    for i, t in enumerate(full)
                }
                if rank < n
                else None
            )

        res: dict = {}
        for rep in range(reps):
            for block_rule in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                use(block_rule)
                r = res.setdefault(block_rule, {})
                for n in (4, 1):
                    sd = state(n, True)
                    path = f"{root}/bench_{block_rule}_{n}"
                    if rank == 0:
                        shutil.rmtree(path, ignore_errors=True)
                        os.sync()
                    dt = timed(
                        lambda: dcp.save(
                            sd,
                            storage_writer=ucp_dcp.UCPFileSystemWriter(path),
                            planner=ucp_dcp.UCPSavePlanner(),
                            process_group=groups[n],
                        ),
                        n,
                    )
                    r.setdefault(f"save {n} ranks s", []).append(dt)
                # without fsync: the hashing's cost is not hidden behind the disk's flush (the benchmark's
                # "save 4 ranks no fsync")
                sd = state(4, True)
                path = f"{root}/bench_{block_rule}_nosync"
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                    os.sync()
                dt = timed(
                    lambda: dcp.save(
                        sd,
                        storage_writer=ucp_dcp.UCPFileSystemWriter(path, sync_files=False),
                        planner=ucp_dcp.UCPSavePlanner(),
                    ),
                    4,
                )
                r.setdefault("save 4 ranks no fsync s", []).append(dt)
                for name, s_n, l_n in (("4->3", 4, 3), ("1->4", 1, 4), ("4->4", 4, 4)):
                    tgt = state(l_n, False)
                    reader = ucp_dcp.UCPFileSystemReader(f"{root}/bench_{block_rule}_{s_n}") if rank < l_n else None
                    dt = timed(
                        lambda: dcp.load(
                            tgt, storage_reader=reader, planner=ucp_dcp.UCPLoadPlanner(), process_group=groups[l_n]
                        ),
                        l_n,
                    )
                    r.setdefault(f"load {name} verified s", []).append(dt)
                    read = reader.stats.bytes_read if reader is not None else 0
                    need = sum(t.to_local().nbytes for t in tgt.values()) if tgt is not None else 0
                    r[f"load {name} verified bytes read / needed"] = total(read) / total(need)
        return {
            k: {m: (statistics.median(v) if isinstance(v, list) else v) for m, v in d.items()} for k, d in res.items()
        } | {"runs": {k: {m: v for m, v in d.items() if isinstance(v, list)} for k, d in res.items()}}

    out = {}
    if not cfg["only_big"]:
        out["fsdp2 2 -> 4 (AdamW)"] = fsdp2_case()
        out["1 -> 4, 1 MiB chunks"] = dtensor_case("1to4", (256, 1024), 16, 1, 4)
        out["1 -> 4, 1 MiB chunks uneven"] = dtensor_case("1to4u", (250, 1048), 16, 1, 4)
        out["2 -> 4, 64 KiB chunks"] = dtensor_case("2to4", (250, 131), 64, 2, 4)
    if not cfg["skip_big"]:
        out["benchmark"] = bench_case()
    use("new")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="the benchmark case's state (default 1024, as make bench)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-big", action="store_true", help="only the bytes cases")
    ap.add_argument("--only-big", action="store_true", help="only the benchmark case")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="scratch folder (default: a temporary one)")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="ucp-verified-reads-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"out": str(out.resolve()), "mib": a.mib, "reps": a.reps, "skip_big": a.skip_big, "only_big": a.only_big}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 4, port, cfg, q)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    if a.out is None:
        shutil.rmtree(out, ignore_errors=True)
    if any("error" in r for r in results.values()):
        raise SystemExit("worker failed:\n" + "\n".join(r.get("error", "") for r in results.values()))
    res = results[0]
    for case, figs in res.items():
        print(f"== {case}")
        if case == "benchmark":
            for rule in ("old", "new"):
                print(f"  {rule} block rule: " + ", ".join(f"{k} {v:.3f}" for k, v in figs[rule].items()))
            continue
        for k, v in figs.items():
            if isinstance(v, dict):
                print(
                    f"  {k:24s} read {v['read'] / 2**20:8.2f} MiB  needed {v['needed'] / 2**20:8.2f} MiB  ratio {v['read'] / v['needed']:.3f}"
                )
            else:
                print(f"  {k:24s} {v / 2**20:.2f} MiB")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
