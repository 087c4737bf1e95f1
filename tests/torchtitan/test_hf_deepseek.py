"""Hugging Face in and out for torchtitan's deepseek_v3 (ucp_dcp.torchtitan.hf_deepseek).

A random transformers ``DeepseekV3ForCausalLM`` built from the config our mapping emits (MLA with
one ``q_proj`` or the ``q_a``/``q_b`` low-rank pair, a dense first layer, sigmoid group-limited
routing with shared experts, a non-zero ``e_score_correction_bias``, YaRN) loads into torchtitan's
deepseek_v3 (``ucp_dev.testing.titan_models.DSV3_HF``) through ``load_hf``: the same logits as transformers;
exported back, the folder is the source bitwise and ``from_pretrained`` gives the same logits.
Negative controls: swapped experts, a sign-flipped correction bias and the other rope layout are
caught by the logits; what HF computes differently is refused by name. At a TP=2 x EP=2 layout
(2 gloo ranks) the load equals the single-process one bitwise, each rank reading its own rows and
experts with no all-gather.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
from helpers import UCP_SAVE, dcp_calls, skip_unless_torchtitan_runs, torchtitan_forward  # noqa: E402
from titan_models import _close, _from_pretrained, _titan, _titan_logits  # noqa: E402
from titan_models import fp32_experts as _fp32_experts  # noqa: E402

skip_unless_torchtitan_runs()

import ucp_dcp  # noqa: E402
from ucp_dcp.errors import UCPError  # noqa: E402
from ucp_dcp.sources.hf import load_hf  # noqa: E402
from ucp_dcp.sources.hf.publish import export_hf  # noqa: E402
from ucp_dcp.torchtitan.mappings import hf_mapping  # noqa: E402
from ucp_dcp.torchtitan.moe import moe_rules  # noqa: E402
from ucp_dev.testing.titan_models import DSV3_HF, deepseek_v3_small_model  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

BIAS = "model.layers.{i}.mlp.gate.e_score_correction_bias"


def _hf_small(**changes):
    """The HF-expressible CPU-sized deepseek_v3 (``DSV3_HF``), with ``changes`` (``q_lora_rank``, ``rope``)."""
    return deepseek_v3_small_model(dataclasses.replace(DSV3_HF, **changes))


def _hf_model(mapping, folder, seed=0):
    """A random transformers DeepSeek-V3 from the mapping's config.json, with a non-zero correction
    bias (large enough to change which experts some tokens get), saved to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(mapping.config)
    arch = cfg.pop("architectures")
    config = AutoConfig.for_model(**cfg)
    config.architectures = arch
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    hf.save_pretrained(folder)
    return hf


def _safetensors(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _tokens():
    return torch.randint(0, DSV3_HF.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))


def _loaded(cfg, folder, mapping):
    """torchtitan's model with its own random weights and bias, then the HF folder loaded into it."""
    model = _titan(cfg)
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "expert_bias_E", None) is not None:
                m.expert_bias_E.fill_(0.5)
    sd = model.state_dict()
    load_hf(sd, folder, mapping, quiet=True)
    model.load_state_dict(sd)
    return model


@torchtitan_forward
@pytest.mark.parametrize(
    ("q_lora_rank", "rope"),
    [  # make test: q_lora with the cos/sin halves; q_proj loads in test_deepseek_loads_at_a_tp2_ep2_layout_...
        pytest.param(0, "complex", marks=pytest.mark.full, id="q_proj-interleaved"),
        pytest.param(32, "cossin", id="q_lora-halves"),
    ],
)
def test_deepseek_loads_and_exports_with_equal_logits(tmp_path, monkeypatch, q_lora_rank, rope):
    _fp32_experts(monkeypatch.setattr)
    cfg = _hf_small(q_lora_rank=q_lora_rank, rope=rope)
    mapping = hf_mapping(cfg)
    c = mapping.config
    assert (c["first_k_dense_replace"], c["n_group"], c["topk_group"], c["rope_interleave"]) == (
        1,
        4,
        2,
        rope == "complex",
    )
    assert c["q_lora_rank"] == (q_lora_rank or None) and c["rope_parameters"]["rope_type"] == "yarn"
    hf = _hf_model(mapping, tmp_path / "hf")
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == [
        "DeepseekV3MLP",
        "DeepseekV3MoE",
        "DeepseekV3MoE",
    ]
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits

    model = _loaded(cfg, tmp_path / "hf", mapping)
    _close(want, _titan_logits(model, tokens))
    src = _safetensors(tmp_path / "hf")
    for i in (1, 2):  # the correction bias is the load-balancing bias, copied as is (0.5 replaced)
        assert torch.equal(model.layers[str(i)].moe.expert_bias_E, src[BIAS.format(i=i)])
    w2 = model.layers["2"].moe.routed_experts.inner_experts.w2_EDF
    assert torch.equal(w2[5], src["model.layers.2.mlp.experts.5.down_proj.weight"])

    ucp_dcp.save(model.state_dict(), tmp_path / "ckpt", patterns=moe_rules([model]))
    export_hf(tmp_path / "ckpt", tmp_path / "out", mapping, max_shard_bytes=1 << 20)  # several files
    out = _safetensors(tmp_path / "out")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    assert set(src) == set(out), set(src) ^ set(out)
    assert all(torch.equal(src[k], out[k]) for k in src), [k for k in src if not torch.equal(src[k], out[k])]
    _close(want, _from_pretrained(tmp_path / "out")(tokens).logits)


@torchtitan_forward
@pytest.mark.parametrize(
    "defect",
    [
        "swapped-experts",
        pytest.param("bias-sign", marks=pytest.mark.full),
        pytest.param("rope-layout", marks=pytest.mark.full),
    ],
)
def test_deepseek_defects_are_caught(tmp_path, monkeypatch, defect):
    """Negative controls (every name is there, the load succeeds): experts 2 and 5 of layer 1
    swapped, the correction bias negated, or the HF config's other rope layout -- the logits differ."""
    from safetensors.torch import save_file

    _fp32_experts(monkeypatch.setattr)
    cfg = _hf_small()
    mapping = hf_mapping(cfg)
    hf = _hf_model(mapping, tmp_path / "hf")
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "hf", bad)
    tensors = _safetensors(tmp_path / "hf")
    if defect == "swapped-experts":
        swap = {
            f"model.layers.1.mlp.experts.{a}.{p}.weight": f"model.layers.1.mlp.experts.{b}.{p}.weight"
            for a, b in ((2, 5), (5, 2))
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        save_file({swap.get(k, k): v for k, v in tensors.items()}, bad / "model.safetensors")
    elif defect == "bias-sign":
        save_file({k: -v if "e_score" in k else v for k, v in tensors.items()}, bad / "model.safetensors")
    else:  # the same weights read by transformers with the other rotary layout
        config = json.loads((bad / "config.json").read_text())
        config["rope_interleave"] = not config["rope_interleave"]
        (bad / "config.json").write_text(json.dumps(config))
        with torch.no_grad():
            want = _from_pretrained(bad)(tokens).logits
    got = _titan_logits(_loaded(cfg, bad, mapping), tokens)
    with pytest.raises(AssertionError):
        _close(want, got)


def _refusal(change):
    cfg = _hf_small()
    change(cfg)
    with pytest.raises(UCPError) as e:
        hf_mapping(cfg)
    return e.value


def _each_moe(attr, value):
    def change(cfg):
        for layer in cfg.layers[1:]:
            obj = layer.moe
            *path, last = attr.split(".")
            for p in path:
                obj = getattr(obj, p)
            setattr(obj, last, value)

    return change


@pytest.mark.parametrize(
    ("change", "atom", "words"),
    [
        (_each_moe("router.score_func", "softmax"), "layers.1.moe.router", "scoring"),
        (_each_moe("router._debug_force_load_balance", True), "layers.1.moe.router", "debug routing"),
        (_each_moe("load_balance_coeff", None), "layers.1.moe.expert_bias_E", "e_score_correction_bias"),
        (_each_moe("shared_experts", None), "layers.1.moe.shared_experts", "shared experts"),
        (lambda c: setattr(c.layers[2].moe.router, "top_k", 3), "layers.2.moe", "differs"),
        (lambda c: setattr(c.layers[1].attention.kv_norm, "eps", 1e-5), "layers.1.attention.kv_norm", "1e-6"),
        (lambda c: c.layers.reverse(), "layers", "dense layers are not the first"),
        (lambda c: setattr(c, "mtp_layers", [c.layers[-1]]), "mtp_layers", "MTP"),
        (lambda c: setattr(c.layers[0].attention.rope, "scaling", "llama"), "layers.0.attention.rope", "scaling"),
    ],
    ids=[
        "softmax",
        "debug-routing",
        "no-load-balancing",
        "no-shared",
        "top_k-differs",
        "latent-eps",
        "dense-last",
        "mtp",
        "llama-rope",
    ],
)
def test_deepseek_mapping_refuses_what_hf_computes_differently(change, atom, words):
    e = _refusal(change)
    assert e.atom == atom and words in str(e), (e.atom, str(e))


def _latent_eps_1e6(cfg):
    for layer in cfg.layers:
        layer.attention.kv_norm.eps = layer.attention.q_norm.eps = 1e-6
    return cfg


def test_stock_deepseek_configs_against_hf():
    """torchtitan's own flavors: ``debugmodel`` is refused for its latent-norm eps (torchtitan's
    default 1e-5, HF's fixed 1e-6), then for its softmax router; ``671B`` with the eps at 1e-6 maps
    to DeepSeek-V3's published HF config values."""
    from torchtitan.models.deepseek_v3 import model_registry

    with pytest.raises(UCPError, match="kv_norm eps") as e:
        hf_mapping(model_registry("debugmodel").model)
    assert e.value.atom == "layers.0.attention.kv_norm" and (e.value.saved, e.value.wanted) == (1e-5, 1e-6)
    with pytest.raises(UCPError, match="sigmoid") as e:
        hf_mapping(_latent_eps_1e6(model_registry("debugmodel").model))
    assert e.value.atom == "layers.1.moe.router"
    c = hf_mapping(_latent_eps_1e6(model_registry("671B").model)).config
    published = {  # deepseek-ai/DeepSeek-V3 config.json
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "vocab_size": 129280,
        "rope_interleave": True,
    }
    assert {k: c[k] for k in published} == published
    rope = c["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 40.0, 4096)
    assert (rope["beta_fast"], rope["beta_slow"], rope["mscale"], rope["mscale_all_dim"]) == (32.0, 1.0, 1.0, 1.0)


def _tp_ep_placement(name):
    """torchtitan's TP plan for deepseek_v3 (``deepseek_v3/sharding.py``) with EP on the same 2 ranks:
    up-projections colwise, ``wo``/``w2`` rowwise, embedding and head by vocab, low-rank projections,
    norms, the router and the bias replicated, the stacked experts ``Shard(0)``."""
    from torch.distributed.tensor import Replicate, Shard

    if "inner_experts" in name:
        return Shard(0)  # EP: 4 experts a rank
    if name.endswith(("wo.weight", "w2.weight")):
        return Shard(1)
    if name.endswith(("wq.weight", "wq_b.weight", "wkv_b.weight", "w1.weight", "w3.weight")):
        return Shard(0)
    if name in ("tok_embeddings.weight", "lm_head.weight"):
        return Shard(0)
    return Replicate()


def _tp_ep_worker(rank, world, hf_path, q_lora_rank):
    """Rank ``rank`` of 2: the HF folder loaded at the TP=2 x EP=2 layout against a single-process
    load; all-gathers counted while loading."""
    import warnings

    import dist as D
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    warnings.simplefilter("ignore")
    cfg = _hf_small(q_lora_rank=q_lora_rank)
    mapping = hf_mapping(cfg)
    ref = _titan(cfg).state_dict()
    load_hf(ref, hf_path, mapping, quiet=True)
    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(v, mesh, [_tp_ep_placement(k)]) for k, v in _titan(cfg).state_dict().items()}
    with torch.no_grad():  # a target unlike the folder: the load must replace every element
        for v in sd.values():
            v.to_local().fill_(7.0)
    gathers = []
    for mod, fn in (
        (dist, "all_gather"),
        (dist, "all_gather_into_tensor"),
        (fc, "all_gather_tensor"),
        (fc, "all_gather_single"),  # what DTensor's Shard -> Replicate calls
    ):
        orig = getattr(mod, fn)
        D.patch(mod, fn, lambda *a, _o=orig, _n=fn, **k: (gathers.append(_n), _o(*a, **k))[1])
    stats = load_hf(sd, hf_path, mapping, quiet=True)
    n_gathers = len(gathers)
    bad = [k for k, v in sd.items() if not torch.equal(v.full_tensor(), ref[k])]
    seen = len(gathers) - n_gathers  # the counter sees DTensor's gathers: full_tensor() above
    local = sum(v.to_local().numel() * v.element_size() for v in sd.values())
    experts = sd["layers.1.moe.routed_experts.inner_experts.w1_EFD"].to_local().shape[0]
    return {
        "bad": bad,
        "read": stats.bytes_read,
        "local": local,
        "experts": experts,
        "gathers": n_gathers,
        "seen": seen,
    }


@pytest.mark.slow
@torchtitan_forward
@pytest.mark.parametrize("q_lora_rank", [0, 32], ids=["q_proj", "q_lora"])
def test_deepseek_loads_at_a_tp2_ep2_layout_equal_to_one_process(tmp_path, q_lora_rank):
    """The HF folder at TP=2 x EP=2 on 2 gloo ranks (as torchtitan lays deepseek_v3 out: EP borrows
    the TP ranks): every tensor equals the single-process load bitwise, each rank reads its own
    rows and 4 experts -- the bytes its shards hold, not the folder -- with no all-gather."""
    import dist as D

    mapping = hf_mapping(_hf_small(q_lora_rank=q_lora_rank))
    _hf_model(mapping, tmp_path / "hf")
    res = D.run(_tp_ep_worker, 2, str(tmp_path / "hf"), q_lora_rank)
    total = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    for r in res:
        assert r["bad"] == [] and r["experts"] == 4 and r["gathers"] == 0 < r["seen"], r
        assert r["read"] == r["local"] and r["read"] < 0.7 * total, (r, total)


def _pp_worker(rank, world, hf_path):
    """Rank ``rank`` of 2 as pipeline stage ``rank`` (stage 0: embedding and layers 0-1, stage 1:
    layer 2, norm and head), plain tensors: its stage loaded from the HF folder against a
    single-process load, reading only that stage's tensors."""
    cfg = _hf_small()
    mapping = hf_mapping(cfg)
    ref = _titan(cfg).state_dict()
    load_hf(ref, hf_path, mapping, quiet=True)

    def stage(k):
        return 0 if k.startswith(("tok_embeddings.", "layers.0.", "layers.1.")) else 1

    sd = {k: torch.full_like(v, 7.0) for k, v in _titan(cfg).state_dict().items() if stage(k) == rank}
    stats = load_hf(sd, hf_path, mapping, quiet=True)
    bad = [k for k, v in sd.items() if not torch.equal(v, ref[k])]
    return {"bad": bad, "keys": len(sd), "read": stats.bytes_read, "local": sum(v.nbytes for v in sd.values())}


@pytest.mark.slow
@torchtitan_forward
def test_deepseek_loads_into_pipeline_stages(tmp_path):
    """PP=2: each stage's tensors equal the single-process load bitwise; a stage reads its own bytes only."""
    import dist as D

    _hf_model(hf_mapping(_hf_small()), tmp_path / "hf")
    res = D.run(_pp_worker, 2, str(tmp_path / "hf"))
    assert all(r["bad"] == [] and r["keys"] > 10 and r["read"] == r["local"] for r in res), res


class _NoState:
    """The optimizer / scheduler / dataloader of a model-only manager run: nothing to save or load."""

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        assert not sd

    def init_cache_state_dict(self):
        pass


def _manager_worker(rank, world, base, hf_path, tokens):
    """UCPCheckpointManager with the HF options on the deepseek_v3 model: ``initial_load_in_hf`` from
    the folder (the target's bias 0.5 replaced by HF's correction bias), ``last_save_in_hf`` back."""
    import dist as D
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    from ucp_dcp.torchtitan import UCPCheckpointManager

    calls = dcp_calls(D.patch)
    _fp32_experts(D.patch)
    cfg = _hf_small()
    model = _titan(cfg)
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "expert_bias_E", None) is not None:
                m.expert_bias_E.fill_(0.5)
    config = UCPCheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=10,
        async_mode="disabled",
        initial_load_path=hf_path,
        initial_load_in_hf=True,
        initial_load_model_only=True,
        last_save_in_hf=True,
        last_save_model_only=True,
    )
    m = UCPCheckpointManager(
        config,
        dataloader=_NoState(),
        model_parts=[model],
        optimizers=_NoState(),
        lr_schedulers=_NoState(),
        states={},
        sd_adapter=DeepSeekV3StateDictAdapter(cfg, None),  # ucp_dcp reads its config only
        base_folder=base,
    )
    assert m.load(step=-1)
    bias = model.layers["2"].moe.expert_bias_E.clone()
    logits = _titan_logits(model, tokens)
    assert m.save(curr_step=1, last_step=True)
    m.close()
    return bias, logits, calls


@pytest.mark.slow
@torchtitan_forward
def test_manager_loads_and_saves_deepseek_in_hf(tmp_path):
    """The manager's HF path with deepseek_v3: transformers' logits after the load, the correction
    bias loaded (with its ``Replicated`` rule in that load), the folder written back bitwise."""
    import dist as D

    hf = _hf_model(hf_mapping(_hf_small()), tmp_path / "hf")
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
    bias, got, calls = D.run(_manager_worker, 1, str(tmp_path / "run"), str(tmp_path / "hf"), tokens)[0]
    # ucp_dcp's HF path did the work: our planner over HFStorageReader, our planner and storage for the
    # scratch checkpoint export_hf publishes, no stock adapter call
    assert calls == [("load", "UCPLoadPlanner", "HFStorageReader"), UCP_SAVE], calls
    src, out = _safetensors(tmp_path / "hf"), _safetensors(tmp_path / "run" / "checkpoint" / "step-1")
    assert torch.equal(bias, src[BIAS.format(i=2)]) and bias.abs().max() < 0.5
    _close(want, got)
    assert set(src) == set(out) and all(torch.equal(src[k], out[k]) for k in src)
