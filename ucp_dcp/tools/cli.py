"""Command line: ``python -m ucp_dcp inspect CKPT [--json] [--all] [--step N] [--no-values]``,
``python -m ucp_dcp verify CKPT [--json]``, ``python -m ucp_dcp plan CKPT --target ...`` (docs/plan.md) and
``python -m ucp_dcp export --to torchtitan CKPT OUT --dp N [job flags]`` (docs/torchtitan.md) and
``python -m ucp_dcp quickstart [CKPT]`` (the README's quickstart, :mod:`ucp_dcp.examples.quickstart`). The ``ucp-dcp``
script is the same command line under its own name."""

from __future__ import annotations

import argparse
import json
import os
import sys


def prog_name(argv0: str) -> str:
    """How the user called us, for usage lines: ``ucp-dcp`` from the console script (any path to it),
    ``python -m ucp_dcp`` from ``__main__.py`` (argv[0] is then that file's path)."""
    name = os.path.basename(argv0)
    return "python -m ucp_dcp" if name in ("__main__.py", "-m", "-c", "") else name


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog or prog_name(sys.argv[0]), description="ucp_dcp tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser(
        "inspect",
        help="source topology, integrity, and per-atom shape, dtype, kind, chunks, bytes and small values; "
        "the steps of a torchtitan checkpoint/ folder",
        description="Exit status: 0 shown; 1 shown, but a value failed its checksum or could not be read (or, for a "
        "torchtitan folder, a committed step is damaged); 2 no checkpoint (or no such --step).",
    )
    ins.add_argument(
        "checkpoint",
        help="checkpoint folder (or fsspec URL) of any DCP checkpoint, or a torchtitan "
        "checkpoint/ folder of step-N checkpoints (lists them)",
    )
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument("--step", type=int, default=None, help="in a torchtitan checkpoint/ folder: show step-N in full")
    ins.add_argument(
        "--all", action="store_true", help="one row per saved atom (optimizer param_groups rows are folded by default)"
    )
    ins.add_argument(
        "--no-values", action="store_true", help="do not read small values from the data files (metadata only)"
    )
    ins.add_argument(
        "--trust",
        action="store_true",
        help="unpickle metadata without the allow-list (only for checkpoints from a trusted source); "
        "values are never decoded with more than torch.load(weights_only=True)",
    )
    ver = sub.add_parser(
        "verify", help="re-hash every byte of a checkpoint against its checksums; exit 0 only if all match"
    )
    ver.add_argument("checkpoint", help="local checkpoint folder")
    ver.add_argument("--json", action="store_true", help="machine-readable output")
    ver.add_argument("--threads", type=int, default=None, help="files hashed in parallel (default: cores, at most 8)")
    ver.add_argument("--trust", action="store_true", help="as for inspect")
    from .dryrun.command import add_parser as add_plan_parser

    add_plan_parser(sub)
    from .export import add_parser as add_export_parser

    add_export_parser(sub)
    qs = sub.add_parser(
        "quickstart",
        help="the README's quickstart: an FSDP2 model and AdamW saved by 2 CPU ranks, loaded by 4, compared bitwise",
        description="Writes CHECKPOINT/ (the checkpoint) and CHECKPOINT.ref.pt beside it (the same state by plain "
        "torch.save, what the load compares with). Exit status: 0 every entry bitwise, 1 otherwise.",
    )
    from ..examples.quickstart import add_arguments as add_quickstart_arguments

    add_quickstart_arguments(qs)
    a, extra = ap.parse_known_args(argv)  # `plan --target titan` passes the Trainer's own flags through
    if extra and a.cmd not in ("plan", "export"):  # so does `export --to torchtitan`
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.cmd == "export":
        from .export import run as run_export

        return run_export(a, extra)
    if a.cmd == "plan":
        from .dryrun.command import run

        return run(a, extra)
    if a.cmd == "quickstart":
        from ..examples.quickstart import run as run_quickstart

        return run_quickstart(a.checkpoint, a.save_ranks, a.load_ranks)
    if a.cmd == "verify":
        from .verify import format_report, verify

        report = verify(a.checkpoint, threads=a.threads, trust=a.trust)
        print(json.dumps(report.to_json(), indent=1) if a.json else format_report(report))
        return report.exit_code
    return _inspect(a)


def _inspect(a: argparse.Namespace) -> int:
    from ..errors import UCPError
    from ..storage.opening import open_path, step_folders
    from .summary import format_steps, format_summary, summarize, summarize_steps

    path = a.checkpoint
    try:
        steps = step_folders(path)
        if a.step is not None:
            if steps is None:
                print(
                    f"error: --step: {path} is not a torchtitan checkpoint folder (no step-N subfolders)",
                    file=sys.stderr,
                )
                return 2
            names = dict(steps)
            if a.step not in names:
                print(
                    f"error: no step-{a.step} in {path}; steps: {', '.join(str(n) for n, _ in steps)}", file=sys.stderr
                )
                return 2
            path = f"{str(path).rstrip('/')}/{names[a.step]}"
        elif steps is not None:
            d = summarize_steps(path, trust=a.trust)
            _print(json.dumps(d, indent=1) if a.json else format_steps(d))
            return 1 if any(r["status"] == "damaged" for r in d["steps"] if r["committed"]) else 0
        md, integrity = open_path(path, trust=a.trust)
        s = summarize(md, integrity, path=None if a.no_values else path)
    except UCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print(json.dumps(s, indent=1) if a.json else format_summary(s, all_rows=a.all))
    return 1 if s["value_errors"] else 0


def _print(text: str) -> None:
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `inspect ... | head`: the reader is gone; so is the need to print
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
