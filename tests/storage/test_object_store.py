"""Checkpoints on an S3-compatible store (moto's server on 127.0.0.1, started by the session fixture ``s3``):
the commit without rename, killed at every request of a save over a checkpoint; bad input (a wrong bucket,
missing credentials, a denied write, throttling, a listing that misses fresh objects); the tools on s3://.
One process each (DCP's no-process-group mode); the multi-rank resharding cases: test_object_store_dist.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import tensors_equal
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp
import ucp_dcp.storage.object_store as OS
import ucp_dcp.storage.object_streams as streams
from ucp_dcp import CheckpointNotFoundError, IncompleteCheckpointError, StorageAccessError, UCPFileSystemWriter
from ucp_dcp.storage.commit import METADATA
from ucp_dcp.storage.object_store import ObjectStore
from ucp_dcp.storage.opening import open_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS = 64
BIG = 1536  # 6 MiB of fp32 rows: two parts of a 5 MiB multipart upload


def _state(gen: int, rows: int = ROWS) -> dict:
    g = torch.Generator().manual_seed(100 + gen)
    return {"w": torch.randn(rows, 1024, generator=g), "b": torch.randn(16, generator=g), "step": gen, "tag": f"g{gen}"}


def _load(path: str, rows: int = ROWS) -> dict:
    sd = {"w": torch.zeros(rows, 1024), "b": torch.zeros(16), "step": -1, "tag": ""}
    ucp_dcp.load(sd, path)
    return sd


def _save(sd: dict, path: str, **kw) -> UCPFileSystemWriter:
    writer = UCPFileSystemWriter(path, thread_count=2, **kw)  # two data objects per save
    with warnings.catch_warnings(), ucp_dcp.ucp_errors():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=writer, planner=ucp_dcp.UCPSavePlanner())
    return writer


def _uploads(path: str) -> list[str]:
    store = ObjectStore(path)
    bucket, _, prefix = store.root.partition("/")
    return [u["Key"] for u in store.s3_call("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])]


def _raises(fn, cls):
    """The UCPError ``fn`` raises (DCP's CheckpointException unwrapped), checked to be a ``cls``."""
    with pytest.raises(cls) as e, ucp_dcp.ucp_errors():
        fn()
    return e.value


class _Killed(BaseException):
    """The process died here: it makes no further request (not even an abort)."""


def _kill_after(monkeypatch, allowed: int, log: list[str]) -> None:
    """Every store request after the first ``allowed`` of a save fails as if the process had been killed."""
    orig = ObjectStore.call

    def call(self, op, path, fn):
        log.append(f"{op} {path.rsplit('/', 1)[-1]}")
        if len(log) > allowed:
            raise _Killed(f"killed at request {len(log)}: {log[-1]}")
        return orig(self, op, path, fn)

    monkeypatch.setattr(ObjectStore, "call", call)


def _kill_walk(s3, monkeypatch, sample: bool) -> None:
    """Kill a save over a checkpoint before each of its requests in turn (``sample``: before the sidecar,
    the commit point and the first clean-up request only): the prefix then loads the previous generation
    (killed before the .metadata PUT) or the new one (after), bitwise; a killed save that wrote anything
    is detected (stray objects ``inspect`` reports, or multipart uploads left open); the next clean save
    removes the strays and aborts those uploads."""
    monkeypatch.setattr(streams, "PART_BYTES", 5 << 20)
    monkeypatch.setattr(streams, "SINGLE_PUT_BYTES", 5 << 20)
    path = s3.prefix
    _save(_state(0, BIG), path)
    clean: list[str] = []
    with monkeypatch.context() as m:
        _kill_after(m, 10**6, clean)
        _save(_state(1, BIG), path)  # a clean save over a checkpoint: the requests the kills walk through
    commit_at = clean.index(f"PUT {METADATA}") + 1  # requests up to and including the commit point
    assert any("(part 2)" in r for r in clean), clean  # the data went up as multipart uploads
    steps = range(len(clean))
    if sample:
        side = next(i for i, r in enumerate(clean) if r.startswith("PUT .ucp."))
        steps = [side, commit_at - 1, commit_at]  # type: ignore[assignment]
    current, outcomes = 1, []
    for allowed in steps:
        gen = allowed + 2
        log: list[str] = []
        with monkeypatch.context() as m:
            _kill_after(m, allowed, log)
            with pytest.raises((_Killed, CheckpointException)):
                _save(_state(gen, BIG), path)
        got = _load(path, BIG)
        which = next((g for g in (current, gen) if tensors_equal(got, _state(g, BIG))), None)
        assert which == (gen if allowed >= commit_at else current), (allowed, clean[allowed], which)
        if allowed < commit_at and any(r.startswith("PUT") for r in log[:allowed]):
            assert open_path(path)[1].strays or _uploads(path), f"killed at {log[allowed]}: nothing detected"
        outcomes.append(which == gen)
        current = which
    assert any(outcomes) and not all(outcomes)
    final = _state(99, BIG)
    _save(final, path)
    assert tensors_equal(_load(path, BIG), final)
    assert open_path(path)[1].strays == [] and _uploads(path) == []


def test_a_save_killed_before_its_sidecar_its_commit_or_after_loses_no_checkpoint(s3, monkeypatch):
    _kill_walk(s3, monkeypatch, sample=True)


@pytest.mark.full
def test_a_save_killed_at_every_request_loses_no_checkpoint(s3, monkeypatch):
    _kill_walk(s3, monkeypatch, sample=False)


def test_a_first_save_killed_before_its_commit_is_an_incomplete_checkpoint(s3, monkeypatch):
    log: list[str] = []
    with monkeypatch.context() as m:
        _kill_after(m, 10**6, log)
        _save(_state(0), s3.prefix)
    commit = log.index(f"PUT {METADATA}")
    with monkeypatch.context() as m:
        _kill_after(m, commit, [])
        with pytest.raises((_Killed, CheckpointException)):
            _save(_state(0), f"{s3.prefix}-2")
    _raises(lambda: _load(f"{s3.prefix}-2"), IncompleteCheckpointError)
    _raises(lambda: _load(f"{s3.prefix}-none"), CheckpointNotFoundError)


def test_a_listing_that_misses_fresh_objects_changes_nothing(s3):
    """The store's listings leave every object out: the commit (HEADs, PUTs by name) and the load (GETs
    by name) never depend on them; the stale objects a listing could not show stay until a later save."""
    path = s3.prefix
    _save(_state(0), path)
    s3.faults.hide.append(".")
    _save(_state(1), path)
    assert tensors_equal(_load(path), _state(1))
    s3.faults.hide.clear()
    assert len(open_path(path)[1].strays) == 3  # the first save's two data objects and its sidecar
    _save(_state(2), path)
    assert tensors_equal(_load(path), _state(2)) and open_path(path)[1].strays == []


def test_a_wrong_bucket_is_a_clear_error_and_nothing_is_created(s3):
    err = _raises(lambda: _save(_state(0), "s3://no-such-bucket/run"), StorageAccessError)
    assert "bucket 'no-such-bucket' does not exist" in err.message
    err = _raises(lambda: _load("s3://no-such-bucket/run"), StorageAccessError)
    assert "no-such-bucket" in err.message
    assert not ObjectStore(s3.prefix).fs.exists("no-such-bucket")


def test_missing_credentials_are_a_clear_error(s3, monkeypatch, tmp_path):
    import s3fs

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        err = _raises(lambda: _save(_state(0), s3.prefix), StorageAccessError)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert "no credentials" in err.message and "AWS_ACCESS_KEY_ID" in (err.hint or "")


def test_a_denied_commit_keeps_the_previous_checkpoint(s3):
    """A bucket policy that denies writing .metadata: the save fails with the request named, and the
    checkpoint it was replacing still loads."""
    _save(_state(0), s3.prefix)
    s3.faults.deny.append(("PUT", r"/\.metadata$"))
    err = _raises(lambda: _save(_state(1), s3.prefix), StorageAccessError)
    assert "denied" in err.message and ".metadata" in err.message
    assert tensors_equal(_load(s3.prefix), _state(0))


def test_a_store_that_denies_deletes_commits_and_warns_about_what_stays(s3):
    """A write-once bucket (DELETE denied): the save over a checkpoint commits and loads; the clean-up's
    refusal is a StaleObjectsWarning naming what to allow, not a failed save (a job would retry one that
    succeeded), and the replaced checkpoint's objects stay."""
    _save(_state(0), s3.prefix)
    before = set(ObjectStore(s3.prefix).names() or [])
    s3.faults.deny.append(("DELETE", r"\.distcp$"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        import torch.distributed.checkpoint as dcp

        dcp.save(_state(1), storage_writer=UCPFileSystemWriter(s3.prefix), planner=ucp_dcp.UCPSavePlanner())
    stale_warnings = [str(w.message) for w in seen if w.category is ucp_dcp.StaleObjectsWarning]
    assert len(stale_warnings) == 1 and "is committed" in stale_warnings[0] and "allow DELETE" in stale_warnings[0]
    assert s3.faults.refused["403"] >= 1
    assert tensors_equal(_load(s3.prefix), _state(1))
    stale = {n for n in before if n.endswith(".distcp")}
    assert stale and stale <= set(ObjectStore(s3.prefix).names() or [])


@pytest.fixture
def one_client_retry(monkeypatch):
    """The client tries a request once (botocore, s3fs), so the store's own backoff is what is seen."""
    import s3fs

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(OS, "BACKOFF_S", 0.02)
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_throttled_request_is_retried_with_backoff(s3, one_client_retry):
    s3.faults.throttle.append(["PUT", r"/\.metadata$", 3])
    _save(_state(0), s3.prefix)
    assert s3.faults.refused["503"] == 3
    assert tensors_equal(_load(s3.prefix), _state(0))


def test_a_store_that_keeps_throttling_is_a_clear_error(s3, one_client_retry):
    _save(_state(0), s3.prefix)
    s3.faults.throttle.append(["PUT", r"/\.metadata$", -1])
    err = _raises(lambda: _save(_state(1), s3.prefix), StorageAccessError)
    assert f"{OS.RETRIES} attempts" in err.message and "throttling" in err.message
    assert s3.faults.refused["503"] == OS.RETRIES
    s3.faults.throttle.clear()
    assert tensors_equal(_load(s3.prefix), _state(0))


def test_a_protocol_without_atomic_writes_is_refused():
    with pytest.raises(ucp_dcp.UCPError, match="promises neither"):
        UCPFileSystemWriter("ftp://host/run")


def test_verify_and_inspect_on_s3(s3, capsys):
    from ucp_dcp.tools.cli import main

    _save(_state(0), s3.prefix)
    assert main(["verify", s3.prefix]) == 0
    assert main(["inspect", s3.prefix]) == 0
    out = capsys.readouterr().out
    assert "OK:" in out and "verified" in out and "'w'" in out or "w " in out
    # a flipped byte of a data object is named by verify and refused by a load
    store = ObjectStore(s3.prefix)
    name = next(n for n in store.names() or [] if n.endswith(".distcp"))
    data = bytearray(store.get(store.join(name)) or b"")
    data[len(data) // 2] ^= 0x10
    store.put(store.join(name), bytes(data))
    assert main(["verify", s3.prefix]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    _raises(lambda: _load(s3.prefix), ucp_dcp.ChecksumError)


def _plan_target(rank, world_size):
    """``ucp_dcp plan``'s function target: the state one process loads."""
    return {"w": torch.zeros(ROWS, 1024), "b": torch.zeros(16), "step": -1, "tag": ""}


def test_plan_on_s3_reads_the_store_and_bounds_time_by_requests(s3, capsys):
    from ucp_dcp.tools.cli import main

    _save(_state(0), s3.prefix)
    s3.faults.clear()
    args = ["plan", s3.prefix, "--target", "test_object_store:_plan_target", "--world-size", "1"]
    assert main([*args, "--bandwidth", "1GB/s", "--request-rate", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "LOADS" in out and "integrity: verified" in out and "bound by the busiest node's requests" in out, out
    assert s3.faults.bytes_out["GET data"] == 0, "planning reads metadata, not data"


def test_many_small_items_are_fetched_in_a_few_requests(s3):
    """A model's norms and biases: 100 tensors of 4 KiB beside a 4 MiB matrix. Each read on its own is a GET
    (100+); the reader fetches the small items' bytes together, joined across their records' framing, and
    the bytes the server sends stay within 5 % of the state's."""
    sd = {f"n{i}": torch.randn(1024, generator=torch.Generator().manual_seed(i)) for i in range(100)}
    sd["w"] = torch.randn(1024, 1024)
    ucp_dcp.save(sd, s3.prefix)
    s3.faults.clear()
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    ucp_dcp.load(got, s3.prefix)
    assert tensors_equal(got, sd)
    needed = sum(v.numel() * 4 for v in sd.values())
    assert s3.faults.requests["GET object"] <= 2 + 8, dict(s3.faults.requests)  # .metadata, sidecar, data
    assert s3.faults.bytes_out["GET data"] <= 1.05 * needed


@given(st.integers(0, 1 << 40), st.integers(1, 200 << 20))
def test_a_read_is_cut_into_equal_pieces_near_the_range_size(start, n):
    """8 MiB and a record frame stay one GET (the frame would otherwise be a request of its own)."""
    pieces = streams.cut_range(start, n)
    assert pieces[0][0] == start and pieces[-1][1] == start + n
    assert all(a == b for (_, a), (b, _) in zip(pieces, pieces[1:]))
    sizes = [e - s for s, e in pieces]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 1.5 * streams.RANGE_BYTES + 1
    assert len(pieces) == max(1, round(n / streams.RANGE_BYTES))
