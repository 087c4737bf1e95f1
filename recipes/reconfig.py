"""The reconfiguration set (``ucp_dev.testing.elastic.RECONFIG_SET``): every (save -> load) transition of the
patterns issue, each run by the elastic-resume recipe in fresh processes, with its time and verdict.

    python recipes/reconfig.py [--steps K] [--only SUBSTRING] [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from ucp_dcp.progress import StepProgress
from ucp_dev.testing.elastic import RECONFIG_SET


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", default="", help="run transitions whose 'save -> load' text contains this")
    ap.add_argument("--out", default="runs/reconfig")
    a = ap.parse_args()
    recipe = Path(__file__).resolve().parent / "elastic_resume.py"
    rows, failed = [], 0
    todo = [(s, lo) for s, lo in RECONFIG_SET if a.only in f"{s} -> {lo}"]
    progress = StepProgress("reconfig", len(todo), "transitions")  # stderr, when it is a terminal
    for save, load in todo:
        label = f"{save} -> {load}"
        out = Path(a.out) / f"{save}_to_{load}".replace(",", "_").replace("=", "")
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                str(recipe),
                "--save-topology",
                save,
                "--load-topology",
                load,
                "--steps",
                str(a.steps),
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
        )
        dt = time.perf_counter() - t0
        lines = proc.stdout.strip().splitlines()
        verdict = lines[-1] if lines else (proc.stderr.strip().splitlines() or ["no output"])[-1]
        ok = proc.returncode == 0 and verdict.startswith("RESUME OK")
        failed += not ok
        rows.append((label, dt, verdict))
        print(f"{label:<36} {dt:6.1f}s  {verdict}", flush=True)
        if not ok:
            print(proc.stderr[-4000:], file=sys.stderr)
        progress(label)
    print(f"\n{len(rows) - failed}/{len(rows)} transitions resumed OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
