"""Tile checksums (issue 25): the math, and strided reads of a file verified by tiles (single process).

A column slice of a row-major chunk is verified by the tiles it touches, reading those tiles only;
whole checksum blocks span whole rows and would read everything."""

import math

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex

from ucp_dcp.errors import CorruptCheckpointError
from ucp_dcp.storage.tiled_read import plan_tiled, read_tiled, read_tiled_remote
from ucp_dcp.storage.tiles import TileGrid, region_tile_sums, saved_tile_grid, tile_checksums, tile_grid, tile_region

H = xxhash.xxh3_64


def _box_bytes(arr: np.ndarray, offsets, sizes) -> bytes:
    sl = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    return np.ascontiguousarray(arr[sl]).tobytes()


@st.composite
def chunks(draw):
    """A chunk (shape, itemsize) with tiles, small tiles so several tile rows exist, and a box of it."""
    ndim = draw(st.integers(2, 3))
    bands = draw(st.sampled_from([2, 4, 8]))
    cols = bands * draw(st.integers(1, 4))
    shape = (draw(st.integers(1, 40)), cols, *([draw(st.integers(1, 3))] if ndim == 3 else []))
    itemsize = draw(st.sampled_from([1, 2, 4]))
    tile = draw(st.sampled_from([64, 256, 1024]))
    offsets, sizes = [], []
    for d, n in enumerate(shape):
        whole = d >= 2 or draw(st.booleans()) and d == 0
        o = 0 if whole else draw(st.integers(0, n - 1))
        offsets.append(o)
        sizes.append(n if whole else draw(st.integers(1, n - o)))
    return shape, itemsize, tile, tuple(offsets), tuple(sizes)


def _grid(shape, itemsize, tile):
    """A grid with small bands (the module's MIN_BAND would give none at these sizes)."""
    cols, inner = shape[1], math.prod(shape[2:]) * itemsize
    bands = next(b for b in (8, 4, 2, 1) if cols % b == 0)
    return TileGrid(shape[0], cols, inner, bands, max(1, tile // (cols // bands * inner)))


@settings(max_examples=150, deadline=None)
@given(chunks())
def test_a_box_reads_exactly_its_tiles_and_their_sums_match_the_save(case):
    shape, itemsize, tile, offsets, sizes = case
    grid = _grid(shape, itemsize, tile)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, size=(*shape[:-1], shape[-1] * itemsize), dtype=np.uint8)
    raw = arr.reshape(-1)
    saved = tile_checksums(raw, grid, H)
    assert len(saved) == grid.groups * grid.bands
    region = tile_region(grid, shape, offsets, sizes)
    assert region is not None
    r0, r1 = region.row_span(grid)
    got = region_tile_sums(raw[r0 * grid.row_bytes : r1 * grid.row_bytes], grid, region, H)
    assert all(saved[t] == s for t, s in got) and len(got) == (region.g1 - region.g0) * (region.b1 - region.b0)
    # the tiles cover the box; aligned to bands and tile rows, they are the box
    per_band = shape[1] // grid.bands
    assert region.b0 * per_band <= offsets[1] and offsets[1] + sizes[1] <= region.b1 * per_band
    assert r0 <= offsets[0] and offsets[0] + sizes[0] <= r1
    aligned = (
        offsets[1] % per_band == 0
        and sizes[1] % per_band == 0
        and offsets[0] % grid.rows_per_tile == 0
        and (offsets[0] + sizes[0] == shape[0] or sizes[0] % grid.rows_per_tile == 0)
    )
    if aligned:
        assert region.nbytes(grid) == math.prod(sizes) * itemsize


def test_tiles_only_where_they_narrow_a_read():
    assert tile_grid((4096,), 4) is None  # one dim: a box is one run, blocks verify it
    assert tile_grid((96, 40), 4) is None  # no band of 512 bytes
    g = tile_grid((4096, 4096), 2)
    assert g is not None and g.bands == 16 and g.band_bytes == 512 and g.rows_per_tile == 512
    assert tile_grid((8, 64, 128), 4).bands == 64  # bands hold whole dim-2 rows
    assert tile_region(g, (4096, 4096), (0, 0), (10, 4096)) is not None
    assert tile_region(tile_grid((8, 64, 128), 4), (8, 64, 128), (0, 0, 5), (8, 64, 3)) is None  # dim 2 sliced


@pytest.mark.parametrize("bad", [[3, 512, []], [16, 0, []], ["x", 1, []], [16, 512, [1, 2]], [16]])
def test_a_tile_record_that_does_not_tile_the_chunk_is_corrupt(bad):
    with pytest.raises(CorruptCheckpointError, match="do not tile"):
        saved_tile_grid(bad, (4096, 4096), 2, MetadataIndex("w", (0, 0)))


def _file(tmp_path, arr: np.ndarray, pad: int = 100):
    p = tmp_path / "chunk.bin"
    p.write_bytes(b"\0" * pad + arr.tobytes())
    return p, pad


@pytest.mark.parametrize("degree", [2, 4, 8, 3])
def test_column_slices_read_only_their_tiles_bitwise(tmp_path, degree):
    shape = (1000, 2048)  # fp32: 16 bands of 512 B, 512 rows per tile, a short last tile row
    arr = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    grid = tile_grid(shape, 4)
    sums = tile_checksums(arr.view(np.uint8).reshape(-1), grid, H)
    p, base = _file(tmp_path, arr)
    per = -(-shape[1] // degree)
    boxes = [((0, k * per), (shape[0], min(per, shape[1] - k * per))) for k in range(degree)]
    tiled = plan_tiled(grid, shape, boxes)
    verified: set[int] = set()
    total = 0
    with open(p, "rb") as f:
        for (offs, sizes), box in zip(boxes, tiled):
            out = np.empty(math.prod(sizes) * 4, dtype=np.uint8)
            total += read_tiled(
                f.fileno(), base, shape, 4, grid, box, out, verified, lambda t, s: _check(sums, t, s), H
            )
            assert out.tobytes() == _box_bytes(arr, offs, sizes)
    assert verified == set(range(len(sums)))  # every tile checked once, across the boxes
    assert total == arr.nbytes  # the boxes together read the chunk once


def test_one_column_slice_reads_a_quarter(tmp_path):
    shape = (1024, 4096)
    arr = np.random.default_rng(2).standard_normal(shape, dtype=np.float32)
    grid = tile_grid(shape, 4)
    sums = tile_checksums(arr.view(np.uint8).reshape(-1), grid, H)
    p, base = _file(tmp_path, arr)
    (box,) = plan_tiled(grid, shape, [((0, 1024), (1024, 1024))])
    out = np.empty(1024 * 1024 * 4, dtype=np.uint8)
    with open(p, "rb") as f:
        n = read_tiled(f.fileno(), base, shape, 4, grid, box, out, set(), lambda t, s: _check(sums, t, s), H)
    assert n == arr.nbytes // 4 and out.tobytes() == _box_bytes(arr, (0, 1024), (1024, 1024))


def test_a_flipped_byte_in_a_read_tile_is_caught_and_one_outside_is_not_read(tmp_path):
    shape = (1024, 4096)
    arr = np.random.default_rng(3).standard_normal(shape, dtype=np.float32)
    grid = tile_grid(shape, 4)
    sums = tile_checksums(arr.view(np.uint8).reshape(-1), grid, H)
    bad = arr.copy()
    bad.view(np.uint8)[700, 1024 * 4 + 5] ^= 1  # row 700, inside columns [1024, 2048)
    bad.view(np.uint8)[3, 3 * 1024 * 4 + 9] ^= 1  # columns [3072, 4096): another slice
    p, base = _file(tmp_path, bad)
    (box,) = plan_tiled(grid, shape, [((0, 0), (1024, 1024))])
    out = np.empty(1024 * 1024 * 4, dtype=np.uint8)
    with open(p, "rb") as f:
        read_tiled(f.fileno(), base, shape, 4, grid, box, out, set(), lambda t, s: _check(sums, t, s), H)
        (box,) = plan_tiled(grid, shape, [((0, 1024), (1024, 1024))])
        with pytest.raises(ValueError, match="tile"):
            read_tiled(f.fileno(), base, shape, 4, grid, box, out, set(), lambda t, s: _check(sums, t, s), H)


def _check(sums, t, s):
    if sums[t] != s:
        raise ValueError(f"tile {t}")


# -- the same boxes from an object on a store: ranged requests of the touched bands of each row ------------


def _fetcher(data: bytes, log: list[tuple[int, int]]):
    def fetch(ranges):
        log.extend(ranges)
        return [data[s : s + n] for s, n in ranges]

    return fetch


@settings(max_examples=150, deadline=None)
@given(chunks())
def test_a_box_from_a_store_is_its_bytes_verified_by_its_tiles_fetching_at_most_2_percent_more(case):
    shape, itemsize, tile, offsets, sizes = case
    grid = _grid(shape, itemsize, tile)
    arr = np.random.default_rng(0).integers(0, 256, size=(*shape[:-1], shape[-1] * itemsize), dtype=np.uint8)
    sums = tile_checksums(arr.reshape(-1), grid, H)
    (box,) = plan_tiled(grid, shape, [(offsets, sizes)]) or [None]
    if box is None:
        return
    log: list[tuple[int, int]] = []
    out = np.empty(math.prod(sizes) * itemsize, dtype=np.uint8)
    verified: set[int] = set()
    fetched, requests = read_tiled_remote(
        _fetcher(b"\0" * 7 + arr.tobytes(), log), 7, shape, itemsize, grid, box, out, verified,
        lambda t, s: _check(sums, t, s), H,
    )  # fmt: skip
    byte_sizes = (*sizes[:-1], sizes[-1] * itemsize)
    byte_offsets = (*offsets[:-1], offsets[-1] * itemsize)
    assert out.tobytes() == _box_bytes(arr, byte_offsets, byte_sizes)
    r = box.region
    assert verified == {g * grid.bands + b for g in range(r.g0, r.g1) for b in range(r.b0, r.b1)}
    assert requests == len(log) and fetched == sum(n for _, n in log)
    assert fetched <= 1.02 * r.nbytes(grid), "the touched tiles' bytes, gaps joined within 2%"


@pytest.mark.parametrize("degree", [2, 4])
def test_column_slices_from_a_store_fetch_their_bytes_once(degree):
    shape = (1000, 2048)  # as the local test: 16 bands of 512 B, a short last tile row
    arr = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    grid = tile_grid(shape, 4)
    sums = tile_checksums(arr.view(np.uint8).reshape(-1), grid, H)
    per = shape[1] // degree
    boxes = [((0, k * per), (shape[0], per)) for k in range(degree)]
    log: list[tuple[int, int]] = []
    total = 0
    for (offs, sizes), box in zip(boxes, plan_tiled(grid, shape, boxes)):
        out = np.empty(math.prod(sizes) * 4, dtype=np.uint8)
        total += read_tiled_remote(
            _fetcher(arr.tobytes(), log), 0, shape, 4, grid, box, out, set(), lambda t, s: _check(sums, t, s), H
        )[0]
        assert out.tobytes() == _box_bytes(arr, offs, sizes)
    assert arr.nbytes <= total <= 1.02 * arr.nbytes  # each slice's bytes, and gaps joined within the 2% budget
    # narrow rows: about one request per row (the store's price of exact bytes: it serves one range a request)
    assert 0.95 * degree * shape[0] <= len(log) <= degree * shape[0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 300)), min_size=0, max_size=30))
def test_joined_ranges_cover_every_range_within_the_waste_budget(raw):
    from ucp_dcp.storage.file_ranges import coalesce_within
    from ucp_dcp.storage.format import merge_intervals

    ivs = merge_intervals(np.array([s for s, _ in raw], dtype=np.int64), np.array([n for _, n in raw], dtype=np.int64))
    out = coalesce_within(ivs, 0.05)
    need = sum(n for _, n in ivs)
    assert sum(n for _, n in out) <= need * 1.05 + 1e-9
    assert all(any(a <= s and s + n <= a + m for a, m in out) for s, n in ivs)
    assert all(out[k][0] + out[k][1] < out[k + 1][0] for k in range(len(out) - 1)) or len(out) < 2


def test_few_store_ranges_read_a_column_slice_as_whole_rows_in_one_request_per_window():
    from ucp_dcp.storage.file_ranges import REMOTE_GAP

    shape = (1000, 2048)
    arr = np.random.default_rng(4).standard_normal(shape, dtype=np.float32)
    grid = tile_grid(shape, 4)
    sums = tile_checksums(arr.view(np.uint8).reshape(-1), grid, H)
    (box,) = plan_tiled(grid, shape, [((0, 512), (1000, 512))])
    log: list[tuple[int, int]] = []
    out = np.empty(1000 * 512 * 4, dtype=np.uint8)
    fetched, requests = read_tiled_remote(
        _fetcher(arr.tobytes(), log), 0, shape, 4, grid, box, out, set(), lambda t, s: _check(sums, t, s), H, REMOTE_GAP
    )
    assert out.tobytes() == _box_bytes(arr, (0, 512), (1000, 512))
    assert requests == len(log) <= 2  # the rows' spans joined (an 8 MiB window of tile rows each)
    assert fetched < arr.nbytes  # from the slice's first byte to its last: not the rows' other bands
