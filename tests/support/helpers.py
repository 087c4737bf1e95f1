"""Small shared helpers for the tests."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp

ROOT = Path(__file__).resolve().parents[2]


def ucp_failure(exc: BaseException) -> ucp_dcp.UCPError:
    """The UCPError inside a DCP CheckpointException (asserting there is one)."""
    assert isinstance(exc, CheckpointException), f"expected CheckpointException, got {type(exc)}: {exc}"
    err = ucp_dcp.first_ucp_error(exc)
    assert err is not None, f"no UCPError in failures: {exc}"
    return err


def expect_ucp_error(fn, cls=ucp_dcp.UCPError) -> ucp_dcp.UCPError:
    try:
        fn()
    except CheckpointException as e:
        err = ucp_failure(e)
        assert isinstance(err, cls), f"expected {cls.__name__}, got {type(err).__name__}: {err}"
        return err
    raise AssertionError(f"expected {cls.__name__}, nothing was raised")


def tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def env_without_ucp() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def rewrite_metadata(folder, md) -> None:
    """Replace a checkpoint's metadata *and* its integrity sidecar (what a writer that meant to
    write ``md`` would have left), so a test can change a table without tripping the sidecar check."""
    import pickle

    from ucp_dcp.storage.commit import commit
    from ucp_dcp.storage.sidecar import encode_sidecar

    data = pickle.dumps(md)
    files = {}
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            files[rel] = max(files.get(rel, 0), info.offset + info.length)
    commit(str(folder), data, encode_sidecar(md, data, files), set(files), sync=False)


def skip_unless_torchtitan_runs() -> None:
    """Skip the calling test module on a torch older than torchtitan 0.3.0 needs: its trainer and models import
    ``torch.distributed.fsdp.DataParallelMeshDims``, new in torch 2.12 (the GPU machine's torch is 2.11)."""
    from torch.distributed import fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        pytest.skip(
            f"torchtitan 0.3.0 needs torch >= 2.12 (torch.distributed.fsdp.DataParallelMeshDims); "
            f"this is torch {torch.__version__}",
            allow_module_level=True,
        )


def _flex_masks_run() -> bool:
    from torch.nn.attention.flex_attention import create_block_mask

    return "separate_full_blocks" in inspect.signature(create_block_mask).parameters


torchtitan_forward = pytest.mark.skipif(
    not _flex_masks_run(),
    reason=f"torchtitan 0.3.0's models build flex-attention masks with create_block_mask(separate_full_blocks=...), "
    f"which torch {torch.__version__} does not take (2.13+ does)",
)
"""Mark a test that runs a torchtitan model's forward pass."""
