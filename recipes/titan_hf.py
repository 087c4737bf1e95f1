"""torchtitan's stock Hugging Face path vs ucp_dcp's, measured on the same HF folder.

One run: a random ``transformers`` Llama (the torchtitan llama3 model below, config.json from
``ucp_dcp.torchtitan.mappings.hf_mapping``) is saved with ``save_pretrained`` in bf16; then, for each
layout (2 ranks: ``dp_shard=2`` and ``tp=2``) and each path, a ``torchrun`` job builds the model
with torchtitan's own ``parallelize_fn`` and checkpoint manager and

* loads the folder: ``manager.load()`` with ``initial_load_in_hf`` (torchtitan's ``_load`` ->
  ``dcp_load(from_hf=True)``), then
* writes the last save in HF: ``manager.save(1, last_step=True)`` with ``last_save_in_hf`` and
  ``export_dtype=bfloat16`` (``_save_last_step`` -> ``dcp_save(to_hf=True)``).

``stock`` is torchtitan's ``CheckpointManager`` (state-dict adapter, ``HuggingFaceStorageReader``/
``Writer``, DCP's default planners; the ucp_dcp option off); ``ucp`` is ``UCPCheckpointManager``
(defaults: ``fused_qkv_atoms`` on). Per rank and operation:

* wall time of the manager call (after a barrier; the slowest rank is reported);
* bytes read from storage: ucp = ``HFStorageReader.stats.bytes_read``; stock = the bytes of every
  slice ``HuggingFaceStorageReader`` takes from a file (its ``_process_read_request`` wrapped:
  numel of the request times the stored dtype's size; safetensors reads through mmap, so
  ``/proc/self/io`` does not see these);
* bytes written: ``/proc/self/io`` ``wchar`` delta (both paths write with plain ``write`` calls;
  both write the model twice: stock its per-rank shards then the consolidated file, ucp a scratch
  ucp_dcp checkpoint then the HF files), and the size of the resulting folder;
* peak RSS: ``VmRSS`` sampled every 2 ms during the call, minus the RSS before it (the growth), and
  ``ru_maxrss`` at the end of the job.

Each job also prints a digest of the loaded full parameters (both paths must load the same
weights) and the test afterwards compares both paths' HF files tensor by tensor. Nothing asserts a
time. ``--json`` writes every figure.

    .venv/bin/python recipes/titan_hf.py [--size 150m|debug] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SIZES = {  # name -> (dim, layers, heads, kv heads, ffn hidden, vocab)
    "debug": (256, 6, 16, 4, 768, 2048),
    "150m": (768, 12, 12, 4, 2048, 32000),
}
LAYOUTS = {"dp_shard=2": {"data_parallel_shard_degree": 2}, "tp=2": {"tensor_parallel_degree": 2}}


def model_config(size: str):
    """A torchtitan llama3 model config (fused wqkv, ComplexRoPE with llama scaling, untied head)."""
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3.model import Llama3Model

    dim, n_layers, n_heads, n_kv, ffn, vocab = SIZES[size]
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
        layers=L._build_llama3_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            hidden_dim=ffn,
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )


# -- worker (one rank of a torchrun job) --------------------------------------------------------------------


class _PeakRSS:
    """Peak VmRSS (bytes) while the block runs, sampled every 2 ms."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (ln.split(": ") for ln in f.read().splitlines())}


def _count_stock_reads(hf_folder: str) -> list[int]:
    """Wrap the stock HF reader: bytes of every slice it takes from a file."""
    import torch.distributed.checkpoint.hf_storage as hfs

    from ucp_dcp.sources.hf.source import scan_hf

    itemsize = {name: st.tensors[name].dtype.itemsize for name, (_, st) in scan_hf(hf_folder).items()}
    total = [0]
    process = hfs.HuggingFaceStorageReader._process_read_request

    def counting(self, f, req, planner):
        n = 1
        for length in req.lengths:
            n *= int(length)
        total[0] += n * itemsize[req.storage_index.fqn]
        return process(self, f, req, planner)

    hfs.HuggingFaceStorageReader._process_read_request = counting
    return total


def worker(args) -> None:
    from ucp_dev.testing.titan import cpu_launch  # the launcher's CPU patches (device type, memory stubs, gloo)

    cpu_launch.patch_device()
    cpu_launch.patch_torchtitan(cpu=True)
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchtitan.config import derive
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.tools.logging import init_logger

    init_logger()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = llama3_debugmodel()
    mc = model_config(args.size)
    cfg.model_spec.model = mc
    P = cfg.parallelism
    P.spmd_backend = "partial_dtensor"
    for k, v in LAYOUTS[args.layout].items():
        setattr(P, k, v)
    cfg.training.mixed_precision_param = "float32"
    pd = ParallelDims.from_config(P, world)
    dist_utils.set_spmd_backend(P.spmd_backend)
    mc.update_from_config(config=cfg)
    from ucp_dev.testing.titan.jobs import CPU_ATTENTION

    cfg.override.imports = [CPU_ATTENTION]
    from torchtitan.config.override import apply_overrides

    apply_overrides(cfg.override, cfg)
    with torch.device("meta"):
        model = mc.build()
    model = cfg.model_spec.parallelize_fn(
        model,
        parallel_dims=pd,
        training=cfg.training,
        parallelism=P,
        compile_config=cfg.compile,
        ac_config=cfg.activation_checkpoint,
        dump_folder=args.out,
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    opt = cfg.optimizer.build(model_parts=[model])
    lrs = cfg.lr_scheduler.build(optimizers=opt, training_steps=1)

    C = cfg.checkpoint
    if args.path == "ucp":
        from ucp_dcp.torchtitan.manager import UCPCheckpointManager

        C = derive(C, UCPCheckpointManager.Config)
    C.enable, C.folder = True, "checkpoint"
    C.initial_load_path, C.initial_load_in_hf, C.initial_load_model_only = args.hf, True, True
    C.last_save_in_hf, C.last_save_model_only, C.export_dtype = True, True, "bfloat16"
    adapter = cfg.model_spec.state_dict_adapter(mc, None)
    stock_bytes = _count_stock_reads(args.hf) if args.path == "stock" else None

    class TrainState:
        step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, sd):
            self.step = sd["step"]

    ckpt = C.build(
        dataloader=None,
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=lrs,
        states={"train_state": TrainState()},
        sd_adapter=adapter,
        base_folder=args.out,
    )
    out = {"rank": rank}

    def measured(name, fn):
        dist.barrier()
        io0 = _io()
        t0 = time.perf_counter()
        with _PeakRSS() as rss:
            fn()
        dist.barrier()
        io1 = _io()
        out[name] = {
            "seconds": time.perf_counter() - t0,
            "rss_before": rss.base,
            "rss_peak": rss.peak,
            "rchar": io1["rchar"] - io0["rchar"],
            "wchar": io1["wchar"] - io0["wchar"],
        }

    measured("load", lambda: ckpt.load())
    out["load"]["bytes_read"] = stock_bytes[0] if stock_bytes is not None else ckpt.hf_load_stats.bytes_read
    if args.path == "ucp":
        out["load"]["bytes_received"] = ckpt.hf_load_stats.bytes_received
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        digest.update(name.encode())
        digest.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    out["params_sha256"] = digest.hexdigest()[:16]
    measured("save", lambda: ckpt.save(1, last_step=True))
    out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ckpt.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # the figures are written; skip interpreter teardown, where a native thread left by this
    # standalone manager set-up aborts the process ("terminate called without an active exception")
    os._exit(0)


# -- driver ---------------------------------------------------------------------------------------------


def make_hf_folder(size: str, folder: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ucp_dcp.torchtitan.mappings import hf_mapping

    mapping = hf_mapping(model_config(size))
    cfg = dict(mapping.config)
    arch = cfg.pop("architectures")
    config = AutoConfig.for_model(**cfg)
    config.architectures = arch
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def run(args) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="titan_hf_"))
    hf = work / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    info = make_hf_folder(args.size, hf)
    print(f"HF folder: {info['params'] / 1e6:.1f}M params, {info['bytes'] / 2**20:.1f} MiB bf16 ({hf})", flush=True)
    from ucp_dev.testing.titan.jobs import titan_env

    env = titan_env()  # this ucp_dcp first on the workers' path
    results: dict = {"size": args.size, "hf": info, "runs": {}}
    for layout in args.layouts:
        for path in ("stock", "ucp"):
            out = work / f"{path}-{layout}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            res = out / "result.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                "--local-ranks-filter=0",
                __file__,
                "--worker",
                "--path",
                path,
                "--layout",
                layout,
                "--size",
                args.size,
                "--hf",
                str(hf),
                "--out",
                str(out),
                "--result",
                str(res),
            ]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            (out / "log.txt").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
                raise SystemExit(f"{path} {layout} failed (exit {proc.returncode}), log {out / 'log.txt'}:\n{tail}")
            ranks = json.loads(res.read_text())
            export = out / "checkpoint" / "step-1"
            results["runs"][f"{path} {layout}"] = {
                "path": path,
                "layout": layout,
                "ranks": ranks,
                "job_seconds": time.perf_counter() - t0,
                "export_bytes": _folder_bytes(export),
                "export_files": sorted(p.name for p in export.iterdir()),
            }
            print(f"  {path:5s} {layout}: done in {time.perf_counter() - t0:.1f}s", flush=True)
    results["checks"] = _checks(work, results)
    return results


def _checks(work: Path, results: dict) -> dict:
    """Both paths loaded the same weights and wrote the same HF tensors."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
        return out

    checks = {}
    for layout in {r["layout"] for r in results["runs"].values()}:
        s, u = results["runs"][f"stock {layout}"], results["runs"][f"ucp {layout}"]
        a = tensors(work / f"stock-{layout}" / "checkpoint" / "step-1")
        b = tensors(work / f"ucp-{layout}" / "checkpoint" / "step-1")
        checks[layout] = {
            "same_loaded_params": s["ranks"][0]["params_sha256"] == u["ranks"][0]["params_sha256"],
            "stock_tensors": len(a),
            "ucp_tensors": len(b),
            "same_hf_tensors": set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a),
        }
    return checks


def _table(results: dict) -> str:
    mib = lambda n: f"{n / 2**20:8.1f}"  # noqa: E731
    rows = [
        "| path  | layout     | load s | load MiB read/rank | load RSS +MiB | save s | save MiB written/rank "
        "| save RSS +MiB | HF folder MiB | max RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"].values():
        rk = run["ranks"]
        worst = lambda op, key: max(r[op][key] for r in rk)  # noqa: E731
        rows.append(
            f"| {run['path']:5s} | {run['layout']:10s} | {worst('load', 'seconds'):6.2f} | "
            f"{' / '.join(mib(r['load']['bytes_read']).strip() for r in rk):>18s} | "
            f"{mib(max(r['load']['rss_peak'] - r['load']['rss_before'] for r in rk))} | "
            f"{worst('save', 'seconds'):6.2f} | {' / '.join(mib(r['save']['wchar']).strip() for r in rk):>21s} | "
            f"{mib(max(r['save']['rss_peak'] - r['save']['rss_before'] for r in rk))} | {mib(run['export_bytes'])} | "
            f"{mib(max(r['maxrss'] for r in rk))} |"
        )
    lines = ["\n".join(rows), ""]
    for layout in sorted({r["layout"] for r in results["runs"].values()}):
        s, u = results["runs"][f"stock {layout}"]["ranks"], results["runs"][f"ucp {layout}"]["ranks"]
        ratio = lambda op, key, agg=max: agg(r[op][key] for r in s) / max(agg(r[op][key] for r in u), 1e-9)  # noqa
        lines.append(
            f"{layout}: stock/ucp  load time {ratio('load', 'seconds'):.2f}x, load bytes read (sum over "
            f"ranks) {ratio('load', 'bytes_read', sum):.2f}x, load RSS growth "
            f"{_growth(s, 'load') / max(_growth(u, 'load'), 1):.2f}x, save time {ratio('save', 'seconds'):.2f}x, "
            f"save bytes written (sum) {ratio('save', 'wchar', sum):.2f}x; checks {results['checks'][layout]}"
        )
    return "\n".join(lines)


def _growth(ranks, op):
    return max(r[op]["rss_peak"] - r[op]["rss_before"] for r in ranks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="150m")
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["dp_shard=2", "tp=2"])
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--workdir", help="keep the folders here (default: a new temporary folder)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for k in ("path", "layout", "hf", "out", "result"):
        ap.add_argument(f"--{k}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    results = run(args)
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not all(c["same_loaded_params"] and c["same_hf_tensors"] for c in results["checks"].values()):
        raise SystemExit("MISMATCH between the stock and the ucp_dcp paths (see checks above)")


if __name__ == "__main__":
    main()
