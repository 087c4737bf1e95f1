"""``python -m ucp_dcp verify`` gives one verdict (issue 47): a damaged checkpoint's report said ``CORRUPT`` and,
just below, "integrity: verified: ..." (what its checksums cover, in ``Integrity``'s words). The coverage line now
says what the checksums cover without a verdict of its own."""

import pytest
import torch
from helpers import run_cli

import ucp_dcp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "no process group: one process" notice


def _saved(path):
    ucp_dcp.save({"w": torch.arange(256 * 1024, dtype=torch.float32).reshape(512, 512)}, path)
    (data,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
    return data


def test_a_healthy_checkpoint_reads_ok_and_what_its_checksums_cover(tmp_path):
    _saved(tmp_path)
    r = run_cli("verify", str(tmp_path))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0] == f"OK: {tmp_path}", r.stdout
    assert lines[1].startswith("  checksums (full): metadata matches .ucp.") and "every tensor block" in lines[1]


def test_a_damaged_checkpoint_reads_corrupt_and_nothing_says_verified(tmp_path):
    data = _saved(tmp_path)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # inside the tensor's 1 MiB of data
    data.write_bytes(bytes(raw))
    r = run_cli("verify", str(tmp_path))
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[0] == f"CORRUPT: {tmp_path} (1 problem(s))", r.stdout
    assert "verified" not in r.stdout and lines[1].startswith("  checksums (full): "), r.stdout
    assert "atom 'w', box [" in lines[-1] and "does not match its xxh3_64 checksum" in lines[-1], r.stdout
