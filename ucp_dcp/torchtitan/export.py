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
(:data:`BUFFER_COPIES`) and refused beyond. Either way the stock job takes exactly the windows the
run would have taken, step by step, to the end of the epoch the cursor is in; after it, stock
torchtitan follows its own epoch order (``Dataset.shuffle(seed=42 + epoch)``, per slice), not the
global cursor's seeded permutation, and a cursor already past epoch 0 is refused. The export checks
the next global batch of the stock loaders it wrote against the global-cursor loader's. Per-rank
stock loader state in the checkpoint (the checkpointer option without the global-cursor loader) is
copied as it is, at its own degree only. ``dataloader=False`` writes no loader state: torchtitan
then resumes with ``--checkpoint.exclude_from_loading dataloader`` and restarts its data stream.

Memory: the whole unsharded training state (parameters and optimizer moments) is held in this
process's CPU memory, as for a torchtitan seed checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import UCPError

__all__ = ["ExportReport", "export_to_torchtitan", "resolve_checkpoint"]

logger = logging.getLogger(__name__)

_HINT_FLAGS = ("give the job's own torchtitan flags after the export's, e.g. --module llama3 --config "
               "llama3_debugmodel --hf_assets_path ... --dataloader.dataset_path ... --training.seq_len ...")
_NO_DATA = ("or export without the data position (--no-dataloader) and resume stock torchtitan with "
            "--checkpoint.exclude_from_loading dataloader (its data stream restarts from the beginning)")
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
        flags = ["--checkpoint.initial_load_path", os.path.abspath(self.out_step),
                 "--checkpoint.no-initial_load_model_only"]
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
            share = (f", ntokens_seen={ts.get('ntokens_seen')} per data-parallel rank (the job's {self.ntokens_total} "
                     f"over {self.dp}; torchtitan sums the ranks' counts)")
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
    from ..summary import step_folders

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
    names = sorted(k[len("dataloader."):] for k in keys if k.startswith("dataloader."))
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
    from torchtitan.config import ConfigManager

    if not any(a == "--module" or a.startswith("--module=") for a in argv):
        raise UCPError("export --to torchtitan needs the job's --module and --config", hint=_HINT_FLAGS)
    try:
        return ConfigManager().parse_args(list(argv))
    except SystemExit:  # tyro printed its own message
        raise UCPError(f"torchtitan rejected the job flags ({' '.join(argv)})", hint=_HINT_FLAGS) from None
    except (ValueError, ImportError, AssertionError, TypeError) as e:
        raise UCPError(f"torchtitan could not read the job config: {type(e).__name__}: {e}", hint=_HINT_FLAGS) from None


def _job_config(config: Any) -> Any:
    """The job's config as its Trainer has it before building (model config updated, overrides
    applied), at world size 1 with no parallelism (the export is unsharded, as torchtitan's seed
    checkpoint is)."""
    from torchtitan.config.override import apply_overrides

    cfg = copy.deepcopy(config)
    P = cfg.parallelism
    for name in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "context_parallel_degree",
                 "tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        if hasattr(P, name):
            setattr(P, name, 1)
    cfg.model_spec.model.update_from_config(config=cfg)
    if cfg.override.imports:
        try:
            apply_overrides(cfg.override, cfg)
        except (ImportError, ValueError) as e:
            raise UCPError(f"--override.imports: {e}", hint="put the override modules on PYTHONPATH") from None
    return cfg


class _TrainState(Stateful):
    """The Trainer's ``train_state`` entry (the Trainer's own ``state_dict``/``load_state_dict``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        from torchtitan.trainer import Trainer

        return Trainer.state_dict(self)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torchtitan.trainer import Trainer

        Trainer.load_state_dict(self, state_dict)  # type: ignore[arg-type]


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
    train_state: _TrainState


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
    return _Job(model, optimizers, lr_schedulers, _TrainState())


# -- the data position ----------------------------------------------------------------------------------

BUFFER_COPIES = 1 << 28
"""Per rank, a bound on the list copies a stock loader makes to drain an exported buffer (it
re-slices its token buffer after every window: ``tokens**2 / (2 * seq_len)`` copies in all; 2**28 is
a second or two of CPython, spread over the steps): about a million tokens per rank at seq_len 2048."""
BUFFER_TOKENS = 1 << 24
"""A bound on all ranks' buffered tokens together (three Python int lists each: about 1.5 GiB at
export, some 200 MB of pickles in the checkpoint)."""


def _stock_loader_config(cfg: Any) -> Any:
    """The job's dataloader config as torchtitan's own text loader's (the global-cursor loader's
    config is switched back)."""
    from torchtitan.config import derive
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from .dataloader import GlobalCursorTextDataLoader

    dl = cfg.dataloader
    if isinstance(dl, GlobalCursorTextDataLoader.Config):
        return derive(dl, HuggingFaceTextDataLoader.Config)
    if type(dl) is not HuggingFaceTextDataLoader.Config:
        raise UCPError(f"the job's dataloader ({type(dl).__qualname__}) is not torchtitan's text loader "
                       "(HuggingFaceTextDataLoader): the export knows only that loader's state", hint=_NO_DATA[3:])
    return dl


def _stock_loader(cfg: Any, tokenizer: Any, dp: int, rank: int) -> Any:
    return _stock_loader_config(cfg).build(
        dp_world_size=dp, dp_rank=rank, tokenizer=tokenizer, seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size, snapshot_every_n_steps=None)


def _stock_entries(cfg: Any, tokenizer: Any, dp: int, state_of: Any) -> dict[str, Any]:
    """torchtitan's own per-rank entries (``dp_rank_<r>``: the pickled ``StatefulDataLoader`` state;
    ``world_size``) of ``dp`` stock loaders, rank ``r``'s dataset given ``state_of(r, dataset)``."""
    entries: dict[str, Any] = {}
    for rank in range(dp):
        loader = _stock_loader(cfg, tokenizer, dp, rank)
        loader.dataset.load_state_dict(state_of(rank, loader.dataset))
        entries.update(loader.state_dict())
    return entries


def _refuse_degree(dp: int, why: str) -> UCPError:
    return UCPError(
        f"the data position cannot be written for stock torchtitan at data-parallel degree {dp}: {why}",
        atom="dataloader", saved="global cursor", wanted=f"dp={dp}",
        hint="export with --dp 1 (the stock loader then continues the run's stream from the current document), "
             + _NO_DATA)


def _map_style(ds: Any, name: str) -> Any:
    from datasets import Dataset

    if not all(hasattr(ds, a) for a in ("_data", "_tokenizer", "_text_processor", "load_state_dict")):
        raise UCPError(f"the job's text dataset ({type(ds).__qualname__}) is not torchtitan 0.3's "
                       "HuggingFaceTextDataset: the export knows only that dataset's state", hint=_NO_DATA[3:])
    data = ds._data
    if not isinstance(data, Dataset):
        raise UCPError(f"dataset {name!r} is a streaming (iterable) dataset: the export writes the position of "
                       "map-style datasets only", atom="dataloader", hint=_NO_DATA[3:])
    return data


def _cursor_to_stock(cfg: Any, cursor: dict[str, Any], dp: int, tokenizer: Any) -> tuple[dict[str, Any], str]:
    """The entries of ``dp`` stock loaders that continue the global cursor exactly to the end of its
    epoch, and a line for the report; refuses what cannot be expressed. The next global batch of the
    stock loaders is checked against the global-cursor loader's.

    At ``dp = 1`` the stock loader reads the global stream itself: its state is the next document and
    the rest of the current one in its token buffers, as a stock save leaves it. At ``dp > 1`` each
    stock rank reads its own contiguous slice of the dataset, never the global stream, so each
    rank's windows of the rest of the epoch are written into its buffers and its slice is marked
    read; after the epoch every rank continues with its own slice, as stock torchtitan does."""
    dl = _stock_loader_config(cfg)
    seq_len, name = int(cfg.training.seq_len), str(dl.dataset).lower()
    if cursor["seq_len"] != seq_len or cursor["dataset"] != name:
        raise UCPError(
            f"the checkpoint's data position is for dataset {cursor['dataset']!r} with seq_len {cursor['seq_len']}, "
            f"the job's flags say {name!r} with seq_len {seq_len}", atom="dataloader",
            saved=(cursor["dataset"], cursor["seq_len"]), wanted=(name, seq_len),
            hint="give the job's own --dataloader.* and --training.seq_len flags")
    epoch, doc, offset, at = int(cursor["epoch"]), int(cursor["doc"]), int(cursor["offset"]), int(cursor["cursor"])
    if epoch != 0:
        raise UCPError(
            f"the global cursor is in epoch {epoch}, whose document order (ucp_dcp's seeded permutation) stock "
            "torchtitan does not reproduce (its loader shuffles with datasets' Dataset.shuffle(seed=42 + epoch)): "
            "no data-parallel degree keeps the position", atom="dataloader.epoch", saved=epoch, wanted=0,
            hint=_NO_DATA[3:])
    if at % dp:
        raise _refuse_degree(dp, f"the global cursor ({at} windows) is not a multiple of {dp}: the ranks cannot "
                                 "split the next global batch")
    first = _stock_loader(cfg, tokenizer, 1, 0).dataset
    data = _map_style(first, name)
    if doc >= len(data):
        raise UCPError(f"the global cursor is at document {doc}, past the dataset's {len(data)}",
                       atom="dataloader.doc", saved=doc, wanted=len(data))
    encode = lambda i: first._tokenizer.encode(first._text_processor(data[i]), add_bos=True, add_eos=True)  # noqa: E731
    if dp == 1:
        state: dict[str, Any] = {"inputs_buffer": [], "labels_buffer": [], "positions_buffer": [],
                                 "sample_idx": doc, "epoch": 0}
        if offset:  # the rest of the current document waits in the loader's buffers
            toks = encode(doc)
            state.update(inputs_buffer=toks[offset:-1], labels_buffer=toks[offset + 1:],
                         positions_buffer=list(range(offset, len(toks) - 1)), sample_idx=doc + 1)
        if not dl.infinite and state["sample_idx"] == len(data) and len(state["inputs_buffer"]) >= seq_len:
            raise _refuse_degree(dp, "the cursor is in the last document of a loader that is not infinite: a stock "
                                     "loader yields buffered windows only when it reads another document")
        entries = _stock_entries(cfg, tokenizer, 1, lambda rank, ds: state)
        what = (f"document {doc}, token {offset} of epoch 0 (sample_idx {state['sample_idx']}, "
                f"{len(state['inputs_buffer'])} tokens buffered)")
    else:
        if not dl.infinite:
            raise _refuse_degree(dp, "the job's loader is not infinite (--dataloader.infinite): a stock rank whose "
                                     "slice is read yields nothing more, not even its buffered windows")
        buffers = _rest_of_epoch(encode, len(data), doc, offset, seq_len, dp)
        entries = _stock_entries(cfg, tokenizer, dp, lambda rank, ds: {
            "inputs_buffer": buffers[rank][0], "labels_buffer": buffers[rank][1],
            "positions_buffer": buffers[rank][2], "sample_idx": len(ds._data), "epoch": 0})
        tokens = sum(len(b[0]) for b in buffers)
        what = (f"the rest of epoch 0 from document {doc}, token {offset} ({tokens} tokens, "
                f"{tokens // seq_len} windows) in the {dp} ranks' buffers, each rank's slice marked read")
    checked = _check_next_batch(cfg, tokenizer, cursor, entries, dp)
    line = (f"{', '.join(k for k in entries if k.startswith('dp_rank_'))} (world_size {dp}): global window {at} = "
            f"{what}; the next {checked} windows checked equal to the global-cursor loader's")
    return entries, line


def _rest_of_epoch(encode: Any, n_docs: int, doc: int, offset: int, seq_len: int,
                   dp: int) -> list[tuple[list, list, list]]:
    """Each rank's (inputs, labels, positions) buffers: window ``cursor + k`` goes to rank ``k mod dp``
    (the global-cursor loader's deal), every window of epoch 0 from ``(doc, offset)`` on; the partial
    window at the end goes to the next rank in turn (a stock rank completes it from its next epoch)."""
    cap = min(int((2 * BUFFER_COPIES * seq_len) ** 0.5), BUFFER_TOKENS // dp)
    out: list[tuple[list, list, list]] = [([], [], []) for _ in range(dp)]
    inp: list[int] = []
    lab: list[int] = []
    pos: list[int] = []
    w = 0
    for i in range(doc, n_docs):
        toks = encode(i)
        o = offset if i == doc else 0
        inp += toks[o:-1]
        lab += toks[o + 1:]
        pos += range(o, len(toks) - 1)
        cut = 0
        while len(inp) - cut >= seq_len:
            b = out[w % dp]
            b[0].extend(inp[cut:cut + seq_len])
            b[1].extend(lab[cut:cut + seq_len])
            b[2].extend(pos[cut:cut + seq_len])
            cut += seq_len
            w += 1
            if len(b[0]) > cap:
                raise _refuse_degree(dp, (
                    f"each of the {dp} stock ranks reads its own slice of the dataset, never the global stream, so "
                    f"the export must write the rest of epoch 0 into the ranks' token buffers, and more than {dp} x "
                    f"{cap} tokens remain (bounded by ucp_dcp.torchtitan.export.BUFFER_COPIES, the list copies a stock "
                    f"loader makes to drain its buffer, and BUFFER_TOKENS); --dp 1 keeps the position at any dataset "
                    f"size"))
        del inp[:cut], lab[:cut], pos[:cut]
    b = out[w % dp]  # the partial window at the end of the epoch: the next rank in turn
    b[0].extend(inp)
    b[1].extend(lab)
    b[2].extend(pos)
    return out


def _check_next_batch(cfg: Any, tokenizer: Any, cursor: dict[str, Any], entries: dict[str, Any], dp: int) -> int:
    """Fresh stock loaders given ``entries`` yield, rank by rank, the windows the global-cursor loader
    at ``cursor`` gives that rank over the next global batch (inputs, labels, positions); returns
    the windows compared."""
    from .dataloader import GlobalWindowDataset

    T = cfg.training
    dl = _stock_loader_config(cfg)
    per_rank = max((T.global_batch_size if T.global_batch_size > 0 else T.local_batch_size * dp) // dp, 1)
    seen = 0
    for rank in range(dp):
        ours = GlobalWindowDataset(dl.dataset, dl.dataset_path, tokenizer, T.seq_len, rank, dp, dl.infinite)
        ours.load_state_dict(cursor)
        want = ours.iter_windows()
        stock = _stock_loader(cfg, tokenizer, dp, rank)
        stock.load_state_dict(entries)
        got = iter(stock)
        done = 0
        while done < per_rank:
            inputs, labels = next(got)
            for i in range(min(labels.shape[0], per_rank - done)):
                w, inp, lab = next(want)
                if not (torch.equal(inputs["input"][i], inp["input"]) and torch.equal(labels[i], lab)
                        and torch.equal(inputs["positions"][i], inp["positions"])):
                    raise UCPError(f"internal check failed: stock rank {rank}'s window {done} after the exported "
                                   f"position differs from the global-cursor loader's window {w}", atom="dataloader")
                done += 1
        seen += done
    return seen


# -- the export -----------------------------------------------------------------------------------------

_NOISE = ("initial_load_model_only", "is being re-looped", "Checkpointing active", "Preparing c4")


class _Quiet(logging.Filter):
    """torchtitan's notices at every config parse, manager build and loader build (it logs on the
    root logger); the stock loaders the export checks re-loop by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in str(record.msg) for n in _NOISE)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    root, f = logging.getLogger(), _Quiet()
    root.addFilter(f)
    try:
        with warnings.catch_warnings():
            for text in ("torch.distributed is disabled", "set_vital", "To get the last learning rate"):
                warnings.filterwarnings("ignore", message=f".*{text}.*")
            yield
    finally:
        root.removeFilter(f)


def _check_degree(config: Any, dp: int) -> None:
    """``dp`` against the job's flags: an explicit data-parallel degree must agree, and torchtitan
    must accept the batch sizes at ``dp`` (it refuses a global batch that is not a multiple of the
    local batch times the data-parallel degree)."""
    P, T = config.parallelism, config.training
    shard, rep = int(P.data_parallel_shard_degree), int(P.data_parallel_replicate_degree)
    if shard > 0 and shard * rep != dp:
        raise UCPError(f"the job's flags give data-parallel degree {shard * rep} (dp_replicate {rep} x dp_shard "
                       f"{shard}), --dp says {dp}", saved=shard * rep, wanted=dp,
                       hint="give the flags of the job that will resume, or leave its dp_shard at -1")
    gbs = T.global_batch_size if T.global_batch_size > 0 else T.local_batch_size * dp
    if gbs % (T.local_batch_size * dp):
        raise UCPError(f"global batch size {gbs} is not a multiple of local batch size {T.local_batch_size} x "
                       f"data-parallel degree {dp}: torchtitan refuses that job", wanted=dp,
                       hint="--training.global_batch_size / --training.local_batch_size of the job that will resume")


def export_to_torchtitan(checkpoint: str, out: str, argv: list[str], *, dp: int, step: int | None = None,
                         dataloader: bool = True) -> ExportReport:
    """Write ``checkpoint`` (saved with ucp_dcp's torchtitan option) as a stock torchtitan checkpoint
    ``out/step-<k>`` that a job with the flags ``argv`` resumes at data-parallel degree ``dp`` (see
    the module docstring). ``dataloader=False`` writes no dataloader state. Runs in one process, not
    inside a process group. What can be refused is refused before the model is built."""
    import ucp_dcp.torchtitan  # noqa: F401 - torchtitan present, and a tested version
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.checkpointer.base import DATALOADER, MODEL
    from torchtitan.components.checkpointer.dcp import AsyncMode
    from torchtitan.config import derive

    from ..reader import UCPFileSystemReader
    from ..summary import read_metadata
    from .manager import UCPCheckpointManager

    t0 = time.perf_counter()
    if dp < 1:
        raise UCPError(f"--dp must be >= 1 (got {dp})")
    if dist.is_available() and dist.is_initialized():
        raise UCPError("export runs in one process without a process group (it writes every tensor unsharded)")
    src = resolve_checkpoint(checkpoint, step)
    keys = set(read_metadata(src).state_dict_metadata)
    if not any(k.startswith("optimizer.") for k in keys):
        raise UCPError(f"{src} holds no optimizer state (a model-only checkpoint?): the export writes a full "
                       "training checkpoint", atom="optimizer")
    with _quiet():
        parsed = _parse(argv)
        _check_degree(parsed, dp)
        cfg = _job_config(parsed)
        entries, line = _dataloader_entries(cfg, src, keys, dp) if dataloader else (None, "none (--no-dataloader)")
        job = _build(cfg)
        ts = job.train_state
        ucp_cfg = cfg.checkpoint if isinstance(cfg.checkpoint, UCPCheckpointManager.Config) else derive(
            cfg.checkpoint, UCPCheckpointManager.Config)
        ucp = _manager_config(ucp_cfg).build(
            dataloader=None, model_parts=[job.model], optimizers=job.optimizers, lr_schedulers=job.lr_schedulers,
            states={"train_state": ts}, sd_adapter=None, base_folder=out)
        states = ucp._states_to_load(model_only=False)
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
            raise UCPError(f"{target} exists and is not empty: refusing to overwrite it",
                           hint="choose another OUT or remove it")
        stock_cfg = cfg.checkpoint if type(cfg.checkpoint) is CheckpointManager.Config else derive(
            cfg.checkpoint, CheckpointManager.Config)
        stock = _manager_config(stock_cfg).build(
            dataloader=_Captured(entries) if entries is not None else None, model_parts=[job.model],
            optimizers=job.optimizers, lr_schedulers=job.lr_schedulers, states={"train_state": ts}, sd_adapter=None,
            base_folder=out)
        if entries is None:
            stock.states.pop(DATALOADER)
        model_sd = stock.states[MODEL].state_dict()
        stock.dcp_save(stock._flattened_model_states_sd(), checkpoint_id=target, async_mode=AsyncMode.DISABLED)
        stock.close()
    opt_sd = job.optimizers.state_dict()
    return ExportReport(
        source=src, out=out, step=ts.step, dp=dp,
        model_tensors=sum(1 for v in model_sd.values() if isinstance(v, torch.Tensor)),
        optimizer_tensors=sum(1 for k, v in opt_sd.items() if k.startswith("state.") and isinstance(v, torch.Tensor)),
        param_groups=sum(1 for k in opt_sd if k.startswith("param_groups.")),
        lr_scheduler=job.lr_schedulers.state_dict(), train_state=ts.state_dict(), ntokens_total=total,
        dataloader=line, dataloader_written=entries is not None,
        bytes_written=sum(os.path.getsize(os.path.join(target, f)) for f in os.listdir(target)),
        seconds=time.perf_counter() - t0)


def _manager_config(cfg: Any) -> Any:
    """A copy that builds a plain synchronous manager (no purge thread, no async process group)."""
    cfg = copy.deepcopy(cfg)
    cfg.enable, cfg.keep_latest_k, cfg.async_mode, cfg.last_save_in_hf = True, 0, "disabled", False
    cfg.exclude_from_loading = []  # the export reads every state (a resume's exclusions are the resume's)
    return cfg


def _dataloader_entries(cfg: Any, src: str, keys: set[str], dp: int) -> tuple[dict[str, Any], str]:
    """The ``dataloader`` entries of the export (torchtitan's per-rank format) and a line for the
    report, read from the checkpoint; refuses what cannot be written at ``dp``."""
    from ..load_planner import UCPLoadPlanner
    from ..reader import UCPFileSystemReader

    kind, names = _saved_dataloader(keys)
    if kind == "none":
        raise UCPError(f"{src} holds no dataloader state", atom="dataloader",
                       hint="export with --no-dataloader and resume with --checkpoint.exclude_from_loading dataloader")
    if kind == "interleaved":
        raise UCPError(f"{src} holds the global-cursor interleaved loader's state: the export writes only the "
                       "single-source loader's stock state", atom="dataloader", hint=_NO_DATA[3:])
    if kind == "other":
        raise UCPError(f"the checkpoint's dataloader state ({', '.join(names[:4])}) is neither ucp_dcp's global "
                       "cursor nor torchtitan's per-rank state", atom="dataloader", hint=_NO_DATA[3:])
    if kind == "per_rank":
        ranks = [n for n in names if n.startswith("dp_rank_")]
        if len(ranks) != dp:
            raise UCPError(
                f"the checkpoint holds torchtitan's per-rank dataloader state for data-parallel degree {len(ranks)}, "
                f"which cannot be remapped to {dp}", atom="dataloader", saved=len(ranks), wanted=dp,
                hint=f"export with --dp {len(ranks)}, " + _NO_DATA)
        template = {**{n: b"" for n in ranks}, "world_size": 0}
    else:
        template = {k: ("" if k in _TEXT_KEYS else 0) for k in _CURSOR_KEYS}
    got = _Captured(template)
    dcp.load({"dataloader": got}, storage_reader=UCPFileSystemReader(src), planner=UCPLoadPlanner())
    value = got.value
    if kind == "per_rank":
        if value.get("world_size") != dp:
            raise UCPError(f"the per-rank dataloader state says world_size {value.get('world_size')}, not {dp}",
                           atom="dataloader.world_size", saved=value.get("world_size"), wanted=dp)
        return value, f"{dp} per-rank stock entries copied as saved (dp_rank_0..{dp - 1}, world_size {dp})"
    tokenizer = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path)
    return _cursor_to_stock(cfg, value, dp, tokenizer)


def mapping_from_flags(argv: list[str]) -> Any:
    """:func:`~ucp_dcp.torchtitan.hf.hf_mapping` of the model a torchtitan job's flags describe
    (``--module llama3 --config llama3_8b ...``; ``export --to hf --mapping torchtitan``)."""
    from .hf import hf_mapping

    return hf_mapping(_job_config(_parse(argv)).model_spec.model)
