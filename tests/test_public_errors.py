"""Every error the public API raises for bad input is a UCPError, one entry point per item; where Python or
DCP code would raise a ValueError / TypeError / FileNotFoundError, the UCPError is one too, so callers that
catch those keep working."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import ucp_dcp as u
from ucp_dcp import InvalidArgumentError, UnexpectedArgumentError


def _mapping() -> u.HFMapping:
    return u.HFMapping((u.HFRule("model.embed_tokens.weight", "model.tok_embeddings.weight"),))


def _titan_config(**bad):
    pytest.importorskip("torchtitan")
    from ucp_dcp.torchtitan import UCPCheckpointManager

    return UCPCheckpointManager.Config(**bad)


# (entry point with bad input, the UCPError subclass, the builtin type it also is (or None))
CASES = {
    "save planner: unknown keyword": (lambda d: u.UCPSavePlanner(bogus=1), UnexpectedArgumentError, TypeError),
    "save planner: UCPOptions first": (lambda d: u.UCPSavePlanner(u.UCPOptions()), UnexpectedArgumentError, TypeError),
    "save planner: options and fields": (
        lambda d: u.UCPSavePlanner(options=u.UCPOptions(), strict=False),
        UnexpectedArgumentError,
        TypeError,
    ),
    "save planner: check_replicas": (lambda d: u.UCPSavePlanner(check_replicas="x"), InvalidArgumentError, ValueError),
    "save planner: replica_digests": (
        lambda d: u.UCPSavePlanner(replica_digests="x"),
        InvalidArgumentError,
        ValueError,
    ),
    "save planner: step out of order": (lambda d: u.UCPSavePlanner().create_local_plan(), u.UCPError, None),
    "load planner: read_once": (lambda d: u.UCPLoadPlanner(read_once="x"), InvalidArgumentError, ValueError),
    "load planner: unknown keyword": (lambda d: u.UCPLoadPlanner(nope=1), UnexpectedArgumentError, TypeError),
    "load planner: no metadata": (lambda d: u.UCPLoadPlanner().set_up_planner({}, None), u.UCPError, None),
    "options: bad regex": (lambda d: u.UCPOptions(patterns=[u.Padded("(", size=3)]), u.RuleArgumentError, ValueError),
    "rule: reduce op": (lambda d: u.Reduce("w", "prod"), u.RuleArgumentError, ValueError),
    "rule: padded size": (lambda d: u.Padded("w", size=-1), u.RuleArgumentError, ValueError),
    "rule: fused dim": (lambda d: u.Fused("w", [("a", 1), ("b", 1)], dim=-1), u.RuleArgumentError, ValueError),
    "rule: tied aliases": (lambda d: u.Tied("w", "v"), u.RuleArgumentError, ValueError),
    "map: stage_map layers": (lambda d: u.stage_map([0, 0]), u.RuleArgumentError, ValueError),
    "map: index map key": (lambda d: u.IndexMap("", (u.Chunk(0),)), u.RuleArgumentError, ValueError),
    "name rules: bare string": (lambda d: u.NameRules(wrapper_segments="_orig_mod"), u.RuleArgumentError, ValueError),
    "HF rule: placeholders": (lambda d: u.HFRule("a.{i}", "b"), u.RuleArgumentError, ValueError),
    "writer: URL without atomic writes": (lambda d: u.UCPFileSystemWriter("ftp://b/x"), u.UCPError, None),
    "writer: staging": (lambda d: u.UCPFileSystemWriter(d, staging="x"), InvalidArgumentError, ValueError),
    "reader: thread_count": (lambda d: u.UCPFileSystemReader(d, thread_count="x"), InvalidArgumentError, ValueError),
    "reader: read_once": (lambda d: u.UCPFileSystemReader(d, read_once="x"), InvalidArgumentError, ValueError),
    "staging env": (
        lambda d: _with_env("UCP_DCP_STAGING", "x", lambda: u.UCPFileSystemReader(d)),
        InvalidArgumentError,
        ValueError,
    ),
    "save: state_dict not a dict": (lambda d: u.save([1, 2], d), UnexpectedArgumentError, TypeError),
    "save: path None": (lambda d: u.save({"a": torch.zeros(1)}, None), UnexpectedArgumentError, TypeError),
    "save: unknown planner option": (
        lambda d: u.save({"a": torch.zeros(1)}, d, nope=1),
        UnexpectedArgumentError,
        TypeError,
    ),
    "load: no checkpoint": (
        lambda d: u.load({"a": torch.zeros(1)}, os.path.join(d, "nope")),
        u.CheckpointNotFoundError,
        FileNotFoundError,
    ),
    "load: state_dict not a dict": (lambda d: u.load(None, d), UnexpectedArgumentError, TypeError),
    "read_catalog: newer version": (
        lambda d: u.read_catalog({"__ucp__": {"format": "ucp-dcp.catalog", "version": 99}}),
        u.CatalogVersionError,
        None,
    ),
    "load_hf: no folder": (
        lambda d: u.load_hf({}, os.path.join(d, "nope"), _mapping()),
        u.CheckpointNotFoundError,
        FileNotFoundError,
    ),
    "export_hf: no checkpoint": (
        lambda d: u.export_hf(os.path.join(d, "nope"), os.path.join(d, "out"), _mapping()),
        u.CheckpointNotFoundError,
        FileNotFoundError,
    ),
    "DeepSpeedReader: no folder": (
        lambda d: u.DeepSpeedReader(os.path.join(d, "nope")),
        u.CheckpointNotFoundError,
        FileNotFoundError,
    ),
    "torchtitan config: ntokens_seen": (lambda d: _titan_config(ntokens_seen="x"), InvalidArgumentError, ValueError),
    "torchtitan config: bad rule": (lambda d: _titan_manager_rules(d), u.PatternError, None),
}


def _with_env(name, value, fn):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _titan_manager_rules(d):
    """A rule that is not JSON, refused when the manager builds its rules (no process group needed)."""
    pytest.importorskip("torchtitan")
    import torch.nn as nn

    from ucp_dcp.torchtitan import UCPCheckpointManager

    model = nn.Linear(2, 2)

    class Stateless:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    opt = Stateless()
    opt.init_cache_state_dict = lambda: None
    config = UCPCheckpointManager.Config(enable=True, folder="ck", rules=["{not json"], keep_latest_k=0)
    return UCPCheckpointManager(
        config,
        dataloader=Stateless(),
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=Stateless(),
        states={},
        sd_adapter=None,
        base_folder=d,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_a_ucp_error(case, tmp_path):
    fn, cls, builtin = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(u.UCPError) as info:
            fn(str(tmp_path))
    assert isinstance(info.value, cls), f"{case}: {type(info.value).__name__}: {info.value}"
    if cls is u.RuleArgumentError:  # a bad argument, and what such a rule raised before: a PatternError
        assert isinstance(info.value, u.PatternError) and isinstance(info.value, InvalidArgumentError), case
    if builtin is not None:
        assert isinstance(info.value, builtin), f"{case}: callers catching {builtin.__name__} no longer would"
