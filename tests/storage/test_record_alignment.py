"""Tensor records start on :data:`~ucp_dcp.storage.format.RECORD_ALIGN` file offsets, so their data does too.

Records packed back to back (DCP's ``FileSystemWriter``) put every tensor after the first at an odd file
offset, and a read out of the page cache from odd source addresses runs at about half the speed
(``docs/performance.md``, Alignment). The writer pads with zeros; ``verify`` accepts exactly that padding
and nothing else between items.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

import ucp_dcp
from ucp_dcp.storage.format import IO_KEY, RECORD_ALIGN, item_key
from ucp_dcp.tools.verify import verify

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    # odd sizes and mixed dtypes: every record length differs from a multiple of 64
    return {
        "model": {
            "a": torch.randn(37, 11, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "c": torch.randint(0, 100, (3, 7, 13), generator=g, dtype=torch.int16),
            "d": torch.randn(129, generator=g).double(),
        },
        "step": 11,
        "note": "a byte object between tensors",
    }


def _tensor_data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    md = pickle.loads((path / ".metadata").read_bytes())
    table = md.storage_data[MetadataIndex(IO_KEY)]["items"]
    out = {}
    for index, info in md.storage_data.items():
        entry = table.get(item_key(index)) if index.fqn != IO_KEY else None
        if entry is not None and entry[0] >= 0 and index.offset is not None:
            out[index.fqn] = (info.offset, info.offset + entry[0])
    return out


def test_every_tensor_record_and_its_data_start_aligned_and_load_bitwise(tmp_path):
    src = _state()
    ucp_dcp.save(src, tmp_path)
    offsets = _tensor_data_offsets(tmp_path)
    assert set(offsets) == {"model.a", "model.b", "model.c", "model.d"}
    for fqn, (record, data) in offsets.items():
        assert record % RECORD_ALIGN == 0 and data % RECORD_ALIGN == 0, (fqn, record, data)
    # the stock writer packs the same records back to back: what this test would see without the padding
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    stock = pickle.loads((tmp_path / "stock" / ".metadata").read_bytes())
    assert any(info.offset % RECORD_ALIGN for info in stock.storage_data.values())
    got = {
        "model": {k: torch.zeros_like(v) for k, v in src["model"].items()},
        "step": 0,
        "note": "",
    }
    ucp_dcp.load(got, tmp_path)
    for k, v in src["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v)
    assert got["step"] == 11 and got["note"] == src["note"]
    assert verify(tmp_path).status == "ok"


def _first_gap(path: Path) -> tuple[Path, int, int]:
    md = pickle.loads((path / ".metadata").read_bytes())
    spans = sorted(
        (info.relative_path, info.offset, info.offset + info.length)
        for index, info in md.storage_data.items()
        if index.fqn != IO_KEY and hasattr(info, "offset")
    )
    for (rel, _, end), (rel2, start, _) in zip(spans, spans[1:]):
        if rel == rel2 and start > end:
            return path / rel, end, start
    raise AssertionError("no padding between records")


def test_verify_finds_a_nonzero_byte_in_the_padding(tmp_path):
    ucp_dcp.save(_state(), tmp_path)
    file, lo, hi = _first_gap(tmp_path)
    assert 0 < hi - lo < RECORD_ALIGN
    data = bytearray(file.read_bytes())
    data[lo] = 0x5A
    file.write_bytes(bytes(data))
    report = verify(tmp_path)
    assert report.status == "corrupt"
    assert any(f"bytes {lo}..{hi} belong to no item" in p.what for p in report.problems)
