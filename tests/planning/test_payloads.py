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


# -- the wire forms -----------------------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(
            st.integers(0, 5), st.sampled_from([SHARD, TENSOR, BYTES]), st.integers(0, 2**40), st.integers(-1, 9)
        ),
        max_size=30,
    )
)
def test_packed_items_come_back_as_they_were(rows):
    names = [f"a{i}" for i in range(6)]
    packed, items = _rank(names, [(1,)] * 6, [(a, k, (o, o + 1), (s, 2)) for a, k, o, s in rows])
    back = packed.unpack_items()
    for mine, got in zip((items.atom, items.kind, items.off, items.size), (back.atom, back.kind, back.off, back.size)):
        assert mine.dtype == got.dtype and mine.shape == got.shape and (mine == got).all()
    assert packed.unpack_structure() == PlanStructure(
        names, [(1,)] * 6, [dtype_code(torch.float32)] * 6, {}, {"meshes": [], "atoms": {}}, [], []
    )


def test_a_ranks_structure_and_items_are_packed_small():
    """1000 sharded tensors and 1000 scalars on 4,096 ranks (recipes/bench_planning.py's rank): the structure
    LZMA-packed, the items delta-encoded; 48 KB a rank before (198 MB gathered at 4,096 ranks)."""
    ranks, f32 = 4096, dtype_code(torch.float32)
    names, shapes, paths = [], [], {}
    cat = {"meshes": [{"shape": [ranks], "dim_names": ["dp"], "ranks": list(range(ranks))}], "atoms": {}}
    for i in range(1000):
        param = f"layers.{i // 8}.block.w{i % 8}.weight"
        w, step = f"model.{param}", f"optim.state.{param}.step"
        names += [w, step]
        shapes += [(ranks * 8, 256), ()]
        paths[w], paths[step] = ("model", param), ("optim", "state", param, "step")
        layout = {"mesh": 0, "placements": ["S(0)"]}
        cat["atoms"][w] = {"kind": "model", "param": param, "value": "tensor", "shape": [ranks * 8, 256],
                           "dtype": "float32", "pattern": "dtensor", "layout": layout}  # fmt: skip
        cat["atoms"][step] = {"kind": "optim_state", "param": param, "value": "tensor", "shape": [],
                              "dtype": "float32", "pattern": "plain"}  # fmt: skip
    structure = PlanStructure(names, shapes, [f32] * 2000, paths, cat, sorted(names[1::2]), [])
    off = np.full((2000, 2), -1, dtype=np.int64)
    size = np.full((2000, 2), -1, dtype=np.int64)
    off[0::2], size[0::2] = (5 * 8, 0), (8, 256)
    kind = np.tile(np.array([SHARD, TENSOR], dtype=np.uint8), 1000)
    packed = PackedPlan.pack(structure, LocalItems(np.arange(2000, dtype=np.int32), kind, off, size))
    assert len(packed.items) < 2000 and len(packed.structure) < 20000  # 4 KB and 44 KB with zlib
    assert packed.structure[:1] in (b"x", b"z") and packed.unpack_structure() == structure
    back = packed.unpack_items()
    assert (back.off == off).all() and (back.size == size).all() and (back.kind == kind).all()


def test_a_load_payloads_meshes_travel_packed():
    import pickle

    from ucp_dcp.planning.payloads import LoadPlanPayload, RuleUsage

    big = tuple(range(1, 4 * 2048, 4))
    p = LoadPlanPayload(
        RuleUsage([0], [("layers", 1, 0)]), "ranks", True, {(big, (("pp", 1),)): b"n", ((0, 1), ()): b"m"}
    )
    wire = pickle.dumps(p)
    back = pickle.loads(wire)
    assert back == p and list(back.meshes) == list(p.meshes)
    assert len(wire) < 600  # the 2048 ranks of a data-parallel mesh: a few bytes, not ~6 KB
