"""Command line: ``python -m ucp_dcp inspect CKPT [--json]``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ucp_dcp", description="ucp_dcp tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="source topology and per-atom shape, dtype, kind, chunks, bytes")
    ins.add_argument("checkpoint", help="checkpoint folder (or fsspec URL) of any DCP checkpoint")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    a = ap.parse_args(argv)
    from .errors import UCPError
    from .inspect import format_summary, read_metadata, summarize

    try:
        s = summarize(read_metadata(a.checkpoint))
    except FileNotFoundError as e:
        print(f"error: no DCP checkpoint at {a.checkpoint} ({e})", file=sys.stderr)
        return 2
    except UCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(s, indent=1) if a.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
