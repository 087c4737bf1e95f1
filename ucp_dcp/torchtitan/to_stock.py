"""A ucp_dcp torchtitan checkpoint written back in stock torchtitan's format (``ucp_dcp export --to torchtitan``).

Stock torchtitan cannot resume a checkpoint saved with the option: the global-cursor dataloader
state has no ``dataloader.dp_rank_<r>``, fused ``wqkv`` moments are stored as ``wq``/``wk``/``wv``
atoms, and the param-group entries are keyed by those atoms. The export runs in one process, with
no process group (DCP's no-PG mode), the way torchtitan writes a seed checkpoint:

1. the job (torchtitan's own flags) is built at world size 1 with real CPU tensors and no
   parallelism -- model, optimizers (state created by torchtitan's zero step), LR schedulers and a
   train state;
2. the checkpoint is loaded into it by ``UCPCheckpointManager``'s own planner options
   (``UCPLoadPlanner`` + ``UCPFileSystemReader``): the ``Fused`` rule turns the ``wq``/``wk``/``wv``
   atoms and their moments back into the fused parameter and its moments, the per-atom param-group
   entries back into the fused parameter's, ``train_state.ntokens_seen`` into the job total;
3. stock ``CheckpointManager`` over the same objects writes it with ``dcp.save`` (default planner,
   ``FileSystemWriter``) to ``OUT/step-<k>``: model keys at the top level (torchtitan's own hook
   splits ``wqkv`` into ``wq``/``wk``/``wv``), fused moments, FQN-keyed param groups, LR scheduler,
   train state, and one ``dataloader.dp_rank_<r>`` per data-parallel rank of the resuming job.

Every saved tensor is unsharded, so stock DCP reshards it at load (any FSDP/TP/PP layout).

The data position (global-cursor loader state). torchtitan's text loader at data-parallel degree
``N`` splits the dataset into ``N`` contiguous slices (``split_dataset_by_node``) and each rank reads
its own, while the global cursor reads the whole dataset in order and deals windows round robin.
At ``N = 1`` the stock loader reads that same stream: its state is the next document and the rest
of the current one in its token buffers, as a stock save would leave it. At ``N > 1`` no position in
the ranks' slices continues the stream, so each rank's windows of the rest of the current epoch
are written into its token buffers and its slice is marked read; this is bounded
(:data:`~ucp_dcp.torchtitan.stock_loader.BUFFER_COPIES`) and refused beyond. Either way the stock job takes exactly the windows the
run would have taken, step by step, to the end of the epoch the cursor is in; after it, stock
torchtitan follows its own epoch order (``Dataset.shuffle(seed=42 + epoch)``, per slice), not the
global cursor's seeded permutation, and a cursor already past epoch 0 is refused. The export checks
the next global batch of the stock loaders it wrote against the global-cursor loader's. Per-rank
stock loader state in the checkpoint (the checkpointer option without the global-cursor loader) is
copied as it is, at its own degree only. ``dataloader=False`` writes no loader state: torchtitan
then resumes with ``--checkpoint.exclude_from_loading dataloader`` and restarts its data stream.

Memory: the whole unsharded training state (parameters and optimizer moments) is held in this
process's CPU memory, as for a torchtitan seed checkpoint.

The job at world size 1 is built by :mod:`ucp_dcp.torchtitan.to_stock_job`, the dataloader entries come
from :mod:`ucp_dcp.torchtitan.to_stock_data`; this module runs the steps in order (refusals, build,
load, write) and fills the report.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import UCPError
from ._compat import flattened_model_states_sd, states_to_load
from .job import job_config, quiet
from .to_stock_data import Captured, dataloader_entries
from .to_stock_job import build_job, check_degree, mapping_from_flags, parse_flags

__all__ = ["ExportReport", "export_to_torchtitan", "mapping_from_flags", "resolve_checkpoint"]

logger = logging.getLogger(__name__)


@dataclass
class ExportReport:
    """What an export read and wrote (``format()`` is the CLI's text)."""

    source: str
    """The checkpoint read (a ``step-N`` folder)."""
    out: str
    """The output folder; the checkpoint is written to its ``step-<step>``."""
    step: int
    """The training step of the checkpoint."""
    dp: int
    """The data-parallel degree of the job that resumes."""
    model_tensors: int = 0
    """Tensors in the model state written."""
    optimizer_tensors: int = 0
    """Optimizer state tensors written."""
    param_groups: int = 0
    """FQN-keyed param-group entries written."""
    lr_scheduler: Any = None
    """The LR schedulers' state written."""
    train_state: dict[str, Any] = field(default_factory=dict)
    """The train state written (``ntokens_seen`` is each rank's share)."""
    ntokens_total: int | None = None
    """The job's ``ntokens_seen`` as the checkpoint holds it, before the share."""
    dataloader: str = ""
    """What was written for the dataloader, in words."""
    dataloader_written: bool = True
    """False: no dataloader state (the resume excludes it from loading)."""
    bytes_written: int = 0
    """Bytes of the files written."""
    seconds: float = 0.0
    """Wall time of the whole export."""

    def resume_flags(self) -> list[str]:
        flags = [
            "--checkpoint.initial_load_path",
            os.path.abspath(self.out_step),
            "--checkpoint.no-initial_load_model_only",
        ]
        if not self.dataloader_written:
            flags += ["--checkpoint.exclude_from_loading", "dataloader"]
        return flags

    @property
    def out_step(self) -> str:
        return os.path.join(self.out, f"step-{self.step}")

    def format(self) -> str:
        ts = self.train_state
        share = ""
        if self.ntokens_total is not None:
            share = (
                f", ntokens_seen={ts.get('ntokens_seen')} per data-parallel rank (the job's {self.ntokens_total} "
                f"over {self.dp}; torchtitan sums the ranks' counts)"
            )
        lines = [
            f"export {self.source} -> {self.out_step}: stock torchtitan, data-parallel degree {self.dp}",
            f"  model        {self.model_tensors} tensors, unsharded (fused wqkv split into wq/wk/wv by torchtitan's "
            "own state-dict hook)",
            f"  optimizer    {self.optimizer_tensors} state tensors (fused wqkv moments), {self.param_groups} "
            "FQN-keyed param-group entries",
            f"  lr_scheduler {self.lr_scheduler}",
            f"  train_state  step={ts.get('step')}{share}",
            f"  dataloader   {self.dataloader}",
            f"wrote {self.bytes_written / 2**20:.2f} MiB with torch.distributed.checkpoint's default planner and "
            f"FileSystemWriter ({self.seconds:.1f} s in all)",
            "resume with stock torchtitan: " + " ".join(self.resume_flags()),
        ]
        return "\n".join(lines)


def resolve_checkpoint(path: str, step: int | None = None) -> str:
    """``path`` itself, or in a torchtitan ``checkpoint/`` folder its ``step-<step>`` (default: the
    latest committed step, the one torchtitan resumes from)."""
    from ..storage.opening import step_folders

    steps = step_folders(path)
    if steps is None:
        if step is not None:
            raise UCPError(f"--step: {path} is not a torchtitan checkpoint folder (no step-N subfolders)")
        return path
    committed = [(n, name) for n, name in steps if os.path.exists(os.path.join(path, name, ".metadata"))]
    if step is not None:
        hit = [name for n, name in committed if n == step]
        if not hit:
            raise UCPError(f"no committed step-{step} in {path}; steps: {', '.join(str(n) for n, _ in committed)}")
        return os.path.join(path, hit[0])
    if not committed:
        raise UCPError(f"{path} holds no committed step-N checkpoint (no .metadata)")
    return os.path.join(path, committed[-1][1])


_NOISE = ("initial_load_model_only", "is being re-looped", "Checkpointing active", "Preparing c4")
"""torchtitan's notices at every config parse, manager build and loader build; the stock loaders the export
checks re-loop by design."""
_WARNED = ("torch.distributed is disabled", "set_vital", "To get the last learning rate")


def export_to_torchtitan(
    checkpoint: str, out: str, argv: list[str], *, dp: int, step: int | None = None, dataloader: bool = True
) -> ExportReport:
    """Write ``checkpoint`` (saved with ucp_dcp's torchtitan option) as a stock torchtitan checkpoint
    ``out/step-<k>`` that a job with the flags ``argv`` resumes at data-parallel degree ``dp`` (see
    the module docstring). ``dataloader=False`` writes no dataloader state. Runs in one process, not
    inside a process group. What can be refused is refused before the model is built."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.checkpointer.base import DATALOADER, MODEL
    from torchtitan.components.checkpointer.dcp import AsyncMode
    from torchtitan.config import derive

    import ucp_dcp.torchtitan  # noqa: F401 - torchtitan present, and a tested version

    from ..storage.opening import read_metadata
    from ..storage.reader import UCPFileSystemReader
    from .manager import UCPCheckpointManager

    t0 = time.perf_counter()
    if dp < 1:
        raise UCPError(f"--dp must be >= 1 (got {dp})")
    if dist.is_available() and dist.is_initialized():
        raise UCPError("export runs in one process without a process group (it writes every tensor unsharded)")
    src = resolve_checkpoint(checkpoint, step)
    keys = set(read_metadata(src).state_dict_metadata)
    if not any(k.startswith("optimizer.") for k in keys):
        raise UCPError(
            f"{src} holds no optimizer state (a model-only checkpoint?): the export writes a full training checkpoint",
            atom="optimizer",
        )
    with quiet(_NOISE, _WARNED):
        parsed = parse_flags(argv)
        check_degree(parsed, dp)
        cfg = job_config(parsed, unsharded=True)
        entries, line = dataloader_entries(cfg, src, keys, dp) if dataloader else (None, "none (--no-dataloader)")
        job = build_job(cfg)
        ts = job.train_state
        ucp_cfg = (
            cfg.checkpoint
            if isinstance(cfg.checkpoint, UCPCheckpointManager.Config)
            else derive(cfg.checkpoint, UCPCheckpointManager.Config)
        )
        ucp = _manager_config(ucp_cfg).build(
            dataloader=None,
            model_parts=[job.model],
            optimizers=job.optimizers,
            lr_schedulers=job.lr_schedulers,
            states={"train_state": ts},
            sd_adapter=None,
            base_folder=out,
        )
        states = states_to_load(ucp, model_only=False)
        states.pop(DATALOADER, None)
        # the manager's own planner options (fused-QKV rules, the ntokens_seen rule, user rules, strict)
        planner = ucp._load_planner(ucp._call_rules(states))
        dcp.load(states, storage_reader=UCPFileSystemReader(src), planner=planner)
        ucp.states[MODEL].load_state_dict(states)
        ucp.close()
        total = ts.ntokens_seen
        ts.ntokens_seen = total // dp  # every stock rank loads this one value; torchtitan logs their sum
        target = os.path.join(out, f"step-{ts.step}")
        if os.path.exists(target) and os.listdir(target):
            raise UCPError(
                f"{target} exists and is not empty: refusing to overwrite it", hint="choose another OUT or remove it"
            )
        stock_cfg = (
            cfg.checkpoint
            if type(cfg.checkpoint) is CheckpointManager.Config
            else derive(cfg.checkpoint, CheckpointManager.Config)
        )
        stock = _manager_config(stock_cfg).build(
            dataloader=Captured(entries) if entries is not None else None,
            model_parts=[job.model],
            optimizers=job.optimizers,
            lr_schedulers=job.lr_schedulers,
            states={"train_state": ts},
            sd_adapter=None,
            base_folder=out,
        )
        if entries is None:
            stock.states.pop(DATALOADER)
        model_sd = stock.states[MODEL].state_dict()
        stock.dcp_save(flattened_model_states_sd(stock), checkpoint_id=target, async_mode=AsyncMode.DISABLED)
        stock.close()
    opt_sd = job.optimizers.state_dict()
    return ExportReport(
        source=src,
        out=out,
        step=ts.step,
        dp=dp,
        model_tensors=sum(1 for v in model_sd.values() if isinstance(v, torch.Tensor)),
        optimizer_tensors=sum(1 for k, v in opt_sd.items() if k.startswith("state.") and isinstance(v, torch.Tensor)),
        param_groups=sum(1 for k in opt_sd if k.startswith("param_groups.")),
        lr_scheduler=job.lr_schedulers.state_dict(),
        train_state=ts.state_dict(),
        ntokens_total=total,
        dataloader=line,
        dataloader_written=entries is not None,
        bytes_written=sum(os.path.getsize(os.path.join(target, f)) for f in os.listdir(target)),
        seconds=time.perf_counter() - t0,
    )


def _manager_config(cfg: Any) -> Any:
    """A copy that builds a plain synchronous manager (no purge thread, no async process group)."""
    cfg = copy.deepcopy(cfg)
    cfg.enable, cfg.keep_latest_k, cfg.async_mode, cfg.last_save_in_hf = True, 0, "disabled", False
    cfg.exclude_from_loading = []  # the export reads every state (a resume's exclusions are the resume's)
    return cfg
