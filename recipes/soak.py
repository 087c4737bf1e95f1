"""The same resharding load many times in a row: does any run end with a signal (an abort at teardown)?

    python recipes/soak.py [--runs 50] [--save dp=3] [--load dp=2] [--out runs/soak]

Issue 32 saw one of four runs of a 3 -> 2 FSDP load end with rank 0 killed by SIGABRT ("terminate called
without an active exception") after the load had succeeded. Each run here is a fresh ``torchrun`` job of the
elastic-resume recipe's load phase with a normal interpreter teardown (no ``os._exit``: what a user's job
does), against one checkpoint saved once at ``--save``. A run counts as a *signal* when torchrun reports a
rank ended by a signal or the output holds "terminate called"; any other failure is a *failure*. The last
line is ``SOAK OK: N runs of SAVE -> LOAD, 0 signals`` (exit 0) or ``SOAK FAILED: ...`` (exit 1).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from ucp_dcp.progress import StepProgress

ROOT = Path(__file__).resolve().parent.parent
_SIGNAL = re.compile(r"terminate called|Signal \d+|SIGABRT|SIGSEGV|exitcode\s*:\s*-\d+|core dumped")


def _torchrun(world: int, phase: str, a: argparse.Namespace) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(ROOT / "recipes" / "elastic_resume.py"),
        "--phase",
        phase,
        "--save-topology",
        a.save,
        "--load-topology",
        a.load,
        "--out",
        str(a.out),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=None)


def _world(topology: str) -> int:
    n = 1
    for part in topology.split(","):
        n *= int(part.split("=")[1])
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--save", default="dp=3")
    ap.add_argument("--load", default="dp=2")
    ap.add_argument("--out", type=Path, default=Path("runs/soak"))
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    saved = _torchrun(_world(a.save), "save", a)
    if saved.returncode != 0:
        print(saved.stdout[-2000:], saved.stderr[-3000:], sep="\n")
        print(f"SOAK FAILED: the save at {a.save} failed (exit {saved.returncode})")
        return 1
    signals: list[int] = []
    failures: list[int] = []
    progress = StepProgress("soak", a.runs, "runs")  # stderr, when it is a terminal
    for i in range(a.runs):
        t0 = time.monotonic()
        run = _torchrun(_world(a.load), "load", a)
        text = run.stdout + run.stderr
        signalled = bool(_SIGNAL.search(text)) or run.returncode < 0
        verdict = "SIGNAL" if signalled else ("ok" if run.returncode == 0 else f"FAIL (exit {run.returncode})")
        print(f"run {i + 1:3d}/{a.runs}: {verdict:<14} {time.monotonic() - t0:5.1f} s", flush=True)
        if signalled:
            signals.append(i + 1)
        elif run.returncode != 0:
            failures.append(i + 1)
        if signalled or run.returncode != 0:
            (a.out / f"run{i + 1}.log").write_text(text)
            print("\n".join("    " + line for line in text.strip().splitlines()[-12:]), flush=True)
        progress()
    summary = f"{a.runs} runs of {a.save} -> {a.load}, {len(signals)} signals"
    if signals or failures:
        print(
            f"SOAK FAILED: {summary} (runs {signals}), {len(failures)} other failures (runs {failures}); logs in {a.out}"
        )
        return 1
    print(f"SOAK OK: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
