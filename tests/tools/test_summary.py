"""``python -m ucp_dcp inspect``: values of small atoms (verified, decoded safely), kinds, folded
optimizer param groups, mesh text, torchtitan ``checkpoint/`` folders, exit codes. Single process."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ucp_dcp
from ucp_dcp.__main__ import main
from ucp_dcp.storage.format import IO_KEY, item_key
from ucp_dcp.storage.opening import open_path, read_metadata
from ucp_dcp.tools.summary import atom_kinds, format_summary, summarize

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model_and_optim(flat: bool = False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(
        [
            {"params": [m[0].weight, m[2].weight], "lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1},
            {"params": [m[0].bias, m[1].weight, m[1].bias, m[2].bias], "lr": 0.01, "weight_decay": 0.0},
        ]
    )
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    return get_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat)) + (sched,)


def _state():
    msd, osd, sched = _model_and_optim()
    return {
        "model": msd,
        "optim": osd,
        "sched": sched.state_dict(),
        "train": {"step": 7, "tokens": torch.tensor(123)},
        "dataloader": {"cursor": 42, "dataset": "c4"},
        "rng": torch.get_rng_state(),
        "big": {"blob": list(range(3000))},
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "ckpt"
    ucp_dcp.save(_state(), path)
    return path


def _summary(path, **kw):
    md, integrity = open_path(path)
    return summarize(md, integrity, path=path, **kw)


def _cli(capsys, *args):
    rc = main(["inspect", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _flip(path, atom, *, data=False):
    """Flip one byte of ``atom``'s saved item (its tensor data when ``data``)."""
    md = read_metadata(path)
    index = next(k for k in md.storage_data if k.fqn == atom)
    info = md.storage_data[index]
    at = info.offset + (
        md.storage_data[MetadataIndex(IO_KEY)]["items"][item_key(index)][0] if data else info.length // 2
    )
    f = path / info.relative_path
    b = bytearray(f.read_bytes())
    b[at] ^= 0x40
    f.write_bytes(bytes(b))


def test_small_values_are_shown_verified(ckpt, capsys):
    s = _summary(ckpt)
    a = s["atoms"]
    assert a["train.step"]["value"] == 7 and a["train.step"]["value_verified"] is True
    assert a["dataloader.cursor"]["value"] == 42 and a["dataloader.dataset"]["value"] == "c4"
    assert a["sched._last_lr"]["value"] == [0.01, 0.01] and a["sched.step_size"]["value"] == 10
    assert a["train.tokens"]["value"] == 123 and a["optim.state.0.weight.step"]["value"] == 1.0  # 0-d tensors
    assert "value" not in a["rng"] and "value" not in a["model.0.weight"]  # 5056 and 16 elements: not read
    assert "value" not in a["big.blob"] and a["big.blob"]["value_text"].startswith("<object, ")
    assert not s["value_errors"] and s["values_read"]
    rc, out, _ = _cli(capsys, ckpt, "--json")
    assert rc == 0 and json.loads(out)["atoms"]["optim.param_groups.0.weight.betas"]["value"] == [0.9, 0.95]
    rc, out, _ = _cli(capsys, ckpt)
    row = next(line for line in out.splitlines() if line.startswith("train.step "))
    assert rc == 0 and row.split()[-1] == "7" and "train_state" in row
    assert "<object, " in out and "verified against their checksums" in out
    rc, out, _ = _cli(capsys, ckpt, "--no-values", "--json")
    assert rc == 0 and "value" not in json.loads(out)["atoms"]["train.step"]


def test_kinds(ckpt):
    kinds = {n: r["kind"] for n, r in _summary(ckpt, values=False)["atoms"].items()}
    assert {kinds[n] for n in kinds if n.startswith("sched.")} == {"scheduler"}
    assert kinds["train.step"] == kinds["train.tokens"] == "train_state"
    assert kinds["dataloader.cursor"] == "dataloader" and kinds["rng"] == "rng" and kinds["big.blob"] == "object"
    assert kinds["model.0.weight"] == "model" and kinds["optim.state.0.weight.exp_avg"] == "optim_state"
    assert kinds["optim.param_groups.0.weight.lr"] == "param_group"


def test_kinds_of_torchtitan_names_without_a_catalog(tmp_path):
    msd, osd, _ = _model_and_optim(flat=True)  # torchtitan: flat optimizer state, weights at the top level
    sd = {
        **msd,
        "optimizer": osd,
        "lr_scheduler": {"last_epoch": 3},
        "train_state": {"step": 3, "ntokens_seen": 96},
        "dataloader": {"dp_rank_0": b"\x80\x04state", "world_size": 1},
        "extra": {"note": "x"},
    }
    dcp.save(sd, checkpoint_id=tmp_path)
    kinds = atom_kinds(read_metadata(tmp_path))
    assert kinds["0.weight"] == "model" and kinds["optimizer.state.0.weight.exp_avg"] == "optim_state"
    assert kinds["optimizer.param_groups.0.weight.lr"] == "param_group"
    assert kinds["lr_scheduler.last_epoch"] == "scheduler" and kinds["train_state.ntokens_seen"] == "train_state"
    assert kinds["dataloader.dp_rank_0"] == "dataloader" and kinds["extra.note"] == "object"
    s = _summary(tmp_path)
    assert s["atoms"]["dataloader.dp_rank_0"]["value_text"] == "<bytes, 7>"  # never unpickled
    assert s["atoms"]["train_state.step"]["value_verified"] is False  # stock DCP: no checksums to check
    assert [len(g["params"]) for g in s["param_groups"]] == [4, 2]


def test_param_groups_fold_into_one_line_per_group(ckpt, capsys):
    s = _summary(ckpt)
    groups = sorted(s["param_groups"], key=lambda g: len(g["params"]))
    assert [sorted(g["params"]) for g in groups] == [
        ["0.weight", "2.weight"],
        ["0.bias", "1.bias", "1.weight", "2.bias"],
    ]
    assert groups[0]["values"]["weight_decay"] == 0.1 and groups[0]["values"]["betas"] == [0.9, 0.95]
    # 2 parameters x 12 hyperparameters, plus the group's copy in DCP's own form (12 + its params list)
    assert groups[1]["values"]["weight_decay"] == 0.0 and len(groups[0]["atoms"]) == 2 * 12 + 13
    rc, out, _ = _cli(capsys, ckpt)
    lines = [line for line in out.splitlines() if line.startswith("optim.param_groups")]
    assert rc == 0 and len(lines) == 2, lines  # one line per group
    two = next(line for line in lines if line.startswith("optim.param_groups (2 params)"))
    assert "lr=0.01 betas=(0.9, 0.95) weight_decay=0.1" in two and "params: 0.weight, 2.weight" in two
    assert "98 param_group rows folded into 2 line(s)" in out  # 72 per parameter, 2 x 13 stock copies
    rc, out, _ = _cli(capsys, ckpt, "--all")
    assert "optim.param_groups.0.weight.lr" in out and "folded" not in out
    assert len([line for line in out.splitlines() if line.startswith("optim.param_groups.")]) == 98
    assert len(out.splitlines()) == len(format_summary(s, all_rows=True).splitlines())


def test_stock_nested_param_groups_fold_by_group_index(tmp_path):
    msd, osd, _ = _model_and_optim()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path)
    s = _summary(tmp_path)
    assert "optim.param_groups.0.params" in s["atoms"]  # stock DCP: one object per group and hyperparameter
    text = format_summary(s)
    assert "optim.param_groups.0 (2 params)" in text and "optim.param_groups.1 (4 params)" in text
    assert "optim.param_groups.0.lr" not in text and "optim.param_groups.0.lr" in format_summary(s, all_rows=True)


def test_a_corrupted_value_is_reported_not_shown(ckpt, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    _flip(bad, "train.step")
    _flip(bad, "optim.state.0.weight.step", data=True)
    _flip(bad, "optim.param_groups.0.weight.lr")
    s = _summary(bad)
    for name in ("train.step", "optim.state.0.weight.step", "optim.param_groups.0.weight.lr"):
        assert "value" not in s["atoms"][name] and "checksum mismatch" in s["atoms"][name]["value_error"]
    assert s["value_errors"] == sorted(["train.step", "optim.state.0.weight.step", "optim.param_groups.0.weight.lr"])
    # the damaged parameter's group rows are not folded: its rows stay visible, the error among them
    assert sorted(len(g["params"]) for g in s["param_groups"]) == [1, 4]
    rc, out, _ = _cli(capsys, bad)
    assert rc == 1 and "value errors (3)" in out
    row = next(line for line in out.splitlines() if line.startswith("train.step "))
    assert row.endswith("<error: checksum mismatch>") and " 7" not in row
    assert "optim.param_groups.0.weight.lr " in out


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_value_of_an_unsafe_type_is_refused_not_run(tmp_path, capsys):
    marker = tmp_path / "ran"
    ucp_dcp.save({"w": torch.ones(2), "evil": _Payload(str(marker))}, tmp_path / "ckpt")
    s = _summary(tmp_path / "ckpt")
    assert "value" not in s["atoms"]["evil"] and "could run code" in s["atoms"]["evil"]["value_refused"]
    rc, out, _ = _cli(capsys, tmp_path / "ckpt")
    assert rc == 0 and "<refused: type outside the safe set>" in out and "values not decoded (1)" in out
    assert not marker.exists()


def test_mesh_is_shown_as_shape_and_dim_names(ckpt):
    md, integrity = open_path(ckpt)
    cat = md.planner_data[ucp_dcp.CATALOG_KEY]
    cat["topology"] = {"world_size": 4, "meshes": [{"shape": [2, 2], "dim_names": ["dp", "tp"], "ranks": [0, 1, 2, 3]}]}
    cat["atoms"]["model.0.weight"]["layouts"] = [{"mesh": 0, "placements": ["S(0)", "R"]}]
    s = summarize(md, integrity)
    assert s["topology_text"] == "world_size=4, mesh (2, 2) dp,tp"
    assert s["atoms"]["model.0.weight"]["layouts"] == ["mesh (2, 2) dp,tp [S(0),R]"]
    text = format_summary(s)
    assert text.splitlines()[0] == "source topology: world_size=4, mesh (2, 2) dp,tp" and "meshes:" not in text
    assert "mesh (2, 2) dp,tp [S(0),R]" in next(line for line in text.splitlines() if line.startswith("model.0.weight"))
    cat["topology"]["meshes"] = [{"shape": [4], "dim_names": ["fsdp"], "ranks": [0, 1, 2, 3]}]
    cat["atoms"]["model.0.weight"]["layouts"] = [{"mesh": 0, "placements": ["S(0)"]}]
    s = summarize(md, integrity)
    assert s["topology_text"] == "world_size=4, mesh (4,) fsdp"
    assert s["atoms"]["model.0.weight"]["layouts"] == ["mesh (4,) fsdp [S(0)]"]
    cat["topology"]["meshes"] = [
        {"shape": [2], "dim_names": ["dp"], "ranks": [0, 1]},
        {"shape": [2], "dim_names": ["dp"], "ranks": [2, 3]},
    ]
    cat["atoms"]["model.0.weight"]["layouts"] = [{"mesh": 1, "placements": ["S(0)"]}]
    s = summarize(md, integrity)
    assert s["topology_text"] == "world_size=4, 2 meshes: mesh0 (2,) dp on ranks 0,1; mesh1 (2,) dp on ranks 2,3"
    assert s["atoms"]["model.0.weight"]["layouts"] == ["mesh1 (2,) dp [S(0)]"]


def test_torchtitan_checkpoint_folder_lists_its_steps(tmp_path, capsys):
    root = tmp_path / "checkpoint"
    for step in (20, 3, 10):
        ucp_dcp.save(
            {"tok_embeddings.weight": torch.full((2, 2), float(step)), "train_state": {"step": step}},
            root / f"step-{step}",
        )
    (root / "step-30").mkdir()
    (root / "step-30" / "__0_0a1b2c3d_0.distcp").write_bytes(b"x")  # a save that never committed
    rc, out, _ = _cli(capsys, root)
    lines = out.splitlines()
    assert rc == 0 and "4 step(s), latest step 20" in lines[0]
    rows = [line.split()[0] for line in lines[2:6]]
    assert rows == ["3", "10", "20", "30"]  # by step, not by name
    assert lines[4].endswith("<- latest") and " verified " in lines[4] and "ucp_dcp" in lines[4]
    assert "incomplete" in lines[5] and "latest" not in lines[5]
    rc, out, _ = _cli(capsys, root, "--json")
    d = json.loads(out)
    assert rc == 0 and d["latest"] == 20 and [r["step"] for r in d["steps"]] == [3, 10, 20, 30]
    assert [r["latest"] for r in d["steps"]] == [False, False, True, False] and d["steps"][2]["atoms"] == 2
    rc, out, _ = _cli(capsys, root, "--step", 10)
    assert rc == 0 and out.startswith("source topology:")
    assert next(line for line in out.splitlines() if line.startswith("train_state.step")).endswith(" 10")
    rc, out, _ = _cli(capsys, root / "step-20")
    assert rc == 0 and next(line for line in out.splitlines() if line.startswith("train_state.step")).endswith(" 20")
    rc, _, err = _cli(capsys, root, "--step", 7)
    assert rc == 2 and "no step-7" in err and "3, 10, 20, 30" in err
    rc, _, err = _cli(capsys, root / "step-20", "--step", 20)
    assert rc == 2 and "not a torchtitan checkpoint folder" in err
    rc, _, err = _cli(capsys, root, "--step", 30)
    assert rc == 2 and "incomplete checkpoint" in err


def test_exit_codes(ckpt, tmp_path, capsys):
    assert _cli(capsys, ckpt)[0] == 0
    rc, _, err = _cli(capsys, tmp_path / "missing")
    assert rc == 2 and "no checkpoint" in err
    (tmp_path / "empty").mkdir()
    assert _cli(capsys, tmp_path / "empty")[0] == 2
