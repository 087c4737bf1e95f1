"""The mistake-injection tier: every ordinary mistake (a rule or map dropped or altered at save, at load or
both, param groups reordered, one replica perturbed, the writer or reader swapped for stock DCP's, a stock save
into the folder holding ours, a map forgotten at load on plain tensors) on every transition of the
reconfiguration set; each run must load bitwise right or end in a UCPError naming the atom
and the fix; then the state-form runs (ties without rules, the raw optimizer form: ``ucp_dev.testing.mistake_forms``)
the subclass-hook runs (DCP's planner extension points overridden: ``ucp_dev.testing.mistake_hooks``) and the
dtype-edge runs (values at and past a narrower target's largest finite value: ``ucp_dev.testing.mistake_dtypes``).
One line per silent, crashed, unclear or wrongly refused run, then ``MISTAKES OK: N runs, 0 silent`` or
``MISTAKES FAILED: ...``. The set is ``ucp_dev.testing.mistakes``; each transition runs in fresh processes
(``ucp_dev.testing.processes``), where the tests run the same worker on their pool.

    python recipes/mistakes.py [--only SUBSTRING] [--json FILE] [-v] [--summarize FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from ucp_dcp.progress import StepProgress
from ucp_dev.testing.elastic import RECONFIG_SET
from ucp_dev.testing.mistake_dtypes import DTYPE_SCENARIOS, dtype_worker
from ucp_dev.testing.mistake_forms import SCENARIOS, WORLD, form_worker
from ucp_dev.testing.mistake_hooks import HOOK_SCENARIOS, hooks_worker
from ucp_dev.testing.mistake_runs import transition_worker
from ucp_dev.testing.mistakes import FAILING, SAME_LAYOUT, plan, summary
from ucp_dev.testing.processes import RanksFailed, run_ranks
from ucp_dev.toy import Topology

warnings.filterwarnings("ignore", category=UserWarning)


def run_transition(save: str, load: str, names: list[str], timeout: float = 1500) -> list[dict]:
    """One transition's runs on as many fresh processes as its larger side has ranks; a run that fails or
    hangs keeps the runs that finished before it and reports the others as crashed."""
    world = max(Topology.parse(save).world, Topology.parse(load).world)
    root = tempfile.mkdtemp(prefix="ucp-mistakes-")
    try:
        return run_ranks(transition_worker, world, root, save, load, names, timeout=timeout)[0]
    except RanksFailed as e:
        path = os.path.join(root, "results.jsonl")
        done = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
        seen = {r["mistake"] for r in done}
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else "task failed"
        print(f"# {save} -> {load}: the task failed after {len(done)} runs:\n{str(e)[-6000:]}", file=sys.stderr)
        return done + [
            {"save": save, "load": load, "mistake": n, "outcome": "crash", "error": f"task failed: {why}"}
            for n in names
            if n not in seen
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_forms(timeout: float = 900, worker=form_worker, scenarios=SCENARIOS, label: str = "state forms") -> list[dict]:
    """The state-form (or subclass-hook) runs on 2 fresh processes; a failed task reports them crashed."""
    root = tempfile.mkdtemp(prefix="ucp-mistakes-forms-")
    try:
        return run_ranks(worker, WORLD, root, list(scenarios), timeout=timeout)[0]
    except RanksFailed as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else "task failed"
        print(f"# {label}: the task failed:\n{str(e)[-6000:]}", file=sys.stderr)
        return [
            {"save": "-", "load": "-", "mistake": n, "outcome": "crash", "error": f"task failed: {why}"}
            for n in scenarios
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="transitions whose 'save -> load' text contains this")
    ap.add_argument("--json", default="", help="write every run's result here")
    ap.add_argument("-v", action="store_true", help="one line per run")
    ap.add_argument("--summarize", default="", help="print the summary of an earlier --json FILE (runs nothing)")
    a = ap.parse_args()
    if a.summarize:
        lines, ok = summary(json.loads(Path(a.summarize).read_text()), skipped=plan(RECONFIG_SET)[1])  # the whole set's
        print("\n".join(lines))
        return 0 if ok else 1
    pick = lambda ts: [t for t in ts if a.only in f"{t[0]} -> {t[1]}"]
    jobs, skipped = plan(pick(RECONFIG_SET), same_layout=pick(SAME_LAYOUT))
    t0, results = time.perf_counter(), []
    progress = StepProgress("mistakes", len(jobs), "transitions")  # stderr, when it is a terminal
    for save, load, names in jobs:
        t1 = time.perf_counter()
        rs = run_transition(save, load, names)
        results += rs
        bad = sum(1 for r in rs if r["outcome"] in FAILING)
        print(
            f"# {save} -> {load}: {len(rs)} runs, {bad} silent/crashed/unclear, {time.perf_counter() - t1:.0f}s",
            flush=True,
        )
        if a.v:
            for r in rs:
                print(
                    f"#   {r['mistake']:<28} {r['outcome']:<14} {r.get('error', '') or r.get('first', '')}", flush=True
                )
        progress(f"{save} -> {load}")
    classes = [
        ("form", "state forms", form_worker, SCENARIOS),
        ("hooks", "subclass hooks", hooks_worker, HOOK_SCENARIOS),
        ("dtype", "dtype edges", dtype_worker, DTYPE_SCENARIOS),
    ]
    # the state-form runs (ties without rules, the raw optimizer form), the subclass-hook runs (issue 31), the
    # dtype-edge runs (issue 46)
    for key, label, worker, scenarios in classes:
        if a.only and a.only not in key:
            continue
        t1 = time.perf_counter()
        rs = run_forms(worker=worker, scenarios=scenarios, label=label)
        results += rs
        bad = sum(1 for r in rs if r["outcome"] in FAILING)
        took = time.perf_counter() - t1
        print(f"# {label}: {len(rs)} runs, {bad} silent/crashed/unclear/overrefused, {took:.0f}s", flush=True)
        if a.v:
            for r in rs:
                print(
                    f"#   {r['mistake']:<28} {r['outcome']:<14} {r.get('error', '') or r.get('first', '')}", flush=True
                )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    lines, ok = summary(results, skipped)
    print(f"# {time.perf_counter() - t0:.0f}s in all")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
