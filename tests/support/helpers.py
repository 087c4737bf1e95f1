"""Small shared helpers for the tests."""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m ucp_dcp ARGS`` in this process: its exit status and what it printed, as a subprocess
    would give them, without the seconds a fresh interpreter spends importing torch (``test_inspect_cli``
    keeps the real command line covered)."""
    from ucp_dcp.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["python", "-m", "ucp_dcp", *args], code, out.getvalue(), err.getvalue())


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


def dcp_calls(patch) -> list[tuple[str, str, str]]:
    """From now on (``patch``: ``dist.patch`` in a task, ``monkeypatch.setattr`` in a test), every
    ``torch.distributed.checkpoint`` save/async_save/load as (function, planner type, storage type).
    torchtitan calls them through that module: UCPCheckpointManager adds our planner and storage to
    its calls, stock torchtitan passes neither (``NoneType``)."""
    import torch.distributed.checkpoint as dcp

    calls: list[tuple[str, str, str]] = []

    def spy(fn, storage):
        real = getattr(dcp, fn)

        def call(*args, **kwargs):
            calls.append((fn, type(kwargs.get("planner")).__name__, type(kwargs.get(storage)).__name__))
            return real(*args, **kwargs)

        return call

    for fn, storage in (("save", "storage_writer"), ("async_save", "storage_writer"), ("load", "storage_reader")):
        patch(dcp, fn, spy(fn, storage))
    return calls


UCP_SAVE = ("save", "UCPSavePlanner", "UCPFileSystemWriter")
UCP_ASYNC_SAVE = ("async_save", "UCPSavePlanner", "UCPFileSystemWriter")
UCP_LOAD = ("load", "UCPLoadPlanner", "UCPFileSystemReader")


def assert_written_by_ucp(path, storage: bool = True) -> None:
    """The checkpoint folder was written by ucp_dcp: its planner's catalog in ``.metadata``'s
    planner_data and, with ``storage`` (UCPFileSystemWriter, not DCP's writer), its integrity sidecar
    present and matching. Stock DCP writes neither, so a round trip that stock DCP would pass the same
    way tells ucp_dcp from it with this."""
    from torch.distributed.checkpoint import FileSystemReader

    from ucp_dcp.planning.catalog import read_catalog
    from ucp_dcp.storage.opening import open_path

    assert read_catalog(FileSystemReader(path).read_metadata().planner_data) is not None, f"no catalog in {path}"
    if storage:
        integrity = open_path(path)[1]
        assert integrity.status == "verified", (str(path), integrity.describe())


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
