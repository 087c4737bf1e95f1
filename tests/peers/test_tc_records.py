"""What UCPResharder records per leaf at save (atoms, fragments) survives torch_checkpointing's JSON metadata
as it was, and is the resolution ucp_dcp.save runs (a Fused rule's parts, the stage map's global names)."""

import json

import torch
from hypothesis import given
from hypothesis import strategies as st

from ucp_dcp.layout.index_maps import Chunk, IndexMap
from ucp_dcp.layout.naming import NameRules
from ucp_dcp.layout.patterns import Fused, Patterns
from ucp_dcp.peers.tc_records import FragmentRecord, LeafRecord, record_leaves
from ucp_dcp.planning.resolve import Resolver

dims = st.lists(st.integers(0, 64), min_size=0, max_size=3)


@st.composite
def records(draw):
    n = draw(st.integers(0, 3))
    frags = []
    for _ in range(n):
        offs = tuple(draw(dims))
        sizes = tuple(draw(st.lists(st.integers(0, 64), min_size=len(offs), max_size=len(offs))))
        view = draw(st.one_of(st.none(), st.lists(st.integers(1, 8), min_size=1, max_size=3).map(tuple)))
        frags.append(FragmentRecord(draw(st.text(min_size=1, max_size=12)), offs, sizes, offs, sizes, view))
    atoms = tuple((f.atom, f.sizes, "torch.float32") for f in frags)
    kind = draw(st.sampled_from(["tensor", "object", "hyperparam"]))
    return LeafRecord(kind, atoms, tuple(frags), draw(st.one_of(st.none(), st.integers(0, 9))), draw(st.booleans()))


@given(records())
def test_a_record_comes_back_equal_through_json(rec):
    back = LeafRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert back == rec and hash(back) == hash(rec)


def test_a_fused_leaf_records_its_parts_and_a_stage_local_layer_its_global_name():
    rule = Fused(r"(.*)\.w13\.weight", [(r"\1.w1.weight", 4), (r"\1.w3.weight", 4)], blocks=1)
    stage = IndexMap("layers", [Chunk(2, ("model",), 1)], total=4)  # this stage's layer 0 is global layer 2
    res = Resolver(NameRules(), Patterns([rule]), [stage])
    recs = record_leaves(res, "model", {"layers": {"0": {"w13": {"weight": torch.zeros(8, 3)}}}}, data_slot=None)
    (path, rec), *_ = recs.items()
    assert path == ("layers", "0", "w13", "weight") and rec.kind == "tensor" and rec.plain
    assert [(a, s) for a, s, _ in rec.atoms] == [("layers.2.w1.weight", (4, 3)), ("layers.2.w3.weight", (4, 3))]
    assert [(f.atom, f.local_offsets) for f in rec.fragments] == [
        ("layers.2.w1.weight", (0, 0)),
        ("layers.2.w3.weight", (4, 0)),
    ]
