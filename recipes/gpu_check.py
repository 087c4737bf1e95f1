"""``make gpu-check``: the whole GPU proof in one command, one JSON, one plot, one summary line.

    python recipes/gpu_check.py [--out runs/gpu_check] [--budget 570]
    python recipes/gpu_check.py --rehearse          # the same script on CPU, tiny sizes (no GPU figures)

Steps, each a subprocess with its own time limit inside ``--budget`` seconds (a step that fails or
runs out of time is recorded and the next one runs):

1. ``gpu_tier``: ``pytest --gpu tests/gpu`` (``make test-gpu``);
2. ``single``: ``recipes/bench_single.py --device cuda`` (one process, 4 GiB: ucp_dcp vs DCP's default
   vs the machine's raw pipelines, warm and cold, save, raw cuFile);
3. ``shared``: ``recipes/bench_device.py --device cuda`` (4 ranks sharing the GPU: same layout,
   tp-dim, HSDP with read-once on/off, 1->N, N->1; bytes read / needed with checksums verified);
4. ``async``: ``recipes/bench_async.py --device cuda`` (2 GiB from one GPU, default group
   ``cpu:gloo,cuda:nccl``; torch 2.11's ``DefaultStager`` cannot stage twice, and the recipe builds
   one per save there; should the default stager still fail, the step reruns with the writer's);
5. ``quick_tier``: the CPU quick tier (``make test-quick``'s selection) on the machine's torch, with
   the time left.

Then every goal of issue 33 is checked against its threshold (``GOALS``), the results go to
``OUT/gpu_check.json`` and a bar plot of measured / threshold to ``OUT/gpu_check.svg`` (no plotting
library needed), and the last line says which goals are met. Without CUDA it prints one ``SKIPPED``
line and exits 0. ``--rehearse`` runs every step on the CPU with the device path forced through the
host staging buffers (``staging="always"``) at tiny sizes, so the script is proven before its first
GPU call; its figures are CPU stand-ins and say so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUICK_MARK = "(not slow and not e2e and not full) or quick"
SKIP_LINE = "gpu-check: SKIPPED, no CUDA GPU on this machine (torch.cuda.is_available() is False)"


@dataclass
class Step:
    """One subprocess of the check."""

    name: str
    """Key in the JSON and the logs."""
    argv: list[str]
    """The command (run from the checkout)."""
    cap_s: float
    """Most seconds it may take (less when the budget runs short)."""
    result: str | None = None
    """The JSON file it writes, or its JUnit XML (tiers)."""
    fallback: list[str] | None = None
    """Run instead when the first try fails (not when it runs out of time)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment."""


@dataclass
class Goal:
    """One goal of the issue and how it is read from the steps' results."""

    name: str
    """What is measured, in words."""
    threshold: str
    """The goal, in words (``>= 0.8`` ...)."""
    test: Callable[[float], bool]
    """Whether a measured value meets it."""
    value: Callable[[dict[str, Any]], float | None]
    """The measured value from the steps' results (None: not measured)."""
    scale: float | None = None
    """Threshold as a number, for the plot (value / scale; None: pass/fail goals)."""


# -- reading the results ----------------------------------------------------------------------------


def _single(res: dict, case: str, metric: str) -> float | None:
    for r in res.get("single") or []:
        if r.get("case") == case and r.get("metric") == metric:
            return r.get("value")
    return None


def _shared_worst(res: dict, fn: Callable[[dict], float], worst: Callable = min) -> float | None:
    loads = (res.get("shared") or {}).get("loads") or {}
    vals = [fn(r) for r in loads.values()]
    return worst(vals) if vals else None


def _hsdp(res: dict) -> dict | None:
    loads = (res.get("shared") or {}).get("loads") or {}
    return next((r for name, r in loads.items() if name.startswith("hsdp")), None)


def _tier_ok(res: dict, key: str) -> float | None:
    """1: every test ran, none failed; 0: one failed; None: none ran (all skipped: no GPU) or cut short."""
    t = res.get(key)
    if not t or not t.get("tests"):
        return None
    if t["failures"] or t["errors"]:
        return 0.0
    return 1.0 if t["completed"] and t["passed"] else None


def _nccl_forms(res: dict) -> float | None:
    t = res.get("gpu_tier") or {}
    cases = {k: v for k, v in (t.get("cases") or {}).items() if "nccl" in k and "async" in k}
    if not cases or all(v == "skipped" for v in cases.values()):
        return None
    return 1.0 if all(v == "passed" for v in cases.values()) else 0.0


def _async_blocked(res: dict) -> float | None:
    a = res.get("async") or {}
    return ((a.get("median") or {}).get("ucp") or {}).get("blocked")


def _gds_vs_pipeline(res: dict) -> float | None:
    gds = _single(res, "load cold raw gds", "GB/s")
    best = max((r["value"] for r in res.get("single") or [] if r["case"].startswith("load cold raw T")), default=None)
    return gds / best if gds and best else None


GOALS = [
    Goal(
        "one GPU: warm load / best raw pipeline",
        ">= 0.8",
        lambda v: v >= 0.8,
        lambda r: _single(r, "load warm", "of raw"),
        0.8,
    ),
    Goal(
        "one GPU: cold load / best raw pipeline",
        ">= 0.9",
        lambda v: v >= 0.9,
        lambda r: _single(r, "load cold", "of raw"),
        0.9,
    ),
    Goal(
        "one GPU: warm load / DCP's default",
        ">= 10x",
        lambda v: v >= 10,
        lambda r: _single(r, "load warm", "x DCP"),
        10.0,
    ),
    Goal("one GPU: save from CUDA / raw", ">= 0.9", lambda v: v >= 0.9, lambda r: _single(r, "save", "of raw"), 0.9),
    Goal(
        "shared GPU: worst case load / raw",
        ">= 0.8",
        lambda v: v >= 0.8,
        lambda r: _shared_worst(r, lambda c: c["gbps"]["ucp"] / c["raw_gbps"]),
        0.8,
    ),
    Goal(
        "shared GPU: worst bytes read / needed, checksums verified",
        "<= 1.05",
        lambda v: v <= 1.05,
        lambda r: _shared_worst(r, lambda c: c["bytes_over_needed"]["ucp"], max),
        1.05,
    ),
    Goal(
        "HSDP: default read-once time / read-once off",
        "<= 1.05 (noise)",
        lambda v: v <= 1.05,
        lambda r: (lambda h: h["time_s"]["ucp"] / h["time_s"]["ucp_off"] if h else None)(_hsdp(r)),
        1.05,
    ),
    Goal("async save of 2 GiB from CUDA: blocked s", "<= 0.2 s", lambda v: v <= 0.2, _async_blocked, 0.2),
    Goal("async save on cuda:nccl,cpu:gloo and NCCL-only (GPU tier)", "passed", lambda v: v == 1.0, _nccl_forms),
    Goal("GPU tier", "passed", lambda v: v == 1.0, lambda r: _tier_ok(r, "gpu_tier")),
    Goal("CPU quick tier on this torch", "passed", lambda v: v == 1.0, lambda r: _tier_ok(r, "quick_tier")),
    Goal(
        "raw cuFile (GDS) / best raw cold pipeline (informs a GDS reader)",
        "> 1.0 to build one",
        lambda v: v > 1.0,
        _gds_vs_pipeline,
        1.0,
    ),
]


def junit(path: Path) -> dict:
    """Counts and per-case outcome of a JUnit XML file (pytest's ``--junitxml``)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    cases: dict[str, str] = {}
    for s in suites:
        for c in s.iter("testcase"):
            kinds = {ch.tag for ch in c}
            out = (
                "failed"
                if "failure" in kinds
                else "error"
                if "error" in kinds
                else "skipped"
                if "skipped" in kinds
                else "passed"
            )
            cases[f"{c.get('classname')}::{c.get('name')}"] = out
    count = lambda k: sum(1 for v in cases.values() if v == k)  # noqa: E731
    return {
        "tests": len(cases),
        "passed": count("passed"),
        "failures": count("failed"),
        "errors": count("error"),
        "skipped": count("skipped"),
        "cases": cases,
    }


# -- running ----------------------------------------------------------------------------------------


def steps(out: Path, scratch: Path, rehearse: bool, quick_paths: list[str]) -> list[Step]:
    """The commands, in order; ``rehearse``: the same ones on the CPU, staging forced, tiny sizes."""
    py = sys.executable
    if rehearse:
        # (shared: 4 MiB tensors, so a rank's quarter of a 1-rank save is one whole checksum block)
        dev, single, shared, asy, reps, backend = "cpu", "8 --tensors 4", "32", "8 --reps 1", 1, "gloo"
        stage = ["--staging", "always"]
    else:  # 4 GiB in one process and 2 GiB of async save as on 2026-11-25; 1 GiB on 4 ranks
        dev, single, shared, asy, reps, backend = "cuda", "4096 --tensors 32", "1024", "2048 --reps 3", 2, None
        stage = []
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q", "-ra"]
    async_cmd = [py, "recipes/bench_async.py", "--device", dev, "--world", "1", "--mib", *asy.split()]
    async_cmd += ["--backend", backend or "cpu:gloo,cuda:nccl", "--out", str(scratch / "async")]
    async_cmd += ["--json", str(out / "async.json")]
    return [
        Step("gpu_tier", [*pytest, "--gpu", "tests/gpu", f"--junitxml={out}/gpu_tier.xml"], 120, f"{out}/gpu_tier.xml"),
        Step(
            "single",
            [py, "recipes/bench_single.py", "--device", dev, "--mib", *single.split(), "--reps", str(reps)]
            + ["--dir", str(scratch / "single"), *stage, "--json", f"{out}/single.json"],
            170,
            f"{out}/single.json",
        ),
        Step(
            "shared",
            [py, "recipes/bench_device.py", "--device", dev, "--mib", shared, "--tensors", "8", "--reps", str(reps)]
            + ["--no-async-save", "--out", str(scratch / "shared"), *stage, "--json", f"{out}/shared.json"],
            150,
            f"{out}/shared.json",
        ),
        Step(
            "async",
            [*async_cmd, "--stager", "default"],
            100,
            f"{out}/async.json",
            fallback=[*async_cmd, "--stager", "writer"],
        ),
        Step(
            "quick_tier",
            [*pytest, "-m", QUICK_MARK, *quick_paths, f"--junitxml={out}/quick_tier.xml"],
            300,
            f"{out}/quick_tier.xml",
        ),
    ]


def _run(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int | None, bool]:
    """Run ``argv`` in its own process group; past ``timeout`` it gets SIGINT (pytest then writes its
    JUnit XML of what ran), 20 s later the group is killed. Returns (exit code, timed out)."""
    with open(log, "w") as f:
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return None, True
        finally:
            if p.poll() is None:  # an exception here (KeyboardInterrupt): leave nothing running
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_step(step: Step, left: float, logs: Path, env: dict[str, str]) -> dict:
    """Run one step within ``left`` seconds (its fallback, if it fails, in what is left); its output
    goes to ``logs/NAME.log``."""
    limit = max(1.0, min(step.cap_s, left))
    rec: dict[str, Any] = {"argv": step.argv, "limit_s": round(limit, 1), "rc": None, "timed_out": False}
    t0 = time.perf_counter()
    tries = [step.argv] + ([step.fallback] if step.fallback else [])
    for attempt, argv in enumerate(tries):
        remaining = limit - (time.perf_counter() - t0)
        if remaining < 5:
            break
        log = logs / f"{step.name}{'.fallback' if attempt else ''}.log"
        rc, timed_out = _run(argv, {**env, **step.env}, log, remaining)
        rec.update(rc=rc, timed_out=timed_out, log=str(log), tail=log.read_text(errors="replace").splitlines()[-6:])
        if attempt:
            rec["fallback_used"] = argv
        if rc == 0 or timed_out:
            break
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def read_result(step: Step, rec: dict) -> Any:
    if step.result is None or not Path(step.result).exists():
        return None
    if step.result.endswith(".xml"):
        try:
            out = junit(Path(step.result))
        except ET.ParseError:
            return None
        out["completed"] = not rec.get("timed_out")
        return out
    data = json.loads(Path(step.result).read_text())
    return data


def preflight(env: dict[str, str]) -> dict:
    """The interpreter, torch, the device, and whether ucp_dcp imports (with the untested-torch
    override only when it refuses this torch: recorded)."""
    code = (
        "import json, platform, torch; d = torch.cuda.is_available(); "
        "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, 'cuda': d, "
        "'device': torch.cuda.get_device_name(0) if d else 'CPU', 'cuda_version': torch.version.cuda, "
        "'cores': len(__import__('os').sched_getaffinity(0))}))"
    )
    info = json.loads(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
        .stdout.strip()
        .splitlines()[-1]
    )
    missing = []
    for mod in ("numpy", "xxhash", "pytest", "hypothesis"):
        if subprocess.run([sys.executable, "-c", f"import {mod}"], env=env, capture_output=True).returncode:
            missing.append(mod)
    info["missing_modules"] = missing
    imp = subprocess.run([sys.executable, "-c", "import ucp_dcp"], env=env, capture_output=True, text=True, cwd=ROOT)
    info["ucp_dcp_import"] = "ok" if imp.returncode == 0 else imp.stderr.strip().splitlines()[-1:]
    if imp.returncode and "UnsupportedTorchError" in imp.stderr:
        env["UCP_DCP_ALLOW_UNTESTED_TORCH"] = "1"
        info["untested_torch_override"] = True
    return info


def evaluate(results: dict) -> list[dict]:
    out = []
    for g in GOALS:
        try:
            v = g.value(results)
        except (KeyError, TypeError, ZeroDivisionError):
            v = None
        out.append(
            {"goal": g.name, "threshold": g.threshold, "value": v, "met": None if v is None else bool(g.test(v))}
        )
    return out


def svg_plot(goals: list[dict], title: str, path: Path) -> None:
    """Bars of measured / threshold per goal (1.0 = the goal; pass/fail goals as 0 or 1): an SVG
    needs no plotting library on the GPU machine."""
    scales = {g.name: g.scale for g in GOALS}
    rows = []
    for g in goals:
        v, s = g["value"], scales.get(g["goal"])
        if v is None:
            rows.append((g, None))
        elif s is None:
            rows.append((g, float(v)))
        elif "<=" in g["threshold"]:
            rows.append((g, s / v if v else 0.0))  # lower is better: show threshold / value
        else:
            rows.append((g, v / s))
    w, left, bar, top = 900, 430, 22, 40
    h = top + len(rows) * (bar + 8) + 30
    full = 400  # pixels for 2x the goal
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<text x="10" y="20" font-size="14">{_esc(title)}</text>',
        f'<line x1="{left + full // 2}" y1="{top - 5}" x2="{left + full // 2}" y2="{h - 25}" stroke="black" '
        'stroke-dasharray="4"/>',
        f'<text x="{left + full // 2 - 30}" y="{h - 8}">goal (1.0)</text>',
    ]
    for i, (g, x) in enumerate(rows):
        y = top + i * (bar + 8)
        label = f"{g['goal']} ({g['threshold']})"
        parts.append(f'<text x="10" y="{y + 15}">{_esc(label[:70])}</text>')
        if x is None:
            parts.append(f'<text x="{left}" y="{y + 15}" fill="gray">not measured</text>')
            continue
        color = "#2a9d55" if g["met"] else "#d1495b"
        width = max(2, min(full, int(x * full / 2)))
        value = g["value"]
        parts.append(f'<rect x="{left}" y="{y}" width="{width}" height="{bar}" fill="{color}"/>')
        parts.append(f'<text x="{left + width + 5}" y="{y + 15}">{value:.3g}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def summary_line(info: dict, goals: list[dict], rehearse: bool) -> str:
    met = [g for g in goals if g["met"]]
    missed = [g for g in goals if g["met"] is False]
    unknown = [g for g in goals if g["met"] is None]

    def fmt(g: dict) -> str:
        v = g["value"]
        return f"{g['goal']} {v:.3g} ({g['threshold']})" if isinstance(v, (int, float)) else g["goal"]

    head = (
        "GPU CHECK REHEARSAL (CPU stand-in figures, not GPU figures)"
        if rehearse
        else f"GPU CHECK {info['device']}, torch {info['torch']}"
    )
    return (
        f"{head}: {len(met)} of {len(goals)} goals met; met: {'; '.join(map(fmt, met)) or 'none'} | NOT met: "
        f"{'; '.join(map(fmt, missed)) or 'none'} | not measured: {'; '.join(g['goal'] for g in unknown) or 'none'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu_check", help="where the JSON, the plot and the logs go")
    ap.add_argument(
        "--budget",
        type=float,
        default=480,
        help="seconds for all steps together (default 480: with the machine's start, a rerun still fits the "
        "15 minutes of device time a session gets)",
    )
    ap.add_argument(
        "--scratch",
        default=str(ROOT / "runs" / "gpu_check_scratch"),
        help="checkpoints and raw files (GiBs; removed at the end): on the disk, never under --out",
    )
    ap.add_argument("--rehearse", action="store_true", help="run every step on the CPU at tiny sizes")
    ap.add_argument(
        "--quick-paths",
        nargs="*",
        default=None,
        help="test paths of the quick tier (default: all; --rehearse: tests/storage/test_threads.py)",
    )
    ap.add_argument("--only", nargs="*", default=None, help="run only these steps (by name)")
    a = ap.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "dev"), env.get("PYTHONPATH", "")) if p)
    if not a.rehearse:
        try:
            import torch
        except ImportError as e:
            raise SystemExit(
                f"gpu-check: {sys.executable} cannot import torch ({e}): run it with PYTHON=<a Python with torch>"
            ) from None
        if not torch.cuda.is_available():
            print(SKIP_LINE)
            return 0
    t_start = time.perf_counter()
    out = Path(a.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    info = preflight(env)
    info.update(date=datetime.date.today().isoformat(), host=platform.node(), rehearse=a.rehearse)
    print(f"gpu-check: {json.dumps({k: v for k, v in info.items() if k != 'host'})}", flush=True)
    quick = a.quick_paths if a.quick_paths is not None else (["tests/storage/test_threads.py"] if a.rehearse else [])
    scratch = Path(a.scratch).resolve()
    if scratch == out or out in scratch.parents:
        raise SystemExit(f"gpu-check: --scratch {scratch} must not be under --out {out} (GiBs would be fetched)")
    plan = [s for s in steps(out, scratch, a.rehearse, quick) if a.only is None or s.name in a.only]
    records: dict[str, dict] = {}
    results: dict[str, Any] = {}
    for s in plan:
        if s.result:
            Path(s.result).unlink(missing_ok=True)
        left = a.budget - (time.perf_counter() - t_start)
        rec = run_step(s, left, logs, env)
        records[s.name] = rec
        results[s.name] = read_result(s, rec)
        state = "timed out" if rec.get("timed_out") else f"rc {rec.get('rc')}"
        print(
            f"gpu-check: {s.name}: {state} in {rec['seconds']} s (limit {rec['limit_s']} s); log {rec['log']}",
            flush=True,
        )
    shutil.rmtree(scratch, ignore_errors=True)
    goals = evaluate(results)
    line = summary_line(info, goals, a.rehearse)
    report = {
        "info": info,
        "steps": records,
        "results": results,
        "goals": goals,
        "summary": line,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    svg_plot(goals, line.split(":")[0] + f" ({info['date']})", out / "gpu_check.svg")
    for g in goals:
        v = g["value"]
        shown = f"{v:.3g}" if isinstance(v, (int, float)) else "not measured"
        state = {True: "met", False: "NOT met", None: "-"}[g["met"]]
        print(f"  {g['goal']:<66} {shown:>12}  goal {g['threshold']:<20} {state}")
    print(f"gpu-check: {out / 'gpu_check.json'}, {out / 'gpu_check.svg'}, {report['seconds']} s")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
