"""The foreign-checkpoint math (ucp_dcp.sources.foreign): flat ranges as boxes, source rows as atom boxes,
the inert reading of torch.save files, and a ForeignReader over hand-made flat partitions loading
into plain targets bitwise. Single process."""

import argparse
import math
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_dcp import Fused, Padded, UCPLoadPlanner
from ucp_dcp.errors import CorruptCheckpointError, ucp_errors
from ucp_dcp.sources.foreign.base import ForeignReader, row_layout
from ucp_dcp.sources.foreign.inert import Opaque, TensorRef, load_inert, parse_pickle
from ucp_dcp.sources.foreign.pieces import Piece, flat_boxes, split_rows

pytestmark = pytest.mark.filterwarnings("ignore::ucp_dcp.errors.UnverifiedCheckpointWarning")


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_flat_ranges_are_contiguous_boxes_in_order(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n - 1))
    numel = data.draw(st.integers(1, n - start))
    full = torch.arange(n).reshape(shape)
    got = []
    for offs, sizes, first in flat_boxes(shape, start, numel):
        box = full[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        flat = box.reshape(-1)
        assert torch.equal(flat, torch.arange(first, first + flat.numel()))  # contiguous, at `first`
        got.append(flat)
    assert torch.equal(torch.cat(got), torch.arange(start, start + numel))
    assert len(got) <= 2 * len(shape) - 1


@settings(max_examples=100, deadline=None)
@given(heads=st.integers(1, 4), rep=st.integers(1, 3), hd=st.integers(1, 3), cols=st.integers(1, 3), data=st.data())
def test_group_major_rows_split_into_their_atoms(heads, rep, hd, cols, data):
    q, kv = heads * rep * hd, heads * hd
    rows = q + 2 * kv
    rule = Fused(r"(.*)\.wqkv", [(r"\1.wq", q), (r"\1.wk", kv), (r"\1.wv", kv)], blocks=heads)
    layout = row_layout("a.wqkv", rows, [rule], prefix="m.")
    fused = torch.randn(rows, cols)
    parts = {
        "m.a.wq": torch.full((q, cols), float("nan")),
        "m.a.wk": torch.full((kv, cols), float("nan")),
        "m.a.wv": torch.full((kv, cols), float("nan")),
    }
    lo = data.draw(st.integers(0, rows - 1))
    hi = data.draw(st.integers(lo + 1, rows))
    for atom, offs, sizes, elem in split_rows(layout, (lo, 0), (hi - lo, cols), (rows, cols)):
        src = fused.reshape(-1)[lo * cols + elem : lo * cols + elem + math.prod(sizes)].reshape(sizes)
        parts[atom][offs[0] : offs[0] + sizes[0]] = src
    # the oracle: the toy model's own group-major fusion
    from ucp_dev.toy.model import deinterleave

    want = deinterleave(fused, [q, kv, kv], heads)
    for (_name, got), w in zip(parts.items(), want):
        rows_in = [r for r in range(got.shape[0]) if not torch.isnan(got[r]).any()]
        assert torch.equal(got[rows_in], w[rows_in])
    assert sum((~torch.isnan(p[:, 0])).sum().item() for p in parts.values()) == hi - lo


def test_padding_rows_are_nobodys():
    layout = row_layout("emb", 70, [Padded("emb", size=61)])
    assert split_rows(layout, (56, 0), (14, 3), (70, 3)) == [("emb", (56, 0), (5, 3), 0)]


def test_inert_parse_never_builds_foreign_classes(tmp_path):
    torch.save({"ns": argparse.Namespace(a=1), "t": torch.arange(6.0).reshape(2, 3)[1:]}, tmp_path / "x.pt")
    tf = load_inert(tmp_path / "x.pt")
    assert isinstance(tf.obj["ns"], Opaque) and tf.obj["ns"].qualname == "argparse.Namespace"
    assert tf.obj["ns"].field("a") == 1
    t = tf.obj["t"]
    assert isinstance(t, TensorRef) and t.shape == (1, 3)
    raw = (tmp_path / "x.pt").read_bytes()
    off = tf.byte_offset(t)
    assert np.frombuffer(raw[off : off + 12], dtype=np.float32).tolist() == [3.0, 4.0, 5.0]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/ucp-pwned",))


def test_a_crafted_pickle_runs_nothing(tmp_path):
    if os.path.exists("/tmp/ucp-pwned"):
        os.remove("/tmp/ucp-pwned")
    obj = parse_pickle(pickle.dumps({"x": _Evil()}), "crafted")
    assert isinstance(obj["x"], Opaque) and obj["x"].qualname in ("posix.system", "os.system")
    assert not os.path.exists("/tmp/ucp-pwned")


def test_a_tensor_reaching_past_its_record_is_refused(tmp_path):
    torch.save(torch.zeros(4), tmp_path / "x.pt")
    tf = load_inert(tmp_path / "x.pt")
    bad = TensorRef(tf.obj.key, torch.float32, 2, (4,), (1,))
    with pytest.raises(CorruptCheckpointError, match="reaches past"):
        tf.byte_offset(bad)


class _FlatReader(ForeignReader):
    """Two 'ranks' each holding half of one flat fp32 buffer of [w (5x3), b (4)], w fused [x (3 rows); y (2 rows)]."""

    source = "test"
    rules = [Fused(r"w", [("x", 3), ("y", 2)])]

    def describe(self):
        pieces, shapes = [], {"x": (torch.float32, (3, 3)), "y": (torch.float32, (2, 3)), "b": (torch.float32, (4,))}
        params = [("w", (5, 3), 0), ("b", (4,), 15)]
        for r in range(2):
            tf = load_inert(os.path.join(self.path, f"rank{r}.pt"))
            base = tf.byte_offset(tf.obj["flat"])
            lo, hi = r * 10, (r + 1) * 10
            for name, shape, start in params:
                a, b = max(lo, start), min(hi, start + math.prod(shape))
                if b <= a:
                    continue
                layout = row_layout(name, shape[0], self.rules)
                for offs, sizes, first in flat_boxes(shape, a - start, b - a):
                    for atom, o, s, elem in split_rows(layout, offs, sizes, shape):
                        at = base + (start + first + elem - lo) * 4
                        pieces.append(Piece(atom, o, s, f"rank{r}.pt", at, torch.float32))
        return pieces, shapes, {"step": 7}


def test_a_foreign_reader_serves_pieces_and_values(tmp_path):
    w, b = torch.randn(5, 3), torch.randn(4)
    flat = torch.cat([w.reshape(-1), b, torch.zeros(1)])  # padded to 2 x 10
    for r in range(2):
        torch.save(
            {"flat": flat[r * 10 : (r + 1) * 10].clone(), "meta": argparse.Namespace(r=r)}, tmp_path / f"rank{r}.pt"
        )
    sd = {"x": torch.zeros(3, 3), "y": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(4), "step": 0}
    with ucp_errors():
        dcp.load(sd, storage_reader=_FlatReader(tmp_path), planner=UCPLoadPlanner())
    assert torch.equal(sd["x"], w[:3]) and torch.equal(sd["y"], w[3:].double()) and torch.equal(sd["b"], b)
    assert sd["step"] == 7


def test_a_hole_in_the_pieces_is_refused_before_reading(tmp_path):
    class Holey(_FlatReader):
        def describe(self):
            pieces, shapes, values = super().describe()
            return [p for p in pieces if p.atom != "b"][:-1], shapes, values

    for r in range(2):
        torch.save({"flat": torch.zeros(10)}, tmp_path / f"rank{r}.pt")
    with pytest.raises(CorruptCheckpointError, match="cover"):
        with ucp_errors():
            dcp.load({"x": torch.zeros(3, 3)}, storage_reader=Holey(tmp_path), planner=UCPLoadPlanner())
