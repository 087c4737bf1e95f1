"""``--target titan``: a torchtitan job, rank by rank, built the way its Trainer builds it.

The job is given by the Trainer's own flags (``--module``, ``--config``, ``--parallelism.*``,
``--training.*``, ``--checkpoint.*``, ``--dataloader.*``, ``--override.imports`` ...), parsed by
torchtitan's ``ConfigManager``. For one rank, under the plan's fake process group,
:meth:`TitanTarget.build` runs what ``Trainer.__init__`` runs before it loads a checkpoint --
``ParallelDims`` and its meshes, the model config's ``update_from_config``, the config overrides, the
model on the meta device, the model spec's pipelining / parallelize functions (FSDP2, TP, PP with
torchtitan's stage split), optimizers, LR schedulers, tokenizer and dataloader, and the checkpoint
manager (``UCPCheckpointManager``; a stock ``CheckpointManager`` config is switched to it as
``--override.imports ucp_dcp.torchtitan.overrides.checkpointer`` would) -- and returns what the
manager hands ``dcp.load`` at a resume: ``_states_to_load``, its dataloader policy, and each
``Stateful`` turned into its state dict as ``dcp.load`` does. :meth:`TitanTarget.options` is the
manager's own ``UCPLoadPlanner`` configuration (fused-QKV rules, the ``ntokens_seen`` rule, user
rules, strict mode, the rank's data slot).

What differs from a real job, on purpose: nothing is moved off the meta device (no ``to_empty``, no
``init_weights``); meshes are CPU meshes (torchtitan's device type is ``cpu`` while a rank is
built); optimizer state is created by torchtitan's own zero-step (``init_optim_state``) with the
for-loop implementation (fused kernels refuse meta tensors; the state's keys, shapes and dtypes are
the same); async checkpointing, checkpoint purging and HF export are off in the manager (they do
not change what is loaded); the Trainer's train state is an object with the Trainer's own
``state_dict`` (step 0, no tokens seen).

Kept in one module (over 400 lines): :class:`TitanTarget` follows ``Trainer.__init__`` step by step;
split, the order the Trainer builds in would be spread over files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import types
import warnings
from collections.abc import Hashable, Iterator
from typing import Any

from ..errors import UCPError
from ._compat import states_to_load
from .job import TrainState, job_config, parse_job, quiet

__all__ = ["TitanTarget"]

_DEGREES = (
    ("dp_replicate", "data_parallel_replicate_degree"),
    ("dp_shard", "data_parallel_shard_degree"),
    ("cp", "context_parallel_degree"),
    ("tp", "tensor_parallel_degree"),
    ("pp", "pipeline_parallel_degree"),
)
_HINT_FLAGS = (
    "give the job's Trainer flags, e.g. --module llama3 --config llama3_debugmodel "
    "--parallelism.data_parallel_shard_degree 8 --parallelism.tensor_parallel_degree 2"
)


def _torchtitan() -> None:
    try:
        importlib.import_module("ucp_dcp.torchtitan")  # torchtitan present, and a tested version
    except ImportError as e:
        raise UCPError(f"--target titan needs torchtitan: {e}", hint="pip install 'ucp-dcp[torchtitan]'") from None


@contextlib.contextmanager
def _cpu_meshes() -> Iterator[None]:
    """torchtitan reads its device type once, at import (``cuda`` when no accelerator is found):
    while a rank is built, its meshes are CPU meshes, and the active SPMD backend (a torchtitan
    global the build sets) is restored after."""
    import torchtitan.distributed.parallel_dims as tt_dims
    import torchtitan.distributed.utils as tt_dist

    saved_type, saved_backend = tt_dims.device_type, tt_dist.get_spmd_backend()
    tt_dims.device_type = "cpu"
    try:
        yield
    finally:
        tt_dims.device_type = saved_type
        tt_dist.set_spmd_backend(saved_backend)


def _init_optimizer_state(optimizers: Any) -> None:
    """torchtitan's zero-gradient, zero-lr ``init_optim_state`` step, with the for-loop kernels
    (fused and foreach kernels refuse meta tensors); the groups' own settings are put back, so the
    state dict's ``param_groups`` entries are the job's."""
    from torchtitan.components.optimizer.utils import init_optim_state

    for optim in optimizers.optimizers:
        saved = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optim.param_groups]
        for g in optim.param_groups:
            g.update({k: False for k in ("fused", "foreach") if k in g})
        try:
            init_optim_state(optim)
        finally:
            for g, s in zip(optim.param_groups, saved):
                g.update(s)


class TitanTarget:
    """A torchtitan job (see the module docstring): ``TitanTarget.from_args(trainer_flags)``."""

    device = "cuda"  # a torchtitan job's state is on its GPUs (the plan builds it on the meta device)

    def __init__(
        self, config: Any, *, world_size: int | None = None, model_only: bool = False, argv: list[str] | None = None
    ) -> None:
        _torchtitan()
        self.config = config
        self.model_only = model_only
        self.argv = list(argv or [])
        P = config.parallelism
        deg = {short: int(getattr(P, long)) for short, long in _DEGREES}
        if deg["dp_shard"] == -1:
            others = math.prod(v for k, v in deg.items() if k != "dp_shard")
            if world_size is None:
                raise UCPError(
                    "--parallelism.data_parallel_shard_degree is -1 (all remaining ranks), and the plan has "
                    "no launcher to say how many ranks the job has",
                    hint="give --parallelism.data_parallel_shard_degree explicitly",
                )
            if world_size % others:
                raise UCPError(f"world size {world_size} is not a multiple of the other parallel degrees ({others})")
            deg["dp_shard"] = world_size // others
        if any(v < 1 for v in deg.values()):
            raise UCPError(f"parallel degrees must be >= 1 (got {deg})")
        self.degrees = deg
        n = math.prod(deg.values())
        if world_size is not None and world_size != n:
            raise UCPError(f"the parallel degrees {deg} make {n} ranks, not {world_size}")
        self.world_size = n
        self._check_job()
        spec = config.model_spec
        shown = [f"{k}={v}" for k, v in deg.items() if v > 1]
        if int(P.expert_parallel_degree) > 1:
            shown.append(f"ep={P.expert_parallel_degree}")
        self.name = f"titan {spec.name}/{spec.flavor} {','.join(shown) or 'single rank'}" + (
            " (model only)" if model_only else ""
        )
        self._metadata: Any = None
        self._preflight: list[UCPError] | None = None
        self._loader_dropped = False
        self._loaders: dict[int, Any] = {}
        self._tokenizer: Any = None
        self._job: Any = None
        self._varies: bool | None = None
        self._options: dict[int, Any] = {}

    @classmethod
    def from_args(cls, argv: list[str], world_size: int | None = None) -> TitanTarget:
        """The job of the torchtitan Trainer flags ``argv`` (``--module``, ``--config`` and any
        ``--section.field``). ``--model-only`` (not a Trainer flag) plans a model-only load, as
        ``checkpoint.initial_load_model_only`` or a step-0 checkpoint does; otherwise the load is
        a resume's. ``world_size`` resolves ``data_parallel_shard_degree = -1``."""
        _torchtitan()
        argv = list(argv)
        model_only = "--model-only" in argv
        argv = [a for a in argv if a != "--model-only"]
        if not any(a == "--module" or a.startswith("--module=") for a in argv):
            raise UCPError("--target titan needs the job's --module and --config", hint=_HINT_FLAGS)
        target = cls(parse_job(argv, _HINT_FLAGS), world_size=world_size, model_only=model_only, argv=argv)
        if target._loads_dataloader():
            target._loader(0)  # the job's data and tokenizer must be reachable: say so now, not per rank
        return target

    # -- the job's rank-independent settings ------------------------------------------------------

    def _check_job(self) -> None:
        """What the Trainer refuses before it builds anything (bad layouts fail here, once)."""
        from torchtitan.distributed import ParallelDims

        cfg, deg = self.config, self.degrees
        P, T = cfg.parallelism, cfg.training
        try:
            dims = ParallelDims.from_config(P, self.world_size)
        except (AssertionError, ValueError) as e:
            raise UCPError(f"torchtitan refuses the parallel layout: {e}") from None
        divisor = (dims.tp if P.enable_sequence_parallel else 1) * (2 * dims.cp if dims.cp > 1 else 1)
        if T.seq_len % divisor:
            raise UCPError(
                f"training.seq_len {T.seq_len} must be divisible by {divisor} for the configured "
                "sequence/context parallelism (torchtitan refuses it)"
            )
        batch = deg["dp_replicate"] * deg["dp_shard"]
        gbs = T.global_batch_size if T.global_batch_size > 0 else T.local_batch_size * batch
        if gbs % (T.local_batch_size * batch):
            raise UCPError(
                f"global batch size {gbs} is not a multiple of local batch size {T.local_batch_size} x "
                f"data-parallel degree {batch} (torchtitan refuses it)",
                hint="set --training.global_batch_size / --training.local_batch_size for the target layout",
            )

    def coord(self, rank: int) -> dict[str, int]:
        """The rank's (pp, batch, cp, tp) coordinate: torchtitan unflattens its world mesh in this
        order (``ParallelDims.build_mesh``); checked against the built meshes in :meth:`build`."""
        d = self.degrees
        batch = d["dp_replicate"] * d["dp_shard"]
        out, rest = {}, rank
        for name, size in (("tp", d["tp"]), ("cp", d["cp"]), ("batch", batch), ("pp", d["pp"])):
            out[name], rest = rest % size, rest // size
        return out

    def _job_config(self) -> Any:
        """A fresh copy of the config as the Trainer has it when it starts building: the model
        config updated from the job config, then the ``--override.imports`` applied; a stock
        checkpointer switched to ``UCPCheckpointManager``."""
        from torchtitan.config import derive

        from .manager import UCPCheckpointManager

        cfg = job_config(self.config)
        if not isinstance(cfg.checkpoint, UCPCheckpointManager.Config):
            cfg.checkpoint = derive(cfg.checkpoint, UCPCheckpointManager.Config)
        ck = cfg.checkpoint
        ck.async_mode, ck.keep_latest_k, ck.last_save_in_hf = "disabled", 0, False  # save-side only
        ck.initial_load_model_only = False  # read by the manager's own load() only (the plan picks the states)
        return cfg

    def _base(self) -> Any:
        if self._job is None:
            self._job = self._job_config()
        return self._job

    def _loads_dataloader(self) -> bool:
        ex = self._base().checkpoint.exclude_from_loading
        return not self.model_only and "dataloader" not in ex and not self._loader_dropped

    def _loader(self, batch_rank: int) -> Any:
        """The job's dataloader at data-parallel rank ``batch_rank`` (as the Trainer builds it; no
        process group needed), one per data-parallel rank for this process."""
        hit = self._loaders.get(batch_rank)
        if hit is not None:
            return hit
        cfg = self._base()
        d = self.degrees
        batch = d["dp_replicate"] * d["dp_shard"]
        try:
            with quiet():
                if self._tokenizer is None:
                    self._tokenizer = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path)
                T, P, C = cfg.training, cfg.parallelism, cfg.checkpoint
                pp = d["pp"] > 1
                accum = (T.global_batch_size if T.global_batch_size > 0 else T.local_batch_size * batch) // (
                    T.local_batch_size * batch
                )
                micro = T.local_batch_size // P.pipeline_parallel_microbatch_size if pp else 1
                loader = cfg.dataloader.build(
                    dp_world_size=batch,
                    dp_rank=batch_rank,
                    tokenizer=self._tokenizer,
                    seq_len=T.seq_len,
                    local_batch_size=P.pipeline_parallel_microbatch_size if pp else T.local_batch_size,
                    snapshot_every_n_steps=C.interval * accum * micro,
                )  # as with checkpointing on
        except UCPError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the job's own loader code
            raise UCPError(
                f"building the job's tokenizer/dataloader failed: {type(e).__name__}: {e}",
                hint="give the job's --hf_assets_path and --dataloader.dataset_path, or plan without "
                "the dataloader state (--checkpoint.exclude_from_loading dataloader)",
            ) from None
        self._loaders[batch_rank] = loader
        return loader

    def _slot_only(self, batch_rank: int) -> Any:
        """Stands in for a dataloader the load leaves out (never asked for its state): the manager
        still takes the rank's data slot from it, as from the job's real loader."""
        from torchtitan.components.dataloader import ParallelAwareDataloader

        owner = getattr(type(self._base().dataloader), "_owner", None)
        aware = isinstance(owner, type) and issubclass(owner, ParallelAwareDataloader)
        return types.SimpleNamespace(dp_rank=batch_rank) if aware else None

    def _loader_varies(self) -> bool:
        """Whether the loaded dataloader state differs between data-parallel ranks in structure
        (torchtitan's per-rank ``dp_rank_<r>`` state), so ranks of one stage are not alike."""
        if self._varies is None:
            batch = self.degrees["dp_replicate"] * self.degrees["dp_shard"]
            if not self._loads_dataloader() or batch == 1:
                self._varies = False
            else:
                try:
                    a, b = ({k: type(v) for k, v in self._loader(r).state_dict().items()} for r in (0, 1))
                except UCPError:  # build() raises it again, on the ranks (symmetry() is asked outside them)
                    return False
                self._varies = a != b
        return self._varies

    def _manager_cls(self) -> Any:
        from .manager import UCPCheckpointManager

        owner = getattr(type(self._base().checkpoint), "_owner", None)
        return owner if isinstance(owner, type) and issubclass(owner, UCPCheckpointManager) else UCPCheckpointManager

    # -- the Target protocol ----------------------------------------------------------------------

    def symmetry(self, rank: int) -> Hashable:
        """The pipeline-stage coordinate (ranks of one stage hold the same modules); with per-rank
        dataloader state in the load, also the data-parallel rank."""
        c = self.coord(rank)
        return (c["pp"], c["batch"]) if self._loader_varies() else c["pp"]

    def preflight(self, metadata: Any) -> list[UCPError]:
        """Checks a real resume makes before ``dcp.load`` reads anything, against the checkpoint's
        metadata: the manager's dataloader policy (per-rank loader state saved at another
        data-parallel degree is refused, or restarted under ``dataloader_policy='restart'``).
        Remembers ``metadata`` for :meth:`build`; call it before the ranks are planned. Returns
        the errors (each raised on every rank of a real job, before any read)."""
        self._metadata = metadata
        self._preflight, self._varies = [], None
        if not self._loads_dataloader():
            return []
        from torchtitan.components.checkpointer.base import DATALOADER

        manager = types.SimpleNamespace(ucp=self._base().checkpoint)  # all the policy reads of its manager
        try:
            kept = self._manager_cls()._apply_dataloader_policy(
                manager, {DATALOADER: self._loader(0)}, lambda: metadata
            )
        except UCPError as e:
            self._preflight.append(e)
            self._loader_dropped = True  # the ranks are planned without it: the error is the answer
        else:
            self._loader_dropped = DATALOADER not in kept
        return list(self._preflight)

    def build(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s state dict for ``dcp.load`` (under :func:`ucp_dcp.tools.dryrun.world.fake_rank`)."""
        try:
            with _cpu_meshes(), quiet():
                return self._build(rank)
        except UCPError:
            raise
        except Exception as e:  # noqa: BLE001 - torchtitan's own code refusing the job on meta
            hint = (
                "the plan builds each rank as the Trainer does, without weights or a GPU; a job whose build "
                "needs a GPU cannot be planned here"
            )
            if "dp_mesh_dims" in str(e):
                hint = (
                    "torchtitan 0.3.0's default spmd_types backend needs an FSDP newer than this torch's; plan "
                    "with --parallelism.spmd_backend partial_dtensor (the same checkpoint layout for FSDP)"
                )
            raise UCPError(
                f"torchtitan could not build the job on the meta device: {type(e).__name__}: {e}", hint=hint
            ) from e

    def _build(self, rank: int) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.stateful import Stateful
        from torchtitan.components.checkpointer.base import DATALOADER
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.tools import utils as tt_utils

        cfg = self._job_config()
        P, T = cfg.parallelism, cfg.training
        if dist.get_rank() != rank or dist.get_world_size() != self.world_size:
            raise UCPError(f"TitanTarget.build({rank}) must run under fake_rank({rank}, {self.world_size})")
        dims = ParallelDims.from_config(P, self.world_size)
        dist_utils.set_spmd_backend(P.spmd_backend)
        c = self.coord(rank)
        if dims.dp_enabled:
            batch_rank = dims.get_mesh("batch").get_local_rank()
        else:
            batch_rank = 0
        if dims.pp_enabled and dims.get_mesh("pp").get_local_rank() != c["pp"] or batch_rank != c["batch"]:
            raise UCPError(
                f"rank {rank}: torchtitan's meshes place it at another (pp, batch) coordinate than "
                f"{c}; TitanTarget's layout arithmetic is out of date"
            )
        spec = cfg.model_spec
        mc = spec.model
        with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[T.dtype]):
            model = mc.build()
        model.verify_module_protocol()
        loss_fn = cfg.loss.build(compile_config=cfg.compile)
        common = dict(
            parallel_dims=dims,
            training=T,
            parallelism=P,
            compile_config=cfg.compile,
            ac_config=cfg.activation_checkpoint,
            dump_folder=cfg.dump_folder,
        )
        if dims.pp_enabled:
            if not spec.pipelining_fn:
                raise UCPError(f"pipeline parallelism is enabled but {spec.name} does not support pipelining")
            _, parts, _, _ = spec.pipelining_fn(
                model,
                device=torch.device("cpu"),
                model_config=mc,
                parallelize_fn=spec.parallelize_fn,
                loss_fn=loss_fn,
                **common,
            )
        else:
            parts = [spec.parallelize_fn(model, **common)]
        optimizers = cfg.optimizer.build(model_parts=parts)
        if spec.post_optimizer_build_fn is not None:
            spec.post_optimizer_build_fn(optimizers, parts, dims)
        lr_schedulers = cfg.lr_scheduler.build(optimizers=optimizers, training_steps=T.steps)
        _init_optimizer_state(optimizers)
        loader = self._loader(batch_rank) if self._loads_dataloader() else self._slot_only(batch_rank)
        if not self.config.checkpoint.enable:
            warnings.warn(
                "the job's flags leave checkpoint.enable off (a real job would load nothing); "
                "planned as with --checkpoint.enable",
                stacklevel=2,
            )
        ck = cfg.checkpoint
        ck.enable = True
        manager = ck.build(
            dataloader=loader,
            model_parts=parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states={"train_state": TrainState()},
            sd_adapter=None,
            base_folder=cfg.dump_folder,
        )
        states = states_to_load(manager, self.model_only)
        if DATALOADER in states and self._loader_dropped:
            states = {k: v for k, v in states.items() if k != DATALOADER}
        elif DATALOADER in states and self._metadata is not None:
            md = self._metadata
            states = manager._apply_dataloader_policy(states, lambda: md)
        rules = manager._call_rules(states)
        self._options[rank] = manager._load_planner(rules).options
        # what dcp.load does before planning: every Stateful becomes its state dict
        return {k: states[k].state_dict() if isinstance(states[k], Stateful) else states[k] for k in sorted(states)}

    def options(self, rank: int) -> dict[str, Any]:
        """The manager's ``UCPLoadPlanner`` options at ``rank``: a rank the plan rebound (not built)
        takes its stage's options with its own data slot (the manager's is its loader's DP rank)."""
        opts = self._options.get(rank)
        if opts is None:
            key = self.symmetry(rank)
            src = next((r for r in self._options if self.symmetry(r) == key), None)
            if src is None:
                raise UCPError(f"TitanTarget.options({rank}): no rank of its class was built")
            opts = self._options[src]
            if opts.data_slot is not None:
                opts = dataclasses.replace(opts, data_slot=self.coord(rank)["batch"])
        return {"options": opts}
