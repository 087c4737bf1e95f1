"""ShardedTensor state (FSDP1 ``SHARDED_STATE_DICT``, ``torch.distributed._shard``) saved and loaded as
fragments: any shard plan into any other, into FSDP2 DTensors at another world size and back, into a
plain tensor in one process; FSDP1 checkpoints written by our planner and by DCP's default planner
resumed by FSDP2; nested (2-D) ShardedTensors. Multi-process cases run on the session's pool of gloo
workers (tests/support/dist.py), one case per item; the workers return values and the test process compares
them bitwise with the saved logical values."""

import os
import subprocess
import sys

import dist as D
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp  # noqa: F401  (before tensor.parallel.fsdp: torch's import order)
import torch.nn as nn
from helpers import assert_written_by_ucp
from torch.distributed._shard import _shard_tensor
from torch.distributed._shard import sharded_tensor as st_api
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Shard as DShard

import ucp_dcp
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _value(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _spec(dim: int, ranks) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def _group(n: int):
    """A process group of ranks 0..n-1 (every rank of the pool calls this)."""
    return dist.new_group(list(range(n)))


def _shards(st: ShardedTensor) -> list[tuple[list[int], torch.Tensor]]:
    return [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in st.local_shards()]


def _assemble(shape, pieces, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A full tensor from ``(offsets, tensor)`` pieces, and how often each element was written."""
    full = torch.zeros(shape, dtype=dtype)
    count = torch.zeros(shape, dtype=torch.int32)
    for offs, t in pieces:
        idx = tuple(slice(o, o + n) for o, n in zip(offs, t.shape))
        full[idx] = t
        count[idx] += 1
    return full, count


def _st_full(st: ShardedTensor, group=None) -> torch.Tensor:
    """The logical value of a ShardedTensor, gathered from every rank's local shards (no ucp_dcp code)."""
    mine = [(list(s.metadata.shard_offsets), s.tensor) for s in st.local_shards()]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    full, count = _assemble(tuple(st.size()), [p for ps in everyone for p in ps], st.dtype)
    assert bool((count == 1).all()), "the shards do not tile the tensor"
    return full


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b
        )
    )


# -- shard plan -> shard plan ------------------------------------------------------------------------------

SHAPES = {"w": (10, 7), "b": (6,), "h": (3, 9)}
"""Uneven on 4 and 3 ranks; ``h`` (3 rows) leaves a rank without a row-wise shard."""


def _rowwise_save(root: str, planner) -> None:
    """The SHAPES tensors sharded row-wise on the 4 ranks (``b`` in bfloat16), saved."""
    sd = {}
    for i, (k, shape) in enumerate(SHAPES.items()):
        full = _value(shape, i, torch.bfloat16 if k == "b" else torch.float32)
        sd[k] = _shard_tensor(full, _spec(0, range(4)))
    dcp.save(sd, checkpoint_id=root, planner=planner)


def _columnwise_worker(rank, world, root):
    """Row-wise on 4 ranks -> column-wise on 3 (1-D ``b`` row-wise: no dim 1); each loading rank returns its
    shards, rank 0 also the catalog record."""
    _rowwise_save(root, UCPSavePlanner())
    g3 = _group(3)
    if rank >= 3:
        return None
    sd = {
        k: st_api.empty(
            _spec(0 if len(s) == 1 else 1, range(3)),
            *s,
            process_group=g3,
            dtype=torch.bfloat16 if k == "b" else torch.float32,
        )
        for k, s in SHAPES.items()
    }
    for v in sd.values():
        for s in v.local_shards():
            s.tensor.fill_(-7)
    dcp.load(sd, checkpoint_id=root, planner=UCPLoadPlanner(), process_group=g3)
    out = {k: _shards(v) for k, v in sd.items()}
    if rank == 0:
        out["catalog"] = ucp_dcp.read_catalog(dcp.FileSystemReader(root).read_metadata().planner_data)["atoms"]["w"]
    return out


def test_rowwise_sharded_tensor_loads_columnwise_on_three_ranks():
    """ChunkShardingSpec dim 0 on 4 ranks (uneven, a rank without rows of ``h``, a bfloat16 tensor) -> dim 1
    on 3 ranks; the catalog records the shard plan."""
    res = D.run(_columnwise_worker, 4, D.tmpdir())
    for k, shape in SHAPES.items():
        dtype = torch.bfloat16 if k == "b" else torch.float32
        full, count = _assemble(shape, [p for r in res[:3] for p in r[k]], dtype)
        assert bool((count == 1).all()), k
        assert _bitwise(full, _value(shape, list(SHAPES).index(k), dtype)), k
    # column-wise targets really are column-wise
    assert [o for o, _ in res[1]["w"]] == [[0, 3]]
    rec = res[0]["catalog"]
    assert rec["pattern"] == "sharded_tensor" and rec["shape"] == [10, 7]
    assert rec["sharded_tensor"] == {
        "kind": "sharded_tensor",
        "spec": "chunk",
        "dim": 0,
        "count": 4,
        "shards": [
            {"offsets": [3 * i, 0], "sizes": [3 if i < 3 else 1, 7], "placement": f"rank:{i}/cpu"} for i in range(4)
        ],
    }


SAVE_PLAN = {0: [([0, 0], [2, 8]), ([4, 0], [2, 4])], 1: [([2, 0], [2, 8])], 2: [([4, 4], [2, 4])], 3: []}
LOAD_PLAN = {0: [([0, 0], [6, 3])], 1: [], 2: [([0, 3], [3, 5]), ([3, 3], [3, 3])], 3: [([3, 6], [3, 2])]}
"""Enumerable plans of a 6x8 tensor: several shards on a rank, ranks with none."""


def _enumerable(plan, full=None):
    md = [ShardMetadata(o, s, f"rank:{r}/cpu") for r in sorted(plan) for o, s in plan[r]]
    st = st_api.empty(EnumerableShardingSpec(md), 6, 8)
    for s in st.local_shards():
        o, n = s.metadata.shard_offsets, s.metadata.shard_sizes
        s.tensor.copy_(full[o[0] : o[0] + n[0], o[1] : o[1] + n[1]] if full is not None else torch.full(n, -7.0))
    return st


def _enumerable_worker(rank, world, root):
    """Enumerable plan -> another enumerable plan on the same 4 ranks; each rank returns its shards."""
    full = _value((6, 8), 11)
    ucp_dcp.save({"t": _enumerable(SAVE_PLAN, full)}, root)  # ucp_dcp's storage: checksums, read-once
    target = {"t": _enumerable(LOAD_PLAN)}
    ucp_dcp.load(target, root)
    return _shards(target["t"])


def test_enumerable_plan_with_several_shards_per_rank_and_empty_ranks():
    """Saved from and loaded into EnumerableShardingSpec plans that share no box, with two local shards on a
    rank and ranks holding none, on either side."""
    root = D.tmpdir()
    res = D.run(_enumerable_worker, 4, root)
    assert_written_by_ucp(root)
    assert [len(r) for r in res] == [1, 0, 2, 1]
    full, count = _assemble((6, 8), [p for r in res for p in r])
    assert bool((count == 1).all())
    assert _bitwise(full, _value((6, 8), 11))


# -- ShardedTensor <-> DTensor, plain ----------------------------------------------------------------------


def _to_dtensor_worker(rank, world, root):
    """Row-wise ShardedTensors on 4 ranks -> DTensors Shard(0) (FSDP2's layout) on a 3-rank mesh."""
    _rowwise_save(root, UCPSavePlanner())
    g3 = _group(3)
    mesh = DeviceMesh("cpu", torch.arange(3))
    if rank >= 3:
        return None
    sd = {
        k: distribute_tensor(
            torch.full(s, -7.0, dtype=torch.bfloat16 if k == "b" else torch.float32), mesh, [DShard(0)]
        )
        for k, s in SHAPES.items()
    }
    dcp.load(sd, checkpoint_id=root, planner=UCPLoadPlanner(), process_group=g3)
    return {k: v.full_tensor() for k, v in sd.items()}


def test_rowwise_sharded_tensor_loads_into_fsdp2_dtensors_on_three_ranks():
    """Row-wise ShardedTensors on 4 ranks -> DTensors Shard(0) on a 3-rank mesh (FSDP2's layout)."""
    root = D.tmpdir()
    res = D.run(_to_dtensor_worker, 4, root)[0]
    assert_written_by_ucp(root, storage=False)
    for i, (k, shape) in enumerate(SHAPES.items()):
        assert _bitwise(res[k], _value(shape, i, torch.bfloat16 if k == "b" else torch.float32)), k


def _colwise_save_worker(rank, world, root):
    _rowwise_save(root + "/row", UCPSavePlanner())
    dcp.save(
        {"w": _shard_tensor(_value((4, 10), 5), _spec(1, range(4)))},
        checkpoint_id=root + "/col",
        planner=UCPSavePlanner(),
    )


def test_sharded_tensor_loads_into_a_plain_tensor_in_one_process():
    """Column-wise and row-wise ShardedTensor checkpoints of 4 ranks loaded in the test process itself
    (no process group) into plain full tensors."""
    root = D.tmpdir()
    D.run(_colwise_save_worker, 4, root)
    assert_written_by_ucp(root + "/col", storage=False)
    assert_written_by_ucp(root + "/row", storage=False)
    target = {"w": torch.full((4, 10), -7.0)}
    dcp.load(target, checkpoint_id=root + "/col", planner=UCPLoadPlanner(), no_dist=True)
    assert _bitwise(target["w"], _value((4, 10), 5))
    target = {k: torch.zeros(s, dtype=torch.bfloat16 if k == "b" else torch.float32) for k, s in SHAPES.items()}
    dcp.load(target, checkpoint_id=root + "/row", planner=UCPLoadPlanner(), no_dist=True)
    for i, (k, shape) in enumerate(SHAPES.items()):
        assert _bitwise(target[k], _value(shape, i, target[k].dtype)), k


# -- FSDP1 SHARDED_STATE_DICT <-> FSDP2 ----------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.mid = nn.Linear(10, 5)
        self.out = nn.Linear(5, 3, bias=False)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def _train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
        opt.step()


def _fsdp1(group, seed: int, lr: float = 0.01):
    torch.manual_seed(seed)
    model = FSDP(
        _Net(),
        process_group=group,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _fsdp2(mesh, seed: int, lr: float = 0.01):
    torch.manual_seed(seed)
    model = _Net()
    for m in (model.inp, model.mid, model.out):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _fsdp1_sharded_sd(model, opt) -> dict:
    """FSDP1's own sharded state dict: ShardedTensors for parameters and optimizer moments."""
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}


def _logical(sd: dict, group=None) -> dict:
    """Every tensor and hyperparameter of a {"model", "optim"} state dict as full values."""

    def full(v):
        if isinstance(v, ShardedTensor):
            return _st_full(v, group)
        if isinstance(v, DTensor):
            return v.full_tensor()
        return v.clone() if isinstance(v, torch.Tensor) else v

    out = {f"model/{k}": full(v) for k, v in sd["model"].items()}
    for p, state in sd["optim"]["state"].items():
        out.update({f"optim/{p}/{k}": full(v) for k, v in state.items()})
    for g in sd["optim"]["param_groups"]:
        for p in g["params"]:
            out.update({f"group/{p}/{k}": v for k, v in g.items() if k not in ("params", "param_names")})
    return out


def _compare(saved: dict, loaded: dict) -> list[str]:
    bad = sorted(set(saved) ^ set(loaded))
    for k in set(saved) & set(loaded):
        a, b = saved[k], loaded[k]
        if not (_bitwise(a, b) if isinstance(a, torch.Tensor) else a == b):
            bad.append(k)
    return sorted(bad)


def _fsdp1_to_fsdp2_worker(rank, world, root, writer):
    """FSDP1 on 4 ranks trains 2 steps, saves its SHARDED_STATE_DICT (our planner, or DCP's default
    planner); FSDP2 on 3 ranks (another seed, another lr) resumes. Rank 0 returns the saved and resumed
    logical state."""
    model, opt = _fsdp1(None, seed=0)
    _train(model, opt, 2, seed=1)
    sd = _fsdp1_sharded_sd(model, opt)
    assert isinstance(sd["model"]["inp.weight"], ShardedTensor)
    assert isinstance(sd["optim"]["state"]["inp.weight"]["exp_avg"], ShardedTensor)
    if writer == "ucp":
        ucp_dcp.save(sd, root)
    else:
        dcp.save(sd, checkpoint_id=root, planner=DefaultSavePlanner())
    saved = _logical(sd)
    g3 = _group(3)
    mesh = DeviceMesh("cpu", torch.arange(3))
    if rank >= 3:
        return None
    m2, o2 = _fsdp2(mesh, seed=5, lr=0.5)
    msd, osd = get_state_dict(m2, o2)
    target = {"model": msd, "optim": osd}
    if writer == "ucp":
        ucp_dcp.load(target, root, process_group=g3)
    else:  # a stock checkpoint has no checksums: DCP's reader, our planner
        dcp.load(target, checkpoint_id=root, planner=UCPLoadPlanner(), process_group=g3)
    set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    msd, osd = get_state_dict(m2, o2)
    loaded = _logical({"model": msd, "optim": osd})
    _train(m2, o2, 1, seed=2)  # training goes on
    return (saved, loaded) if rank == 0 else None


@pytest.mark.parametrize("writer", ["ucp", "stock"])
def test_fsdp1_sharded_checkpoint_resumes_in_fsdp2_on_three_ranks(writer):
    """ucp: FSDP1 sharded state saved with ucp_dcp.save; stock: the same with DCP's DefaultSavePlanner (a
    stock FSDP1 checkpoint). Both resume into FSDP2 at dp=3, model and optimizer bitwise."""
    root = D.tmpdir()
    saved, loaded = D.run(_fsdp1_to_fsdp2_worker, 4, root, writer)[0]
    if writer == "ucp":
        assert_written_by_ucp(root)
    assert any(k.startswith("optim/") for k in saved) and "group/inp.weight/lr" in saved
    assert saved["group/inp.weight/lr"] == 0.01
    assert _compare(saved, loaded) == []


def _fsdp2_to_fsdp1_worker(rank, world, root):
    """FSDP2 on 3 ranks trains and saves; FSDP1 on 4 ranks loads into its sharded state dict (DSD's
    SHARDED_STATE_DICT: ShardedTensors) and resumes."""
    g3 = _group(3)
    mesh = DeviceMesh("cpu", torch.arange(3))  # every rank: creating groups is collective
    saved = None
    if rank < 3:
        m2, o2 = _fsdp2(mesh, seed=0)
        _train(m2, o2, 2, seed=1)
        msd, osd = get_state_dict(m2, o2)
        ucp_dcp.save({"model": msd, "optim": osd}, root, process_group=g3)
        saved = _logical({"model": msd, "optim": osd})
    dist.barrier()
    model, opt = _fsdp1(None, seed=5, lr=0.5)
    msd, osd = get_state_dict(model, opt)
    assert isinstance(msd["inp.weight"], ShardedTensor) and isinstance(
        osd["state"]["inp.weight"]["exp_avg"], ShardedTensor
    )
    target = {"model": msd, "optim": osd}
    ucp_dcp.load(target, root)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    loaded = _logical(_fsdp1_sharded_sd(model, opt))
    _train(model, opt, 1, seed=2)
    return (saved, loaded) if rank == 0 else None


def test_fsdp2_checkpoint_resumes_in_fsdp1_sharded_state_on_four_ranks():
    """The reverse: FSDP2 (3 ranks) -> FSDP1 SHARDED_STATE_DICT targets (4 ranks), model and optimizer bitwise."""
    saved, loaded = D.run(_fsdp2_to_fsdp1_worker, 4, D.tmpdir())[0]
    assert _compare(saved, loaded) == []


# -- nested (2-D) ShardedTensors -----------------------------------------------------------------------------


def _nested(full, rank):
    """FSDP1 over a tensor-parallel ShardedTensor on a 2x2 grid, built the way torch's FSDP1 extension does
    (``torch.distributed.tensor.parallel.fsdp._chunk_tensor``): a column-wise outer ShardedTensor over
    the TP pair whose local shard is a row-chunked inner ShardedTensor over the DP pair."""
    from torch.distributed.tensor.parallel.fsdp import _chunk_tensor

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = rank % 2, rank // 2
    cols = full.shape[1]
    c0, cn = (0, cols // 2 + 1) if tp == 0 else (cols // 2 + 1, cols - cols // 2 - 1)
    outer = st_api.init_from_local_shards(
        [Shard(full[:, c0 : c0 + cn].clone(), ShardMetadata([0, c0], [full.shape[0], cn], f"rank:{rank}/cpu"))],
        *full.shape,
        process_group=tp_groups[rank // 2],
    )
    return _chunk_tensor(outer, dp, 2, 1, dp_groups[tp])


def _nested_worker(rank, world, root, writer):
    full = _value((7, 6), 21)
    st = _nested(full, rank)
    assert isinstance(st.local_shards()[0].tensor, ShardedTensor)
    planner = UCPSavePlanner() if writer == "ucp" else DefaultSavePlanner()
    dcp.save({"w": st}, checkpoint_id=root, planner=planner)
    g3 = _group(3)
    mesh = DeviceMesh("cpu", torch.arange(3))
    out = {}
    if rank < 3:
        dt = {"w": distribute_tensor(torch.full((7, 6), -7.0), mesh, [DShard(1)])}
        dcp.load(dt, checkpoint_id=root, planner=UCPLoadPlanner(), process_group=g3)
        out["dtensor"] = dt["w"].full_tensor()
    nested_target = _nested(torch.full((7, 6), -7.0), rank)
    dcp.load({"w": nested_target}, checkpoint_id=root, planner=UCPLoadPlanner())
    inner = nested_target.local_shards()[0]
    out["nested"] = [
        ([a + b for a, b in zip(inner.metadata.shard_offsets, s.metadata.shard_offsets)], s.tensor.clone())
        for s in inner.tensor.local_shards()
    ]
    return out


@pytest.mark.parametrize("writer", ["ucp", "stock"])
def test_nested_sharded_tensor_fsdp1_over_tp(writer):
    """A 2-D FSDP1+TP nested ShardedTensor saved by ours (inner shards flattened into fragments) or by DCP's
    default planner (its _flatten_sharded_tensors): loads into DTensors Shard(1) on 3 ranks and back
    into the nested layout, bitwise."""
    root = D.tmpdir()
    res = D.run(_nested_worker, 4, root, writer)
    if writer == "ucp":
        assert_written_by_ucp(root, storage=False)
    full = _value((7, 6), 21)
    assert _bitwise(res[0]["dtensor"], full)
    got, count = _assemble((7, 6), [p for r in res for p in r["nested"]])
    assert bool((count == 1).all()) and _bitwise(got, full)


# -- refused ------------------------------------------------------------------------------------------------


def _dtensor_in_shard_worker(rank, world, root):
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    mesh = DeviceMesh("cpu", torch.arange(4))
    dt = distribute_tensor(torch.zeros(4, 6), mesh, [DShard(0)])
    md = ShardMetadata([0, 0], [4, 6], f"rank:{rank}/cpu")
    meta = ShardedTensorMetadata(
        [ShardMetadata([0, 0], [4, 6], "rank:0/cpu")], torch.Size([4, 6]), TensorProperties(dtype=torch.float32)
    )
    # built around a plain shard, then the DTensor put in its place (torch 2.11 refuses to build it directly)
    shards = [Shard(torch.zeros(4, 6), md)] if rank == 0 else []
    st = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, init_rrefs=False)
    if rank == 0:
        st.local_shards()[0].tensor = dt
    try:
        dcp.save({"w": st}, checkpoint_id=root, planner=UCPSavePlanner())
    except BaseException as e:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        err = ucp_dcp.first_ucp_error(e)
        return type(err).__name__ if err is not None else repr(e), str(err)
    return "saved", ""


def test_sharded_tensor_holding_a_dtensor_is_refused():
    """A local shard that is a DTensor (no torch API builds one) is refused at save with the reason."""
    kind, text = D.run(_dtensor_in_shard_worker, 4, D.tmpdir())[0]
    assert kind == "AmbiguousLayoutError", (kind, text)
    assert "holds a DTensor" in text and "'w'" in text


# -- the recipe ---------------------------------------------------------------------------------------------


def _recipe(out, *args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "recipes", "fsdp1_to_fsdp2.py"), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.e2e
def test_fsdp1_to_fsdp2_recipe(tmp_path):
    """The recipe end to end in fresh processes: FSDP1 on 4 ranks saved with ucp_dcp, FSDP2 on 3 resumes;
    a stock FSDP1 checkpoint (dcp.save) resumed at 2 ranks with one loaded element flipped is refused."""
    out = _recipe(tmp_path / "ucp", "--save-ranks", "4", "--load-ranks", "3", "--steps", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESUME OK: FSDP1 on 4 ranks -> FSDP2 on 3 ranks: 64 model and optimizer entries"), last
    bad = _recipe(
        tmp_path / "dcp", "--writer", "dcp", "--save-ranks", "3", "--load-ranks", "2", "--steps", "2", "--corrupt"
    )
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    last = bad.stdout.strip().splitlines()[-1]
    assert (
        last.startswith("RESUME MISMATCH: FSDP1 on 3 ranks -> FSDP2 on 2 ranks: 1 of 64") and "model/inp.weight" in last
    ), last
