"""One rank fails during a load: does every rank end, within seconds, with the true cause?

    python recipes/chaos.py [--worlds 2,4] [--modes hosts,off] [--only FAULT,...] [--peer-timeout 8]

Each case (:mod:`ucp_dev.testing.chaos`) is a fresh gloo job on two simulated hosts whose collective
timeout (300 s) is far above the bound: one rank finds a checksum mismatch, a missing file, a dtype
that overflows, or raises, dies or stops at a step of ``read_data`` or of a save's or load's planning
and writes; ``read_once`` on and off, 2 and 4 ranks; the last rank, and the coordinator (rank 0: killed
with the store its process hosts, or frozen beside a launcher's store). A case passes when every rank not stopped on purpose ends within the bound with an error of the
cause's class, naming the failing rank. The last line is ``CHAOS OK: N cases, 0 hangs, 0 aborts``
(exit 0), or ``CHAOS FAILED: ...`` (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from ucp_dcp.progress import StepProgress
from ucp_dev.testing.chaos import cases, run_case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--modes", default="hosts,off")
    ap.add_argument(
        "--only", default=None, help="run only the faults containing one of these (comma-separated: exit@,dtype)"
    )
    ap.add_argument("--peer-timeout", type=float, default=8.0)
    ap.add_argument("--coordinator", action="store_true", help="only the cases where rank 0 (DCP's coordinator) fails")
    args = ap.parse_args(argv)
    todo = [
        dataclasses.replace(c, peer_timeout=args.peer_timeout)
        for c in cases(tuple(int(w) for w in args.worlds.split(",")), tuple(args.modes.split(",")))
        if (args.only is None or any(part in c.fault for part in args.only.split(",")))
        and (not args.coordinator or c.rank == 0)
    ]
    hangs = aborts = failed = 0
    progress = StepProgress("chaos", len(todo), "cases")  # stderr, when it is a terminal
    for case in todo:
        t0 = time.monotonic()
        out = run_case(case)
        wall = time.monotonic() - t0
        hangs += len(out.hangs)
        aborts += len(out.aborts)
        failed += not out.ok
        ends = ", ".join(f"{r}:{rep['error']} {rep['seconds']:.1f}s" for r, rep in sorted(out.results.items()))
        print(
            f"{'ok  ' if out.ok else 'FAIL'} {case.name:<44} {out.seconds:5.1f} s (case {wall:.0f} s)  [{ends}]",
            flush=True,
        )
        for p in out.problems + [f"rank {r} hung" for r in out.hangs] + [f"rank {r} aborted" for r in out.aborts]:
            print(f"       {p}", flush=True)
        progress(case.name)
    summary = f"{len(todo)} cases, {hangs} hangs, {aborts} aborts"
    if failed or hangs or aborts:
        print(f"CHAOS FAILED: {summary}, {failed} failed")
        return 1
    print(f"CHAOS OK: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
