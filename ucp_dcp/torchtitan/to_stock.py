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

Kept in one module (over 400 lines once formatted): the export's steps in the order they run (refusals,
build, load, write) and the report they fill; the data-position math is apart, in
:mod:`ucp_dcp.torchtitan.stock_loader`.
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
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import UCPError
from ._compat import flattened_model_states_sd, states_to_load
from .job import TrainState, job_config, parse_job, quiet
from .stock_loader import NO_DATA, cursor_to_stock

__all__ = ["ExportReport", "export_to_torchtitan", "resolve_checkpoint"]

logger = logging.getLogger(__name__)

_HINT_FLAGS = (
    "give the job's own torchtitan flags after the export's, e.g. --module llama3 --config "
    "llama3_debugmodel --hf_assets_path ... --dataloader.dataset_path ... --training.seq_len ..."
)
_CURSOR_KEYS = ("version", "cursor", "epoch", "doc", "offset", "text_hash", "resume", "seq_len", "dataset")
"""The global-cursor loader's state keys (``dataloader.STATE_KEYS``, without importing torchtitan here)."""
_TEXT_KEYS = ("dataset", "text_hash", "resume")


@dataclass
class ExportReport:
    """What an export read and wrote (``format()`` is the CLI's text)."""

    source: str
    out: str
    step: int
    dp: int
    model_tensors: int = 0
    optimizer_tensors: int = 0
    param_groups: int = 0
    lr_scheduler: Any = None
    train_state: dict[str, Any] = field(default_factory=dict)
    ntokens_total: int | None = None
    dataloader: str = ""
    dataloader_written: bool = True
    bytes_written: int = 0
    seconds: float = 0.0

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


# -- the checkpoint -------------------------------------------------------------------------------------


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


def _saved_dataloader(keys: set[str]) -> tuple[str, list[str]]:
    """``("cursor" | "interleaved" | "per_rank" | "none" | "other", names)`` of the saved dataloader entries."""
    names = sorted(k[len("dataloader.") :] for k in keys if k.startswith("dataloader."))
    if not names:
        return "none", names
    if any(n.startswith("dp_rank_") for n in names):
        return "per_rank", names
    if "sources" in names:  # the interleaved loader's (it also has the single-source keys)
        return "interleaved", names
    if set(_CURSOR_KEYS) <= set(names):
        return "cursor", names
    return "other", names


# -- the job at world size 1 --------------------------------------------------------------------------


def _parse(argv: list[str]) -> Any:
    if not any(a == "--module" or a.startswith("--module=") for a in argv):
        raise UCPError("export --to torchtitan needs the job's --module and --config", hint=_HINT_FLAGS)
    return parse_job(argv, _HINT_FLAGS)


class _Captured(Stateful):
    """A state entry read as it is (its template gives the names and types)."""

    def __init__(self, template: dict[str, Any]) -> None:
        self.value = dict(template)

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = dict(state_dict)


@dataclass
class _Job:
    model: Any
    optimizers: Any
    lr_schedulers: Any
    train_state: TrainState


def _build(cfg: Any) -> _Job:
    """Model (real CPU tensors, no parallelism), optimizers with their state, LR schedulers, as the
    Trainer builds them (and as torchtitan builds its seed checkpoint)."""
    from torchtitan.components.optimizer.utils import init_optim_state
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import utils as tt_utils

    mc = cfg.model_spec.model
    with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[cfg.training.dtype]):
        model = mc.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizers = cfg.optimizer.build(model_parts=[model])
    lr_schedulers = cfg.lr_scheduler.build(optimizers=optimizers, training_steps=cfg.training.steps)
    for optim in optimizers.optimizers:
        init_optim_state(optim)
    return _Job(model, optimizers, lr_schedulers, TrainState())


_NOISE = ("initial_load_model_only", "is being re-looped", "Checkpointing active", "Preparing c4")
"""torchtitan's notices at every config parse, manager build and loader build; the stock loaders the export
checks re-loop by design."""
_WARNED = ("torch.distributed is disabled", "set_vital", "To get the last learning rate")


def _check_degree(config: Any, dp: int) -> None:
    """``dp`` against the job's flags: an explicit data-parallel degree must agree, and torchtitan
    must accept the batch sizes at ``dp`` (it refuses a global batch that is not a multiple of the
    local batch times the data-parallel degree)."""
    P, T = config.parallelism, config.training
    shard, rep = int(P.data_parallel_shard_degree), int(P.data_parallel_replicate_degree)
    if shard > 0 and shard * rep != dp:
        raise UCPError(
            f"the job's flags give data-parallel degree {shard * rep} (dp_replicate {rep} x dp_shard "
            f"{shard}), --dp says {dp}",
            saved=shard * rep,
            wanted=dp,
            hint="give the flags of the job that will resume, or leave its dp_shard at -1",
        )
    gbs = T.global_batch_size if T.global_batch_size > 0 else T.local_batch_size * dp
    if gbs % (T.local_batch_size * dp):
        raise UCPError(
            f"global batch size {gbs} is not a multiple of local batch size {T.local_batch_size} x "
            f"data-parallel degree {dp}: torchtitan refuses that job",
            wanted=dp,
            hint="--training.global_batch_size / --training.local_batch_size of the job that will resume",
        )


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
        parsed = _parse(argv)
        _check_degree(parsed, dp)
        cfg = job_config(parsed, unsharded=True)
        entries, line = _dataloader_entries(cfg, src, keys, dp) if dataloader else (None, "none (--no-dataloader)")
        job = _build(cfg)
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
            dataloader=_Captured(entries) if entries is not None else None,
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


def _dataloader_entries(cfg: Any, src: str, keys: set[str], dp: int) -> tuple[dict[str, Any], str]:
    """The ``dataloader`` entries of the export (torchtitan's per-rank format) and a line for the
    report, read from the checkpoint; refuses what cannot be written at ``dp``."""
    from ..planning.load_planner import UCPLoadPlanner
    from ..storage.reader import UCPFileSystemReader

    kind, names = _saved_dataloader(keys)
    if kind == "none":
        raise UCPError(
            f"{src} holds no dataloader state",
            atom="dataloader",
            hint="export with --no-dataloader and resume with --checkpoint.exclude_from_loading dataloader",
        )
    if kind == "interleaved":
        raise UCPError(
            f"{src} holds the global-cursor interleaved loader's state: the export writes only the "
            "single-source loader's stock state",
            atom="dataloader",
            hint=NO_DATA[3:],
        )
    if kind == "other":
        raise UCPError(
            f"the checkpoint's dataloader state ({', '.join(names[:4])}) is neither ucp_dcp's global "
            "cursor nor torchtitan's per-rank state",
            atom="dataloader",
            hint=NO_DATA[3:],
        )
    if kind == "per_rank":
        ranks = [n for n in names if n.startswith("dp_rank_")]
        if len(ranks) != dp:
            raise UCPError(
                f"the checkpoint holds torchtitan's per-rank dataloader state for data-parallel degree {len(ranks)}, "
                f"which cannot be remapped to {dp}",
                atom="dataloader",
                saved=len(ranks),
                wanted=dp,
                hint=f"export with --dp {len(ranks)}, " + NO_DATA,
            )
        template = {**{n: b"" for n in ranks}, "world_size": 0}
    else:
        template = {k: ("" if k in _TEXT_KEYS else 0) for k in _CURSOR_KEYS}
    got = _Captured(template)
    dcp.load({"dataloader": got}, storage_reader=UCPFileSystemReader(src), planner=UCPLoadPlanner())
    value = got.value
    if kind == "per_rank":
        if value.get("world_size") != dp:
            raise UCPError(
                f"the per-rank dataloader state says world_size {value.get('world_size')}, not {dp}",
                atom="dataloader.world_size",
                saved=value.get("world_size"),
                wanted=dp,
            )
        return value, f"{dp} per-rank stock entries copied as saved (dp_rank_0..{dp - 1}, world_size {dp})"
    tokenizer = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path)
    return cursor_to_stock(cfg, value, dp, tokenizer)


def mapping_from_flags(argv: list[str]) -> Any:
    """:func:`~ucp_dcp.torchtitan.mappings.hf_mapping` of the model a torchtitan job's flags describe
    (``--module llama3 --config llama3_8b ...``; ``export --to hf --mapping torchtitan``)."""
    from .mappings import hf_mapping

    return hf_mapping(job_config(_parse(argv), unsharded=True).model_spec.model)
