"""Rule, index-map and name-rule constructors check their arguments (single process): an impossible value is
refused where it is given, with a RuleArgumentError (an InvalidArgumentError, so a ValueError, and a
PatternError) naming the rule, the argument, the value and what is allowed; the values the rules take still
construct, and what they keep is plain JSON for the catalog."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ucp_dcp
from ucp_dcp import (
    Chunk,
    Fused,
    HFMapping,
    HFRule,
    IndexMap,
    InvalidArgumentError,
    NameRules,
    Padded,
    PatternError,
    Reduce,
    Replicated,
    RuleArgumentError,
    Tied,
    expert_map,
    stage_map,
)
from ucp_dcp.layout.patterns import REDUCE_OPS, REPLICA_CHECKS, rule_from_json, rule_to_json

SETTINGS = settings(max_examples=25)

_NOT_INTS = st.one_of(
    st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.none(), st.just([1]), st.just(2.0)
)
_NOT_REALS = st.one_of(
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.just([0.0]),
    st.complex_numbers(allow_nan=False, allow_infinity=False).filter(lambda z: z.imag != 0),
)
_NOT_BOOLS = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.just([True]))
_BAD_REGEXES = st.one_of(
    st.sampled_from(["(", "[a-", "*x", "a{2,1}", r"(?P<1>x)", "a)"]),
    st.integers(),
    st.none(),
    st.just(re.compile(r"emb\.weight")),  # a compiled pattern: its text is what the catalog records
)


def _not_one_of(choices):
    return st.one_of(st.text(max_size=6).filter(lambda s: s not in choices), st.integers(), st.none())


def _negative():
    return st.integers(max_value=-1)


_PARTS_OK = ((r"\1.wq.weight", 8), (r"\1.wk.weight", 4))
_BAD_PARTS = st.one_of(
    st.just(()),
    st.just(((r"\1.wq.weight", 8),)),  # one part is no fusion
    st.just(((r"\1.w.weight", 8), (r"\1.w.weight", 4))),  # two parts, one atom
    st.just(((r"\2.wq.weight", 8), (r"\1.wk.weight", 4))),  # the regex has one group
    st.just(((r"\g<name>.wq", 8), (r"\1.wk", 4))),  # ... and no named one
    st.just(((r"\1.wq.weight",), (r"\1.wk.weight", 4))),  # not a pair
    st.just("wq,wk"),
    st.just(((r"\1.wq.weight", 8), (7, 4))),  # a template that is no string
    st.tuples(st.just((r"\1.wq.weight", 8)), st.tuples(st.just(r"\1.wk.weight"), st.integers(max_value=0))),
    st.tuples(st.just((r"\1.wq.weight", 8)), st.tuples(st.just(r"\1.wk.weight"), _NOT_INTS)),
)

# rule -> the keyword arguments of a rule that constructs
BASE = {
    Fused: dict(pattern=r"(.*)\.wqkv\.weight", parts=_PARTS_OK, dim=0, blocks=2),
    Padded: dict(pattern=r"emb\.weight", size=61, dim=0, fill=0.0, state_fill=0.0, discard=False),
    Replicated: dict(pattern=r".*norm\.weight", check="error"),
    Reduce: dict(pattern=r"train_state\.tokens", op="sum"),
    Tied: dict(param="emb.weight", aliases=(r"out\.weight",)),
}

# (rule, argument) -> values it cannot take
BAD = {
    (Fused, "pattern"): _BAD_REGEXES,
    (Fused, "parts"): _BAD_PARTS,
    (Fused, "dim"): st.one_of(_negative(), _NOT_INTS),
    (Fused, "blocks"): st.one_of(st.integers(max_value=0), st.just(""), st.none(), st.floats(), st.booleans()),
    (Fused, "optional"): _NOT_BOOLS,
    (Padded, "pattern"): _BAD_REGEXES,
    (Padded, "size"): st.one_of(st.integers(max_value=0), _NOT_INTS),
    (Padded, "dim"): st.one_of(_negative(), _NOT_INTS),
    (Padded, "fill"): _NOT_REALS,
    (Padded, "state_fill"): _NOT_REALS,
    (Padded, "discard"): _NOT_BOOLS,
    (Padded, "optional"): _NOT_BOOLS,
    (Replicated, "pattern"): _BAD_REGEXES,
    (Replicated, "check"): _not_one_of(REPLICA_CHECKS),
    (Replicated, "optional"): _NOT_BOOLS,
    (Reduce, "pattern"): _BAD_REGEXES,
    (Reduce, "op"): _not_one_of(REDUCE_OPS),
    (Reduce, "optional"): _NOT_BOOLS,
    (Tied, "param"): st.one_of(st.just(""), st.integers(), st.none()),
    (Tied, "aliases"): st.one_of(
        st.just(r"out\.weight"),  # a bare string: a sequence of one-letter regexes before
        st.just(()),
        st.lists(_BAD_REGEXES.filter(lambda r: not isinstance(r, re.Pattern)), min_size=1, max_size=2),
        st.integers(),
    ),
    (Tied, "optional"): _NOT_BOOLS,
}


def _refused(make, *names):
    """``make()`` raises a RuleArgumentError whose message names ``names``; returns the error."""
    with pytest.raises(RuleArgumentError) as info:
        make()
    err = info.value
    assert isinstance(err, InvalidArgumentError) and isinstance(err, ValueError) and isinstance(err, PatternError)
    for name in names:
        assert name in str(err), f"{name!r} not in: {err}"
    assert err.wanted, "the error says what is allowed"
    return err


def test_every_public_rule_is_checked_here():
    assert {cls for cls, _ in BAD} == set(BASE) == {Fused, Padded, Replicated, Reduce, Tied}
    assert set(ucp_dcp.layout.patterns._KINDS.values()) == set(BASE)


@pytest.mark.parametrize(
    "rule,arg", sorted(BAD, key=lambda k: (k[0].__name__, k[1])), ids=lambda x: getattr(x, "__name__", x)
)
@SETTINGS
@given(data=st.data())
def test_rule_refuses_an_impossible_argument_naming_rule_argument_and_value(rule, arg, data):
    value = data.draw(BAD[(rule, arg)], label=arg)
    _refused(lambda: rule(**{**BASE[rule], arg: value}), rule.__name__, arg)


@SETTINGS
@given(
    size=st.integers(1, 1 << 40),
    dim=st.integers(0, 7),
    fill=st.one_of(st.floats(allow_nan=False), st.integers(-(1 << 20), 1 << 20)),
    blocks=st.one_of(st.integers(1, 64), st.sampled_from(["tp", "ep", "dp_shard"])),
    sizes=st.lists(st.integers(1, 1 << 20), min_size=2, max_size=5),
    numpy=st.booleans(),
    optional=st.booleans(),
)
def test_rules_with_good_arguments_construct_and_record_plain_json(size, dim, fill, blocks, sizes, numpy, optional):
    as_int = np.int64 if numpy else int  # numpy integers are taken, kept as ints (the catalog is JSON)
    rules = [
        Padded(r"emb\.weight", size=as_int(size), dim=as_int(dim), fill=fill, state_fill=-fill, optional=optional),
        Fused(
            r"(?P<layer>.*)\.w13\.weight",
            [(rf"\g<layer>.w{i}.weight" if i % 2 else rf"\1.w{i}.weight", as_int(n)) for i, n in enumerate(sizes)],
            dim=as_int(dim),
            blocks=blocks if isinstance(blocks, str) else as_int(blocks),
        ),
        Replicated(r".*norm\.weight", check="average"),
        Reduce(r"train_state\.tokens", "max", optional=optional),
        Tied("tok_embeddings.weight", [r"output\.weight", r"lm_head\.weight"]),
    ]
    for rule in rules:
        record = rule_to_json(rule)
        assert rule_from_json(json.loads(json.dumps(record))) == rule
    assert (
        type(rules[0].size) is int and type(rules[1].parts[0][1]) is int and rules[4].aliases[1] == r"lm_head\.weight"
    )


def test_a_catalogs_impossible_rule_is_a_pattern_error_naming_the_catalog():
    """A catalog is not an argument of the caller's: its impossible rule is a damaged checkpoint's PatternError."""
    record = {"kind": "padded", "pattern": "emb", "size": -3}
    with pytest.raises(PatternError, match=r"rule Padded in catalog: Padded\('emb'\): size=-3: expected") as info:
        rule_from_json(record)
    assert info.value.saved == {"pattern": "emb", "size": -3} and "int >= 1" in info.value.wanted


# -- index maps and name rules ------------------------------------------------------------------------------

_BAD_TABLES = st.one_of(
    _negative(),
    st.floats(),
    st.booleans(),
    st.text(min_size=1, max_size=3),  # a string is no table
    st.lists(st.integers(0, 3), min_size=2, max_size=5).filter(lambda t: len(set(t)) < len(t)),  # repeats
    st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
    st.none(),
)
_BAD_PREFIXES = st.one_of(st.just("model.c0"), st.just(("model..c0",)), st.just(("",)), st.just((3,)), st.integers())
_BAD_OWNERS = st.one_of(_negative(), st.booleans(), st.text(max_size=2), st.floats())


@SETTINGS
@given(indices=_BAD_TABLES, prefixes=_BAD_PREFIXES, owner=_BAD_OWNERS)
def test_chunks_and_maps_refuse_impossible_tables(indices, prefixes, owner):
    _refused(lambda: Chunk(indices), "Chunk", "indices")
    _refused(lambda: Chunk(0, prefixes), "Chunk", "prefixes")
    _refused(lambda: Chunk(0, (), owner), "Chunk", "owner")
    _refused(lambda: stage_map(indices), "stage_map", "layers")
    _refused(lambda: stage_map(0, prefixes=prefixes), "prefixes")
    _refused(lambda: stage_map(0, stage=owner), "stage_map", "stage")
    _refused(lambda: expert_map(indices), "expert_map", "experts")
    _refused(lambda: expert_map(0, owner=owner), "expert_map", "owner")


@SETTINGS
@given(
    key=st.one_of(st.just(""), st.just("model.layers"), st.integers(), st.none()),
    total=st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), st.text(max_size=2)),
    n=st.integers(2, 6),
)
def test_index_maps_refuse_impossible_keys_totals_and_chunks(key, total, n):
    chunk = Chunk(tuple(range(n)))
    _refused(lambda: IndexMap(key, (chunk,)), "IndexMap", "key")
    _refused(lambda: IndexMap("layers", (chunk,), total), "IndexMap('layers')", "total")
    _refused(lambda: stage_map(list(range(n)), total=total), "total")
    _refused(lambda: IndexMap("layers", chunk), "chunks")  # one Chunk, not a sequence of them
    _refused(lambda: IndexMap("layers", ()), "chunks")
    _refused(lambda: IndexMap("layers", (chunk, Chunk(n))), "chunks")  # two chunks without namespaces
    _refused(lambda: IndexMap("layers", (chunk,), total=n - 1), "IndexMap('layers')", f"below total={n - 1}")
    _refused(lambda: stage_map(list(range(n)), total=n - 1), "stage_map", "layers", f"below total={n - 1}")


@SETTINGS
@given(
    layers=st.one_of(st.integers(0, 100), st.lists(st.integers(0, 63), unique=True, max_size=8)),
    stage=st.one_of(st.none(), st.integers(0, 16)),
    numpy=st.booleans(),
)
def test_maps_with_good_tables_construct(layers, stage, numpy):
    table = layers if isinstance(layers, int) else [np.int32(i) if numpy else i for i in layers]
    m = stage_map(table, total=64 if not isinstance(layers, int) else None, stage=stage, prefixes=["model.c0"])
    chunk = m.chunks[0]
    assert chunk.indices == (layers if isinstance(layers, int) else tuple(layers)) and chunk.owner == stage
    assert all(type(i) is int for i in ((chunk.indices,) if isinstance(chunk.indices, int) else chunk.indices))
    assert expert_map(table, owner=stage).chunks[0].indices == chunk.indices
    IndexMap("layers", [Chunk((0,), ("model.c0",), 0), Chunk((1,), ("model.c1",), 1)], total=2)
    IndexMap("layers", (Chunk(2, (), 1),), total=2)  # an offset past the total: a stage holding no layer


def test_name_rules_and_hf_rules_refuse_impossible_arguments():
    _refused(lambda: NameRules(wrapper_segments="_orig_mod"), "NameRules", "wrapper_segments")
    _refused(lambda: NameRules(leading_segments=("module.inner",)), "NameRules", "leading_segments")
    _refused(lambda: NameRules(wrapper_segments=("",)), "wrapper_segments")
    assert NameRules(wrapper_segments=["_orig_mod"]).wrapper_segments == ("_orig_mod",)  # hashable (cached on)
    _refused(lambda: HFRule("model.layers.{i}.w", "layers.w"), "HFRule", "atom")
    _refused(lambda: HFRule("", "w"), "HFRule", "hf")
    _refused(lambda: HFRule("e.{e}.w", "w", stack="x"), "stack")
    _refused(lambda: HFRule("q", "wq", rotary_heads=-2), "rotary_heads")
    _refused(lambda: HFRule("q", "wq", rotary_heads=2.0), "rotary_heads")
    _refused(lambda: HFRule("e.{e}.w", "w", stack="e", rotary_heads=4), "rotary_heads")
    assert HFRule("q", "wq", rotary_heads=np.int64(4)).rotary_heads == 4
    assert HFRule("q", "wq", rotary_heads=0).rotary_heads == 0  # 0: rows in HF's order, as None
    rule = HFRule("w", "net.w")
    _refused(lambda: HFMapping(rule), "HFMapping", "rules")
    _refused(lambda: HFMapping(("w",)), "rules")
    _refused(lambda: HFMapping((rule,), ignore=r"model\.x"), "ignore")
    _refused(lambda: HFMapping((rule,), zero=("(",)), "zero[0]")
    _refused(lambda: HFMapping((rule,), prefix=None), "prefix")
    assert HFMapping([rule], ignore=[r"a\.b"]).ignore == (r"a\.b",)


def test_bad_regexes_name_the_regex_error():
    err = _refused(lambda: Padded("(", size=3), "Padded", "pattern='('", "a regex that compiles")
    assert "missing )" in str(err)
    err = _refused(lambda: Replicated(re.compile("w")), "pattern", "a regex string")
    assert "'w'" in err.hint
