"""The tests' own harness for real torchtitan jobs (tests/e2e/test_titan_trainer.py, tests/torchtitan/test_dataloader.py).

A job is ``torchrun`` of the recipe's CPU launcher (recipes/titan/cpu_launch.py, with its CPU patches)
as a subprocess; nothing from recipes/ is imported here. :func:`make_assets` is a copy of
recipes/titan/assets.py (tiny generated tokenizer and dataset) and :func:`transition` of the
save -> resume check of recipes/titan_resume.py, for the transitions the tests run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TITAN = ROOT / "recipes" / "titan"
TOL_FIRST, TOL_LAST = 1e-5, 1e-4  # relative loss difference at the first resumed and the last step

UCP_CONFIG = "llama3_debugmodel_gqa_ucp"  # registry entry: UCP manager + global-cursor dataloader
STOCK_CONFIG = "llama3_debugmodel_gqa"  # stock torchtitan checkpointer and dataloader
ONE_FLAG = "ucp_dcp.torchtitan.overrides.checkpointer"  # the --override.imports switch on a stock config

# name -> (save topology, load topology, save config, load config, extra --override.imports at load,
#          extra save flags[, (save spmd_backend, load spmd_backend)])
TRANSITIONS = {
    # async (thread) checkpointing, resumed at a smaller DP degree
    "dp2async-dp1": ({"dp": 2}, {"dp": 1}, UCP_CONFIG, UCP_CONFIG, [], ["--checkpoint.async_mode", "async"]),
    # async checkpointing in a separate checkpoint process (DCP's PROCESS type: planner and storage
    # writer are pickled into it); on CPU without pinned memory or non-blocking copies (launcher (p))
    "dp2pinned-dp1": (
        {"dp": 2},
        {"dp": 1},
        UCP_CONFIG,
        UCP_CONFIG,
        [],
        ["--checkpoint.async_mode", "async_with_pinned_mem"],
    ),
    # torchtitan's default SPMD backend: FSDP at dp=2 (launcher (s)), resumed under pipeline parallelism
    "spmd-dp2-pp2": ({"dp": 2}, {"pp": 2}, UCP_CONFIG, UCP_CONFIG, [], [], ("spmd_types", "spmd_types")),
    # a checkpoint written by stock torchtitan (no UCP) resumes with the one-flag UCP switch on
    "stock-dp2-dp2": ({"dp": 2}, {"dp": 2}, STOCK_CONFIG, STOCK_CONFIG, [ONE_FLAG], []),
}

# -- assets -------------------------------------------------------------------------------------------

WORDS = (
    "the a checkpoint resumes training at another scale shards tensors ranks layers optimizer moments "
    "pipeline stages experts tokens window cursor global batch data parallel tensor parallel load save "
    "model weights gradient step loss learning rate schedule warmup atoms fragments catalog patterns"
).split()


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(8, 60)
        out.append(f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(k)) + ".")
    return out


def make_assets(folder: str | Path, n_docs: int = 2000, seed: int = 0) -> Path:
    """``folder/tokenizer/{tokenizer.json,tokenizer_config.json}`` (a byte-level BPE trained on the
    synthetic text) and ``folder/dataset/data.json`` (JSON lines of ``{"text": ...}``, readable by
    torchtitan's ``c4_test`` loader). Deterministic for a given seed."""
    folder = Path(folder)
    tok_dir, data_dir = folder / "tokenizer", folder / "dataset"
    if (tok_dir / "tokenizer.json").exists() and (data_dir / "data.json").exists():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = _texts(n_docs, seed)
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    with open(data_dir / "data.json", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return folder


# -- jobs -----------------------------------------------------------------------------------------------


def titan_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launcher subprocess: recipes/titan on its path (the launcher's CPU
    attention override is imported by name there)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TITAN), os.environ.get("PYTHONPATH", "")]),
        **(extra or {}),
    }


def _topology_flags(topo: dict[str, int]) -> list[str]:
    names = {
        "dp": "data_parallel_shard_degree",
        "tp": "tensor_parallel_degree",
        "pp": "pipeline_parallel_degree",
        "ep": "expert_parallel_degree",
    }
    out = []
    for k, v in topo.items():
        out += [f"--parallelism.{names[k]}", str(v)]
    return out


def _world(topo: dict[str, int]) -> int:
    n = 1
    for k, v in topo.items():
        if k != "ep":  # expert parallelism borrows the dp_shard x tp ranks (torchtitan's ParallelDims)
            n *= v
    return n


def run_job(
    topo: dict[str, int],
    out: Path,
    assets: Path,
    steps: int,
    extra: list[str],
    env: dict[str, str],
    config: str = UCP_CONFIG,
    overrides: list[str] = (),
    backend: str | None = "partial_dtensor",
) -> subprocess.CompletedProcess:
    """One torchrun job of the launcher; ``backend=None`` leaves torchtitan's default SPMD backend."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={_world(topo)}",
        "--local-ranks-filter=0",
        str(TITAN / "cpu_launch.py"),
        "--module",
        "ucp_dcp.testing",
        "--config",
        config,
        "--hf_assets_path",
        str(assets / "tokenizer"),
        "--dataloader.dataset_path",
        str(assets / "dataset"),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "8",
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "float32",
        "--debug.seed",
        "0",
        *(["--parallelism.spmd_backend", backend] if backend else []),
        "--override.imports",
        "cpu_attention.sdpa_attention",
        *overrides,
        "--training.disable_cuda_graphs",
        "--checkpoint.enable",
        "--dump_folder",
        str(out),
        *_topology_flags(topo),
        *extra,
    ]
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=titan_env(env), capture_output=True, text=True)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 and not env.get("UCP_TITAN_EXPECT_FAILURE"):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"torchtitan run {topo} failed (exit {proc.returncode}):\n{tail}")
    return proc


def _losses(prefix: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for f in prefix.parent.glob(prefix.name + ".rank*"):
        out.update({int(k): v for k, v in json.loads(f.read_text()).items()})
    return out


def _diffs(a: dict, b: dict) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        same = (
            isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            if isinstance(x, torch.Tensor)
            else x == y
        )
        if not same:
            bad.append(k)
    return bad


def resume_flags(save: Path, k: int, steps: int) -> list[str]:
    """Start from the save job's step-k checkpoint (full state, not model-only)."""
    return [
        "--checkpoint.interval",
        str(steps),
        "--checkpoint.initial_load_path",
        str((save / "checkpoint" / f"step-{k}").resolve()),
        "--checkpoint.no-initial_load_model_only",
    ]


def transition(name: str, root: Path, assets: Path, steps: int, k: int) -> tuple[bool, str]:
    """Save job (N steps, checkpoint at step k; also the uninterrupted reference) -> resume job at
    another layout from the step-k checkpoint: the full state right after the save and right after
    the load (written by the launcher with plain ``torch.save``) must be bitwise equal, and the
    losses continue the reference within fp32 tolerances."""
    save_topo, load_topo, save_cfg, load_cfg, overrides, save_flags, *rest = TRANSITIONS[name]
    save_backend, load_backend = rest[0] if rest else ("partial_dtensor", "partial_dtensor")
    save, load = root / name / "save", root / name / "resume"
    for d in (save, load):  # torchtitan resumes from any checkpoint already in its folder: start clean
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    run_job(
        save_topo,
        save,
        assets,
        steps,
        ["--checkpoint.interval", str(k), *save_flags],
        {
            "UCP_TITAN_METRICS": str(save / "loss.json"),
            "UCP_TITAN_STATE": str(save / "oracle.pt"),
            "UCP_TITAN_STATE_STEP": str(k),
        },
        config=save_cfg,
        backend=save_backend,
    )
    run_job(
        load_topo,
        load,
        assets,
        steps,
        resume_flags(save, k, steps),
        {"UCP_TITAN_METRICS": str(load / "loss.json"), "UCP_TITAN_STATE": str(load / "loaded.pt")},
        config=load_cfg,
        overrides=overrides,
        backend=load_backend,
    )
    ref, res = _losses(save / "loss.json"), _losses(load / "loss.json")
    oracle = torch.load(save / "oracle.pt", weights_only=False)
    loaded = torch.load(load / "loaded.pt", weights_only=False)
    bad = _diffs(oracle, loaded)
    rels = [
        abs(res.get(s, float("nan")) - ref.get(s, float("nan"))) / abs(ref.get(s, float("nan")))
        for s in range(k + 1, steps + 1)
    ]
    problems = []
    if bad:
        problems.append(f"{len(bad)} of {len(oracle)} state entries differ ({', '.join(bad[:4])})")
    if not rels or not rels[0] <= TOL_FIRST:
        problems.append(f"first resumed step rel diff {rels[0] if rels else 'missing'} > {TOL_FIRST:g}")
    elif not rels[-1] <= TOL_LAST:
        problems.append(f"step {steps} rel diff {rels[-1]:.1e} > {TOL_LAST:g}")
    if problems:
        return False, f"{name}: " + "; ".join(problems)
    return True, (
        f"{name}: {len(oracle)} state entries bitwise equal, loss rel diff {rels[0]:.1e} at step {k + 1}, "
        f"{rels[-1]:.1e} at step {steps}"
    )


# -- torchtitan models against transformers (tests/torchtitan/test_mappings.py, tests/e2e/test_to_stock.py) --


def _titan(model_config):
    with torch.device("meta"):
        m = model_config.build()
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights(buffer_device=None)
    return m.eval()


def _titan_logits(m, tokens):
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return m(tokens, positions=pos, attention_masks=m.get_attention_masks(pos))


def _from_pretrained(folder):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf.eval()


def _close(a, b):
    """fp32 logits of two implementations: max |a - b| <= 1e-5 of the logit scale."""
    diff, scale = (a - b).abs().max().item(), a.abs().max().item()
    assert scale > 1.0 and diff <= 1e-5 * scale, (diff, scale)


def fp32_experts(patch):
    """torchtitan's ``GroupedExperts`` compute in bf16 by design (inputs and weights cast before
    ``_grouped_mm``); to compare with fp32 transformers at the dense tests' 1e-5 the experts run the
    same math in fp32: rows grouped by expert, ``counts[e]`` rows each (rows past them stay zero)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    def forward(self, x, counts):
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        out, start = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype), 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n]
            out[start : start + n] = (F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T
            start += n
        return out

    patch(GroupedExperts, "forward", forward)  # monkeypatch.setattr in a test, dist.patch in a task


def hf_model(mapping, folder, seed=0):
    """A random transformers model built from the mapping's config.json, saved to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(mapping.config)
    arch = cfg.pop("architectures")
    config = AutoConfig.for_model(**cfg)
    config.architectures = arch
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from 1 and weights large enough that a wrong row order shows
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    hf.save_pretrained(folder)
    return hf
