"""Megatron-Core MoE ``torch_dist`` keys into the toy's MoE atoms (pure parts, one process, no megatron).

``torch_dist`` is DCP underneath (``.metadata`` + ``torch.save`` items), so a checkpoint with
Megatron's MoE keys, shapes and ``common.pt`` envelope (a ChainedOptimizer's ``{0: dense, 1: expert}``
groups) is written here with ``dcp.save``; the real library's run is ``tests/e2e/test_foreign_moe_megatron.py``.
Checked: every expert slice lands in the right atom (stacked ``[E, F, D]`` layers and per-expert
layers, SwiGLU halves apart), both key forms (``singleton_local_shards`` off and on), expert groups
from the expert optimizer, a flipped expert row caught, unmapped keys named.
"""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ucp_dcp import UCPLoadPlanner
from ucp_dcp.errors import UCPError, ucp_errors
from ucp_dcp.planning.opened import UnopenedMetadata, raise_if_unopened
from ucp_dcp.sources.foreign.megatron import MegatronReader
from ucp_dcp.sources.foreign.megatron_rules import EXTRA_RULES, GPT_RULES, moe_rules

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ucp_dcp.errors.UnverifiedCheckpointWarning"),
]

L, E, F, D = 4, 4, 3, 5
EXP = "decoder.layers.mlp.experts.experts."
STACKED, LISTED = (0, 2), (1, 3)


def _source(singleton: bool) -> dict[str, torch.Tensor]:
    """Megatron's keys of a MoE GPT; ``singleton``: as ``singleton_local_shards=True`` saves them
    (one key per layer, per expert and per ``linear_fc1`` half ``weight_w``/``weight_v``)."""
    g = torch.Generator().manual_seed(0)
    stacked = {
        "decoder.layers.mlp.router.weight": torch.randn(L, E, D, generator=g),
        "decoder.layers.mlp.router.expert_bias": torch.randn(L, E, generator=g),
        "decoder.layers.self_attention.linear_qkv.bias": torch.randn(L, 7, generator=g),
        "decoder.layers.self_attention.q_layernorm.weight": torch.randn(L, 2, generator=g),
        EXP + "linear_fc1.weight": torch.randn(L, E, 2 * F, D, generator=g),
        EXP + "linear_fc2.weight": torch.randn(L, E, D, F, generator=g),
    }
    model = stacked
    if singleton:
        model = {}
        for name, t in stacked.items():
            for i in range(L):
                if not name.startswith(EXP):
                    model[name.replace("layers.", f"layers.{i}.")] = t[i]
                    continue
                for e in range(E):
                    key = name.replace("layers.", f"layers.{i}.").replace("experts.experts.", f"experts.experts.{e}.")
                    if "fc1" in name:
                        model[key + "_w"], model[key + "_v"] = t[i, e, :F], t[i, e, F:]
                    else:
                        model[key] = t[i, e]
    # fully_reshardable: the fp32 master copy (optimizer.state.param) is the parameter, the model key a
    # stale copy (+100 here); the expert_bias buffer has no master and no moments: its model key counts
    out = {n: t if "expert_bias" in n else t + 100 for n, t in model.items()}
    for kind, k in (("param", 1.0), ("exp_avg", 1.5), ("exp_avg_sq", 2.5)):
        out.update({f"optimizer.state.{kind}.{n}": t * k for n, t in model.items() if "expert_bias" not in n})
    return out, stacked


def _write(path, singleton: bool = False) -> dict[str, torch.Tensor]:
    """Writes the checkpoint; returns its stacked form (the tensors of Megatron-LM's default keys)."""
    sd, stacked = _source(singleton)
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)

    def groups(expert: bool, lr: float) -> dict:
        base = {"is_expert_parallel": expert, "lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "step": 3.0}
        return {"optimizer": {"param_groups": [{**base, "wd_mult": 1.0, "weight_decay": 0.1},
                                               {**base, "wd_mult": 0.0, "weight_decay": 0.0}]},
                "param_state_sharding_type": "fully_reshardable"}  # fmt: skip

    torch.save({"optimizer": {0: groups(False, 1e-3), 1: groups(True, 2e-3)}}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return stacked


RULES = moe_rules(STACKED, LISTED) + EXTRA_RULES


def _expected(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The logical atoms, sliced by hand from the stacked source tensors (moments: x1.5)."""
    out = {}
    for pre, suf, k in (("model.", "", 1.0), ("optim.state.", ".exp_avg", 1.5)):
        fc1, fc2 = model[EXP + "linear_fc1.weight"] * k, model[EXP + "linear_fc2.weight"] * k
        for i in range(L):
            out[f"{pre}layers.{i}.moe.router.weight{suf}"] = model["decoder.layers.mlp.router.weight"][i] * k
            out[f"{pre}layers.{i}.attn.wqkv.bias{suf}"] = model["decoder.layers.self_attention.linear_qkv.bias"][i] * k
            w1, w3, w2 = fc1[i, :, :F], fc1[i, :, F:], fc2[i]
            for n, t in (("w1", w1), ("w3", w3), ("w2", w2)):
                if i in STACKED:
                    out[f"{pre}layers.{i}.moe.experts.{n}{suf}"] = t
                else:
                    out.update({f"{pre}layers.{i}.moe.experts.{e}.{n}.weight{suf}": t[e] for e in range(E)})
    for i in range(L):
        out[f"model.layers.{i}.moe.router.expert_bias"] = model["decoder.layers.mlp.router.expert_bias"][i]
    return out


def _load(path, want: dict[str, torch.Tensor], **kw) -> dict[str, torch.Tensor]:
    got = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    with ucp_errors():
        dcp.load(got, storage_reader=MegatronReader(path, rules=RULES, **kw), planner=UCPLoadPlanner(), no_dist=True)
    return got


@pytest.mark.parametrize("singleton", [False, True], ids=["expert-axis", "singleton"])
def test_every_expert_slice_lands_in_its_atom_bitwise(tmp_path, singleton):
    want = _expected(_write(tmp_path, singleton))
    got = _load(tmp_path, want)
    assert len(want) > 60
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad[:6]


def test_expert_parameters_take_the_expert_optimizers_groups(tmp_path):
    _write(tmp_path)
    _, atoms, values = MegatronReader(tmp_path, rules=RULES).describe()
    assert values["optim.param_groups.layers.1.moe.experts.2.w3.weight.lr"] == 2e-3
    assert values["optim.param_groups.layers.0.moe.experts.w1.lr"] == 2e-3
    assert values["optim.param_groups.layers.0.moe.router.weight.lr"] == 1e-3
    assert values["optim.param_groups.layers.0.attn.wqkv.bias.weight_decay"] == 0.0  # a bias: no decay
    assert float(values["optim.state.layers.3.moe.experts.0.w2.weight.step"]) == 3.0
    assert atoms["model.layers.0.moe.experts.w1"][1] == (E, F, D)
    assert "optim.state.layers.0.moe.router.expert_bias.exp_avg" not in atoms  # a buffer: no moments


def test_a_flipped_expert_row_is_caught(tmp_path):
    """Sabotage: one row of expert 2's W3 half in layer 1, negated in the saved file, shows up in
    exactly that atom (and nowhere else)."""
    stacked = _write(tmp_path / "good")
    sd, _ = _source(False)
    sd["optimizer.state.param." + EXP + "linear_fc1.weight"][1, 2, F + 1] *= -1  # the fp32 master: the parameter
    dcp.save(sd, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    for f in ("common.pt", "metadata.json"):
        (tmp_path / "bad" / f).write_bytes((tmp_path / "good" / f).read_bytes())
    want = _expected(stacked)
    got = _load(tmp_path / "bad", want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert bad == ["model.layers.1.moe.experts.2.w3.weight"]


def test_unmapped_expert_keys_are_named(tmp_path):
    _write(tmp_path)
    md = MegatronReader(tmp_path, rules=GPT_RULES).read_metadata()
    assert isinstance(md, UnopenedMetadata)
    with pytest.raises(UCPError, match=r"match no rule: .*experts\.experts\.linear_fc1\.weight") as e:
        raise_if_unopened(md)
    assert "decoder.layers.mlp.router.expert_bias" in e.value.saved


def test_a_layer_without_a_rule_is_refused(tmp_path):
    _write(tmp_path)
    md = MegatronReader(tmp_path, rules=moe_rules(STACKED, ()) + EXTRA_RULES).read_metadata()
    with pytest.raises(UCPError, match=r"no rule for layer 1"):
        raise_if_unopened(md)
