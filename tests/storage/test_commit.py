"""Trust: atomic commit, integrity of every byte a load uses, safe opening, our errors, verify.

Single-process saves and loads (DCP without a process group) plus the fault-injection recipe's
small runs in subprocesses; `make faults` runs the full set.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import ROOT, assert_written_by_ucp, expect_ucp_error, rewrite_metadata, run_cli
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ucp_dcp
from ucp_dcp import UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.storage.opening import open_path
from ucp_dcp.tools.verify import verify

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(300, 500, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
        "optim": {"lr": 0.001, "betas": (0.9, 0.95)},
        "train": {"step": 3, "rng": (torch.ones(2) * seed,)},
    }


def _empty() -> dict:
    return {
        "model": {"w": torch.zeros(300, 500), "b": torch.zeros(7, dtype=torch.bfloat16)},
        "optim": {"lr": None, "betas": None},
        "train": {"step": None, "rng": None},
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _load(path, **kw) -> dict:
    sd = _empty()
    ucp_dcp.load(sd, path, **kw)
    return sd


def _names(path) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir())


def _data_file(path) -> Path:
    return next(p for p in Path(path).iterdir() if p.name.endswith(".distcp"))


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


# -- atomic commit ---------------------------------------------------------------------------------------


def test_a_save_replaces_the_old_checkpoint_only_after_it_commits(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    old = _names(tmp_path)
    writer = UCPFileSystemWriter(tmp_path)
    dcp.save(_state(1), storage_writer=writer, planner=UCPSavePlanner())
    new = _names(tmp_path)
    assert not set(old) & set(new) - {".metadata"}, "new data must go to names the old metadata does not use"
    assert sorted(writer.removed) == sorted(set(old) - {".metadata"})
    assert _same(_load(tmp_path), _state(1))
    # the stock tools still read what we write
    back = _empty()
    dcp.load(back, checkpoint_id=tmp_path)
    assert _same(back, _state(1))
    dcp_to_torch_save(tmp_path, tmp_path.parent / "full.pt")
    assert torch.equal(torch.load(tmp_path.parent / "full.pt")["model"]["w"], _state(1)["model"]["w"])


def test_a_folder_whose_old_files_cannot_be_removed_commits_and_warns(tmp_path, monkeypatch):
    """Removing the replaced checkpoint's files is refused (a permission error after the commit): the
    save is committed, so it succeeds with a StaleObjectsWarning naming what stays (a failed save would
    make a job retry one that succeeded); the next save that may remove them does."""
    ucp_dcp.save(_state(0), tmp_path)
    old = {p.name for p in tmp_path.iterdir() if p.name.endswith(".distcp")}
    real = os.remove

    def denied(path, *a, **kw):
        if Path(path).name in old:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "remove", denied)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dcp.save(_state(1), storage_writer=UCPFileSystemWriter(tmp_path), planner=UCPSavePlanner())
    stale = [str(w.message) for w in seen if w.category is ucp_dcp.StaleObjectsWarning]
    assert len(stale) == 1 and "is committed" in stale[0] and "Permission denied" in stale[0], stale
    assert old <= set(_names(tmp_path))
    assert _same(_load(tmp_path), _state(1))
    monkeypatch.setattr(os, "remove", real)
    ucp_dcp.save(_state(2), tmp_path)
    assert not old & set(_names(tmp_path)) and _same(_load(tmp_path), _state(2))


def test_a_crash_between_sidecar_and_metadata_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    ucp_dcp.save(_state(0), tmp_path)
    real = os.replace

    def crash_on_commit(src, dst):
        if str(dst).endswith(".metadata"):
            raise KeyboardInterrupt("killed at the commit")  # what SIGKILL leaves, minus the process
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_commit)
    with pytest.raises(BaseException):
        dcp.save(_state(1), storage_writer=UCPFileSystemWriter(tmp_path), planner=UCPSavePlanner())
    monkeypatch.setattr(os, "replace", real)
    assert _same(_load(tmp_path), _state(0))
    _, integ = open_path(tmp_path)
    assert integ.status == "verified" and len(integ.strays) >= 2, integ  # new data file, sidecar, tmp file
    out = run_cli("inspect", str(tmp_path))
    assert "stray file(s) of an interrupted save" in out.stdout, out.stdout + out.stderr
    ucp_dcp.save(_state(2), tmp_path)  # the next save cleans up
    assert not open_path(tmp_path)[1].strays and _same(_load(tmp_path), _state(2))


def test_pieces_of_a_save_that_never_committed_are_an_incomplete_checkpoint(tmp_path, monkeypatch):
    real = os.replace
    monkeypatch.setattr(
        os,
        "replace",
        lambda s, d: (_ for _ in ()).throw(KeyboardInterrupt()) if str(d).endswith(".metadata") else real(s, d),
    )
    with pytest.raises(BaseException):
        dcp.save(_state(0), storage_writer=UCPFileSystemWriter(tmp_path), planner=UCPSavePlanner())
    monkeypatch.setattr(os, "replace", real)
    with pytest.raises(ucp_dcp.IncompleteCheckpointError, match="incomplete checkpoint.*no .metadata") as e:
        _load(tmp_path)
    assert any(n.endswith(".distcp") for n in e.value.saved)
    out = run_cli("inspect", str(tmp_path))
    assert out.returncode == 2 and "incomplete checkpoint" in out.stderr
    assert verify(tmp_path).status == "incomplete"
    with pytest.raises(FileNotFoundError):  # DCP's own reader does not take it for a checkpoint either
        dcp.FileSystemReader(tmp_path).read_metadata()


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    err = expect_ucp_error(
        lambda: dcp.save(
            _state(1), storage_writer=UCPFileSystemWriter(tmp_path, overwrite=False), planner=UCPSavePlanner()
        )
    )
    assert "overwrite=False" in str(err) and _same(_load(tmp_path), _state(0))


# -- every byte a load uses is verified -------------------------------------------------------------------


def _item(path, fqn):
    md, _ = open_path(path)
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = md.storage_data[MetadataIndex(fqn)]
    return Path(path, info.relative_path), info


def test_a_flipped_bit_in_a_saved_number_is_caught(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    path, info = _item(tmp_path, "optim.lr")
    raw = path.read_bytes()[info.offset : info.offset + info.length]
    at = raw.find(pickle.dumps(0.001)[2:-1])  # the float's 8 bytes inside the pickled value
    _flip(path, info.offset + (at if at >= 0 else info.length // 2) + 7)
    with pytest.raises(ucp_dcp.ChecksumError, match="optim.lr"):
        _load(tmp_path)
    assert verify(tmp_path).status == "corrupt"


@pytest.mark.parametrize("which", [".metadata", "sidecar"])
def test_a_flip_in_the_tables_is_caught(tmp_path, which):
    ucp_dcp.save(_state(0), tmp_path)
    name = ".metadata" if which == ".metadata" else next(n for n in _names(tmp_path) if n.startswith(".ucp."))
    p = Path(tmp_path, name)
    _flip(p, p.stat().st_size // 2)
    with pytest.raises(ucp_dcp.CorruptCheckpointError):
        _load(tmp_path)
    r = verify(tmp_path)
    assert r.status == "corrupt" and r.exit_code == 1


def test_a_missing_sidecar_is_not_silently_skipped(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    for n in _names(tmp_path):
        if n.startswith(".ucp."):
            os.remove(tmp_path / n)
    with pytest.raises(ucp_dcp.CorruptCheckpointError, match="sidecar, which is missing"):
        _load(tmp_path)


def test_a_checkpoint_without_checksums_warns_once_and_says_how(tmp_path):
    dcp.save(_state(0), checkpoint_id=tmp_path, planner=UCPSavePlanner())  # DCP's own writer
    sd = _empty()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ucp_dcp.load(sd, tmp_path)
    ours = [w for w in caught if issubclass(w.category, ucp_dcp.UnverifiedCheckpointWarning)]
    assert len(ours) == 1 and "no checksums" in str(ours[0].message) and "UCPFileSystemWriter" in str(ours[0].message)
    assert _same(sd, _state(0))
    assert open_path(tmp_path)[1].status == "none"
    assert verify(tmp_path).status == "unchecksummed" and verify(tmp_path).exit_code == 3


def test_a_writer_without_checksums_is_reported_as_unverified(tmp_path):
    dcp.save(_state(0), storage_writer=UCPFileSystemWriter(tmp_path, checksums=False), planner=UCPSavePlanner())
    with pytest.warns(ucp_dcp.UnverifiedCheckpointWarning, match="no checksums"):
        assert _same(_load(tmp_path), _state(0))
    assert open_path(tmp_path)[1].status == "none" and verify(tmp_path).status == "unchecksummed"


def test_a_load_through_the_stock_reader_warns_that_nothing_is_verified(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    with pytest.warns(ucp_dcp.UnverifiedCheckpointWarning, match="verifies no checksums"):
        dcp.load(_empty(), checkpoint_id=tmp_path, planner=UCPLoadPlanner())


# -- safe to open ------------------------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_metadata_pickle_never_runs(tmp_path):
    ckpt = tmp_path / "ckpt"
    dcp.save(_state(0), checkpoint_id=ckpt)
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ucp_dcp.UnsafeCheckpointError, match="could run code"):
        _load(ckpt)
    out = run_cli("inspect", str(ckpt))
    assert out.returncode == 2 and "UnsafeCheckpointError" not in out.stderr and "could run code" in out.stderr
    assert verify(ckpt).status == "unsafe"
    assert not marker.exists()


def test_a_crafted_value_is_refused_unless_trusted(tmp_path):
    marker = tmp_path / "ran"

    class Hostile(UCPSavePlanner):  # a writer with valid checksums over a crafted object
        def resolve_data(self, item):
            if item.index.fqn == "optim.lr":
                buf = io.BytesIO()
                torch.save(_Payload(marker), buf)
                return buf
            return super().resolve_data(item)

    dcp.save(_state(0), storage_writer=UCPFileSystemWriter(tmp_path / "c"), planner=Hostile())
    with pytest.raises(ucp_dcp.UnsafeCheckpointError, match="optim.lr.*could run code") as e:
        _load(tmp_path / "c")
    assert e.value.atom == "optim.lr" and "trust=True" in str(e.value)
    assert not marker.exists()
    _load(tmp_path / "c", trust=True)  # the explicit opt-in is the only way in
    assert marker.exists()


def test_safe_values_round_trip_without_trust(tmp_path):
    state = {"w": torch.ones(3), "v": {"a": [1, 2.5, "x", None, True], "t": (torch.arange(3), {"k": b"raw"})}}
    ucp_dcp.save(state, tmp_path)
    assert_written_by_ucp(tmp_path)
    back = {"w": torch.zeros(3), "v": {"a": None, "t": None}}
    stats = ucp_dcp.load(back, tmp_path)
    assert _same(back, state) and stats.bytes_read > 0, "read by UCPFileSystemReader's safe decoding"


# -- our errors --------------------------------------------------------------------------------------------


def test_no_checkpoint_at_the_path(tmp_path):
    with pytest.raises(ucp_dcp.CheckpointNotFoundError, match="does not exist"):
        _load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ucp_dcp.CheckpointNotFoundError, match="no .metadata"):
        _load(tmp_path / "empty")


def test_a_missing_data_file(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    name = _data_file(tmp_path).name
    os.remove(tmp_path / name)
    with pytest.raises(ucp_dcp.MissingFileError, match=f"{name} is missing") as e:
        _load(tmp_path)
    assert e.value.atom is not None


def test_a_truncated_data_file(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    p = _data_file(tmp_path)
    os.truncate(p, p.stat().st_size - 100)
    with pytest.raises(ucp_dcp.TruncatedFileError, match="truncated"):
        _load(tmp_path)


def test_tables_that_disagree_are_a_corrupt_checkpoint(tmp_path):
    ucp_dcp.save(_state(0), tmp_path)
    md, _ = open_path(tmp_path)
    from torch.distributed.checkpoint.metadata import MetadataIndex

    del md.storage_data[MetadataIndex("model.w", (0, 0))]
    rewrite_metadata(tmp_path, md)
    with pytest.raises(ucp_dcp.CorruptCheckpointError, match="model.w.*no storage entry"):
        _load(tmp_path)


# -- verify ------------------------------------------------------------------------------------------------


def test_verify_names_file_atom_and_box_of_a_bad_block(tmp_path):
    big = {"w": torch.randn(1024, 512)}  # 2 MiB: 64 checksum blocks of 32 KiB, 16 rows each
    ucp_dcp.save(big, tmp_path)
    assert verify(tmp_path).status == "ok"
    md, _ = open_path(tmp_path)
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = md.storage_data[MetadataIndex("w", (0, 0))]
    data_offset = md.storage_data[MetadataIndex("__ucp_io__")]["items"]["w|0,0"][0]
    _flip(Path(tmp_path, info.relative_path), info.offset + data_offset + (1 << 20) + 5)
    out = run_cli("verify", str(tmp_path), "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    rep = json.loads(out.stdout)
    (p,) = rep["problems"]
    assert rep["status"] == "corrupt" and p["file"] == info.relative_path and p["atom"] == "w"
    assert p["box"] == "[512:528, 0:512]", p  # block 32: the 16 rows from 512


def test_verify_catches_a_flip_in_an_item_frame(tmp_path):
    w = torch.randn(64, 64)
    ucp_dcp.save({"w": w}, tmp_path)
    _flip(_data_file(tmp_path), 40)  # inside the item's zip header (its record name)
    sd = {"w": torch.zeros(64, 64)}
    ucp_dcp.load(sd, tmp_path)  # a load never reads those bytes: it is still right ...
    assert torch.equal(sd["w"], w)
    r = verify(tmp_path)  # ... and verify still reports them
    assert r.status == "corrupt" and "frame" in r.problems[0].what, r


# -- the fault-injection recipe, small ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(
    "kind,args,expect",
    [
        ("flips", ["--flips", "16"], "flips 16/16 caught"),
        ("truncations", ["--truncations", "6"], "truncations 6/6"),
        ("crashes", ["--crashes", "2"], "crashes 0/2 lost"),
        ("code-exec", [], "code-exec 0/5"),
        ("store", ["--store", "s3", "--crashes", "4"], "store crashes 0/4 lost, 0/4 undetected"),
    ],
)
def test_fault_injection(kind, args, expect):
    only = [] if kind == "store" else ["--only", kind]  # store: kills at a save's requests on a local S3 server
    out = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "faults.py"), *only, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert out.returncode == 0 and last == f"FAULTS OK: {expect}", out.stdout + out.stderr[-3000:]


def test_verify_checks_the_tile_sums_column_reads_use(tmp_path):
    """A tile table that disagrees with good bytes would fail only column loads: verify reports it."""
    ucp_dcp.save({"w": torch.randn(1024, 512)}, tmp_path)  # 2-D, 2 KiB rows: tile sums recorded
    md, _ = open_path(tmp_path)
    from torch.distributed.checkpoint.metadata import MetadataIndex

    entry = md.storage_data[MetadataIndex("__ucp_io__")]["items"]["w|0,0"]
    assert entry[3] is not None and len(entry[3][2]) > 1
    entry[3][2][1] ^= 1
    rewrite_metadata(tmp_path, md)
    r = verify(tmp_path)
    assert r.status == "corrupt" and "tile 1" in r.problems[0].what, r
