"""Ties found from the state (issue 31, item 2), one process: a tied embedding and output head (one
``Parameter`` under two names) saved as one atom with an alias, loaded into the same tied model with
no rule, into an untied model, and by stock DCP; two atoms saved separately tied at load only when
the checkpoint's digests show they are one value, refused with a hint that works when they differ; a tied
model saved by stock DCP (both names written as copies, no digests) loads into a tied model when its copies,
read and compared bitwise, are equal (issue 46), and is refused with the same hint when they differ."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import ucp_failure
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict import get_state_dict

import ucp_dcp
from ucp_dcp import Tied, UCPFileSystemReader, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.planning.ties import saved_equal, storage_identity

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TIE = Tied("tok_embeddings.weight", (r"output\.weight",))


class LM(nn.Module):
    """The smallest tied language model: embedding and output head share one weight."""

    def __init__(self, tied: bool = True, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.output = nn.Linear(4, 11, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.tok_embeddings(x)))


def _trained(tied: bool = True):
    model = LM(tied, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).square().sum().backward()
    opt.step()
    return model, opt


FORMS = {
    "model.state_dict": lambda m, o: {"model": m.state_dict()},
    "get_state_dict": lambda m, o: dict(zip(("model", "optim"), get_state_dict(m, o))),
}


def _equal_models(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


@pytest.mark.parametrize("form", FORMS)
def test_a_tied_model_saves_one_atom_and_loads_into_itself_without_a_rule(tmp_path, form):
    model, opt = _trained()
    ucp_dcp.save(FORMS[form](model, opt), tmp_path)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    rec = md.planner_data["__ucp__"]["atoms"]["model.tok_embeddings.weight"]
    assert (
        rec["aliases"] == ["model.output.weight"] and "model.output.weight" not in md.planner_data["__ucp__"]["atoms"]
    )
    at = torch.Size([0, 0])  # the alias is a key of the same stored bytes: written once
    assert (
        md.storage_data[MetadataIndex("model.output.weight", at)]
        == md.storage_data[MetadataIndex("model.tok_embeddings.weight", at)]
    )
    fresh, fresh_opt = LM(True, seed=1), None
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = FORMS[form](fresh, fresh_opt)
    ucp_dcp.load(state, tmp_path)
    assert fresh.output.weight is fresh.tok_embeddings.weight, "the tie is kept"
    assert torch.equal(fresh.tok_embeddings.weight, model.tok_embeddings.weight)
    if form == "get_state_dict":
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        saved = opt.state_dict()["state"][0]
        got = fresh_opt.state_dict()["state"][0]
        assert all(torch.equal(saved[k], got[k]) for k in saved)
    assert _equal_models(fresh, model)


def _written_once(folder) -> bool:
    """The checkpoint holds the tied weight once: an alias whose entries are its atom's bytes."""
    md = dcp.FileSystemReader(folder).read_metadata()
    rec = md.planner_data["__ucp__"]["atoms"]["model.tok_embeddings.weight"]
    at = torch.Size([0, 0])
    return (
        rec.get("aliases") == ["model.output.weight"]
        and md.storage_data[MetadataIndex("model.output.weight", at)]
        == md.storage_data[MetadataIndex("model.tok_embeddings.weight", at)]
    )


def test_a_tied_checkpoint_loads_into_an_untied_model_in_both_names(tmp_path):
    model, _ = _trained()
    ucp_dcp.save({"model": model.state_dict()}, tmp_path)
    assert _written_once(tmp_path)
    untied = LM(tied=False, seed=1)
    ucp_dcp.load({"model": untied.state_dict()}, tmp_path)
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert torch.equal(untied.output.weight, model.output.weight)
    assert torch.equal(untied.tok_embeddings.weight, model.tok_embeddings.weight)
    assert _equal_models(untied, model)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_stock_dcp_reads_a_tied_checkpoint_written_once(tmp_path, tied):
    model, _ = _trained()
    ucp_dcp.save({"model": model.state_dict()}, tmp_path)
    assert _written_once(tmp_path)
    target = LM(tied, seed=1)
    dcp.load({"model": target.state_dict()}, checkpoint_id=tmp_path)  # DCP's planner and reader
    assert _equal_models(target, model)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_with_dcp_own_writer_the_alias_lives_in_the_catalog(tmp_path, tied):
    model, _ = _trained()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    assert "model.output.weight" not in md.state_dict_metadata  # written once, named by the catalog
    target = LM(tied, seed=1)
    dcp.load({"model": target.state_dict()}, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    assert _equal_models(target, model)


def _separately(tmp_path, equal: bool) -> torch.Tensor:
    """A checkpoint holding the two names as atoms of their own (as ucp_dcp wrote tied models before)."""
    model, _ = _trained()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if not equal:
        sd["output.weight"] += 1
    ucp_dcp.save({"model": sd}, tmp_path)
    return sd


@pytest.mark.parametrize("rules", [[], [TIE]], ids=["no rule", "Tied at load"])
def test_separately_saved_equal_copies_load_into_a_tied_model(tmp_path, rules):
    sd = _separately(tmp_path, equal=True)
    target = LM(True, seed=1)
    ucp_dcp.load({"model": target.state_dict()}, tmp_path, patterns=rules)
    assert torch.equal(target.output.weight, sd["output.weight"])
    assert torch.equal(target.norm.weight, sd["norm.weight"])


def test_separately_saved_different_copies_refused_and_the_hint_works(tmp_path):
    sd = _separately(tmp_path, equal=False)
    tied = LM(True, seed=1)
    before = tied.tok_embeddings.weight.detach().clone()
    with pytest.raises(ucp_dcp.AmbiguousLayoutError) as e:
        ucp_dcp.load({"model": tied.state_dict()}, tmp_path)
    assert "different values" in str(e.value) and "untie" in e.value.hint
    with pytest.raises(ucp_dcp.PatternError) as e:  # the rule the old hint named is refused too: they differ
        ucp_dcp.load({"model": tied.state_dict()}, tmp_path, patterns=[TIE])
    err = e.value
    assert err.atom == "model.output.weight" and "digests disagree" in str(err)
    assert "drop the Tied rule" in err.hint and "'model.output.weight' a tensor of its own" in err.hint
    assert torch.equal(tied.tok_embeddings.weight, before), "nothing was loaded"
    untied = LM(False, seed=1)  # following the hint: no rule, a tensor of its own
    ucp_dcp.load({"model": untied.state_dict()}, tmp_path)
    assert torch.equal(untied.output.weight, sd["output.weight"])
    assert torch.equal(untied.tok_embeddings.weight, sd["tok_embeddings.weight"])


def test_a_tie_rule_without_digests_to_compare_is_refused(tmp_path):
    """DCP's own writer records no checksums: equality cannot be shown, so the rule is not trusted."""
    model, _ = _trained()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save({"model": sd}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    with pytest.raises(ucp_dcp.PatternError, match="cannot show they are equal"):
        ucp_dcp.load({"model": LM(True, seed=1).state_dict()}, tmp_path, patterns=[TIE])
    untied = LM(False, seed=1)
    ucp_dcp.load({"model": untied.state_dict()}, tmp_path)
    assert _equal_models(untied, model)


def _stock_saved(tmp_path, equal: bool = True, tied: bool = True):
    """A tied model (or, for different copies, an untied one whose head differs) saved by stock DCP: its
    default planner and FileSystemWriter write both names as copies of their own and no checksums."""
    model, opt = _trained(tied)
    if not equal:
        with torch.no_grad():
            model.output.weight.copy_(model.tok_embeddings.weight + 1)
    state = FORMS["get_state_dict"](model, opt)
    dcp.save(state, checkpoint_id=tmp_path)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    assert "__ucp__" not in md.planner_data and not any(i.fqn == "__ucp_io__" for i in md.storage_data)
    at = torch.Size([0, 0])
    assert (
        md.storage_data[MetadataIndex("model.output.weight", at)]
        != md.storage_data[MetadataIndex("model.tok_embeddings.weight", at)]
    ), "written twice"
    assert saved_equal(md, "model.tok_embeddings.weight", "model.output.weight") is None  # no digests: cannot tell
    return model, opt


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))
    )


def _one_storage(m: nn.Module) -> bool:
    sd = m.state_dict()
    return (
        m.output.weight is m.tok_embeddings.weight
        and sd["output.weight"].untyped_storage().data_ptr() == sd["tok_embeddings.weight"].untyped_storage().data_ptr()
    )


def _error(exc: BaseException) -> ucp_dcp.UCPError:
    """ucp_dcp.load raises the UCPError itself, dcp.load DCP's CheckpointException holding it."""
    return exc if isinstance(exc, ucp_dcp.UCPError) else ucp_failure(exc)


LOADS = {
    "ucp_dcp.load": lambda state, path: ucp_dcp.load(state, path),
    "dcp.load": lambda state, path: dcp.load(state, checkpoint_id=path, planner=UCPLoadPlanner()),
    "staged": lambda state, path: dcp.load(
        state, storage_reader=UCPFileSystemReader(path, staging="always", thread_count=2), planner=UCPLoadPlanner()
    ),
}


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("form", FORMS)
def test_a_stock_saved_tied_checkpoint_loads_into_a_tied_model(tmp_path, form, load, monkeypatch):
    """Issue 46: the two copies stock DCP wrote are read, compared bitwise and loaded once, the tie kept."""
    from ucp_dcp.planning import device

    monkeypatch.setattr(device, "STAGE_BYTES", 64)  # the staged load cuts each copy into many reads
    model, opt = _stock_saved(tmp_path)
    fresh = LM(True, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = FORMS[form](fresh, fresh_opt)
    LOADS[load](state, tmp_path)
    assert _one_storage(fresh), "the tie is kept"
    assert _bitwise(fresh.tok_embeddings.weight, model.tok_embeddings.weight)
    assert _bitwise(fresh.output.weight, model.output.weight)
    if form == "get_state_dict":
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert _one_storage(fresh)
        saved, got = opt.state_dict()["state"][0], fresh_opt.state_dict()["state"][0]
        assert all(torch.equal(saved[k], got[k]) for k in saved)
    assert _equal_models(fresh, model)


@pytest.mark.parametrize("load", LOADS)
def test_stock_saved_different_copies_are_refused_when_read_and_the_hint_works(tmp_path, load):
    model, _ = _stock_saved(tmp_path, equal=False, tied=False)
    tied = LM(True, seed=1)
    before = tied.tok_embeddings.weight.detach().clone()
    with pytest.raises((ucp_dcp.AmbiguousLayoutError, CheckpointException)) as e:
        LOADS[load]({"model": tied.state_dict()}, tmp_path)
    err = _error(e.value)
    assert isinstance(err, ucp_dcp.AmbiguousLayoutError), e.value
    assert "share memory" in str(err) and "different values" in str(err) and "compared when read" in str(err)
    assert "44 of 44 values differ, the first at index (0, 0)" in str(err), str(err)
    assert err.atom == "model.output.weight" and "untie" in err.hint
    assert _bitwise(tied.tok_embeddings.weight, before), "nothing of the tied tensor was loaded"
    untied = LM(False, seed=1)  # following the hint: a tensor of its own for the head
    LOADS[load]({"model": untied.state_dict()}, tmp_path)
    assert _bitwise(untied.output.weight, model.output.weight)
    assert _bitwise(untied.tok_embeddings.weight, model.tok_embeddings.weight)


def test_copies_differing_in_one_bit_are_refused(tmp_path):
    """Bitwise, not by value: -0.0 and 0.0 are equal numbers but different saved bytes."""
    w = torch.zeros(3, 2)
    dcp.save({"a": w, "b": w.clone().neg_()}, checkpoint_id=tmp_path)  # -0.0 everywhere
    shared = torch.ones(3, 2)
    with pytest.raises(ucp_dcp.AmbiguousLayoutError, match="6 of 6 values differ"):
        ucp_dcp.load({"a": shared, "b": shared}, tmp_path)
    assert torch.equal(shared, torch.ones(3, 2))
    nan = torch.full((3, 2), float("nan"))
    dcp.save({"a": nan, "b": nan.clone()}, checkpoint_id=tmp_path / "nan")  # NaN == NaN bitwise: one value
    ucp_dcp.load({"a": shared, "b": shared}, tmp_path / "nan")
    assert torch.equal(shared.view(torch.int32), nan.view(torch.int32))


def test_a_stock_saved_tie_converts_into_a_narrower_tied_target(tmp_path):
    """The copies are compared as saved (fp32), then the value goes through the range-checked conversion."""
    model, _ = _stock_saved(tmp_path)
    half = LM(True, seed=1).half()
    ucp_dcp.load({"model": half.state_dict()}, tmp_path)
    assert _one_storage(half) and torch.equal(half.output.weight, model.output.weight.half())
    w = model.tok_embeddings.weight.detach().clone()
    w[0, 0] = 1e6  # past float16's range
    big = {"model": {**model.state_dict(), "tok_embeddings.weight": w, "output.weight": w}}  # saved twice
    dcp.save(big, checkpoint_id=tmp_path / "big")
    with pytest.raises(ucp_dcp.DtypeConversionError):
        ucp_dcp.load({"model": LM(True, seed=1).half().state_dict()}, tmp_path / "big")


def test_a_cached_plan_compares_the_copies_again(tmp_path):
    _stock_saved(tmp_path / "equal")
    model, _ = _stock_saved(tmp_path / "different", equal=False, tied=False)
    tied = LM(True, seed=1)
    for _ in range(2):
        with pytest.raises(ucp_dcp.AmbiguousLayoutError, match="different values"):
            ucp_dcp.load({"model": tied.state_dict()}, tmp_path / "different")
    stats = [ucp_dcp.load({"model": tied.state_dict()}, tmp_path / "equal").plan_cached for _ in range(2)]
    assert stats == [0, 1] and _one_storage(tied)
    with torch.no_grad():
        tied.tok_embeddings.weight.zero_()
    ucp_dcp.load({"model": tied.state_dict()}, tmp_path / "equal")
    assert torch.equal(tied.output.weight, _trained()[0].output.weight)


def test_an_override_dropping_one_copy_of_a_tie_is_refused(tmp_path):
    """The copies are compared when read: dropping the reads of one name but not the other cannot load."""
    _stock_saved(tmp_path)

    class Skip(UCPLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            return dataclasses.replace(plan, items=[i for i in plan.items if "output" not in i.dest_index.fqn])

    with pytest.raises((ucp_dcp.UCPError, CheckpointException)) as e:
        dcp.load({"model": LM(True, seed=1).state_dict()}, checkpoint_id=tmp_path, planner=Skip())
    err = _error(e.value)
    assert "dropped for some keys but not all" in str(err) and "drop the reads of every key" in err.hint


def test_saved_equal_reads_the_chunk_digests(tmp_path):
    w = torch.randn(6, 3)
    ucp_dcp.save({"a": w, "b": w.clone(), "c": w + 1, "d": w.double(), "e": torch.randn(3, 6)}, tmp_path)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    assert saved_equal(md, "a", "b") is True
    assert saved_equal(md, "a", "c") is False
    assert saved_equal(md, "a", "d") is False and saved_equal(md, "a", "e") is False
    md.storage_data = {}
    assert saved_equal(md, "a", "b") is None  # no digests: cannot tell


def test_only_identical_views_are_one_tensor():
    w = torch.randn(4, 3)
    assert storage_identity(w) == storage_identity(w.detach()) == storage_identity(nn.Parameter(w).detach())
    assert storage_identity(w) != storage_identity(w[1:])  # another offset: other values
    assert storage_identity(w) != storage_identity(w.clone())  # equal values, other memory: two tensors
    assert storage_identity(w.view(3, 4)) != storage_identity(w)
    assert storage_identity(torch.empty(0)) is None and storage_identity(torch.empty(2, device="meta")) is None
    assert storage_identity(3) is None


def test_overlapping_but_different_views_are_saved_as_they_are(tmp_path):
    """A key and a view of part of it are not a tie: both are saved, as DCP saves them."""
    w = torch.arange(12.0).reshape(4, 3)
    ucp_dcp.save({"w": w, "top": w[:2]}, tmp_path)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    assert not md.planner_data["__ucp__"]["atoms"]["w"].get("aliases")
    out = {"w": torch.zeros(4, 3), "top": torch.zeros(2, 3)}
    ucp_dcp.load(out, tmp_path)
    assert torch.equal(out["w"], w) and torch.equal(out["top"], w[:2])


def test_an_untied_target_lacks_only_the_head_optimizer_state(tmp_path):
    """A tied model's optimizer has one parameter: the untied target's head has no saved moments."""
    model, opt = _trained()
    ucp_dcp.save(FORMS["get_state_dict"](model, opt), tmp_path)
    untied = LM(False, seed=1)
    state = FORMS["get_state_dict"](untied, torch.optim.AdamW(untied.parameters(), lr=0.1))
    with pytest.raises(ucp_dcp.MissingAtomsError) as e:
        ucp_dcp.load(state, tmp_path)
    wanted = set(e.value.wanted)
    assert {f"optim.state.output.weight.{k}" for k in ("step", "exp_avg", "exp_avg_sq")} <= wanted
    assert all(".output.weight." in a for a in wanted), wanted  # its state and per-parameter group entries only
    ucp_dcp.load(state, tmp_path, allow_partial_load=True)
    assert torch.equal(state["model"]["output.weight"], model.output.weight)
    assert torch.equal(
        state["optim"]["state"]["tok_embeddings.weight"]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


def test_tensors_without_plain_memory_are_never_one_tensor():
    assert storage_identity(torch.eye(3).to_sparse()) is None


def test_inspect_shows_the_alias_and_verify_checks_its_bytes_once(tmp_path):
    from ucp_dcp.tools.summary import summarize
    from ucp_dcp.tools.verify import verify

    model, _ = _trained()
    ucp_dcp.save({"model": model.state_dict()}, tmp_path)
    report = verify(tmp_path)
    assert report.status == "ok", report.problems
    rows = summarize(dcp.FileSystemReader(tmp_path).read_metadata())["atoms"]
    alias = rows["model.output.weight"]
    assert alias["pattern"] == "alias" and alias["live"] == "model.tok_embeddings.weight" and alias["bytes"] == 0
    assert rows["model.tok_embeddings.weight"]["bytes"] > 0


@pytest.mark.parametrize("rules", [[], [TIE]], ids=["found", "declared"])
def test_a_tied_target_reads_the_value_once(tmp_path, rules):
    model, _ = _trained()
    ucp_dcp.save({"model": {"tok_embeddings.weight": model.tok_embeddings.weight}}, tmp_path / "one")
    ucp_dcp.save({"model": model.state_dict()}, tmp_path / "tied", patterns=rules)
    alone = ucp_dcp.load({"model": {"tok_embeddings.weight": torch.zeros(11, 4)}}, tmp_path / "one")
    target = LM(True, seed=1)
    stats = ucp_dcp.load(
        {
            "model": {
                "tok_embeddings.weight": target.tok_embeddings.weight.data,
                "output.weight": target.output.weight.data,
            }
        },
        tmp_path / "tied",
    )
    assert torch.equal(target.output.weight, model.output.weight)
    assert stats.bytes_read == alone.bytes_read and len(stats.items) == len(alone.items), (stats, alone)
