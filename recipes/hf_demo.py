"""Hugging Face in and out at any layout, proven against ``transformers`` itself (no downloads).

    python recipes/hf_demo.py [--steps K] [--out DIR]

1. ``transformers`` builds a tiny random Llama and a tiny random Mixtral from the configs our toy
   mappings emit and ``save_pretrained``s them (sharded safetensors), with their logits on fixed
   tokens.
2. Fresh processes load the Llama into the toy LLM at dp=2·tp=2 (fused QKV and SwiGLU, padded
   vocabulary, rotary rows permuted) and at pp=2 (stage-local layer names), and the Mixtral at
   ep=2·tp=2 (experts as slices of stacked ``[E, F, D]`` DTensors and as EP-local lists), inside
   ``dcp.load`` (``ucp_dcp.sources.hf.load_hf``); each compares its logits with transformers' and counts
   the bytes each rank read against the bytes its own shards hold.
3. The dp=2·tp=2 job trains K steps, saves a ucp_dcp checkpoint and exports it collectively with
   ``ucp_dcp.sources.hf.export_hf``; ``transformers`` loads the export and its logits must equal the trained
   model's.

The last line is ``HF OK: ...`` (exit 0) or ``HF MISMATCH: ...`` (exit 1).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import socket
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ATOL = 2e-5
"""fp32 logits: the same math as transformers' up to summation order."""


def _models() -> dict:
    from ucp_dev.toy.hf_presets import TOY_LLAMA, TOY_MIXTRAL, toy_llama, toy_mixtral

    return {
        "llama": (TOY_LLAMA, toy_llama, "LlamaForCausalLM", "LlamaConfig"),
        "mixtral": (TOY_MIXTRAL, toy_mixtral, "MixtralForCausalLM", "MixtralConfig"),
    }


def _make_hf(out: Path, tokens: torch.Tensor) -> dict:
    import transformers

    refs = {}
    for i, (kind, (cfg, preset, model_cls, config_cls)) in enumerate(_models().items()):
        torch.manual_seed(i)
        conf = {k: v for k, v in preset(cfg).config.items() if k not in ("architectures", "model_type")}
        m = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**conf)).eval()
        m.save_pretrained(out / f"hf-{kind}", max_shard_size="100KB")
        with torch.no_grad():
            refs[kind] = m(tokens).logits
        refs[kind + "-params"] = sum(p.numel() for p in m.parameters())
    return refs


def _job(rank: int, world: int, port: int, out: str, kind: str, topo_text: str, steps: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    import ucp_dcp
    from ucp_dcp.sources.hf import export_hf, load_hf
    from ucp_dev.toy import Topology, build_job, build_trainer, live_logits, train_step, ucp_options

    cfg, preset = _models()[kind][:2]
    job = build_job(Topology.parse(topo_text))
    tr = build_trainer(cfg, job, seed=123)  # other weights than the HF model's: the load replaces them all
    opts = ucp_options(cfg, job.topo, job.coord, model_only=True)
    tokens = torch.load(Path(out) / "tokens.pt")
    stats = load_hf({"model": tr.state_dict()["model"]}, Path(out) / f"hf-{kind}", preset(cfg), quiet=True, **opts)
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for c in tr.chunks
        for p in c.parameters()
    )
    res = {"read": stats.bytes_read, "local": local, "logits": live_logits(tr, tokens)}
    if steps:
        for _ in range(steps):
            train_step(tr)
        tag = Path(out) / f"{kind}-{topo_text.replace(',', '_').replace('=', '')}"
        ucp_dcp.save({"model": tr.state_dict()["model"]}, str(tag) + "-ckpt", **opts)
        ex = export_hf(str(tag) + "-ckpt", str(tag) + "-hf", preset(cfg), max_shard_bytes=100_000, overwrite=True)
        res.update(trained=live_logits(tr, tokens), written=ex.bytes_written)
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        torch.save(gathered, Path(out) / f"result-{kind}-{topo_text}.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _spawn(out: Path, kind: str, topo_text: str, steps: int) -> list[dict]:
    from ucp_dev.toy import Topology

    world = Topology.parse(topo_text).world
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_job, args=(r, world, port, str(out), kind, topo_text, steps)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(
            f"HF MISMATCH: the {kind} job at {topo_text} failed (exit codes {[p.exitcode for p in procs]})"
        )
    return torch.load(out / f"result-{kind}-{topo_text}.pt", weights_only=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="training steps before the export")
    ap.add_argument("--out", default="runs/hf_demo")
    a = ap.parse_args(argv)
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    warnings.simplefilter("ignore")
    import transformers

    from ucp_dev.toy.hf_presets import TOY_LLAMA

    tokens = torch.randint(0, TOY_LLAMA.vocab, (3, TOY_LLAMA.seq_len), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, out / "tokens.pt")
    refs = _make_hf(out, tokens)
    problems: list[str] = []
    lines: list[str] = []
    worst = 0.0
    for kind, topo, steps in (("llama", "dp=2,tp=2", a.steps), ("llama", "pp=2", 0), ("mixtral", "ep=2,tp=2", 0)):
        res = _spawn(out, kind, topo, steps)
        d = max(float((r["logits"] - refs[kind]).abs().max()) for r in res if r["logits"] is not None)
        worst = max(worst, d)
        if d > ATOL:
            problems.append(f"{kind} at {topo}: logits differ from transformers' by {d:.2e}")
        reads = [r["read"] for r in res]
        over = [i for i, r in enumerate(res) if r["read"] > r["local"]]
        if over:
            problems.append(f"{kind} at {topo}: rank(s) {over} read more bytes than their shards hold")
        lines.append(
            f"  {kind:8s} {topo:10s} logits max|d| {d:.1e}; bytes read per rank {reads} "
            f"(own shards {[r['local'] for r in res]})"
        )
        if steps:
            ex = out / f"{kind}-{topo.replace(',', '_').replace('=', '')}-hf"
            back = transformers.AutoModelForCausalLM.from_pretrained(ex).eval()
            with torch.no_grad():
                got = back(tokens).logits
            trained = next(r["trained"] for r in res if r.get("trained") is not None)
            dx = float((got - trained).abs().max())
            moved = float((trained - refs[kind]).abs().max())
            files = sorted(p.name for p in ex.iterdir())
            lines.append(
                f"  export after {steps} steps: {len(files)} files, transformers logits max|d| {dx:.1e} "
                f"(training moved them by {moved:.2f})"
            )
            if dx > ATOL:
                problems.append(f"export: transformers' logits differ from the trained model's by {dx:.2e}")
            if moved < 1e-3:
                problems.append("training did not change the logits: the export check proves nothing")
    print("\n".join(lines))
    if problems:
        print("HF MISMATCH: " + "; ".join(problems))
        return 1
    print(
        f"HF OK: transformers' Llama ({refs['llama-params']} params) loads at dp=2·tp=2 and pp=2 and its Mixtral "
        f"({refs['mixtral-params']} params) at ep=2·tp=2 inside dcp.load with equal logits (max |d| {worst:.1e}), "
        f"no rank reading more than its own shards; after {a.steps} steps the export loads in transformers with "
        "equal logits"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
