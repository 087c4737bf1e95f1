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


# -- peer errors: one statically written class per error class (issue 48) ------------------------------------------


def _ucp_error_classes() -> list[type]:
    """Every UCPError subclass ucp_dcp defines (its higher layers' too), peer classes left out."""
    import importlib

    from ucp_dcp.errors import PeerFailedError

    for module in ("ucp_dcp.planning.faults", "ucp_dcp.planning.plan_cache", "ucp_dcp.memory.tier"):
        importlib.import_module(module)
    found, todo = [], [u.UCPError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls is not u.UCPError and not issubclass(cls, PeerFailedError) and cls.__module__.startswith("ucp_dcp."):
            found.append(cls)
    return sorted(set(found), key=lambda c: (c.__module__, c.__qualname__))


def _cause(cls: type) -> BaseException:
    """An instance of ``cls`` with every field set, built as the planners' errors are (keyword fields)."""
    err = cls.__new__(cls)
    u.UCPError.__init__(err, f"{cls.__name__} on this rank", atom="w", saved=(4, 2), wanted=(4, 3), hint="do this")
    return err


def test_every_error_class_has_a_peer_class_written_at_module_level():
    import sys

    from ucp_dcp import errors as E

    classes = _ucp_error_classes()
    exported = {getattr(u, n) for n in u.__all__ if isinstance(getattr(u, n), type)}
    assert {c for c in exported if issubclass(c, u.UCPError)} <= set(classes) | {u.UCPError}
    assert len(classes) >= 26, classes  # errors.py's 22 and the higher layers' 4
    for cls in classes:
        peer = E._peer_class(cls)
        assert peer.__name__ == f"Peer{cls.__name__}" and peer.__bases__ == (E.PeerFailedError, cls), (cls, peer)
        assert getattr(sys.modules[peer.__module__], peer.__name__) is peer, peer  # pickled by reference
        if cls in exported:
            assert peer.__module__ == "ucp_dcp.errors" and getattr(E, peer.__name__) is peer, peer
    # and every peer class is in the table, under its cause
    for name in dir(E):
        obj = getattr(E, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, E.PeerFailedError)
            and obj not in (E.PeerFailedError, E.PeerLostError)
        ):
            assert E._PEER_CLASSES[obj.__bases__[1]] is obj, name


@pytest.mark.parametrize("same", [False, True])
def test_a_peer_error_of_every_class_survives_a_pickle_with_its_class_and_fields(same):
    import pickle

    from ucp_dcp.errors import PeerFailedError, peer_error, same_as

    for cls in _ucp_error_classes():
        cause = _cause(cls)
        err = same_as(2, cause) if same else peer_error(3, cause)
        assert isinstance(err, cls) and isinstance(err, PeerFailedError) and err.cause_class == cls.__name__, cls
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err), cls
        got = (back.rank, back.message, back._fields(), back.same, back.cause_class, str(back))
        assert got == (err.rank, err.message, err._fields(), err.same, err.cause_class, str(err)), cls
        assert back.atom == "w" and back.saved == (4, 2) and back.hint == "do this", cls


def test_a_peer_of_a_builtin_or_a_subclass_is_the_nearest_class_with_a_peer_class():
    import pickle

    from ucp_dcp import errors as E

    class UsersChecksumError(u.ChecksumError):
        pass

    for cause, peer, builtin in (
        (ValueError("v"), E.PeerValueError, ValueError),
        (RuntimeError("r"), E.PeerRuntimeError, RuntimeError),
        (OSError("o"), E.PeerOSError, OSError),
        (BlockingIOError("b"), E.PeerOSError, OSError),  # a subclass without one: its nearest base's
        (KeyError("k"), E.PeerKeyError, KeyError),
        (UsersChecksumError("c"), E.PeerChecksumError, u.ChecksumError),
        (ZeroDivisionError("z"), E.PeerFailedError, u.UCPError),  # nothing catches it as more
    ):
        err = E.peer_error(1, cause)
        assert type(err) is peer and isinstance(err, builtin) and err.cause_class == type(cause).__name__, cause
        assert str(err).splitlines()[0] == f"rank 1 failed: {type(cause).__name__}: {cause}", err
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is peer and back.cause_class == err.cause_class and str(back) == str(err), cause
    assert E.peer_error(1, E.peer_error(0, ValueError("v"))).rank == 0  # a peer's error is passed on


def test_a_class_name_on_the_wire_is_looked_up_never_imported_or_called(monkeypatch):
    import builtins
    import importlib
    import sys

    from ucp_dcp import errors as E

    called = []
    monkeypatch.setattr(os, "system", lambda *a: called.append(a))
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: called.append(a))
    real_import = builtins.__import__

    def no_import(name, *args, **kwargs):
        called.append(name)
        return real_import(name, *args, **kwargs)

    forged = [("os", "system"), ("antigravity", "fly"), ("builtins", "exec"), ("builtins", "__import__")]
    forged += [("ucp_dcp.errors", "_build"), ("ucp_dcp.errors", "json.loads"), ("builtins", "object.__class__")]
    lines = [json_line(m, c) for m, c in forged]
    builtins.__import__ = no_import  # not monkeypatch: its setattr imports (inspect)
    try:
        errs = [E.error_from_wire(2, line) for line in lines]
    finally:
        builtins.__import__ = real_import
    assert not called and "antigravity" not in sys.modules, called
    for err in errs:
        assert type(err) is E.PeerFailedError and "rank 2 failed: UCPError: x" in str(err), err
    # the names a rank sends (wire_error) are found: ucp_dcp's classes with a peer class, builtins, UCPError
    for cls in _ucp_error_classes():
        got = E.error_from_wire(2, E.wire_error(_cause(cls)))
        assert type(got) is E._peer_class(cls) and got.cause_class == cls.__name__ and got.rank == 2, cls
    assert type(E.error_from_wire(2, E.wire_error(PermissionError("denied")))) is E.PeerPermissionError
    assert type(E.error_from_wire(2, E.wire_error(u.UCPError("x")))) is E.PeerFailedError


def json_line(module: str, cls: str) -> bytes:
    import json

    return json.dumps({"module": module, "cls": cls, "msg": "x"}).encode()
