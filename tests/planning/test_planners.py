"""Save/load without a process group: naming, optimizer forms, dtype conversion, errors, interop."""

import json
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import assert_written_by_ucp, expect_ucp_error, run_cli, tensors_equal
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import ucp_dcp
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Net(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.block(self.emb(x)))


def _trained(seed=0, width=6):
    torch.manual_seed(seed)
    m = Net(width)
    opt = torch.optim.AdamW(
        [
            {"params": [m.emb.weight, m.head.weight], "lr": 0.01},
            {
                "params": [p for n, p in m.named_parameters() if n not in ("emb.weight", "head.weight")],
                "lr": 0.02,
                "weight_decay": 0.0,
            },
        ],
    )
    for _ in range(2):
        m(torch.randint(0, 10, (4, 5))).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _fresh(width=6, lrs=(0.5, 0.7)):
    m = Net(width)
    opt = torch.optim.AdamW(
        [
            {"params": [m.emb.weight, m.head.weight], "lr": lrs[0]},
            {
                "params": [p for n, p in m.named_parameters() if n not in ("emb.weight", "head.weight")],
                "lr": lrs[1],
                "weight_decay": 0.0,
            },
        ],
    )
    return m, opt


def _assert_same_training_state(m1, o1, m2, o2):
    assert tensors_equal(m1.state_dict(), m2.state_dict())
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert tensors_equal(s1["state"], s2["state"])
    assert tensors_equal(s1["param_groups"], s2["param_groups"])


@pytest.mark.parametrize("save_flat,load_flat", [(False, False), (False, True), (True, False), (True, True)])
def test_round_trip_between_optimizer_forms(tmp_path, save_flat, load_flat):
    m, opt = _trained()
    msd, osd = get_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=save_flat))
    dcp.save({"model": msd, "optim": osd, "meta": {"epoch": 3}}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    assert_written_by_ucp(tmp_path, storage=False)
    m2, opt2 = _fresh()
    opts = StateDictOptions(flatten_optimizer_state_dict=load_flat)
    msd2, osd2 = get_state_dict(m2, opt2, options=opts)
    sd = {"model": msd2, "optim": osd2, "meta": {"epoch": 0}}
    dcp.load(sd, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=opts)
    _assert_same_training_state(m, opt, m2, opt2)
    assert sd["meta"]["epoch"] == 3
    # hyperparameters are per-parameter atoms, named like flatten_optimizer_state_dict's keys; a nested
    # optimizer also gets DCP's own list-index entries, for stock readers (tests/storage/test_stock_readable.py)
    names = set(dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata)
    assert "optim.param_groups.emb.weight.lr" in names
    assert any(".param_groups.0." in n for n in names) == (not save_flat)


def test_wrapper_segments_are_stripped(tmp_path):
    m, opt = _trained()
    wrapped = nn.Module()
    wrapped._orig_mod = nn.Module()
    wrapped._orig_mod.emb = m.emb
    wrapped._orig_mod.block = checkpoint_wrapper(m.block)
    wrapped._orig_mod.head = m.head
    raw = {f"module.{k}": v.detach() for k, v in wrapped.named_parameters()}  # DDP prefix on top
    assert any("_checkpoint_wrapped_module" in k for k in raw) and all("_orig_mod" in k for k in raw)
    dcp.save({"model": raw}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    saved = set(dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata)
    assert saved == {f"model.{k}" for k, _ in m.named_parameters()}
    m2, _ = _fresh()
    sd = {"model": m2.state_dict()}
    dcp.load(sd, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    assert tensors_equal(sd["model"], m.state_dict())


def test_dtype_change_is_converted(tmp_path):
    m, _ = _trained()
    dcp.save({"model": m.state_dict()}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    assert_written_by_ucp(tmp_path, storage=False)
    m2, _ = _fresh()
    m2.to(torch.bfloat16)
    sd = {"model": m2.state_dict()}
    dcp.load(sd, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    for k, v in m.state_dict().items():
        assert sd["model"][k].dtype == torch.bfloat16
        assert torch.equal(sd["model"][k], v.to(torch.bfloat16)), k


def test_shape_mismatch_names_atom_and_shapes(tmp_path):
    m, _ = _trained()
    dcp.save({"model": m.state_dict()}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    m2 = Net(width=8)
    err = expect_ucp_error(
        lambda: dcp.load({"model": m2.state_dict()}, checkpoint_id=tmp_path, planner=UCPLoadPlanner()),
        ucp_dcp.ShapeMismatchError,
    )
    text = str(err)
    assert "model.emb.weight" in text and "(10, 6)" in text and "(10, 8)" in text and "Likely cause" in text
    assert err.atom and err.saved and err.wanted


def test_missing_atoms_listed_and_partial_load(tmp_path):
    m, _ = _trained()
    sd = {k: v for k, v in m.state_dict().items() if not k.startswith("head.")}
    dcp.save({"model": sd}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    m2, _ = _fresh()
    target = {"model": m2.state_dict()}
    err = expect_ucp_error(
        lambda: dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner()), ucp_dcp.MissingAtomsError
    )
    assert "model.head.weight" in str(err) and "model.head.bias" in str(err) and "2 atom(s)" in str(err)
    # nothing was read: the target is untouched
    assert tensors_equal(target["model"], m2.state_dict())
    before = m2.head.weight.detach().clone()
    planner = UCPLoadPlanner(allow_partial_load=True)
    dcp.load(target, checkpoint_id=tmp_path, planner=planner)
    assert sorted(planner.missing_atoms) == ["model.head.bias", "model.head.weight"]
    assert torch.equal(m2.head.weight, before) and torch.equal(m2.emb.weight, m.emb.weight)


def test_two_live_keys_for_one_atom_is_ambiguous(tmp_path):
    t = torch.ones(3)
    err = expect_ucp_error(
        lambda: dcp.save({"model": {"_orig_mod.w": t, "w": t * 2}}, checkpoint_id=tmp_path, planner=UCPSavePlanner()),
        ucp_dcp.AmbiguousLayoutError,
    )
    assert "model.w" in str(err) and "_orig_mod.w" in str(err)
    assert not (tmp_path / ".metadata").exists(), "a failed save must not look complete"


def test_kind_mismatch_tensor_vs_object(tmp_path):
    dcp.save({"x": torch.ones(2), "y": {"a": 1}}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    err = expect_ucp_error(lambda: dcp.load({"x": 5}, checkpoint_id=tmp_path, planner=UCPLoadPlanner()))
    assert "'x'" in str(err)


def test_coverage_is_checked_before_reading(tmp_path):
    m, _ = _trained()
    dcp.save({"model": m.state_dict()}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    # tamper: the saved chunk of one atom claims to cover only half of it
    md_path = tmp_path / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    smd = md.state_dict_metadata["model.emb.weight"]
    smd.chunks[0] = type(smd.chunks[0])(offsets=torch.Size([0, 0]), sizes=torch.Size([5, 6]))
    md_path.write_bytes(pickle.dumps(md))
    m2, _ = _fresh()
    target = {"model": m2.state_dict()}
    before = {k: v.clone() for k, v in target["model"].items()}
    err = expect_ucp_error(
        lambda: dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner()), ucp_dcp.CoverageError
    )
    assert "model.emb.weight" in str(err) and "cover 30 of 60" in str(err)
    assert tensors_equal(target["model"], before), "no byte may be loaded when validation fails"


def test_param_group_disagreement_is_an_error(tmp_path):
    m, opt = _trained()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"optim": osd}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    # target groups everything together although the saved lrs differ per group
    m2 = Net()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1.0)
    _, osd2 = get_state_dict(m2, opt2)
    err = expect_ucp_error(
        lambda: dcp.load({"optim": osd2}, checkpoint_id=tmp_path, planner=UCPLoadPlanner()), ucp_dcp.ParamGroupError
    )
    assert "'lr'" in str(err) and "0.01" in str(err) and "0.02" in str(err)


def test_stock_planner_checkpoint_loads(tmp_path):
    m, opt = _trained()
    msd, osd = get_state_dict(m, opt)
    raw = {f"_orig_mod.{k}": v for k, v in msd.items()}
    dcp.save({"model": raw, "optim": osd}, checkpoint_id=tmp_path, planner=DefaultSavePlanner())
    m2, opt2 = _fresh()
    msd2, osd2 = get_state_dict(m2, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _assert_same_training_state(m, opt, m2, opt2)


def test_our_checkpoint_loads_with_stock_tools(tmp_path):
    m, opt = _trained()
    msd, osd = get_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ck", planner=UCPSavePlanner())
    assert_written_by_ucp(tmp_path / "ck", storage=False)  # ours, read by stock tools below
    # stock planner (flat optimizer form: same keys)
    m2, opt2 = _fresh()
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    msd2, osd2 = get_state_dict(m2, opt2, options=opts)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=tmp_path / "ck", planner=DefaultLoadPlanner())
    set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=opts)
    _assert_same_training_state(m, opt, m2, opt2)
    # dcp_to_torch_save rebuilds the nested dict from the flatten mappings kept in planner_data
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert tensors_equal(full["model"], m.state_dict())
    assert torch.equal(full["optim"]["state.emb.weight.exp_avg"], opt.state[m.emb.weight]["exp_avg"])


def test_catalog_is_builtins_and_unpickles_without_ucp_dcp(tmp_path):
    m, _ = _trained()
    dcp.save({"model": m.state_dict()}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    cat = md.planner_data[ucp_dcp.CATALOG_KEY]

    def builtins_only(x):
        if isinstance(x, dict):
            return all(isinstance(k, str) and builtins_only(v) for k, v in x.items())
        if isinstance(x, list):
            return all(builtins_only(v) for v in x)
        return x is None or isinstance(x, (str, int, float, bool))

    assert builtins_only(cat)
    assert cat["version"] == 1 and cat["topology"]["world_size"] == 1
    assert cat["atoms"]["model.emb.weight"]["shape"] == [10, 6]
    code = (
        "import sys, pickle; sys.modules['ucp_dcp'] = None\n"
        f"md = pickle.load(open({str(tmp_path / '.metadata')!r}, 'rb'))\n"
        "cat = md.planner_data['__ucp__']; print(cat['format'], len(cat['atoms']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ucp-dcp.catalog", str(len(cat["atoms"]))]


def test_newer_catalog_version_is_refused(tmp_path):
    dcp.save({"x": torch.ones(2)}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    md_path = tmp_path / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    md.planner_data[ucp_dcp.CATALOG_KEY]["version"] = 99
    md_path.write_bytes(pickle.dumps(md))
    err = expect_ucp_error(
        lambda: dcp.load({"x": torch.zeros(2)}, checkpoint_id=tmp_path, planner=UCPLoadPlanner()),
        ucp_dcp.CatalogVersionError,
    )
    assert "99" in str(err) and "upgrade" in str(err)


def test_inspect_cli(tmp_path):
    m, opt = _trained()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ucp", planner=UCPSavePlanner())
    dcp.save({"model": msd}, checkpoint_id=tmp_path / "stock", planner=DefaultSavePlanner())
    # the real command line once (a fresh interpreter: seconds importing torch), the other two in this process
    proc = subprocess.run(
        [sys.executable, "-m", "ucp_dcp", "inspect", str(tmp_path / "ucp"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert s["ucp_catalog"] and s["topology"]["world_size"] == 1
    row = s["atoms"]["optim.state.emb.weight.exp_avg"]
    assert row["shape"] == [10, 6] and row["dtype"] == "float32" and row["kind"] == "optim_state"
    assert row["chunks"] == 1 and row["bytes"] > 240
    stock = run_cli("inspect", str(tmp_path / "stock"))
    assert stock.returncode == 0 and "source topology: unknown" in stock.stdout and "model.emb.weight" in stock.stdout
    assert run_cli("inspect", str(tmp_path / "nothing")).returncode == 2


def test_errors_survive_pickle_and_helpers_unwrap():
    for cls in (
        ucp_dcp.UCPError,
        ucp_dcp.ShapeMismatchError,
        ucp_dcp.MissingAtomsError,
        ucp_dcp.ReplicaMismatchError,
        ucp_dcp.ChecksumError,
        ucp_dcp.PatternError,
    ):
        e = cls("boom", atom="a.b", saved=(2, 3), wanted=(4, 3), hint="do x")
        e2 = pickle.loads(pickle.dumps(e))
        assert type(e2) is cls and str(e2) == str(e)
        assert (e2.atom, e2.saved, e2.wanted, e2.hint) == ("a.b", (2, 3), (4, 3), "do x")
    from torch.distributed.checkpoint.api import CheckpointException

    inner = ucp_dcp.ShapeMismatchError("bad shape", atom="w")
    exc = pickle.loads(pickle.dumps(CheckpointException("load", {1: (RuntimeError("x"), None), 2: (inner, None)})))
    assert ucp_dcp.first_ucp_error(exc).atom == "w"
    with pytest.raises(ucp_dcp.ShapeMismatchError):
        with ucp_dcp.ucp_errors():
            raise exc
    with pytest.raises(ucp_dcp.ShapeMismatchError):
        ucp_dcp.raise_first_ucp_error(exc)


def test_planners_pickle_cheaply(tmp_path):
    p = UCPSavePlanner(check_replicas="warn")
    assert len(pickle.dumps(p)) < 2000
    p.set_up_planner({"x": torch.zeros(1000)}, None, True)
    assert len(pickle.dumps(p)) < 2000, "runtime state (tensors) must not be pickled"
    q = pickle.loads(pickle.dumps(UCPLoadPlanner(allow_partial_load=True)))
    assert q.allow_partial_load


def test_fsspec_storage(tmp_path):
    m, opt = _trained()
    msd, osd = get_state_dict(m, opt)
    url = f"file://{tmp_path}/ck"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=url, planner=UCPSavePlanner())
    m2, opt2 = _fresh()
    msd2, osd2 = get_state_dict(m2, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=url, planner=UCPLoadPlanner())
    set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _assert_same_training_state(m, opt, m2, opt2)
    out = run_cli("inspect", url, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["ucp_catalog"], out.stderr
