"""Run torchtitan 0.3.0's Trainer on CPU/gloo with torch 2.13.

A test and recipe aid, not library code: GPU users run torchtitan as usual. It patches, before
torchtitan is imported, what breaks on CPU or between these two releases:

(a) the device type is read at import time and defaults to "cuda" -> report "cpu" (gloo backend);
(b) the memory monitor calls CUDA-only ``torch.cpu`` functions -> harmless stand-ins;
(e) FSDP gradient division is turned off, which makes FSDP2 use PREMUL_SUM, unknown to gloo
    -> also force SUM reductions (the loss is already divided by the global token count);
(f) ``set_pg_timeouts`` calls ``barrier(device_ids=...)`` and ``torch.distributed.set_timeout``
    (absent in 2.13) -> plain barrier and the private per-group timeout setter;
(g) the trainer calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, a newer API
    -> route pre-split microbatches to ``_step_microbatches``;
(s) the default ``spmd_backend="spmd_types"`` keeps parameters as plain tensors carrying spmd_types
    annotations and hands ``fully_shard`` a ``DataParallelMeshDims``, relying on an FSDP that turns
    annotated plain parameters into DTensors (newer than torch 2.13, whose ``FSDPParam`` raises
    "all parameters must be DTensors on the full SPMD mesh"; a torch-version gap, not a CPU one)
    -> when the dense storage mesh holds data-parallel axes only (no TP/CP), shard on it the classic
    way (no ``DataParallelMeshDims``). Layouts with TP or CP are left to fail as they do unpatched;
(p) ``async_mode="async_with_pinned_mem"`` asks for non-blocking copies, which torch refuses without
    an accelerator -> plain copies (the checkpoint process and shared-memory staging stay).
FlexAttention has no CPU backward: ``ucp_dev.testing.titan.cpu_attention.sdpa_attention`` (an
``--override.imports`` entry, :data:`.jobs.CPU_ATTENTION`) swaps it for SDPA on local shards.

For the tests it also: records each step's loss (from the rank where it is computed) into the JSON file named by
``$UCP_TITAN_METRICS`` (``<file>.rank<N>``), and, for the resume oracle, writes the full training
state (every parameter and optimizer entry as a full tensor, plus train/scheduler state) with plain
``torch.save`` to ``$UCP_TITAN_STATE`` right after the save at step ``$UCP_TITAN_STATE_STEP`` or
right after a checkpoint load (with ``$UCP_TITAN_STATE_BUFFERS`` set, every model buffer too);
records the hashes of the sequences each step trained on into ``$UCP_TITAN_BATCHES``
(``<file>.rank<N>``); and, with ``$UCP_TITAN_FLIP_EXPERTS=<parameter>``, swaps two expert rows right
after a load (sabotage the resume comparison must catch). No ucp_dcp code is involved in any of it: this
module and :mod:`.cpu_attention` import no other ucp_dcp module (tests/e2e/test_to_stock.py runs them with
the library blocked), so a stock torchtitan job can use them too.

    torchrun --nproc-per-node 2 -m ucp_dev.testing.titan.cpu_launch --module ... --config ... [flags]

(:func:`.jobs.run_job` builds that command with the flags the tests and recipes share.)

With ``UCP_TITAN_DEVICE=cuda`` (the GPU tier, tests/gpu/) only the torch-version patches (f), (g)
and (s) are applied: torchtitan then runs on its own device and backend (CUDA, NCCL).
"""

from __future__ import annotations

import json
import logging
import os
import types

import torch
import torch._utils


def patch_device() -> None:
    """(a) and (b): torch reports the CPU as the device, and the memory monitor gets its stand-ins."""
    torch._utils._get_available_device_type = lambda: "cpu"  # (a)
    stand_ins = {  # (b)
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: types.SimpleNamespace(total_memory=2**34, name="cpu"),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
    }
    for name, fn in stand_ins.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def patch_torchtitan(cpu: bool = True) -> None:
    """All patches; ``cpu=False`` keeps only those for the torch 2.13 / torchtitan 0.3.0 gap."""
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as tt_dist
    from torch.distributed.fsdp import FSDPModule

    divide = tt_fsdp.disable_fsdp_gradient_division

    def no_division_sum_only(model):  # (e)
        divide(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    if cpu:
        tt_fsdp.disable_fsdp_gradient_division = no_division_sum_only

    def set_pg_timeouts(timeout, parallel_dims):  # (f)
        torch.distributed.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for g in groups:
            torch.distributed.distributed_c10d._set_pg_timeout(timeout, g)

    tt_dist.set_pg_timeouts = set_pg_timeouts

    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):  # (g)
        _patch_step(cls)

    _patch_spmd_types_fsdp()
    if cpu:
        _patch_pinned_staging()


def _patch_pinned_staging() -> None:
    """(p): ``async_mode="async_with_pinned_mem"`` builds ``DefaultStager(StagingOptions(
    use_pinned_memory=True, use_shared_memory=True, use_async_staging=True,
    use_non_blocking_copy=True))``; torch's ``DefaultStager.__init__`` raises
    ``AssertionError: Non-blocking copy requires that the current accelerator is available`` without
    one. Pinning is already skipped without CUDA (``StateDictStager`` warns), so drop the
    non-blocking copy: staging into shared memory on a thread and the checkpoint *process*
    (``AsyncCheckpointerType.PROCESS``), which receives the planner and storage writer, stay real."""
    import dataclasses

    import torchtitan.components.checkpointer.dcp as tt_dcp

    stager = tt_dcp.DefaultStager

    def cpu_stager(options=None):
        if options is not None and options.use_non_blocking_copy and not torch.accelerator.is_available():
            options = dataclasses.replace(options, use_non_blocking_copy=False)
        return stager(options) if options is not None else stager()

    tt_dcp.DefaultStager = cpu_stager


def _patch_spmd_types_fsdp() -> None:
    """(s): spmd_types + FSDP on torch 2.13, for data-parallel-only dense meshes.

    torchtitan 0.3.0 (``models/llama3/parallelize.py``) calls ``resolve_fsdp_mesh`` under
    spmd_types, which returns the dense storage mesh (dp_replicate, dp_shard, cp, tp; active axes)
    plus ``DataParallelMeshDims``. With those dims torch 2.13's ``FSDPParam._init_sharding_spec``
    requires DTensor parameters, but spmd_types parameters are plain tensors (their annotations are
    translated to DTensors only by a newer FSDP). When every axis of the storage mesh is
    data-parallel, parameters are replicated there (``R``: the plain tensors hold full values), and
    the classic ``fully_shard(module, mesh=storage_mesh)`` shards them ``Shard(0)`` on that mesh.
    torchtitan itself drops the dims when that mesh has size 1 (one rank, or PP only); this extends
    it to any data-parallel-only mesh. The unsharded parameters then carry no spmd_types
    annotations: only ``--debug.spmd_typechecking`` (off by default) reads them. Tested at
    dp_shard=2; the spmd_types model code, input annotation and loss run as in torchtitan.
    """
    import torchtitan.distributed.full_dtensor as tt_full_dtensor

    resolve = tt_full_dtensor.resolve_fsdp_mesh

    def resolve_fsdp_mesh(parallel_dims):
        mesh, dims = resolve(parallel_dims)
        if parallel_dims.spmd_backend != "spmd_types":
            return mesh, dims
        axes = tuple(mesh.mesh_dim_names or ())
        if dims is not None and set(axes) <= {"dp_replicate", "dp_shard"}:
            logging.getLogger("cpu_launch").info(
                "cpu_launch (s): spmd_types FSDP on data-parallel mesh %s without DataParallelMeshDims", axes
            )
            return mesh, None
        logging.getLogger("cpu_launch").info("cpu_launch (s): spmd_types FSDP mesh %s, dims %s (unpatched)", axes, dims)
        return mesh, dims

    tt_full_dtensor.resolve_fsdp_mesh = resolve_fsdp_mesh
    import torchtitan.models.llama3.parallelize as llama3_parallelize  # binds the name at import

    llama3_parallelize.resolve_fsdp_mesh = resolve_fsdp_mesh


def _patch_step(cls) -> None:
    whole_batch_step = cls.step

    def step(
        self,
        *args,
        arg_mbs=None,
        kwarg_mbs=None,
        target_mbs=None,
        losses=None,
        return_outputs=True,
        loss_kwargs=None,
        **kwargs,
    ):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch_step(
                self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs
            )
        stages = getattr(self, "_stages", None) or [self._stage]
        for s in stages:
            s.has_backward = self._has_backward
            s.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        for s in stages:
            if s.is_last and return_outputs:
                return self._merge_outputs(s.output_chunks)
        return None

    cls.step = step


def _record_losses() -> None:
    path = os.environ.get("UCP_TITAN_METRICS")
    if not path:
        return
    from torchtitan.components.metrics import MetricsProcessor

    log = MetricsProcessor.log
    rank = int(os.environ.get("RANK", "0"))
    out = f"{path}.rank{rank}"
    seen: dict[str, float] = {}

    def recording_log(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **k):
        if global_avg_loss >= 0:  # -1 on pipeline stages that do not hold the loss
            seen[str(step)] = float(global_avg_loss)
            with open(out, "w") as f:
                json.dump(seen, f)
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **k)

    MetricsProcessor.log = recording_log


def _full_state(manager) -> dict:
    """Every parameter and optimizer entry as a full tensor, by global name (collective)."""
    from torch.distributed.tensor import DTensor

    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()  # noqa: E731
    out: dict = {}
    optims = manager.states["optimizer"]
    for model, opt in zip(optims.model_parts, optims.optimizers):
        names = {id(p): n for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            out[f"param/{n}"] = full(p)
        for group in opt.param_groups:
            for p in group["params"]:
                for k, v in opt.state.get(p, {}).items():
                    out[f"state/{names[id(p)]}/{k}"] = full(v) if isinstance(v, torch.Tensor) else v
                # membership (params, param_names) depends on the layout; hyperparameters must not
                out[f"group/{names[id(p)]}"] = repr(
                    sorted((k, v) for k, v in group.items() if k not in ("params", "param_names"))
                )
    if os.environ.get("UCP_TITAN_STATE_BUFFERS"):  # model buffers too (MoE expert_bias_E, tokens_per_expert_E)
        for model in optims.model_parts:
            for n, b in model.named_buffers():
                out[f"buffer/{n}"] = full(b)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, out)
    merged: dict = {}
    for d in gathered:
        merged.update(d)
    ts = manager.states["train_state"]
    merged["train_state/step"] = ts.step
    sched = manager.states.get("lr_scheduler")
    if sched is not None:
        merged["lr_scheduler"] = repr(sched.state_dict())
    return merged


def _dump_state() -> None:
    path = os.environ.get("UCP_TITAN_STATE")
    if not path:
        return
    from torchtitan.components.checkpointer.base import BaseCheckpointManager

    at_step = int(os.environ.get("UCP_TITAN_STATE_STEP", "-1"))
    save, load = BaseCheckpointManager.save, BaseCheckpointManager.load

    def write(manager) -> None:
        state = _full_state(manager)
        if torch.distributed.get_rank() == 0:
            torch.save(state, path)

    def saving(self, curr_step, last_step=False):
        done = save(self, curr_step, last_step)
        if curr_step == at_step:
            write(self)
        return done

    def loading(self, step=-1):
        done = load(self, step)
        if done and os.environ.get("UCP_TITAN_FLIP_EXPERTS"):
            _flip_experts(self, os.environ["UCP_TITAN_FLIP_EXPERTS"])
        if done:
            write(self)
        return done

    BaseCheckpointManager.save, BaseCheckpointManager.load = saving, loading


def _flip_experts(manager, name: str) -> None:
    """Test sabotage (``$UCP_TITAN_FLIP_EXPERTS=<parameter name>``): right after a checkpoint load,
    swap the first two rows (experts) of that parameter's local shard on every rank holding one, as
    a loader that mixed up expert order would. The resume comparison must catch it."""
    from torch.distributed.tensor import DTensor

    for model in manager.states["optimizer"].model_parts:
        for n, p in model.named_parameters():
            if n.replace("_checkpoint_wrapped_module.", "") == name:
                local = p.to_local() if isinstance(p, DTensor) else p
                if local.shape[0] >= 2:
                    with torch.no_grad():
                        local[[0, 1]] = local[[1, 0]].clone()
                    logging.getLogger("cpu_launch").warning("cpu_launch: flipped rows 0 and 1 of %s (test)", n)


def _record_batches() -> None:
    """``$UCP_TITAN_BATCHES``: per step, the hashes of the sequences this rank trained on (input
    tokens, one hash per row) into ``<file>.rank<N>``; merged over ranks they name the global batch
    whatever the layout (data-parallel degree, microbatching)."""
    path = os.environ.get("UCP_TITAN_BATCHES")
    if not path:
        return
    import hashlib

    from torchtitan.trainer import Trainer

    generator = Trainer.batch_generator
    out = f"{path}.rank{int(os.environ.get('RANK', '0'))}"
    seen: dict[str, list[str]] = {}

    def recording_generator(self, data_iterable):
        for input_dict, labels in generator(self, data_iterable):
            tokens = input_dict["input"] if isinstance(input_dict, dict) else input_dict
            rows = seen.setdefault(str(self.step), [])
            rows += [hashlib.sha256(r.contiguous().numpy().tobytes()).hexdigest()[:16] for r in tokens.cpu()]
            with open(out, "w") as f:
                json.dump(seen, f)
            yield input_dict, labels

    Trainer.batch_generator = recording_generator


def main() -> None:
    cpu = os.environ.get("UCP_TITAN_DEVICE", "cpu") == "cpu"
    if cpu:
        patch_device()
    patch_torchtitan(cpu=cpu)
    _record_losses()
    _record_batches()
    _dump_state()
    from torchtitan.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()
