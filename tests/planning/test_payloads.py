"""The compact plan codec and the vectorized global save planner (single process, synthetic plans)."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ucp_dcp.errors import CoverageError
from ucp_dcp.planning.payloads import ItemKind, LocalItems, PackedPlan, PlanStructure, dtype_code
from ucp_dcp.planning.save_steps import plan_global

SHARD, TENSOR, BYTES = ItemKind.SHARD, ItemKind.TENSOR, ItemKind.BYTES


def _rank(names, shapes, rows, dtypes=None):
    """A rank's packed plan: rows of (atom index, kind, offsets, sizes)."""
    structure = PlanStructure(
        names, shapes, dtypes or [dtype_code(torch.float32)] * len(names), {}, {"meshes": [], "atoms": {}}, [], []
    )
    width = max([len(r[2]) for r in rows] + [1])
    off = np.full((len(rows), width), -1, dtype=np.int64)
    size = np.full((len(rows), width), -1, dtype=np.int64)
    for i, (_, _, o, s) in enumerate(rows):
        off[i, : len(o)] = o
        size[i, : len(s)] = s
    items = LocalItems(
        np.array([r[0] for r in rows], dtype=np.int32), np.array([r[1] for r in rows], dtype=np.uint8), off, size
    )
    return PackedPlan.pack(structure, items), items


def _plan(ranks, lowest=False):
    return plan_global([p for p, _ in ranks], lowest)


def test_dedup_balances_replicas_over_the_least_loaded_ranks():
    names = ["big"] + [f"r{i}" for i in range(6)]
    shapes = [(3000,)] + [(1000,)] * 6
    rank0 = _rank(names, shapes, [(0, TENSOR, (0,), (3000,))] + [(i, TENSOR, (0,), (1000,)) for i in range(1, 7)])
    others = [_rank(names[1:], shapes[1:], [(i, TENSOR, (0,), (1000,)) for i in range(6)]) for _ in range(3)]
    res = _plan([rank0, *others])
    written = [int(k.sum()) for k in res.keep]
    assert written == [1, 2, 2, 2]  # rank 0 already writes the big piece
    assert set(res.state_dict_metadata) == set(names)
    assert res.structure_of == [0, 1, 1, 1], "identical structures are decoded once"
    assert [int(k.sum()) for k in _plan([rank0, *others], lowest=True).keep] == [7, 0, 0, 0]


@given(st.integers(1, 5), st.integers(1, 40), st.integers(0, 3))
def test_sharded_pieces_tile_and_metadata_matches(world, rows, n_objects):
    names = ["w"] + [f"o{i}" for i in range(n_objects)]
    shapes = [(rows, 3)] + [None] * n_objects
    ranks = []
    for r in range(world):
        s, n = compact_chunk(rows, world, r)
        items = ([(0, SHARD, (s, 0), (n, 3))] if n else []) + [(1 + i, BYTES, (), ()) for i in range(n_objects)]
        ranks.append(_rank(names, shapes, items, [dtype_code(torch.float32)] + [-1] * n_objects))
    res = _plan(ranks)
    chunks = res.state_dict_metadata["w"].chunks
    assert sum(c.sizes[0] for c in chunks) == rows and sum(int(k.sum()) for k in res.keep) == len(chunks) + n_objects


def compact_chunk(n, k, i):
    c = -(-n // k)
    s = min(c * i, n)
    return s, max(0, min(c * (i + 1), n) - s)


def test_inconsistent_layouts_are_caught():
    names, shapes = ["w"], [(10,)]
    a = _rank(names, shapes, [(0, SHARD, (0,), (6,))])
    b = _rank(names, shapes, [(0, SHARD, (4,), (6,))])  # overlaps a: 12 elements for a 10-element atom
    with pytest.raises(CoverageError, match="cover 12 elements, not 10"):
        _plan([a, b])
    c = _rank(names, shapes, [(0, SHARD, (8,), (6,))])
    with pytest.raises(CoverageError):
        _plan([_rank(names, shapes, [(0, SHARD, (0,), (8,))]), c])
