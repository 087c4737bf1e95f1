"""What a person sees printing a load's ``ReadStats`` or an ``async_save`` future's result (issue 47): a line of
totals, not every item (a load of 10,000 tensors printed 110 KB) nor every chunk of every key (DCP's ``Metadata``:
about 7 MB here); the details stay where they were."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

import ucp_dcp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "no process group: one process" notice

N = 2000


def _state():
    return {f"layer{i}.w": torch.full((64,), float(i)) for i in range(N)} | {"step": 7}


def test_read_stats_print_as_one_line_of_totals_and_keep_their_items(tmp_path):
    sd = _state()
    ucp_dcp.save(sd, tmp_path)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    stats = ucp_dcp.load(target, tmp_path)
    text = repr(stats)
    needed = N * 64 * 4 + _stored_length(tmp_path, "step")  # the tensors' bytes and the object's stored bytes
    assert stats.bytes_loaded == needed and len(text) < 300 and "\n" not in text and str(stats) == text, text
    size = ucp_dcp.progress.size_text
    assert text.startswith(f"ReadStats({size(needed)} needed, {size(stats.bytes_read)} read ("), text
    assert f" of {N + 1} item(s) from 1 file(s)" in text and f"; {stats.seconds:.2f} s)" in text, text
    assert len(stats.items) == N + 1 and stats.files == 1  # the per-item detail is still there


def _stored_length(path, key):
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return next(int(info.length) for index, info in md.storage_data.items() if index.fqn == key)


def test_an_async_saves_result_is_the_metadata_with_a_one_line_repr(tmp_path):
    sd = _state()
    md = ucp_dcp.async_save(sd, tmp_path).result()
    text = repr(md)
    assert isinstance(md, Metadata) and len(text) < 300 and str(md) == text, text
    assert text.startswith(f"SavedMetadata({N + 1} key(s): {N} tensor(s) of 500.0 KiB in {N} chunk(s), 1 object(s)")
    assert len(repr(Metadata(**vars(md)))) > 100_000  # what DCP's own repr printed
    # the checkpoint's own metadata: the same fields, equal both ways, and DCP's type again once pickled
    on_disk = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert md.state_dict_metadata == on_disk.state_dict_metadata and md.planner_data == on_disk.planner_data
    plain = Metadata(**vars(md))
    assert md == plain and plain == md
    again = pickle.loads(pickle.dumps(md))
    assert type(again) is Metadata and again == plain
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    ucp_dcp.load(target, tmp_path)
    assert torch.equal(target["layer9.w"], sd["layer9.w"]) and target["step"] == 7
