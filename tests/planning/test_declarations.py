"""A load's declarations checked against the checkpoint and the target (issue 21), one process: a tie
declared only at load over atoms saved separately, and target keys that alias one storage."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_written_by_ucp, expect_ucp_error

import ucp_dcp
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.layout.patterns import Tied

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TIE = Tied("emb.weight", (r"out\.weight",))


def _untied(tmp_path):
    torch.manual_seed(0)
    sd = {"model": {"emb.weight": torch.randn(5, 3), "out.weight": torch.randn(5, 3)}}
    dcp.save(sd, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    return sd


def test_a_tie_declared_only_at_load_over_separately_saved_atoms_is_refused(tmp_path):
    _untied(tmp_path)
    target = {"model": {"emb.weight": torch.zeros(5, 3), "out.weight": torch.zeros(5, 3)}}
    err = expect_ucp_error(
        lambda: dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner(patterns=[TIE])), ucp_dcp.PatternError
    )
    assert err.atom == "model.out.weight" and "declared at load, not at save" in str(err)
    assert "drop the Tied rule" in err.hint


def test_a_tie_declared_at_save_and_load_loads(tmp_path):
    w = torch.randn(5, 3)
    dcp.save(
        {"model": {"emb.weight": w, "out.weight": w.clone()}},
        checkpoint_id=tmp_path,
        planner=UCPSavePlanner(patterns=[TIE]),
    )
    assert_written_by_ucp(tmp_path, storage=False)
    target = {"model": {"emb.weight": torch.zeros(5, 3), "out.weight": torch.zeros(5, 3)}}
    dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner(patterns=[TIE]))
    assert torch.equal(target["model"]["out.weight"], w) and torch.equal(target["model"]["emb.weight"], w)


def test_target_keys_sharing_memory_with_different_saved_atoms_are_refused(tmp_path):
    saved = _untied(tmp_path)
    shared = torch.zeros(5, 3)  # one tied Parameter under two keys, no rule: the loads would overwrite each other
    target = {"model": {"emb.weight": shared, "out.weight": shared}}
    err = expect_ucp_error(
        lambda: dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner()), ucp_dcp.AmbiguousLayoutError
    )
    # DCP's writer recorded no checksums: the two saved copies are read and compared, and differ
    assert "share memory" in str(err) and "different values" in str(err) and "compared when read" in str(err)
    assert "untie" in err.hint
    assert torch.equal(shared, torch.zeros(5, 3)), "nothing was loaded"
    del saved


def test_a_fused_rule_that_differs_from_the_saved_one_is_refused(tmp_path):
    from ucp_dcp.layout.patterns import Fused

    saved_rule = Fused(r"(.*)wqkv\.weight", [(r"\1wq.weight", 4), (r"\1wk.weight", 2), (r"\1wv.weight", 2)], blocks=2)
    other = Fused(r"(.*)wqkv\.weight", [(r"\1wq.weight", 4), (r"\1wk.weight", 2), (r"\1wv.weight", 2)], blocks=1)
    w = torch.randn(8, 3)
    dcp.save({"attn.wqkv.weight": w}, checkpoint_id=tmp_path, planner=UCPSavePlanner(patterns=[saved_rule]))
    target = {"attn.wqkv.weight": torch.zeros(8, 3)}
    err = expect_ucp_error(
        lambda: dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner(patterns=[other])), ucp_dcp.PatternError
    )
    assert "blocks 2 at save, 1 now" in str(err) and err.atom and "strict=False" in err.hint
    dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner())  # the saved rule applies by itself
    assert torch.equal(target["attn.wqkv.weight"], w)


def test_a_fused_rule_of_another_model_config_reports_the_shapes(tmp_path):
    """Other KV heads: other part sizes and blocks. That is a model change, reported as the shape
    mismatch naming both shapes, not as a rule conflict (the e2e tier's other-config plan expects it)."""
    from ucp_dcp.layout.patterns import Fused

    saved_rule = Fused(r"(.*)wqkv\.weight", [(r"\1wq.weight", 4), (r"\1wk.weight", 2), (r"\1wv.weight", 2)], blocks=2)
    other = Fused(r"(.*)wqkv\.weight", [(r"\1wq.weight", 4), (r"\1wk.weight", 4), (r"\1wv.weight", 4)], blocks=4)
    dcp.save(
        {"attn.wqkv.weight": torch.randn(8, 3)}, checkpoint_id=tmp_path, planner=UCPSavePlanner(patterns=[saved_rule])
    )
    target = {"attn.wqkv.weight": torch.zeros(12, 3)}
    err = expect_ucp_error(
        lambda: dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner(patterns=[other])),
        ucp_dcp.ShapeMismatchError,
    )
    assert err.atom == "attn.wk.weight" and "(2, 3)" in str(err) and "(4, 3)" in str(err), err


def test_an_unused_rule_names_itself_as_the_atom(tmp_path):
    err = expect_ucp_error(
        lambda: dcp.save(
            {"a": torch.ones(2)},
            checkpoint_id=tmp_path,
            planner=UCPSavePlanner(patterns=[Tied("emb.weight", (r"out\.weight",))]),
        ),
        ucp_dcp.PatternError,
    )
    assert err.atom == "emb.weight" and "matched no name" in str(err)


def test_a_reduce_rule_only_at_load_is_refused(tmp_path):
    from ucp_dcp.layout.patterns import Reduce

    dcp.save({"train_state": {"tokens_seen": 5}}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    target = {"train_state": {"tokens_seen": 0}}
    err = expect_ucp_error(
        lambda: dcp.load(
            target,
            checkpoint_id=tmp_path,
            planner=UCPLoadPlanner(patterns=[Reduce(r"train_state\.tokens_seen", "sum")]),
        ),
        ucp_dcp.PatternError,
    )
    assert err.atom == "train_state.tokens_seen" and "without a reduction" in str(err)


def test_map_orders_read_off_the_claims():
    from types import SimpleNamespace as U

    from ucp_dcp.layout.structure import check_map_orders, map_orders

    up = [U(claims=[("experts", 0, 0), ("experts", 1, 0)]), U(claims=[("experts", 2, 1), ("experts", 3, 1)])]
    down = [U(claims=[("experts", 2, 0)]), U(claims=[("experts", 0, 1)])]
    assert map_orders(up) == {"experts": "ascending"} and map_orders(down) == {"experts": "descending"}
    assert map_orders([U(claims=[("layers", 0, 0), ("layers", 1, 0)])]) == {}  # one owner: nothing known
    check_map_orders({"experts": "ascending"}, {"experts": "ascending"})
    with pytest.raises(ucp_dcp.AmbiguousLayoutError, match="descending order"):
        check_map_orders({"experts": "ascending"}, {"experts": "descending"})
