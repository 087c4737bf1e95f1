"""Integrity records bound to the metadata they describe (issue 31, item 4).

Each ``.ucp.<hash>.json`` was committed with one ``.metadata`` (its hash is the record's name and is
recorded inside it). Another writer saving into our folder (stock ``dcp.save``) replaces ``.metadata``
and leaves our record behind: that checkpoint loads as the stock checkpoint it is. A ``.metadata``
that says a ucp_dcp writer committed it (our catalog, our I/O table, data files a record lists) but
matches no record was changed after its commit and is refused.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

import ucp_dcp
from ucp_dcp import UCPSavePlanner
from ucp_dcp.storage.format import IO_KEY
from ucp_dcp.storage.opening import open_path
from ucp_dcp.tools.verify import verify

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FIXTURE = Path(__file__).parent / "data" / "sidecar_v1"
"""A checkpoint written by ``ucp_dcp.save`` before this change (main at e542697): sidecar format version 1."""


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(30, 50, generator=g), "b": torch.randn(7, generator=g)}, "train": {"step": seed}}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(30, 50), "b": torch.zeros(7)}, "train": {"step": None}}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _ucp_load(path, target: dict) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ucp_dcp.load(target, path)
    return [w for w in caught if issubclass(w.category, ucp_dcp.UnverifiedCheckpointWarning)]


def _records(path) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir() if p.name.startswith(".ucp."))


def test_a_stock_save_over_ours_loads_as_the_stock_checkpoint(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    old = sorted(p.name for p in tmp_path.iterdir() if p.name != ".metadata")
    dcp.save(_state(1), checkpoint_id=tmp_path)  # stock planner and FileSystemWriter: no record of its own
    stock = _empty()
    dcp.load(stock, checkpoint_id=tmp_path)
    ours = _empty()
    unverified = _ucp_load(tmp_path, ours)
    assert _same(ours, stock) and _same(ours, _state(1))
    assert len(unverified) == 1 and "no checksums" in str(unverified[0].message)
    _, integ = open_path(tmp_path)
    assert integ.status == "none" and sorted(integ.strays) == old, integ  # our old record and data file
    assert "checkpoint this one replaced" in integ.describe()
    assert verify(tmp_path).status == "unchecksummed"
    ucp_dcp.save(_state(2), tmp_path)  # the next save of ours commits over it and removes what is left
    _, integ = open_path(tmp_path)
    assert integ.status == "verified" and not integ.strays
    assert _same(_load_verified(tmp_path), _state(2))


def _load_verified(path) -> dict:
    out = _empty()
    assert not _ucp_load(path, out)
    return out


def _rewrite(path: Path, change) -> None:
    """Rewrite our ``.metadata`` with ``change(md)`` applied and no new record (what damage or an edit leaves)."""
    md = pickle.loads((path / ".metadata").read_bytes())  # our own fixture: trusted
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _drop_catalog(md) -> None:
    del md.planner_data[ucp_dcp.CATALOG_KEY]


def _drop_io(md) -> None:
    del md.storage_data[MetadataIndex(IO_KEY)]


def _rename_files(md) -> None:
    for info in md.storage_data.values():
        if hasattr(info, "relative_path"):
            info.relative_path = "__0_0.distcp"


SIGNS = {
    "all": (lambda md: None, ["catalog", "I/O table", "data file"]),
    "catalog only": (lambda md: (_drop_io(md), _rename_files(md)), ["catalog"]),
    "io table only": (lambda md: (_drop_catalog(md), _rename_files(md)), ["I/O table"]),
    "data files only": (lambda md: (_drop_catalog(md), _drop_io(md)), ["data file"]),
}


@pytest.mark.parametrize("left", list(SIGNS))
def test_a_metadata_of_ours_that_no_record_describes_is_refused(tmp_path, left):
    change, named = SIGNS[left]
    ucp_dcp.save(_state(0), tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(ucp_dcp.CorruptCheckpointError, match="matches none of its integrity records") as e:
        ucp_dcp.load(_empty(), tmp_path)
    for word in named:
        assert word in e.value.message, e.value.message
    assert "restore the checkpoint from a good copy" in e.value.hint
    assert verify(tmp_path).status == "corrupt"


def test_our_planner_through_the_stock_writer_over_ours_is_refused_as_a_rewrite(tmp_path):
    """The catalog is the sign of ours that no damaged byte of ``storage_data`` can hide, so a save with
    UCPSavePlanner through a writer that keeps no record, into our folder, is refused too, with the way out."""
    ucp_dcp.save(_state(0), tmp_path)
    dcp.save(_state(1), checkpoint_id=tmp_path, planner=UCPSavePlanner())
    with pytest.raises(ucp_dcp.CorruptCheckpointError, match="carries ucp_dcp's catalog") as e:
        ucp_dcp.load(_empty(), tmp_path)
    assert "UCPFileSystemWriter" in e.value.hint and "delete the .ucp.*.json" in e.value.hint
    for name in _records(tmp_path):
        (tmp_path / name).unlink()
    assert _same(_ucp_load_ok(tmp_path), _state(1))


def _ucp_load_ok(path) -> dict:
    out = _empty()
    _ucp_load(path, out)
    return out


def test_a_metadata_that_no_longer_parses_is_refused(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    (tmp_path / ".metadata").write_bytes((tmp_path / ".metadata").read_bytes()[:-20])
    with pytest.raises(ucp_dcp.CorruptCheckpointError, match="does not open as DCP metadata either"):
        ucp_dcp.load(_empty(), tmp_path)


def _fixture_state() -> dict:
    return {
        "model": {
            "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
            "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        },
        "train": {"step": 7},
    }


def _fixture_target() -> dict:
    return {"model": {"w": torch.zeros(4, 6), "b": torch.zeros(2, dtype=torch.bfloat16)}, "train": {"step": None}}


def test_a_checkpoint_written_before_the_binding_loads_verified(tmp_path):
    ckpt = tmp_path / "old"
    shutil.copytree(FIXTURE, ckpt)
    out = _fixture_target()
    assert not _ucp_load(ckpt, out)
    assert _same(out, _fixture_state())
    assert open_path(ckpt)[1].status == "verified" and verify(ckpt).status == "ok"


def test_a_stock_save_over_a_checkpoint_written_before_the_binding_loads(tmp_path):
    ckpt = tmp_path / "old"
    shutil.copytree(FIXTURE, ckpt)
    new = {
        "model": {"w": -_fixture_state()["model"]["w"], "b": torch.ones(2, dtype=torch.bfloat16)},
        "train": {"step": 8},
    }
    dcp.save(new, checkpoint_id=ckpt)
    out = _fixture_target()
    assert len(_ucp_load(ckpt, out)) == 1
    assert _same(out, new)
