"""Plot the records ``recipes/benchmark.py --json`` wrote.

    python recipes/plot_benchmark.py runs/benchmark.json docs/benchmark.png

Three panels: load time per resharding case (UCP, UCP with checksum verification, DCP, and DCP's
same-layout load as the line to beat), bytes read / bytes needed, and rank-0 planning time
against simulated ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _get(records: list[dict], case: str, metric: str) -> dict | None:
    return next((r for r in records if r["case"] == case and r["metric"] == metric), None)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = json.loads(Path(argv[0]).read_text())
    cases = [
        r["case"].removeprefix("load ") for r in records if r["metric"] == "time_s" and r["case"].startswith("load ")
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    # load time
    ax = axes[0]
    x = range(len(cases))
    w = 0.27
    ucp = [_get(records, f"load {c}", "time_s")["ucp"] for c in cases]
    ver = [_get(records, f"load {c}", "time_with_checksums_s")["ucp"] for c in cases]
    dcp = [_get(records, f"load {c}", "time_s")["dcp"] for c in cases]
    same = _get(records, f"load {cases[0]}", "time_vs_dcp_same_layout")["dcp"]
    ax.bar([i - w for i in x], ucp, w, label="UCP")
    ax.bar(list(x), ver, w, label="UCP, checksums verified")
    ax.bar([i + w for i in x], dcp, w, label="DCP default")
    ax.axhline(same, color="k", ls="--", lw=1, label="DCP same-layout 4→4")
    ax.set_xticks(list(x), cases, rotation=30, ha="right")
    ax.set_ylabel("load time (s, median, warm cache)")
    ax.set_title("Resharding load")
    ax.legend(fontsize=8)
    # bytes read / needed
    ax = axes[1]
    ub = [_get(records, f"load {c}", "bytes_read_over_needed")["ucp"] for c in cases]
    db = [_get(records, f"load {c}", "bytes_read_over_needed")["dcp"] for c in cases]
    ax.bar([i - w / 2 for i in x], ub, w, label="UCP")
    ax.bar([i + w / 2 for i in x], db, w, label="DCP default")
    ax.axhline(1.05, color="k", ls="--", lw=1, label="target 1.05")
    ax.set_xticks(list(x), cases, rotation=30, ha="right")
    ax.set_ylabel("bytes read / bytes needed")
    ax.set_title("Read amplification")
    ax.legend(fontsize=8)
    # planning
    ax = axes[2]
    for phase, marker in (("save", "o"), ("load", "s")):
        pts = sorted(
            (int(r["case"].split()[2]), r["ucp"], r["dcp"])
            for r in records
            if r["metric"] == "rank0_cpu_s"
            and r["case"].startswith(f"plan {phase} ")
            and not r["case"].endswith("cached")
        )
        if not pts:
            continue
        ranks = [p[0] for p in pts]
        ax.plot(ranks, [p[1] for p in pts], marker + "-", label=f"UCP {phase}")
        ax.plot(ranks, [p[2] for p in pts], marker + "--", label=f"DCP {phase}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("simulated ranks (1000 tensors each)")
    ax.set_ylabel("rank-0 planning CPU time (s)")
    ax.set_title("Planning (DCP past 1024 ranks: linear extrapolation)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
