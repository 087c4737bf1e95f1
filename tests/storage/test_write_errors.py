"""A data file write the storage fails (a full disk, a quota) is our error naming the file and the cause.

``torch.save`` closes its zip record after a failed write and raises its own ``unexpected pos`` error in
place of the storage's; without the writer keeping the storage's error, a full disk read as a torch bug.
The save does not commit, so the folder's previous checkpoint loads as it was.
"""

from __future__ import annotations

import contextlib
import errno
from typing import Any

import pytest
import torch

import ucp_dcp
from ucp_dcp.errors import StorageAccessError, ucp_errors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g), "note": f"run {seed}"}


class _FullAfter:
    """A write stream whose file system fills up after ``room`` bytes."""

    def __init__(self, stream: Any, room: int, err: int) -> None:
        self.stream, self.room, self.err = stream, room, err

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if n > self.room:
            raise OSError(self.err, "simulated")
        self.room -= n
        return self.stream.write(b)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _filling(writer: ucp_dcp.UCPFileSystemWriter, room: int, err: int = errno.ENOSPC) -> None:
    create = writer.fs.create_stream

    @contextlib.contextmanager
    def full(path: Any, mode: str):
        with create(path, mode) as stream:
            yield _FullAfter(stream, room, err) if str(path).endswith(".distcp") else stream

    writer.fs.create_stream = full  # type: ignore[method-assign]


@pytest.mark.parametrize("room", [0, 2000], ids=["at-the-first-record", "inside-a-tensor-record"])
def test_a_full_disk_is_named_and_the_previous_checkpoint_stands(tmp_path, room):
    import torch.distributed.checkpoint as dcp

    ucp_dcp.save(_state(1), tmp_path)
    writer = ucp_dcp.UCPFileSystemWriter(tmp_path)
    _filling(writer, room)
    with pytest.raises(StorageAccessError) as err, ucp_errors():  # what ucp_dcp.save raises: DCP's wrapper off
        dcp.save(_state(2), storage_writer=writer, planner=ucp_dcp.UCPSavePlanner())
    text = str(err.value)
    assert "No space left on device" in text and ".distcp" in text and "did not commit" in text, text
    assert "the file system is full" in text
    got = {"w": torch.zeros(64, 33), "b": torch.zeros(7), "note": ""}
    ucp_dcp.load(got, tmp_path)
    want = _state(1)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["note"] == "run 1"


def test_another_write_failure_keeps_its_own_cause(tmp_path):
    import torch.distributed.checkpoint as dcp

    writer = ucp_dcp.UCPFileSystemWriter(tmp_path)
    _filling(writer, 2000, errno.EIO)
    with pytest.raises(StorageAccessError) as err, ucp_errors():
        dcp.save(_state(3), storage_writer=writer, planner=ucp_dcp.UCPSavePlanner())
    assert "Input/output error" in str(err.value) and "permissions" in str(err.value)
