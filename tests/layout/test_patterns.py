"""Pattern rules without a process group: fused <-> unfused, padding, ties, reductions, maps, and
the errors raised before any byte is read or written."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import assert_written_by_ucp, expect_ucp_error
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import ucp_dcp
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.layout.index_maps import Chunk, IndexMap, stage_map
from ucp_dcp.layout.patterns import Fused, Padded, Reduce, Replicated, Tied

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

D, Q, KV, G = 6, 8, 4, 2  # dim, q rows, k/v rows, KV groups (group-major blocks)
QKV = Fused(r"(.*)wqkv\.weight", [(r"\1wq.weight", Q), (r"\1wk.weight", KV), (r"\1wv.weight", KV)], blocks=G)


def _interleave(parts, blocks):
    chunks = [t.chunk(blocks) for t in parts]
    return torch.cat([c[b] for b in range(blocks) for c in chunks])


class Unfused(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (
            nn.Linear(D, Q, bias=False),
            nn.Linear(D, KV, bias=False),
            nn.Linear(D, KV, bias=False),
        )

    def forward(self, x):
        return self.wq(x).sum() + self.wk(x).sum() * 2 + self.wv(x).square().sum()


class FusedAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(D, Q + 2 * KV, bias=False)

    def forward(self, x):
        y = x @ self.wqkv.weight.T
        q, k, v = [torch.cat(p, -1) for p in zip(*[b.split([Q // G, KV // G, KV // G], -1) for b in y.chunk(G, -1)])]
        return q.sum() + k.sum() * 2 + v.square().sum()


def _train(m, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for _ in range(2):
        m(torch.randn(3, D)).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _sd(m, opt, flat=False):
    msd, osd = get_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    return {"model": msd, "optim": osd}


def _fused_from(u: Unfused) -> FusedAttn:
    f = FusedAttn()
    with torch.no_grad():
        f.wqkv.weight.copy_(_interleave([u.wq.weight, u.wk.weight, u.wv.weight], G))
    return f


def test_fused_and_unfused_load_into_each_other(tmp_path):
    torch.manual_seed(0)
    u = Unfused()
    f = _fused_from(u)
    uo, fo = _train(u), _train(f)  # same data, same math: identical states up to layout
    dcp.save(_sd(f, fo), checkpoint_id=tmp_path / "fused", planner=UCPSavePlanner(patterns=[QKV]))
    names = set(dcp.FileSystemReader(tmp_path / "fused").read_metadata().state_dict_metadata)
    assert {"model.wq.weight", "optim.state.wq.weight.exp_avg", "optim.param_groups.wv.weight.lr"} <= names
    assert not any("wqkv" in n for n in names)
    # fused checkpoint -> unfused model: the catalog's rule is applied automatically
    u2 = Unfused()
    o2 = torch.optim.AdamW(u2.parameters(), lr=1.0)
    sd = _sd(u2, o2)
    dcp.load(sd, checkpoint_id=tmp_path / "fused", planner=UCPLoadPlanner())
    set_state_dict(u2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for name in ("wq", "wk", "wv"):
        assert torch.equal(getattr(u2, name).weight, getattr(u, name).weight)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o2.state[getattr(u2, name).weight][k], uo.state[getattr(u, name).weight][k])
    assert o2.param_groups[0]["lr"] == 0.1
    # unfused checkpoint -> fused model (rule declared at load), flat optimizer form on top
    dcp.save(_sd(u, uo), checkpoint_id=tmp_path / "unfused", planner=UCPSavePlanner())
    f2 = FusedAttn()
    fo2 = torch.optim.AdamW(f2.parameters(), lr=1.0)
    sd = _sd(f2, fo2, flat=True)
    dcp.load(sd, checkpoint_id=tmp_path / "unfused", planner=UCPLoadPlanner(patterns=[QKV]))
    set_state_dict(
        f2,
        fo2,
        model_state_dict=sd["model"],
        optim_state_dict=sd["optim"],
        options=StateDictOptions(flatten_optimizer_state_dict=True),
    )
    assert torch.equal(f2.wqkv.weight, f.wqkv.weight)
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fo2.state[f2.wqkv.weight][k], fo.state[f.wqkv.weight][k])


def test_padding_any_new_padded_size(tmp_path):
    torch.manual_seed(0)
    logical = torch.randn(61, 4)
    rule = Padded(r"emb\.weight", size=61, discard=True)
    padded = torch.cat([logical, torch.randn(3, 4)])  # padding holds garbage: declared, never saved
    dcp.save({"model": {"emb.weight": padded}}, checkpoint_id=tmp_path, planner=UCPSavePlanner(patterns=[rule]))
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    assert tuple(md.state_dict_metadata["model.emb.weight"].size) == (61, 4)
    bigger = {"model": {"emb.weight": torch.full((70, 4), 5.0)}}
    dcp.load(bigger, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    assert torch.equal(bigger["model"]["emb.weight"][:61], logical)
    assert torch.all(bigger["model"]["emb.weight"][61:] == 0)
    custom = {"model": {"emb.weight": torch.zeros(63, 4)}}
    dcp.load(custom, checkpoint_id=tmp_path, planner=UCPLoadPlanner(patterns=[Padded(r"emb\.weight", 61, fill=-1.0)]))
    assert torch.all(custom["model"]["emb.weight"][61:] == -1) and torch.equal(
        custom["model"]["emb.weight"][:61], logical
    )
    exact = {"model": {"emb.weight": torch.zeros(61, 4)}}
    dcp.load(exact, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    assert torch.equal(exact["model"]["emb.weight"], logical)
    small = {"model": {"emb.weight": torch.zeros(60, 4)}}
    err = expect_ucp_error(
        lambda: dcp.load(small, checkpoint_id=tmp_path, planner=UCPLoadPlanner()), ucp_dcp.PatternError
    )
    assert "model.emb.weight" in str(err) and "60" in str(err) and "61" in str(err) and "padded" in str(err)
    assert torch.all(small["model"]["emb.weight"] == 0)


def test_tied_copies_saved_once_loaded_into_both(tmp_path):
    emb = torch.randn(5, 3)
    tie = Tied("emb.weight", (r"head\.weight",))
    dcp.save(
        {"model": {"emb.weight": emb, "head.weight": emb.clone()}},
        checkpoint_id=tmp_path / "a",
        planner=UCPSavePlanner(patterns=[tie]),
    )
    names = set(dcp.FileSystemReader(tmp_path / "a").read_metadata().state_dict_metadata)
    assert "model.emb.weight" in names and "model.head.weight" not in names
    target = {"model": {"emb.weight": torch.zeros(5, 3), "head.weight": torch.zeros(5, 3)}}
    dcp.load(target, checkpoint_id=tmp_path / "a", planner=UCPLoadPlanner())
    assert torch.equal(target["model"]["emb.weight"], emb) and torch.equal(target["model"]["head.weight"], emb)
    bad = {"model": {"emb.weight": emb, "head.weight": emb + 1}}
    err = expect_ucp_error(
        lambda: dcp.save(bad, checkpoint_id=tmp_path / "b", planner=UCPSavePlanner(patterns=[tie])),
        ucp_dcp.ReplicaMismatchError,
    )
    assert "model.emb.weight" in str(err)
    assert not (tmp_path / "b" / ".metadata").exists()


def test_reduce_on_a_single_rank(tmp_path):
    dcp.save(
        {"train_state": {"tokens": 123, "step": 5}},
        checkpoint_id=tmp_path,
        planner=UCPSavePlanner(patterns=[Reduce(r"train_state\.tokens", "sum")]),
    )
    assert_written_by_ucp(tmp_path, storage=False)
    target = {"train_state": {"tokens": 0, "step": 0}}
    dcp.load(target, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    assert target == {"train_state": {"tokens": 123, "step": 5}}


def _expect_pattern_error(tmp_path, sd, **kw):
    err = expect_ucp_error(
        lambda: dcp.save(sd, checkpoint_id=tmp_path, planner=UCPSavePlanner(**kw)), ucp_dcp.PatternError
    )
    assert not (tmp_path / ".metadata").exists(), "nothing may be written when a pattern is refused"
    return str(err)


def test_pattern_errors_name_atom_rule_and_numbers(tmp_path):
    w = {"model": {"l.wqkv.weight": torch.zeros(Q + 2 * KV, D)}}
    three = Fused(r"(.*)\.wqkv\.weight", [(r"\1.wq.weight", Q), (r"\1.wk.weight", KV), (r"\1.wv.weight", KV)], blocks=3)
    text = _expect_pattern_error(tmp_path / "a", w, patterns=[three])
    assert "model.l.wqkv.weight" in text and "fused" in text and "[8, 4, 4]" in text and "3 blocks" in text
    text = _expect_pattern_error(tmp_path / "b", w, patterns=[QKV, Padded(r".*wqkv.*", size=10)])
    assert "conflicting rules" in text and "fused" in text and "padded" in text
    text = _expect_pattern_error(tmp_path / "c", w, patterns=[Padded(r"l\.wqkv\.weight", size=99)])
    assert "smaller than the logical size 99" in text and "16" in text
    text = _expect_pattern_error(tmp_path / "d", w, patterns=[QKV, Padded(r"nothing\.here", size=3)])
    assert "matched no name" in text and "nothing" in text
    dcp.save(
        w,
        checkpoint_id=tmp_path / "e",
        planner=UCPSavePlanner(patterns=[QKV, Padded(r"nothing", size=3)], strict=False),
    )
    sd = {"model": {"layers.0.w": torch.ones(2), "layers.1.w": torch.ones(2)}}
    text = _expect_pattern_error(tmp_path / "f", sd, stage_map=stage_map(0, total=3, stage=0))
    assert "1 of 3 layers are owned by no rank" in text and "[2]" in text
    clash = IndexMap("layers", (Chunk(0, ("model.a",), 0), Chunk((1, 0), ("model.b",), 1)))
    sd = {"model": {"a": {"layers.0.w": torch.ones(2)}, "b": {"layers.1.w": torch.ones(2)}}}
    # on one rank the clash is two live keys for one atom (across ranks: see test_pattern_math)
    err = expect_ucp_error(
        lambda: dcp.save(sd, checkpoint_id=tmp_path / "g", planner=UCPSavePlanner(stage_map=clash)),
        ucp_dcp.AmbiguousLayoutError,
    )
    assert "model.layers.0.w" in str(err) and "model.a.layers.0.w" in str(err) and "model.b.layers.1.w" in str(err)


def test_declared_load_rule_must_match_saved_or_target(tmp_path):
    dcp.save({"x": torch.ones(2)}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    err = expect_ucp_error(
        lambda: dcp.load(
            {"x": torch.zeros(2)}, checkpoint_id=tmp_path, planner=UCPLoadPlanner(patterns=[Replicated(r"nope")])
        ),
        ucp_dcp.PatternError,
    )
    assert "nope" in str(err)
    dcp.load(
        {"x": torch.zeros(2)},
        checkpoint_id=tmp_path,
        planner=UCPLoadPlanner(patterns=[Replicated(r"nope")], strict=False),
    )


def test_rules_are_recorded_in_the_catalog(tmp_path):
    w = {"model": {"l.wqkv.weight": torch.zeros(Q + 2 * KV, D)}}
    dcp.save(w, checkpoint_id=tmp_path, planner=UCPSavePlanner(patterns=[QKV]))
    cat = dcp.FileSystemReader(tmp_path).read_metadata().planner_data[ucp_dcp.CATALOG_KEY]
    assert cat["rules"][0]["kind"] == "fused" and cat["rules"][0]["blocks"] == G
    rec = cat["atoms"]["model.l.wk.weight"]
    assert rec["pattern"] == "fused" and rec["live"] == "l.wqkv.weight" and rec["shape"] == [KV, D]


def test_padding_that_holds_data_is_not_dropped_silently(tmp_path):
    """A Padded size that is too small (or padding that is not padding) would drop real rows."""
    emb = torch.randn(64, 4)
    err = expect_ucp_error(
        lambda: dcp.save(
            {"model": {"emb.weight": emb}},
            checkpoint_id=tmp_path,
            planner=UCPSavePlanner(patterns=[Padded(r"emb\.weight", size=61)]),
        ),
        ucp_dcp.PatternError,
    )
    assert err.atom == "model.emb.weight" and "12 of their 12 values" in str(err) and "discard=True" in err.hint
    zero_padded = torch.cat([emb[:61], torch.zeros(3, 4)])  # real padding: saved without a word
    dcp.save(
        {"model": {"emb.weight": zero_padded}},
        checkpoint_id=tmp_path,
        planner=UCPSavePlanner(patterns=[Padded(r"emb\.weight", size=61)]),
    )
