"""A torchtitan mixture-of-experts job resumes at new expert-parallel layouts (``make moe-demo``).

The save job trains torchtitan's qwen3 MoE architecture at a CPU size (``qwen3_moe_small_ucp``: 4 layers of
8 stacked experts, top-k router, auxiliary-loss-free load balancing through the ``expert_bias_E`` buffer)
with the ucp_dcp option at dp_shard=4 x ep=2 on 4 ranks (torchtitan's Trainer under torchrun, CPU/gloo),
checkpointing at step K; it is also the uninterrupted reference. Each resume starts from that one
checkpoint at a layout that changes the EP degree up (ep=4) or removes it (dp=2), adds pipeline stages
(pp=2 x dp=2 x ep=2) or tensor parallelism (tp=2 x dp=2 x ep=4), and trains to step N. Right after the load, the full state every rank holds
(parameters, optimizer moments, step, hyperparameters, model buffers; written with plain ``torch.save``
by the launcher, no ucp_dcp code) must equal bitwise what the save job held right after the save; the
losses continue the reference and every step trains on the same sequences (batch hashes). A last run
swaps two experts' rows right after a load: the comparison must name exactly that parameter.

    python recipes/moe_demo.py [--only ep4] [--out DIR]

Last line: ``MOE OK: ...`` or ``MOE MISMATCH: ...``. The jobs are ``ucp_dev.testing.titan``'s; the same
runs, with the plan check, are ``tests/e2e/test_titan_moe.py``; docs/torchtitan.md lists how each MoE state
entry is treated.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from ucp_dev.testing.checks import loss_problems, rel_diffs, state_diffs
from ucp_dev.testing.titan.assets import make_assets
from ucp_dev.testing.titan.jobs import batches, losses, recording_env, resume_flags, run_job

CONFIG = "qwen3_moe_small_ucp"
SAVE = {"dp": 4, "ep": 2}
RESUMES = {
    "ep4": {"dp": 4, "ep": 4},  # EP degree up: 2 experts per rank instead of 4
    "ep1-dp2": {"dp": 2},  # no EP, fewer ranks: the experts FSDP-sharded over dp
    "pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2},  # pipeline stages added, EP kept, DP halved
    "tp2-dp2-ep4": {"tp": 2, "dp": 2, "ep": 4},  # tensor parallelism added, EP up over dp x tp
}
STEPS, K = 3, 2
FLIPPED = "layers.0.moe.routed_experts.inner_experts.w1_EFD"


def _moe_entries(state: dict) -> str:
    """How the MoE entries of a state look: a summary line (what a reader of the demo checks first)."""
    experts = [k for k in state if k.startswith("param/") and "inner_experts" in k]
    biases = [k for k in state if k.startswith("buffer/") and k.endswith("expert_bias_E")]
    counts = [k for k in state if k.startswith("buffer/") and k.endswith("tokens_per_expert_E")]
    moved = sum(bool(state[k].abs().sum() > 0) for k in biases)
    return (
        f"{len(experts)} stacked expert weights {tuple(state[experts[0]].shape) if experts else ()}, "
        f"{len(biases)} expert_bias_E ({moved} moved off zero), {len(counts)} tokens_per_expert_E "
        f"({'all zero' if all(not state[k].any() for k in counts) else 'NOT zero'})"
    )


def _resume(name: str, topo: dict[str, int], root: Path, assets: Path, save: Path, **env: str) -> Path:
    load = root / name
    shutil.rmtree(load, ignore_errors=True)
    run_job(
        topo,
        load,
        assets,
        STEPS,
        resume_flags(save, K, STEPS),
        recording_env(load, UCP_TITAN_STATE=str(load / "loaded.pt"), **env),
        config=CONFIG,
    )
    return load


def _judge(name: str, topo: dict[str, int], oracle: dict, save: Path, load: Path) -> tuple[bool, str]:
    loaded = torch.load(load / "loaded.pt", weights_only=False)
    problems = []
    bad = state_diffs(oracle, loaded)
    if bad:
        problems.append(f"{len(bad)} of {len(oracle)} entries differ ({', '.join(bad[:4])})")
    ref, res = losses(save / "loss.json"), losses(load / "loss.json")
    resumed = range(K + 1, STEPS + 1)
    rels = rel_diffs([ref[s] for s in resumed], [res.get(s, float("nan")) for s in resumed])
    problems += loss_problems(rels, K + 1, STEPS)
    ref_b, res_b = batches(save / "batches.json"), batches(load / "batches.json")
    if any(res_b.get(s) != ref_b.get(s) for s in range(K + 1, STEPS + 1)):
        problems.append("other sequences than the reference's after the resume")
    print(f"  {name} {topo}: step {K + 1} loss {res.get(K + 1, float('nan')):.6f} (reference {ref[K + 1]:.6f})")
    if problems:
        return False, f"{name}: " + "; ".join(problems)
    return True, f"{name}: {len(oracle)} entries bitwise, loss rel diff {rels[-1]:.1e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(RESUMES), help="resume(s) to run (default: all)")
    ap.add_argument("--out", default="runs/moe_demo")
    a = ap.parse_args(argv)
    root = Path(a.out)
    assets = make_assets(root / "assets")
    save = root / "save"
    shutil.rmtree(save, ignore_errors=True)
    t0 = time.perf_counter()
    run_job(
        SAVE,
        save,
        assets,
        STEPS,
        ["--checkpoint.interval", str(K)],
        recording_env(save, UCP_TITAN_STATE=str(save / "oracle.pt"), UCP_TITAN_STATE_STEP=str(K)),
        config=CONFIG,
    )
    oracle = torch.load(save / "oracle.pt", weights_only=False)
    print(f"save {SAVE}, step-{K} checkpoint ({time.perf_counter() - t0:.0f} s): {_moe_entries(oracle)}")
    results = []
    for name in a.only or list(RESUMES):
        load = _resume(name, RESUMES[name], root, assets, save)
        results.append(_judge(name, RESUMES[name], oracle, save, load))
    # the comparison must catch a wrong expert: two rows of one layer's experts swapped after a load
    flip = _resume("flip", {"dp": 2}, root, assets, save, UCP_TITAN_FLIP_EXPERTS=FLIPPED)
    bad = [
        k.replace("_checkpoint_wrapped_module.", "")
        for k in state_diffs(oracle, torch.load(flip / "loaded.pt", weights_only=False))
    ]
    caught = bad == [f"param/{FLIPPED}"]
    results.append((caught, f"swapped experts {'caught' if caught else 'NOT caught'} ({bad[:3]})"))
    ok = all(r[0] for r in results)
    print()
    for good, line in results:
        print(("  ok   " if good else "  FAIL ") + line)
    print(f"{'MOE OK' if ok else 'MOE MISMATCH'}: " + "; ".join(r[1] for r in results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
