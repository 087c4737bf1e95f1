"""One process, one device: how close a load and a save come to what the machine moves.

    python recipes/bench_single.py --device cuda --mib 4096 --json runs/bench_single.json
    python recipes/bench_single.py --device cpu --mib 1024          # this VM

State: ``--tensors`` fp32 tensors of ``--mib`` MiB in all on ``--device``, saved in the same layout
by ucp_dcp (``ucp_dcp.save``: one file) and by DCP's default (``dcp.save``), then loaded back into the
same tensors, warm (page cache) and cold (the files' pages dropped with ``posix_fadvise``). Raw
pipelines on the same bytes give the machine's rate: ``raw load Tn`` -- n threads, each reading its
share of the file with ``readinto`` into its own two pinned buffers of 64 MiB and copying each into
the target with a non-blocking copy on its own stream (CPU targets: ``readinto`` the target
directly); the best n is the raw rate.
``raw H2D`` is a pinned -> device copy alone. ``raw save``: copy to (pinned) host memory, write,
fsync. Every figure is a median of ``--reps`` interleaved runs; ratios are printed and written as
JSON records ``{"case", "metric", "value", "note"}``. ucp_dcp's reader runs with its own thread
choice (``thread_count=None``) and, for comparison, with one thread (the reader before it chose).
``--staging always`` sends CPU targets through the device path's host staging buffers (a rehearsal
of the CUDA run on a machine without a GPU: ``recipes/gpu_check.py --rehearse``). On CUDA,
``raw gds`` reads the raw file into the device with torch's cuFile bindings (``torch.cuda.gds``,
``O_DIRECT``: never from the page cache), when they work on the machine: whether a GDS reader
would beat the pinned pipeline; a failure is reported with its error, not raised.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ucp_dcp  # noqa: E402
from ucp_dcp import UCPFileSystemReader, UCPLoadPlanner  # noqa: E402
from ucp_dev.testing.pagecache import evict  # noqa: E402

BUF = 64 << 20


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def raw_load(path: Path, flat: torch.Tensor, threads: int, device: str) -> None:
    """n threads, each its share of ``path`` into two host buffers, copied into ``flat`` (uint8)."""
    size = flat.numel()
    share = -(-size // threads)

    def work(k: int) -> None:
        lo, hi = k * share, min(size, (k + 1) * share)
        if device == "cpu":  # host targets take the bytes directly
            with open(path, "rb", buffering=0) as f:
                f.seek(lo)
                view = memoryview(flat.numpy())
                for pos in range(lo, hi, BUF):
                    assert f.readinto(view[pos : min(hi, pos + BUF)]) == min(hi, pos + BUF) - pos
            return
        pin = True
        bufs = [torch.empty(min(BUF, max(1, hi - lo)), dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        stream = torch.cuda.Stream()
        events: list = [None, None]
        with open(path, "rb", buffering=0) as f:
            f.seek(lo)
            pos, i = lo, 0
            while pos < hi:
                n = min(BUF, hi - pos)
                if events[i] is not None:
                    events[i].synchronize()
                buf = bufs[i][:n]
                got = f.readinto(memoryview(buf.numpy()))
                assert got == n
                with torch.cuda.stream(stream):
                    flat[pos : pos + n].copy_(buf, non_blocking=True)
                    events[i] = torch.cuda.Event()
                    events[i].record(stream)
                pos, i = pos + n, 1 - i
        stream.synchronize()

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def raw_save(path: Path, state: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for v in state.values():
            f.write(v.cpu().numpy().tobytes() if v.device.type != "cpu" else memoryview(v.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def gds_load(path: Path, flat: torch.Tensor) -> None:
    """The raw file into ``flat`` (a CUDA uint8 tensor) through cuFile, one call."""
    from torch.cuda import gds

    f = gds.GdsFile(str(path), os.O_RDONLY)
    try:
        f.load_storage(flat.untyped_storage(), 0)
    finally:
        del f


def _plot(rate: dict[str, float], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(rate)
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(names) + 1))
    ax.barh(
        names, [rate[k] for k in names], color=["C0" if "ucp" in k else "C1" if "dcp" in k else "C7" for k in names]
    )
    ax.set_xlabel("GB/s")
    ax.set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--mib", type=int, default=4096)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp folder)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="a PNG of the rates (needs matplotlib)")
    ap.add_argument("--staging", default=None, choices=["auto", "always"], help="the reader's staging mode")
    ap.add_argument("--gds", action=argparse.BooleanOptionalAction, default=True, help="CUDA: try raw cuFile reads")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        return 0
    dev = a.device
    n = a.mib * (1 << 20) // 4 // a.tensors
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(n, generator=g).to(dev) for i in range(a.tensors)}
    total = sum(v.numel() * 4 for v in state.values())
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench_single_"))
    ucp, ref, raw = root / "ucp", root / "dcp", root / "raw.bin"
    for p in (ucp, ref):
        shutil.rmtree(p, ignore_errors=True)
    flat = torch.empty(total, dtype=torch.uint8, device=dev)
    cores = len(os.sched_getaffinity(0))
    counts = sorted({1, 2, 4, 8, 16, cores} & set(range(1, cores + 1)))
    auto = UCPFileSystemReader(root).thread_count
    times: dict[str, list[float]] = {}

    def rec(name: str, t: float) -> None:
        times.setdefault(name, []).append(t)

    for _ in range(a.reps):  # interleaved
        shutil.rmtree(ucp, ignore_errors=True)
        shutil.rmtree(ref, ignore_errors=True)
        rec("save ucp", _timed(lambda: ucp_dcp.save(state, ucp), dev))
        rec("save dcp", _timed(lambda: dcp.save(state, checkpoint_id=ref), dev))
        rec("save raw", _timed(lambda: raw_save(raw, state), dev))
        for cold in (False, True):
            tag = "cold" if cold else "warm"
            for k in counts:
                if cold:
                    evict(root)
                rec(f"load {tag} raw T{k}", _timed(lambda k=k: raw_load(raw, flat, k, dev), dev))
            for name, threads in ((f"ucp T{auto}", None), ("ucp T1", 1)):
                if cold:
                    evict(root)
                reader = UCPFileSystemReader(ucp, thread_count=threads, staging=a.staging)
                rec(
                    f"load {tag} {name}",
                    _timed(lambda r=reader: dcp.load(state, storage_reader=r, planner=UCPLoadPlanner()), dev),
                )
            if cold:
                evict(root)
            rec(f"load {tag} dcp", _timed(lambda: dcp.load(state, checkpoint_id=ref), dev))
    gds_error = None
    if dev == "cuda":
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        for _ in range(a.reps):
            rec("raw H2D", _timed(lambda: flat.copy_(pinned, non_blocking=True), dev))
        for _ in range(a.reps if a.gds else 0):
            try:
                rec("load cold raw gds", _timed(lambda: gds_load(raw, flat), dev))
            except Exception as e:  # no GDS driver / filesystem: reported, the rest stands
                gds_error = f"{type(e).__name__}: {e}"
                break

    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: total / t / 1e9 for k, t in med.items()}
    records: list[dict] = []
    print(
        f"{a.mib} MiB in {a.tensors} tensors on {dev}; {cores} cores; reader threads {auto}; torch {torch.__version__}"
    )
    for k in sorted(rate):
        print(f"  {k:<22} {rate[k]:7.2f} GB/s  ({med[k]:.3f} s)")
        records.append({"case": k, "metric": "GB/s", "value": rate[k], "note": f"{med[k]:.3f} s median"})
    for tag in ("warm", "cold"):
        best = max((k for k in rate if k.startswith(f"load {tag} raw T")), key=rate.get)
        ours = rate[f"load {tag} ucp T{auto}"]
        for what, val in (("of raw", ours / rate[best]), ("x DCP", ours / rate[f"load {tag} dcp"])):
            print(f"load {tag}: ucp {what} {val:.2f} (raw best {best.split()[-1]})")
            records.append({"case": f"load {tag}", "metric": what, "value": val, "note": best})
    if gds_error is not None:
        print(f"raw gds: not measured ({gds_error})")
        records.append({"case": "load cold raw gds", "metric": "error", "value": None, "note": gds_error})
    save = rate["save ucp"] / rate["save raw"]
    print(f"save: ucp of raw {save:.2f}, x DCP {rate['save ucp'] / rate['save dcp']:.2f}")
    records.append({"case": "save", "metric": "of raw", "value": save, "note": ""})
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(records, indent=1))
    if a.plot:
        _plot(rate, f"{a.mib} MiB, one process, {dev}, torch {torch.__version__}", Path(a.plot))
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
