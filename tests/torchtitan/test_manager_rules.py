"""Declared rules in saves and loads that leave state out on purpose (torchtitan's model-only export
and model-only loads): optional rules, namespace-anchored rules, and strict mode still catching a
rule that matches nothing in a save that holds its state. Single process, no Trainer."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import expect_ucp_error

import ucp_dcp
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.layout.patterns import Fused, Padded, Reduce, anchored_in, literal_prefix, rule_from_json

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NTOKENS = Reduce(r"train_state\.ntokens_seen", "sum")  # the manager's built-in rule
QKV = Fused(r"(.*)\.wqkv\.weight", [(r"\1.wq.weight", 4), (r"\1.wk.weight", 2), (r"\1.wv.weight", 2)], blocks=2)


def _model():
    return {"layers.0.attention.wqkv.weight": torch.arange(24.0).reshape(8, 3), "norm.weight": torch.ones(3)}


def _full():
    return {**_model(), "train_state": {"step": 3, "ntokens_seen": 96}, "lr_scheduler": {"last_epoch": 3}}


def _catalog(path):
    return dcp.FileSystemReader(path).read_metadata().planner_data[ucp_dcp.CATALOG_KEY]


def test_unmatched_optional_rule_is_not_counted_by_strict_mode(tmp_path):
    rules = [QKV, Reduce(r"train_state\.x", optional=True)]
    dcp.save(_model(), checkpoint_id=tmp_path, planner=UCPSavePlanner(patterns=rules))
    assert (tmp_path / ".metadata").exists()
    assert all("optional" not in r for r in _catalog(tmp_path)["rules"]), "optional is not part of the layout record"


def test_unmatched_rule_in_a_save_holding_its_state_is_still_an_error(tmp_path):
    rules = [QKV, NTOKENS, Reduce(r"train_state\.nope")]
    err = expect_ucp_error(
        lambda: dcp.save(_full(), checkpoint_id=tmp_path, planner=UCPSavePlanner(patterns=rules)), ucp_dcp.PatternError
    )
    assert "matched no name at save" in str(err) and "train_state" in str(err) and "nope" in str(err)
    assert not (tmp_path / ".metadata").exists()


def test_optional_rule_applies_where_it_matches(tmp_path):
    sd = {"emb.weight": torch.arange(10.0).reshape(5, 2)}
    rules = [Padded(r"emb\.weight", size=3, optional=True, discard=True)]  # rows 3.. are data, dropped by design
    dcp.save(sd, checkpoint_id=tmp_path, planner=UCPSavePlanner(patterns=rules))
    assert _catalog(tmp_path)["atoms"]["emb.weight"]["shape"] == [3, 2]
    target = {"emb.weight": torch.full((4, 2), 7.0)}
    dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    assert torch.equal(target["emb.weight"][:3], sd["emb.weight"][:3]) and not target["emb.weight"][3].any()


def test_optional_flag_from_json_and_rule_identity():
    rule = rule_from_json({"kind": "reduce", "pattern": r"train_state\.x", "op": "sum", "optional": True})
    assert rule.optional and rule == Reduce(r"train_state\.x", "sum") and not Reduce(r"train_state\.x").optional


@pytest.mark.parametrize(
    "pattern, prefix",
    [
        (r"train_state\.ntokens_seen", "train_state.ntokens_seen"),
        (r"train_state\.(a|b)", "train_state."),
        (r"train_state\.a|lr_scheduler\.b", ""),  # top-level alternation: no common start
        (r"train_state.x", "train_state"),  # unescaped dot matches any character
        (r"(?i)train_state\.x", ""),
        (r"ab*c", "a"),
        (r"\d+\.x", ""),
    ],
)
def test_literal_prefix(pattern, prefix):
    assert literal_prefix(pattern) == prefix


def test_anchored_in_a_namespace():
    assert anchored_in(NTOKENS, "train_state") and not anchored_in(NTOKENS, "train")
    assert not anchored_in(Reduce(r".*ntokens_seen"), "train_state") and not anchored_in(QKV, "train_state")


def _rules_for_call():
    pytest.importorskip("torchtitan")
    from ucp_dcp.torchtitan.manager import rules_for_call

    return rules_for_call


def test_model_only_save_and_load_declare_no_train_state_rules(tmp_path):
    """What broke torchtitan's last-step model-only export: the built-in ntokens_seen rule declared
    in a save that holds no train state; the same for a model-only load of the export."""
    rules_for_call = _rules_for_call()
    left_out = ["optimizer", "lr_scheduler", "dataloader", "train_state"]
    err = expect_ucp_error(
        lambda: dcp.save(_model(), checkpoint_id=tmp_path / "bug", planner=UCPSavePlanner(patterns=[QKV, NTOKENS])),
        ucp_dcp.PatternError,
    )
    assert "matched no name at save: reduce('train_state\\\\.ntokens_seen')" in str(err)
    rules = rules_for_call([QKV, NTOKENS], left_out)
    assert rules == [QKV]
    dcp.save(_model(), checkpoint_id=tmp_path / "export", planner=UCPSavePlanner(patterns=rules))
    target = {k: torch.zeros_like(v) for k, v in _model().items()}
    dcp.load(target, checkpoint_id=tmp_path / "export", planner=UCPLoadPlanner(patterns=rules))
    assert all(torch.equal(target[k], v) for k, v in _model().items())


def test_full_save_declares_every_rule():
    rules_for_call = _rules_for_call()
    user = Reduce(r"train_state\.nope")
    assert rules_for_call([QKV, NTOKENS, user], []) == [QKV, NTOKENS, user]
    assert rules_for_call([QKV, NTOKENS, user], ["dataloader"]) == [QKV, NTOKENS, user]


@pytest.mark.parametrize("name", ["ntokens_seen", "dataloader_policy", "check_replicas", "memory_staging"])
def test_config_refuses_a_mode_outside_its_literal(name):
    """UCPCheckpointManager.Config's string modes are Literal types, checked when the config is made
    (as torchtitan's own Config checks async_mode), not when a save or load first reads them."""
    pytest.importorskip("torchtitan")
    from ucp_dcp.torchtitan.manager import UCPCheckpointManager

    with pytest.raises(ValueError, match=f"checkpoint.{name} must be one of"):
        UCPCheckpointManager.Config(**{name: "bogus"})
