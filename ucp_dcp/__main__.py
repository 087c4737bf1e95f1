"""Command line: ``python -m ucp_dcp inspect CKPT [--json]`` and ``python -m ucp_dcp verify CKPT [--json]``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ucp_dcp", description="ucp_dcp tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="source topology, integrity, and per-atom shape, dtype, kind, chunks, bytes")
    ins.add_argument("checkpoint", help="checkpoint folder (or fsspec URL) of any DCP checkpoint")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument("--trust", action="store_true",
                     help="unpickle metadata without the allow-list (only for checkpoints from a trusted source)")
    ver = sub.add_parser("verify", help="re-hash every byte of a checkpoint against its checksums; exit 0 only if all match")
    ver.add_argument("checkpoint", help="local checkpoint folder")
    ver.add_argument("--json", action="store_true", help="machine-readable output")
    ver.add_argument("--threads", type=int, default=None, help="files hashed in parallel (default: cores, at most 8)")
    ver.add_argument("--trust", action="store_true", help="as for inspect")
    a = ap.parse_args(argv)
    from .errors import UCPError

    if a.cmd == "verify":
        from .verify import format_report, verify

        report = verify(a.checkpoint, threads=a.threads, trust=a.trust)
        print(json.dumps(report.to_json(), indent=1) if a.json else format_report(report))
        return report.exit_code
    from .summary import format_summary, open_path, summarize

    try:
        md, integrity = open_path(a.checkpoint, trust=a.trust)
        s = summarize(md, integrity)
    except UCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(s, indent=1) if a.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
