"""Ties found from the state and the raw optimizer form under FSDP2 on 2 gloo ranks (issue 31, items 2 and 3):
FSDP2 keeps a tie (one DTensor parameter under two names), which is saved once as an atom with an alias and
loads back bitwise; a raw ``optimizer.state_dict()`` of DTensor moments saves with stock DCP's keys, its
positions in the catalog, and loads back bitwise (steps and groups included). A tied model saved by stock DCP
(both names as copies, no checksums) loads into a tied model when its copies compare equal when read (issue 46). The mistake tier runs the
other loads of both forms (ucp_dev.testing.mistake_forms)."""

from __future__ import annotations

import copy

import dist as D
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import tensors_equal
from torch.distributed.checkpoint.metadata import MetadataIndex

import ucp_dcp
from ucp_dev.testing.mistake_forms import WORLD, TiedLM, _flat, _job

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def _tied_worker(rank, world, root):
    model, _ = _job(True, 0, sharded=True)
    assert model.output.weight is model.tok_embeddings.weight, "FSDP2 keeps the tie"
    ucp_dcp.save({"model": model.state_dict()}, root)
    m2, _ = _job(True, 1, sharded=True)
    sd = {"model": m2.state_dict()}
    ucp_dcp.load(sd, root)
    same = tensors_equal(_flat("", {"model": model.state_dict()}), _flat("", {"model": m2.state_dict()}))
    md = dcp.FileSystemReader(root).read_metadata()
    return {
        "tie kept": m2.output.weight is m2.tok_embeddings.weight,
        "same": same,
        "aliases": md.planner_data["__ucp__"]["atoms"]["model.tok_embeddings.weight"].get("aliases"),
        "chunks": [tuple(c.offsets) for c in md.state_dict_metadata["model.output.weight"].chunks],
        "one copy": all(
            md.storage_data[MetadataIndex("model.output.weight", c.offsets)]
            == md.storage_data[MetadataIndex("model.tok_embeddings.weight", c.offsets)]
            for c in md.state_dict_metadata["model.output.weight"].chunks
        ),
    }


def test_fsdp2_tied_model_saves_one_atom_with_an_alias_and_loads_back_bitwise():
    out = D.run(_tied_worker, WORLD, D.tmpdir())
    for r in out:
        assert r["tie kept"] and r["same"], r
    assert out[0]["aliases"] == ["model.output.weight"]
    assert len(out[0]["chunks"]) == WORLD and out[0]["one copy"], out[0]  # each rank's shard, stored once


def _stock_tied_worker(rank, world, root, equal):
    """Issue 46: a tied FSDP2 model (or, ``equal=False``, an untied one whose head differs) saved by stock DCP,
    which writes each rank's shard of both names as copies of their own, with no checksums."""
    model, _ = _job(equal, 0, sharded=True)
    if not equal:
        with torch.no_grad():
            model.output.weight.copy_(model.tok_embeddings.weight + 1)
    dcp.save({"model": model.state_dict()}, checkpoint_id=root)  # DCP's own planner and writer
    m2, _ = _job(True, 1, sharded=True)
    before = m2.tok_embeddings.weight.to_local().clone()
    out = {"saved": _flat("", {"model": model.state_dict()})}
    try:
        ucp_dcp.load({"model": m2.state_dict()}, root)
    except ucp_dcp.AmbiguousLayoutError as e:
        out.update(error=str(e), hint=e.hint, untouched=torch.equal(m2.tok_embeddings.weight.to_local(), before))
        return out
    loaded = _flat("", {"model": m2.state_dict()})
    md = dcp.FileSystemReader(root).read_metadata()
    out.update(
        tie_kept=m2.output.weight is m2.tok_embeddings.weight,
        bitwise=all(torch.equal(loaded[k].view(torch.int32), out["saved"][k].view(torch.int32)) for k in out["saved"]),
        chunks=len(md.state_dict_metadata["model.output.weight"].chunks),
        digests="__ucp__" in md.planner_data,
    )
    return out


def test_fsdp2_tied_model_saved_by_stock_dcp_loads_its_equal_copies_into_a_tied_model():
    root = D.tmpdir()
    out = D.run(_stock_tied_worker, WORLD, root, True)
    for r in out:
        assert r.get("tie_kept") and r["bitwise"] and r["chunks"] == WORLD and not r["digests"], r
    one = TiedLM(True, 2)  # the same checkpoint into one process: each copy's fragment read from both ranks' chunks
    ucp_dcp.load({"model": one.state_dict()}, root)
    assert one.output.weight is one.tok_embeddings.weight
    saved = out[0]["saved"]
    assert torch.equal(one.output.weight.detach().view(torch.int32), saved[".model.output.weight"].view(torch.int32))


def test_fsdp2_stock_saved_different_copies_are_refused_on_every_rank_when_read():
    root = D.tmpdir()
    for r in D.run(_stock_tied_worker, WORLD, root, False):
        assert "different values" in r["error"] and "compared when read" in r["error"], r
        assert "untie" in r["hint"] and r["untouched"], r
    untied = TiedLM(False, 2)  # the hint: a tensor of its own for the head
    ucp_dcp.load({"model": untied.state_dict()}, root)
    with pytest.raises(ucp_dcp.AmbiguousLayoutError, match="different values"):
        ucp_dcp.load({"model": TiedLM(True, 2).state_dict()}, root)


def _raw_worker(rank, world, root):
    model, opt = _job(False, 0, sharded=True)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    ucp_dcp.save(sd, f"{root}/ucp")
    dcp.save(sd, checkpoint_id=f"{root}/stock")
    m2, o2 = _job(False, 1, sharded=True)
    target = {"model": m2.state_dict(), "optim": copy.deepcopy(o2.state_dict())}
    ucp_dcp.load(target, f"{root}/ucp")
    o2.load_state_dict(target["optim"])
    ours = dcp.FileSystemReader(f"{root}/ucp").read_metadata()
    stock = dcp.FileSystemReader(f"{root}/stock").read_metadata()
    return {
        "same": tensors_equal(_flat("", opt.state_dict()), _flat("", o2.state_dict())),
        "model": tensors_equal(_flat("", model.state_dict()), _flat("", m2.state_dict())),
        "dtensor moments": type(opt.state_dict()["state"][0]["exp_avg"]).__name__,
        "keys": set(ours.state_dict_metadata) == set(stock.state_dict_metadata),
        "positions": ours.planner_data["__ucp__"].get("raw_optimizers"),
        "rank": dist.get_rank(),
    }


def test_fsdp2_raw_optimizer_state_dict_saves_with_dcp_keys_and_loads_back_bitwise():
    out = D.run(_raw_worker, WORLD, D.tmpdir())
    for r in out:
        assert r["same"] and r["model"] and r["keys"], r
    assert out[0]["dtensor moments"] == "DTensor"
    assert out[0]["positions"] == {"optim": [[0, 1], [2, 3]]}
