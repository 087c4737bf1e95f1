"""``ucp_dev.toy.build_trainer(..., device="meta")`` on torch's fake process group, in one process:
for a rank of an 8-rank layout, the meta trainer's ``state_dict()`` has the structure of a cpu build
of the same rank (keys, DTensor or not, placements, mesh, global and local shapes, dtypes, optimizer
hyperparameters, train state), which is what a load at that layout hands to ``dcp.load``."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from ucp_dev.toy import ModelConfig, Topology, build_job, build_trainer, trainer_options, ucp_options

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CASES = [  # (topology, ranks): world 8 each
    ("pp=2,dp=2,tp=2", (0, 5)),
    ("dp=2,ep=2,tp=2", (0, 3, 6)),
    ("dpr=2,dp=2,tp=2", (1, 7)),
    ("pp=2,vpp=2,dp=2,tp=2", (6,)),
]


@pytest.fixture
def fake_world():
    """``init(rank, world)`` starts the fake process group; it is destroyed after the case."""

    def init(rank: int, world: int) -> None:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _flat(x, path: str = "") -> dict[str, object]:
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flat(val, f"{path}/{key}").items()}
    if isinstance(x, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in x):
        return {k: v for i, val in enumerate(x) for k, v in _flat(val, f"{path}[{i}]").items()}
    return {path: x}


def _describe(v: object) -> object:
    """What a load plans from: the value's structure, never its data."""
    if isinstance(v, DTensor):
        m = v.device_mesh
        return (
            "DTensor",
            tuple(v.placements),
            m.mesh.tolist(),
            m.mesh_dim_names,
            tuple(v.shape),
            tuple(v.to_local().shape),
            v.dtype,
        )
    if isinstance(v, torch.Tensor):
        return ("Tensor", tuple(v.shape), v.dtype)
    return v


@pytest.mark.parametrize("topology,ranks", CASES, ids=[c[0] for c in CASES])
def test_meta_trainer_state_dict_has_the_cpu_structure(fake_world, topology, ranks):
    topo, cfg = Topology.parse(topology), ModelConfig()
    for rank in ranks:
        fake_world(rank, topo.world)
        job = build_job(topo)
        assert job.member and job.coord, (topology, rank)
        cpu, meta = build_trainer(cfg, job), build_trainer(cfg, job, device="meta")
        assert meta.schedule is None and (cpu.schedule is not None) == (topo.pp > 1)
        assert meta.stage_ids == cpu.stage_ids
        want, got = _flat(cpu.state_dict()), _flat(meta.state_dict())
        assert sorted(got) == sorted(want), (rank, sorted(set(got) ^ set(want)))
        diffs = [k for k in want if _describe(got[k]) != _describe(want[k])]
        assert not diffs, (rank, [(k, _describe(want[k]), _describe(got[k])) for k in diffs[:5]])
        dtensors = [v for v in got.values() if isinstance(v, DTensor)]
        assert dtensors and all(v.to_local().is_meta for v in dtensors), "the meta build holds weights"
        assert any(k.endswith("/step") for k in got) and got["/train_state/step"] == 0
        assert ucp_options(cfg, topo, job.coord) == trainer_options(cfg, cpu) == trainer_options(cfg, meta)
        dist.destroy_process_group()
