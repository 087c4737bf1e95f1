"""Megatron-Core's unchanged code on a CPU-only torch (megatron-core 0.16.1, torch 2.13 CPU, no Apex/TE).

Megatron hard-codes CUDA on the paths a CPU step reaches, each raising ``AssertionError: Torch not
compiled with CUDA enabled`` on a CPU torch: the default causal mask (``transformer/utils.py``:
``torch.ones(sq, sq, device="cuda")``), TP gathers (``tensor_parallel/mappings.py``:
``device=torch.cuda.current_device()``), DDP grad/param buffers (``distributed/param_and_grad_buffer.py``),
``FP32Optimizer.__init__`` (``torch.tensor([1.0], device='cuda')``), and DistributedOptimizer accepts only
``torch.cuda.{Float,Half,BFloat16}Tensor`` params (``TypeError: Wrapped parameters must be one of ...``).
The CUDA RNG tracker's ``fork()`` needs CUDA generators. So Megatron's code runs under :class:`CpuAsCuda`
(a ``TorchFunctionMode`` mapping CUDA device arguments to CPU, ``.cuda()`` to a no-op, and reporting CPU
float tensors as ``torch.cuda.*Tensor`` to ``Tensor.type()``) with Megatron's own no-op "inference" RNG
tracker (:mod:`.megatron_job`). With it, Megatron's DDP, ``get_megatron_optimizer`` (Adam, decoupled
weight decay; torch.optim fallback as Apex/TE are absent), OptimizerParamScheduler, ``sharded_state_dict``
and ``dist_checkpointing.save/load`` all run; nothing in Megatron is edited, and every byte of a
checkpoint is written by Megatron's own save path. The MoE path needs two more stand-ins
(:func:`install_cuda_stubs` with ``moe=True``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


_CPU_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class CpuAsCuda(TorchFunctionMode):
    """Run CUDA-hard-coded Megatron code on CPU: every CUDA device argument becomes CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            args = tuple(
                "cpu" if (i > 0 and _is_cuda(a) and not isinstance(a, bool)) else a for i, a in enumerate(args)
            )
        if name == "type" and args and isinstance(args[0], torch.Tensor) and len(args) == 1 and not kwargs:
            t = func(*args)
            return _CPU_TYPES.get(t, t)
        if name == "is_cuda":  # property getter
            return True
        return func(*args, **kwargs)


def install_cuda_stubs(moe: bool = False) -> None:
    """The ``torch.cuda`` queries Megatron makes outside tensor functions, answered for one CPU "device".

    ``moe``: the allgather dispatcher's backward allocates with ``device=torch.cuda.current_device()``,
    and autograd runs backward nodes outside :class:`CpuAsCuda` (a thread-local mode), so the device
    itself must be CPU; and MCore 0.16.1 without Transformer Engine tests ``te_general_gemm is not None``
    in ``router_gating_linear``, a name bound only when TE imports (``NameError`` otherwise): it is
    bound to None, torch's path."""
    torch.cuda.current_device = lambda: "cpu" if moe else 0  # type: ignore[assignment,return-value]
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    if moe:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
