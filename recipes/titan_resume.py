"""A real torchtitan job resumes at a new scale (``make titan-demo``).

For each transition, the save job runs torchtitan's Trainer (llama3 debug model with grouped-query
attention, generated tokenizer and data, fp32, CPU/gloo under torchrun) for N steps with ucp_dcp
(``--module ucp_dev.testing --config llama3_debugmodel_gqa_ucp``), checkpointing at step K; it is
also the uninterrupted reference. The resume job starts from the step-K checkpoint at another
layout and trains to step N. The full training state right after the save and right after the load
is written by the CPU launcher with plain ``torch.save`` (the oracle uses no ucp_dcp code) and must
be bitwise equal; the losses must continue the reference within fp32 tolerances. The jobs and the
check are ``ucp_dev.testing.titan``'s, the ones tests/e2e/test_titan_trainer.py runs.

    python recipes/titan_resume.py [--only dp4-dp2] [--steps N] [--save-step K] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ucp_dev.testing.titan.assets import make_assets
from ucp_dev.testing.titan.jobs import DEMO, TRANSITIONS, transition


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", action="append", choices=sorted(TRANSITIONS), help="transition(s) to run (default: demo set)"
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-step", type=int, default=2)
    ap.add_argument("--out", default="runs/titan_resume")
    a = ap.parse_args(argv)
    root = Path(a.out)
    assets = make_assets(root / "assets")
    results = [transition(n, root, assets, a.steps, a.save_step, show=True) for n in (a.only or DEMO)]
    ok = all(r[0] for r in results)
    print()
    for good, line in results:
        print(("  ok   " if good else "  FAIL ") + line)
    print(("RESUME OK: " if ok else "RESUME MISMATCH: ") + "; ".join(r[1] for r in results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
