"""torch 2.14's ``CheckpointableTensor`` (``torch.distributed.checkpoint.CheckpointableTensor``,
pytorch#189492): a plain tensor carrying ``global_shape``, ``global_offsets``, ``local_offsets`` and
``local_sizes`` is a shard of a global tensor (several shards with padding in one local tensor
allowed). ucp_dcp saves each stated box as a fragment and fills each wanted box from the saved
fragments: between any two layouts, into and out of DTensors and plain tensors, with ucp_dcp or
stock DCP on either side, bitwise. On torch < 2.14 the protocol does not exist, and such attributes
mean nothing (to DCP as to ucp_dcp)."""

import dist as D
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ucp_dcp
from ucp_dcp import UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp._compat import CheckpointableTensor, is_checkpointable_tensor

needs_protocol = pytest.mark.skipif(
    CheckpointableTensor is None,
    reason=f"torch {torch.__version__} has no torch.distributed.checkpoint.CheckpointableTensor (torch >= 2.14)",
)

SHAPE = (12, 5)
"""The global tensor every layout below cuts."""


def _full(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)).to(dtype)


def _ckpt(local: torch.Tensor, shards) -> torch.Tensor:
    """``local`` as a CheckpointableTensor holding ``shards``: ``(global offsets, local offsets, sizes)``."""
    local.global_shape = SHAPE
    local.global_offsets = tuple(tuple(g) for g, _, _ in shards)
    local.local_offsets = tuple(tuple(lo) for _, lo, _ in shards)
    local.local_sizes = tuple(tuple(n) for _, _, n in shards)
    return local


def _box(t, offs, sizes):
    return t[tuple(slice(o, o + n) for o, n in zip(offs, sizes))]


# Each layout: rank -> (local shape, shards). Padding between shards holds -1 (never saved, never loaded).
LAYOUTS = {
    # two row blocks per rank in one local tensor, a padding row between them
    "rows2": {
        0: ((7, 5), [((0, 0), (0, 0), (3, 5)), ((6, 0), (4, 0), (3, 5))]),
        1: ((7, 5), [((3, 0), (0, 0), (3, 5)), ((9, 0), (4, 0), (3, 5))]),
    },
    # column blocks (uneven), rank 1's local tensor has a padding column
    "cols": {0: ((12, 3), [((0, 0), (0, 0), (12, 3))]), 1: ((12, 3), [((0, 3), (0, 1), (12, 2))])},
    # everything on rank 0 as four quadrant-ish boxes; rank 1 holds no shard at all
    "rank0": {
        0: ((12, 5), [((0, 0), (0, 0), (6, 2)), ((0, 2), (0, 2), (6, 3)), ((6, 0), (6, 0), (6, 5))]),
        1: ((0, 5), []),
    },
}


def _make(layout: str, rank: int, full: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    """This rank's CheckpointableTensor of ``layout``: filled from ``full``, or -1 everywhere (a target)."""
    shape, shards = LAYOUTS[layout][rank]
    local = torch.full(shape, -1.0, dtype=dtype)
    if full is not None:
        for g, lo, n in shards:
            _box(local, lo, n).copy_(_box(full, g, n))
    return _ckpt(local, shards)


def _check(layout: str, rank: int, got: torch.Tensor, full: torch.Tensor) -> list[str]:
    """Problems with a loaded CheckpointableTensor: a box not bitwise equal to ``full``'s, padding touched."""
    _, shards = LAYOUTS[layout][rank]
    bad, covered = [], torch.zeros(got.shape, dtype=torch.bool)
    for g, lo, n in shards:
        if not torch.equal(_box(got, lo, n), _box(full, g, n)):
            bad.append(f"{layout} rank {rank} box {g}+{n}")
        _box(covered, lo, n).fill_(True)
    if not bool((got[~covered] == -1).all()):
        bad.append(f"{layout} rank {rank}: padding overwritten")
    return bad


def _save(sd, root, stock: bool) -> None:
    if stock:
        dcp.save(sd, checkpoint_id=root)
    else:
        dcp.save(sd, storage_writer=UCPFileSystemWriter(root), planner=UCPSavePlanner())


def _load(sd, root, stock: bool) -> None:
    if stock:
        dcp.load(sd, checkpoint_id=root)
    else:
        dcp.load(sd, storage_reader=UCPFileSystemReader(root), planner=UCPLoadPlanner())


def _reshard_worker(rank, world, root, save_layout, load_layout, save_stock, load_stock):
    """Save a mixed state dict (a CheckpointableTensor, a DTensor, a plain tensor, an int) with
    ``save_layout``; load it with ``load_layout`` for the CheckpointableTensor, plus the same atom into a
    DTensor (Shard(1)) and a plain tensor, and the DTensor's atom into a CheckpointableTensor."""
    mesh = init_device_mesh("cpu", (world,))
    full, other = _full(), _full(torch.bfloat16) * 3
    sd = {
        "ck": _make(save_layout, rank, full),
        "dt": distribute_tensor(other, mesh, [Shard(0)]),
        "plain": torch.arange(6.0),
        "step": 4,
    }
    assert is_checkpointable_tensor(sd["ck"]) and not is_checkpointable_tensor(sd["dt"])
    _save(sd, root, save_stock)
    want = {
        "ck": _make(load_layout, rank, None),
        "dt": _make(load_layout, rank, None, torch.bfloat16),
        "plain": torch.zeros(6),
        "step": 0,
    }
    _load(want, root, load_stock)
    bad = _check(load_layout, rank, want["ck"], full) + _check(load_layout, rank, want["dt"], other)
    if not torch.equal(want["plain"], torch.arange(6.0)) or want["step"] != 4:
        bad.append("plain/step")
    # the CheckpointableTensor's atom into other kinds of targets (stock DCP reads them too)
    as_dt = {"ck": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(1)])}
    as_plain = {"ck": torch.zeros(SHAPE)}
    _load(as_dt, root, load_stock)
    _load(as_plain, root, load_stock)
    if not torch.equal(as_dt["ck"].full_tensor(), full) or not torch.equal(as_plain["ck"], full):
        bad.append("ck into DTensor / plain")
    return bad


CASES = [
    ("rows2", "cols", False, False),  # ucp_dcp both ways, two boxes + padding -> columns
    ("cols", "rank0", False, False),  # -> one rank holds everything, the other nothing
    ("rank0", "rows2", False, False),  # a rank without a shard at save
    ("rows2", "cols", True, False),  # stock DCP's save, ucp_dcp's resharding load
    ("cols", "rows2", False, True),  # ucp_dcp's save, stock DCP's load
]


@pytest.mark.slow
@needs_protocol
@pytest.mark.parametrize(
    "save_layout,load_layout,save_stock,load_stock",
    CASES,
    ids=[f"{a}-to-{b}{'-stocksave' if c else ''}{'-stockload' if d else ''}" for a, b, c, d in CASES],
)
def test_checkpointable_tensor_reshards_bitwise(save_layout, load_layout, save_stock, load_stock):
    out = D.run(_reshard_worker, 2, D.tmpdir(), save_layout, load_layout, save_stock, load_stock)
    assert out == [[], []], out


@needs_protocol
def test_checkpointable_tensor_in_one_process_round_trips(tmp_path):
    """One process holding the whole tensor as three boxes of one local tensor: saved as three chunks
    (catalog pattern ``checkpointable``, global shape), loaded into a plain tensor and back into the layout."""
    full = _full()
    ucp_dcp.save({"ck": _make("rank0", 0, full)}, str(tmp_path))
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert tuple(md.state_dict_metadata["ck"].size) == SHAPE and len(md.state_dict_metadata["ck"].chunks) == 3
    rec = ucp_dcp.read_catalog(md.planner_data)["atoms"]["ck"]
    assert rec["pattern"] == "checkpointable" and rec["shape"] == list(SHAPE)
    plain = {"ck": torch.zeros(SHAPE)}
    ucp_dcp.load(plain, str(tmp_path))
    assert torch.equal(plain["ck"], full)
    back = {"ck": _make("rank0", 0, None)}
    ucp_dcp.load(back, str(tmp_path))
    assert _check("rank0", 0, back["ck"], full) == []


@needs_protocol
def test_inconsistent_checkpointable_tensor_is_refused_naming_it(tmp_path):
    t = _ckpt(torch.zeros(3, 5), [((10, 0), (0, 0), (3, 5))])  # rows 10..12 of a 12-row tensor
    with pytest.raises(ucp_dcp.AmbiguousLayoutError, match="'ck'.*outside global_shape"):
        with ucp_dcp.ucp_errors():
            ucp_dcp.save({"ck": t}, str(tmp_path))


def test_protocol_exists_from_torch_2_14_only():
    t = _ckpt(torch.zeros(3, 5), [((0, 0), (0, 0), (3, 5))])
    new = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
    assert (CheckpointableTensor is not None) == new
    assert is_checkpointable_tensor(t) == new  # before 2.14 the attributes mean nothing: a plain tensor
