"""``python -m ucp_dcp export --to torchtitan|hf CKPT OUT ...`` (also ``ucp-dcp export``).

The way back: a checkpoint saved with ucp_dcp rewritten in the format of the framework it came
from, readable with that framework's own checkpointing alone (no ucp_dcp in the resuming job).
Targets: ``torchtitan`` (:mod:`ucp_dcp.torchtitan.to_stock`, docs/torchtitan.md "Way back to stock
torchtitan") and ``hf``: the model as a Hugging Face safetensors folder (:func:`ucp_dcp.sources.hf.export_hf`,
docs/huggingface.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import UCPError

__all__ = ["add_parser", "run"]

_EPILOG = """The torchtitan job's own flags follow the known options: --module, --config and any --section.field
(--hf_assets_path, --dataloader.*, --training.seq_len, --training.local_batch_size, ...). Its parallelism flags are
not used to build anything (an explicit data-parallel degree must equal --dp): the export is unsharded, and stock
torchtitan reshards it at load to any FSDP/TP/PP layout whose data-parallel degree (dp_replicate x dp_shard) is --dp.

--to hf writes the model atoms as a Hugging Face folder (safetensors shards, index, config.json) under a declared
mapping: --mapping torchtitan with the job's --module and --config (llama3, qwen3), or --mapping package.module:callable
returning an ucp_dcp.sources.hf.HFMapping (your model's: e.g. mypkg.hf:mapping). Runs under torchrun too (each rank copies a share of the atoms).

examples:
  python -m ucp_dcp export --to hf outputs/checkpoint/step-100 hf-out --mapping torchtitan --module llama3 \\
      --config llama3_8b --dtype bfloat16
  python -m ucp_dcp export --to torchtitan outputs/checkpoint stock/checkpoint --dp 8 \\
      --module llama3 --config llama3_8b --hf_assets_path ./assets/hf/Llama-3.1-8B
  then resume stock torchtitan with --checkpoint.initial_load_path stock/checkpoint/step-<k>
  --checkpoint.no-initial_load_model_only (printed at the end)"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export",
        allow_abbrev=False,
        help="rewrite a ucp_dcp checkpoint in a framework's stock format (the way back)",
        description="Write CKPT (saved with ucp_dcp's torchtitan option) as a stock torchtitan "
        "checkpoint OUT/step-<k> that torchtitan's own CheckpointManager resumes from: "
        "model, optimizer state and param groups, LR scheduler, train state and the data "
        "position for --dp data-parallel ranks. One process, no GPU.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--to", required=True, choices=("torchtitan", "hf"), help="the target format")
    p.add_argument("checkpoint", help="a checkpoint folder, or a torchtitan checkpoint/ folder (its latest step)")
    p.add_argument("out", help="output folder (torchtitan's checkpoint/ folder layout: OUT/step-<k> is written)")
    p.add_argument(
        "--dp",
        type=int,
        default=None,
        help="--to torchtitan (required): data-parallel degree of the stock job that resumes (one "
        "dataloader entry per rank)",
    )
    p.add_argument(
        "--mapping",
        default=None,
        help="--to hf (required): the model family's HF names and row orders: 'torchtitan' (with the "
        "job's --module and --config) or 'package.module:callable' returning an HFMapping, e.g. "
        "mypkg.hf:mapping",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="--to hf: dtype of the exported tensors (default: as saved)",
    )
    p.add_argument("--max-shard-size", type=int, default=5 << 30, help="--to hf: most data bytes per file")
    p.add_argument("--overwrite", action="store_true", help="--to hf: replace an existing OUT")
    p.add_argument("--step", type=int, default=None, help="in a torchtitan checkpoint/ folder: export step-N")
    p.add_argument(
        "--no-dataloader",
        action="store_true",
        help="write no data position (resume with --checkpoint.exclude_from_loading dataloader; the "
        "stock data stream restarts)",
    )
    return p


def run(a: argparse.Namespace, extra: list[str]) -> int:
    """Exit status: 0 written; 2 refused (the reason on stderr, nothing written)."""
    if a.to == "hf":
        return _run_hf(a, extra)
    if a.dp is None:
        print("error: export --to torchtitan needs --dp", file=sys.stderr)
        return 2
    try:
        from ..torchtitan.to_stock import export_to_torchtitan

        report = export_to_torchtitan(a.checkpoint, a.out, extra, dp=a.dp, step=a.step, dataloader=not a.no_dataloader)
    except UCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: export --to torchtitan needs torchtitan: {e}", file=sys.stderr)
        return 2
    print(report.format())
    return 0


def _run_hf(a: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from ..sources.hf import export_hf

    try:
        mapping = _hf_mapping(a.mapping, extra)
        st = export_hf(
            a.checkpoint,
            a.out,
            mapping,
            dtype=getattr(torch, a.dtype) if a.dtype else None,
            max_shard_bytes=a.max_shard_size,
            overwrite=a.overwrite,
        )
    except UCPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"exported {st.tensors} HF tensors to {a.out}: {st.chunks} saved chunks copied, {st.bytes_read} bytes "
        f"read, {st.bytes_written} written in {st.seconds:.2f} s (this rank)"
    )
    return 0


def _hf_mapping(name: str | None, extra: list[str]) -> Any:
    """``torchtitan`` (the job's --module/--config follow) or ``package.module:callable`` returning an
    HFMapping (your own code, imported as named: nothing comes from the checkpoint)."""
    if name is None:
        raise UCPError("export --to hf needs --mapping", hint="torchtitan, or package.module:callable")
    if name == "torchtitan":
        try:
            from ..torchtitan.to_stock import mapping_from_flags
        except ImportError as e:
            raise UCPError(f"--mapping torchtitan needs torchtitan: {e}") from None
        return mapping_from_flags(extra)
    if extra:
        raise UCPError(f"unexpected arguments for --mapping {name}: {extra}")
    module, _, attr = name.partition(":")
    if not attr:
        raise UCPError(f"--mapping {name!r}: expected 'torchtitan' or 'package.module:callable'")
    import importlib

    from ..sources.hf.mapping import HFMapping

    try:
        mapping = getattr(importlib.import_module(module), attr)()
    except (ImportError, AttributeError) as e:
        raise UCPError(f"--mapping {name}: {e}") from None
    if not isinstance(mapping, HFMapping):
        raise UCPError(f"--mapping {name} returned a {type(mapping).__name__}, not an HFMapping")
    return mapping
