"""DeepSpeed MoE checkpoints (ucp_dcp.sources.foreign.deepspeed_moe): names, the expert layout, and
DeepSpeedReader over a hand-made ZeRO-1 MoE folder laid out as deepspeed 0.19.8 writes one (expert
files per global expert, each rank's ``moe`` group partition = part ``r // ep`` of EP rank
``r % ep``'s local experts), loaded bitwise into a plain target. Single process; the real
library's files are checked in tests/e2e/test_foreign_moe_deepspeed.py."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ucp_dcp import UCPLoadPlanner
from ucp_dcp.errors import CheckpointNotFoundError, CorruptCheckpointError, UCPError, ucp_errors
from ucp_dcp.planning.opened import UnopenedMetadata, raise_if_unopened
from ucp_dcp.sources.foreign.deepspeed import DeepSpeedReader
from ucp_dcp.sources.foreign.deepspeed_moe import TOY_NAMES, moe_layout, rename, to_global

pytestmark = pytest.mark.filterwarnings("ignore::ucp_dcp.errors.UnverifiedCheckpointWarning")

X = "l.moe.deepspeed_moe.experts.deepspeed_experts."
GATE = "l.moe.deepspeed_moe.gate.wg.weight"
EXPERT = {"w.weight": (2, 3), "v.weight": (1, 3)}  # 9 elements: partitions cut through experts
DP, EP, E = 4, 2, 4


def test_local_experts_are_numbered_globally_by_ep_rank():
    assert to_global(X + "1.w.weight", 3, 2) == X + "7.w.weight"
    assert to_global(GATE, 3, 2) == GATE
    with pytest.raises(CorruptCheckpointError):
        to_global(X + "2.w.weight", 0, 2)


def test_toy_names():
    assert rename(X + "5.w1.weight", TOY_NAMES) == "l.moe.experts.5.w1.weight"
    assert rename(GATE, TOY_NAMES) == "l.moe.router.weight"
    assert rename("norm.weight", TOY_NAMES) == "norm.weight"


def test_the_layout_comes_from_rank_0s_local_names():
    xs = ".deepspeed_moe.experts.deepspeed_experts."
    shapes = {f"{p}{xs}{j}.{r}": s for p in ("a", "b") for j in range(2) for r, s in EXPERT.items()}
    lay = moe_layout(shapes, [8, 8], "f")
    assert (lay.layers, lay.n_local, lay.ep) == (("a", "b"), 2, 4)
    assert lay.names(1, 5) == [(f"b{xs}5.w.weight", (2, 3)), (f"b{xs}5.v.weight", (1, 3))]
    with pytest.raises(UCPError, match="different expert counts"):
        moe_layout(shapes, [8, 4], "f")
    with pytest.raises(UCPError, match="not a DeepSpeed MoE expert param"):
        moe_layout({"a.w": (2,)}, [2], "f")


def _truth():
    g = torch.Generator().manual_seed(0)
    t = {"emb": torch.randn(3, 2, generator=g), GATE: torch.randn(4, 2, generator=g)}
    for e in range(E):
        for r, s in EXPERT.items():
            t[f"{X}{e}.{r}"] = torch.randn(*s, generator=g)
    return {n: {k: torch.randn(v.shape, generator=g) for k in ("fp32", "exp_avg", "exp_avg_sq")} for n, v in t.items()}


def _parts(flats, count):
    """Concatenate, pad to a multiple of 2 x count, cut into count equal partitions (ZeRO-1/2)."""
    flat = torch.cat([f.reshape(-1) for f in flats])
    size = -(-flat.numel() // (2 * count)) * 2 * count
    return torch.nn.functional.pad(flat, (0, size - flat.numel())).chunk(count)


def _write(path, truth):
    """A ZeRO-1 MoE tag folder: dense group [emb, gate] over 4 ranks, expert group over ep=2 x edp=2."""
    os.makedirs(path, exist_ok=True)
    dense = ["emb", GATE]
    local = [f"{X}{j}.{r}" for j in range(E // EP) for r in EXPERT]
    torch.save(
        {
            "module": {n: truth[n]["fp32"] for n in dense},
            "buffer_names": [],
            "param_shapes": [
                {n: truth[n]["fp32"].shape for n in dense},
                {n: torch.Size(EXPERT[n[-8:]]) for n in local},
            ],
            "shared_params": {},
            "num_experts": [E],
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "frozen_param_shapes": None,
        },
        path / "mp_rank_00_model_states.pt",
    )
    for e in range(E):
        names = [f"{X}{e}.{r}" for r in EXPERT]
        torch.save(
            {n: truth[n]["fp32"].clone() for n in names}, path / f"layer_0_expert_{e}_mp_rank_00_model_states.pt"
        )
    for r in range(DP):
        ep_rank, part = r % EP, r // EP
        mine = [to_global(n, ep_rank, E // EP) for n in local]
        groups = [
            {k: _parts([truth[n][k] for n in dense], DP)[r] for k in ("fp32", "exp_avg", "exp_avg_sq")},
            {k: _parts([truth[n][k] for n in mine], DP // EP)[part] for k in ("fp32", "exp_avg", "exp_avg_sq")},
        ]
        osd = {
            "single_partition_of_fp32_groups": [g["fp32"].clone() for g in groups],
            "base_optimizer_state": {
                "state": {
                    i: {
                        "step": torch.tensor(3.0 + i),
                        "exp_avg": g["exp_avg"].clone(),
                        "exp_avg_sq": g["exp_avg_sq"].clone(),
                    }
                    for i, g in enumerate(groups)
                },
                "param_groups": [
                    {"lr": 0.1, "weight_decay": 0.1, "params": [0]},
                    {"lr": 0.1, "weight_decay": 0.1, "name": "ep_size_2", "moe": True, "params": [1]},
                ],
            },
            "partition_count": [DP, DP // EP],
            "param_alignment_paddings": [[0, 0], [0] * len(local)],
        }
        torch.save({"optimizer_state_dict": osd}, path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def _target(truth):
    sd = {}
    for n, v in truth.items():
        t = rename(n, TOY_NAMES)
        sd[f"model.{t}"] = torch.zeros_like(v["fp32"])
        for k in ("exp_avg", "exp_avg_sq"):
            sd[f"optim.state.{t}.{k}"] = torch.zeros_like(v[k])
        sd[f"optim.state.{t}.step"] = torch.zeros(())
    return sd


def _load(path, sd):
    with ucp_errors():
        dcp.load(sd, storage_reader=DeepSpeedReader(path, names=TOY_NAMES), planner=UCPLoadPlanner())


def test_a_zero1_moe_folder_loads_bitwise_per_expert_and_moment(tmp_path):
    truth = _truth()
    _write(tmp_path, truth)
    sd = _target(truth)
    _load(tmp_path, sd)
    for n, v in truth.items():
        t = rename(n, TOY_NAMES)
        want_w = v["fp32"]
        assert torch.equal(sd[f"model.{t}"], want_w), t
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[f"optim.state.{t}.{k}"], v[k]), (t, k)
        assert float(sd[f"optim.state.{t}.step"]) == (4.0 if ".experts." in t else 3.0)


def test_a_swapped_moment_row_is_caught(tmp_path):
    """The oracle above can fail: one swapped pair of moments in rank 3's expert partition shows."""
    truth = _truth()
    _write(tmp_path, truth)
    f = tmp_path / "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    d = torch.load(f, weights_only=True)
    m = d["optimizer_state_dict"]["base_optimizer_state"]["state"][1]["exp_avg"]
    m[0], m[1] = m[1].clone(), m[0].clone()
    torch.save(d, f)
    sd = _target(truth)
    _load(tmp_path, sd)
    # rank 3: EP rank 1, second half of its [expert 2, expert 3] flat (10 of 18 + 2 padding): expert 3's w, row 0
    bad = [k for k in sd if k.endswith("exp_avg") and not torch.equal(sd[k], truth[_ds(k)]["exp_avg"])]
    assert bad == ["optim.state.l.moe.experts.3.w.weight.exp_avg"]


def _ds(key):
    name = key.split("optim.state.")[1].rsplit(".", 1)[0]
    return {rename(n, TOY_NAMES): n for n in _truth()}[name]


def _refused(path):
    md = DeepSpeedReader(path, names=TOY_NAMES).read_metadata()
    assert isinstance(md, UnopenedMetadata)
    raise_if_unopened(md)


def test_a_missing_expert_file_names_the_atom(tmp_path):
    _write(tmp_path, _truth())
    os.remove(tmp_path / "layer_0_expert_2_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointNotFoundError, match="layer_0_expert_2") as e:
        _refused(tmp_path)
    assert e.value.atom == "model.l.moe.experts.2.w.weight"


def test_an_expert_file_of_another_expert_is_refused(tmp_path):
    _write(tmp_path, _truth())
    os.replace(
        tmp_path / "layer_0_expert_1_mp_rank_00_model_states.pt",
        tmp_path / "layer_0_expert_2_mp_rank_00_model_states.pt",
    )
    with pytest.raises(UCPError):  # expert 1 is now missing; expert 2's file holds expert 1
        _refused(tmp_path)
    _write(tmp_path, _truth())
    torch.save(
        torch.load(tmp_path / "layer_0_expert_1_mp_rank_00_model_states.pt"),
        tmp_path / "layer_0_expert_2_mp_rank_00_model_states.pt",
    )
    with pytest.raises(CorruptCheckpointError, match="expected the params of expert 2") as e:
        _refused(tmp_path)
    assert e.value.atom == "model.l.moe.experts.2.w.weight"


def test_a_partition_count_that_is_not_dp_over_ep_is_refused(tmp_path):
    _write(tmp_path, _truth())
    f = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    d = torch.load(f, weights_only=True)
    d["optimizer_state_dict"]["partition_count"] = [DP, DP]
    torch.save(d, f)
    with pytest.raises(CorruptCheckpointError, match="split 4 ways"):
        _refused(tmp_path)


def test_moe_in_the_universal_form_is_refused(tmp_path):
    _write(tmp_path, _truth())
    os.mkdir(tmp_path / "zero")
    with pytest.raises(UCPError, match="universal form is not read"):
        _refused(tmp_path)


def test_expert_files_without_moe_params_are_refused(tmp_path):
    """AutoEP (stacked experts) also writes layer_*_expert_* files; its layout is not this one."""
    _write(tmp_path, _truth())
    f = tmp_path / "mp_rank_00_model_states.pt"
    d = torch.load(f, weights_only=True)
    d["param_shapes"] = d["param_shapes"][:1]
    torch.save(d, f)
    with pytest.raises(UCPError, match="AutoEP"):
        _refused(tmp_path)
