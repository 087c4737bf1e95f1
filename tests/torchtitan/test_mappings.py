"""Hugging Face in and out for torchtitan models (ucp_dcp.torchtitan.mappings, UCPCheckpointManager's HF path).

Single process: a random ``transformers`` Llama / Qwen3 built from the config our mapping emits is
loaded into torchtitan's llama3 / qwen3 debug model through ``HFStorageReader`` + ``UCPLoadPlanner``
(fused wqkv from separate q/k/v, rotary rows permuted for llama, tied head for qwen3): same logits
as transformers; exported back (ucp_dcp checkpoint + ``export_hf``), ``from_pretrained`` gives the
same logits again. qwen3 MoE (``Qwen3MoeForCausalLM``): the same in and out, with a dense layer too,
a swapped-experts negative control, the load-balancing bias zeroed on load and a non-zero one
refused on export, the settings HF cannot express refused, an EP=2 layout load equal to the
single-process one, and the manager's HF options. End to end (slow): the real Trainer starts from that HF folder
(``initial_load_in_hf``) at tp=2 with the option on and stock (same layout, same data), trains 2 steps and
writes its last save in HF (``last_save_in_hf``); the first losses agree and transformers loads our
export with every tensor equal to the trained parameters."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
from helpers import UCP_SAVE, dcp_calls, skip_unless_torchtitan_runs, torchtitan_forward  # noqa: E402
from titan_models import _close, _from_pretrained, _titan, _titan_logits  # noqa: E402
from titan_models import fp32_experts as _fp32_experts  # noqa: E402
from titan_models import hf_model as _hf_model  # noqa: E402

skip_unless_torchtitan_runs()

import torch.distributed.checkpoint as dcp  # noqa: E402

import ucp_dcp  # noqa: E402
from ucp_dcp import UCPLoadPlanner  # noqa: E402
from ucp_dcp.errors import UCPError  # noqa: E402
from ucp_dcp.sources.hf import HFStorageReader  # noqa: E402
from ucp_dcp.sources.hf.publish import export_hf  # noqa: E402
from ucp_dcp.torchtitan.manager import FusedQKVModelWrapper, fused_qkv_rules  # noqa: E402
from ucp_dcp.torchtitan.mappings import hf_mapping, tied_rules  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _spec(family: str, flavor: str = "debugmodel"):
    if family == "llama3":
        from torchtitan.models.llama3 import model_registry
    else:
        from torchtitan.models.qwen3 import model_registry
    return model_registry(flavor)


@torchtitan_forward
@pytest.mark.parametrize("family", ["llama3", pytest.param("qwen3", marks=pytest.mark.full)])
def test_transformers_folder_loads_and_exports_with_equal_logits(tmp_path, family):
    spec = _spec(family)
    mapping = hf_mapping(spec.model)
    hf = _hf_model(mapping, tmp_path / "hf")
    tokens = torch.randint(0, spec.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits

    model = _titan(spec.model)
    wrapper = FusedQKVModelWrapper([model])  # the fused wqkv key, as the manager hands it to DCP
    sd = wrapper.state_dict()
    assert any(k.endswith("qkv_linear.wqkv.weight") for k in sd)
    rules = fused_qkv_rules([model]) + tied_rules(spec.model)
    reader = HFStorageReader(tmp_path / "hf", mapping)
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(patterns=rules))
    wrapper.load_state_dict(sd)
    got = _titan_logits(model, tokens)
    _close(want, got)
    if family == "qwen3":
        assert mapping.config["tie_word_embeddings"] and "lm_head.weight" not in str(mapping.rules)
        assert torch.equal(model.lm_head.weight, hf.model.embed_tokens.weight)

    ucp_dcp.save(wrapper.state_dict(), tmp_path / "ckpt", patterns=rules)
    stats = export_hf(tmp_path / "ckpt", tmp_path / "out", mapping, max_shard_bytes=8 << 20)  # several files
    names = set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"])
    assert names == set(hf.state_dict()) - ({"lm_head.weight"} if family == "qwen3" else set())
    assert stats.bytes_written == sum(p.numel() * 4 for n, p in hf.state_dict().items() if n in names)
    _close(want, _from_pretrained(tmp_path / "out")(tokens).logits)


def test_mapping_derives_sizes_and_rope_from_the_model_config():
    llama = hf_mapping(_spec("llama3").model).config
    assert llama["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert (llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"]) == (16, 16, 16)
    assert llama["tie_word_embeddings"] is False and llama["architectures"] == ["LlamaForCausalLM"]
    rules = {r.hf: r for r in hf_mapping(_spec("llama3").model).rules}
    assert rules["model.layers.{i}.self_attn.q_proj.weight"].rotary_heads == 16
    qwen = hf_mapping(_spec("qwen3").model)
    assert (qwen.config["num_key_value_heads"], qwen.config["head_dim"], qwen.config["rms_norm_eps"]) == (8, 128, 1e-6)
    assert all(r.rotary_heads is None for r in qwen.rules), "CosSinRoPE already rotates halves, as HF does"
    assert qwen.ignored("lm_head.weight") and not hf_mapping(_spec("llama3").model).ignored("lm_head.weight")


# -- qwen3 MoE <-> Qwen3MoeForCausalLM -------------------------------------------------------------------------


def _moe_config(dense_layers=(), **router):
    """The CPU-sized qwen3 MoE (4 layers, 8 experts, top-2), optionally with dense ``dense_layers`` and
    router settings changed on every MoE layer."""
    from torchtitan.models.common.config_utils import make_ffn_config

    from ucp_dev.testing.titan_models import MOE_SMALL, qwen3_moe_small_model

    cfg = qwen3_moe_small_model()
    for i, layer in enumerate(cfg.layers):
        for k, v in router.items():
            setattr(layer.moe.router, k, v)
        if i in dense_layers:
            init = layer.moe.router.gate.param_init
            layer.moe = None
            layer.feed_forward = make_ffn_config(
                dim=MOE_SMALL["dim"], hidden_dim=96, w1_param_init=init, w2w3_param_init=init
            )
    return cfg


def _safetensors(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@torchtitan_forward
@pytest.mark.parametrize(
    "dense_layers", [(), pytest.param((1,), marks=pytest.mark.full)], ids=["all-moe", "layer1-dense"]
)
def test_qwen3_moe_loads_and_exports_with_equal_logits(tmp_path, monkeypatch, dense_layers):
    """A random transformers Qwen3-MoE (from the mapping's config.json) -> torchtitan qwen3 MoE: equal
    logits; a random load-balancing bias in the target is zeroed (HF routes without one: left as it
    was, the routing -- and the logits -- would differ); exported back: the same tensors bitwise and
    ``from_pretrained`` gives the same logits."""
    from ucp_dcp.sources.hf import load_hf
    from ucp_dcp.torchtitan.moe import moe_rules

    _fp32_experts(monkeypatch.setattr)
    cfg = _moe_config(dense_layers)
    mapping = hf_mapping(cfg)
    assert mapping.config["mlp_only_layers"] == list(dense_layers) and mapping.config["num_experts"] == 8
    hf = _hf_model(mapping, tmp_path / "hf")
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and [type(layer.mlp).__name__ for layer in hf.model.layers] == [
        "Qwen3MoeMLP" if i in dense_layers else "Qwen3MoeSparseMoeBlock" for i in range(4)
    ]
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits

    model = _titan(cfg)
    biases = [m.expert_bias_E for m in model.modules() if getattr(m, "expert_bias_E", None) is not None]
    assert len(biases) == 4 - len(dense_layers)
    with torch.no_grad():
        for b in biases:
            b.copy_(torch.randn(b.shape))
    wrapper = FusedQKVModelWrapper([model])
    sd = wrapper.state_dict()
    rules = fused_qkv_rules([model]) + tied_rules(cfg)
    load_hf(sd, tmp_path / "hf", mapping, patterns=rules, quiet=True)
    wrapper.load_state_dict(sd)
    assert all(not b.any() for b in biases), "HF has no load-balancing bias: it loads as zero"
    _close(want, _titan_logits(model, tokens))
    hf_experts = hf.model.layers[0].mlp.experts  # fused [E, 2F, D] in transformers' module
    w1 = model.layers["0"].moe.routed_experts.inner_experts.w1_EFD
    assert torch.equal(w1, hf_experts.gate_up_proj[:, : w1.shape[1]])

    ucp_dcp.save(wrapper.state_dict(), tmp_path / "ckpt", patterns=rules + moe_rules([model]))
    export_hf(tmp_path / "ckpt", tmp_path / "out", mapping, max_shard_bytes=4 << 20)
    src, out = _safetensors(tmp_path / "hf"), _safetensors(tmp_path / "out")
    assert set(src) == set(out) and any(".mlp.experts.7.down_proj." in k for k in out)
    assert all(torch.equal(src[k], out[k]) for k in src), [k for k in src if not torch.equal(src[k], out[k])]
    _close(want, _from_pretrained(tmp_path / "out")(tokens).logits)


@torchtitan_forward
def test_qwen3_moe_swapped_experts_are_caught(tmp_path, monkeypatch):
    """Negative control: experts 2 and 5 of layer 0 swapped in the HF folder load without complaint
    (names are all there) but the logits differ from transformers' beyond the tolerance."""
    from safetensors.torch import save_file

    from ucp_dcp.sources.hf import load_hf

    _fp32_experts(monkeypatch.setattr)
    cfg = _moe_config()
    mapping = hf_mapping(cfg)
    hf = _hf_model(mapping, tmp_path / "hf")
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
    tensors = _safetensors(tmp_path / "hf")
    swap = {
        f"model.layers.0.mlp.experts.{a}.{p}.weight": f"model.layers.0.mlp.experts.{b}.{p}.weight"
        for a, b in ((2, 5), (5, 2))
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    (tmp_path / "bad").mkdir()
    save_file({swap.get(k, k): v for k, v in tensors.items()}, tmp_path / "bad" / "model.safetensors")
    model = _titan(cfg)
    wrapper = FusedQKVModelWrapper([model])
    sd = wrapper.state_dict()
    load_hf(sd, tmp_path / "bad", mapping, patterns=fused_qkv_rules([model]), quiet=True)
    wrapper.load_state_dict(sd)
    with pytest.raises(AssertionError):
        _close(want, _titan_logits(model, tokens))


def test_qwen3_moe_export_refuses_a_nonzero_expert_bias(tmp_path):
    """HF's Qwen3-MoE routes without torchtitan's load-balancing bias: a checkpoint with a non-zero
    bias is refused before anything is written (dropping it would change the routing); at zero it exports."""
    from ucp_dcp.torchtitan.moe import moe_rules

    cfg = _moe_config()
    mapping = hf_mapping(cfg)
    model = _titan(cfg)
    rules = fused_qkv_rules([model]) + moe_rules([model])
    ucp_dcp.save(FusedQKVModelWrapper([model]).state_dict(), tmp_path / "zero", patterns=rules)
    export_hf(tmp_path / "zero", tmp_path / "ok", mapping)
    assert not any("expert_bias" in k for k in _safetensors(tmp_path / "ok"))
    with torch.no_grad():
        model.layers["2"].moe.expert_bias_E[3] = 1e-3
    ucp_dcp.save(FusedQKVModelWrapper([model]).state_dict(), tmp_path / "biased", patterns=rules)
    with pytest.raises(UCPError, match="not zero") as e:
        export_hf(tmp_path / "biased", tmp_path / "out", mapping)
    assert e.value.atom == "layers.2.moe.expert_bias_E" and "load_balance_coeff" in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".ucp-hf-export-*"))


def _ep2_worker(rank, world, hf_path):
    """Rank ``rank`` of 2: the HF folder loaded into the torchtitan model's state at an EP=2 x FSDP=2
    layout -- stacked experts ``Shard(0)`` (4 experts a rank, as EP places them), every other weight
    ``Shard(0)`` (FSDP), the bias replicated -- against a single-process load of the same folder."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ucp_dcp.sources.hf import load_hf

    warnings.simplefilter("ignore")
    cfg = _moe_config()
    mapping = hf_mapping(cfg)
    torch.manual_seed(7)
    ref_model = _titan(cfg)
    ref = FusedQKVModelWrapper([ref_model]).state_dict()
    load_hf(ref, hf_path, mapping, patterns=fused_qkv_rules([ref_model]), quiet=True)
    model = _titan(cfg)  # its own random weights and a non-zero bias: the load must replace them all
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "expert_bias_E", None) is not None:
                m.expert_bias_E.fill_(0.5)
    mesh = init_device_mesh("cpu", (world,))
    sd = {
        k: distribute_tensor(v, mesh, [Replicate() if k.endswith("expert_bias_E") else Shard(0)])
        for k, v in FusedQKVModelWrapper([model]).state_dict().items()
    }
    stats = load_hf(sd, hf_path, mapping, patterns=fused_qkv_rules([model]), quiet=True)
    w1 = sd["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    bad = [k for k, v in sd.items() if not torch.equal(v.full_tensor(), ref[k])]
    return {"bad": bad, "read": stats.bytes_read, "experts": w1.to_local().shape[0], "keys": len(sd)}


@pytest.mark.slow
@torchtitan_forward
def test_qwen3_moe_loads_at_an_ep2_layout_equal_to_one_process(tmp_path):
    """The same HF folder at EP=2 x FSDP=2 (2 gloo ranks): every atom equals the single-process load
    bitwise (expert_bias_E zero), each rank reading its own 4 experts, not the whole folder. (The layout
    of torchtitan's EP, built with DTensors directly: parallelizing torchtitan's MoE in-process is not
    needed to place the state; the logits at that layout are the e2e tier's.)"""
    import dist as D

    mapping = hf_mapping(_moe_config())
    _hf_model(mapping, tmp_path / "hf")
    res = D.run(_ep2_worker, 2, str(tmp_path / "hf"))
    total = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    for r in res:
        assert r["bad"] == [] and r["experts"] == 4 and r["keys"] > 40, r
        assert 0 < r["read"] < 0.7 * total, (r["read"], total)


class _NoState:
    """The optimizer / scheduler / dataloader of a model-only manager run: nothing to save or load."""

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        assert not sd

    def init_cache_state_dict(self):
        pass


def _manager_hf_worker(rank, world, base, hf_path, tokens):
    """UCPCheckpointManager with the HF options on a qwen3 MoE model: ``initial_load_in_hf`` from the
    folder (bias 0.5 before, zero after), ``last_save_in_hf`` writes it back, and with a non-zero
    bias the HF save is refused."""
    import dist as D
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from ucp_dcp.torchtitan import UCPCheckpointManager

    calls = dcp_calls(D.patch)
    _fp32_experts(D.patch)
    cfg = _moe_config()
    model = _titan(cfg)
    biases = [m.expert_bias_E for m in model.modules() if getattr(m, "expert_bias_E", None) is not None]
    with torch.no_grad():
        for b in biases:
            b.fill_(0.5)

    def manager():
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
        return UCPCheckpointManager(
            config,
            dataloader=_NoState(),
            model_parts=[model],
            optimizers=_NoState(),
            lr_schedulers=_NoState(),
            states={},
            sd_adapter=Qwen3StateDictAdapter(cfg, None),  # torchtitan wants one; ucp_dcp reads its config only
            base_folder=base,
        )

    m = manager()
    assert m.load(step=-1)
    zeroed = all(not b.any() for b in biases)
    logits = _titan_logits(model, tokens)
    assert m.save(curr_step=1, last_step=True)
    with torch.no_grad():
        biases[1][0] = 1e-3
    try:
        m.save(curr_step=2, last_step=True)
        refused = None
    except UCPError as e:
        refused = (e.atom, str(e))
    m.close()
    return zeroed, logits, refused, calls


@pytest.mark.slow
@torchtitan_forward
def test_manager_loads_and_saves_qwen3_moe_in_hf(tmp_path):
    """The manager's HF path (``initial_load_in_hf`` / ``last_save_in_hf``) with a qwen3 MoE: transformers'
    logits after the load (the bias zeroed, its Replicated rule left out of that load), the folder
    written back equal to the source bitwise, and a non-zero bias refused at the next HF save."""
    import dist as D

    mapping = hf_mapping(_moe_config())
    hf = _hf_model(mapping, tmp_path / "hf")
    tokens = torch.randint(0, mapping.config["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
    zeroed, got, refused, calls = D.run(_manager_hf_worker, 1, str(tmp_path / "run"), str(tmp_path / "hf"), tokens)[0]
    # ucp_dcp's HF path did the work: our planner over HFStorageReader, our planner and storage for the
    # scratch checkpoint export_hf publishes (the refused save included), no stock adapter call
    assert calls == [("load", "UCPLoadPlanner", "HFStorageReader"), UCP_SAVE, UCP_SAVE], calls
    assert zeroed
    _close(want, got)
    src, out = _safetensors(tmp_path / "hf"), _safetensors(tmp_path / "run" / "checkpoint" / "step-1")
    assert set(src) == set(out) and all(torch.equal(src[k], out[k]) for k in src)
    assert refused and refused[0] == "layers.1.moe.expert_bias_E" and "not zero" in refused[1], refused
    assert not (tmp_path / "run" / "checkpoint" / "step-2" / "model.safetensors.index.json").exists()


def _shared_ffn():
    from torchtitan.models.common.config_utils import make_ffn_config

    init = _moe_config().layers[0].moe.router.gate.param_init
    return make_ffn_config(dim=256, hidden_dim=64, w1_param_init=init, w2w3_param_init=init)


@pytest.mark.parametrize(
    "change, match, atom",
    [
        ({"score_func": "sigmoid"}, "router scoring: found 'sigmoid'.*'softmax'", "layers.0.moe.router"),
        ({"route_scale": 2.5}, "route_scale: found 2.5", "layers.0.moe.router"),
        ({"num_expert_groups": 2, "num_limited_groups": 1}, "node-limited routing", "layers.0.moe.router"),
        ({"_debug_force_load_balance": True}, "round-robin", "layers.0.moe.router"),
        ("shared", "shared experts", "layers.0.moe.shared_experts"),
        ("top_k", "one MoE geometry", "layers.0.moe"),
    ],
    ids=["sigmoid", "route-scale", "node-limited", "debug-balance", "shared-experts", "mixed-top-k"],
)
def test_qwen3_moe_settings_hf_cannot_express_are_refused(change, match, atom):
    cfg = _moe_config(**change) if isinstance(change, dict) else _moe_config()
    if change == "shared":
        cfg.layers[0].moe.shared_experts = _shared_ffn()
    elif change == "top_k":
        cfg.layers[3].moe.router.top_k = 3
    with pytest.raises(UCPError, match=match) as e:
        hf_mapping(cfg)
    assert e.value.atom == atom and e.value.hint


def test_llama3_with_moe_layers_is_refused():
    cfg = _spec("llama3").model
    cfg.layers[0].moe = _moe_config().layers[0].moe  # a fresh config per registry call
    with pytest.raises(UCPError, match="only qwen3 MoE") as e:
        hf_mapping(cfg)
    assert e.value.atom == "layers.0.moe"
    assert _spec("llama3").model.layers[0].moe is None


# -- the real Trainer -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("topo", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_trainer_loads_and_saves_hf_through_ucp(tmp_path, topo):
    """HF folder (transformers, GQA llama3 debug model) -> Trainer at tp=2 with the one-flag option
    (HFStorageReader + Fused rule into TP shards of wqkv) and stock (the same layout, so the same
    batches): equal first losses.
    Our last save in HF loads in transformers and holds exactly the trained parameters."""
    from safetensors.torch import load_file

    from ucp_dev.testing.checks import TOL_FIRST
    from ucp_dev.testing.config_registry import llama3_debugmodel_gqa
    from ucp_dev.testing.titan import jobs as tr
    from ucp_dev.testing.titan.assets import make_assets

    model_config = llama3_debugmodel_gqa().model_spec.model
    mapping = hf_mapping(model_config)
    _hf_model(mapping, tmp_path / "hf")
    assets = make_assets(tmp_path / "assets")
    flags = [
        "--checkpoint.initial_load_path",
        str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.last_save_model_only",
        "--checkpoint.interval",
        "10",
    ]
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    tr.run_job(
        topo,
        ours,
        assets,
        2,
        flags,
        {
            "UCP_TITAN_METRICS": str(ours / "loss.json"),
            "UCP_TITAN_STATE": str(ours / "trained.pt"),
            "UCP_TITAN_STATE_STEP": "2",
        },
        config=tr.STOCK_CONFIG,
        overrides=[tr.ONE_FLAG],
    )
    tr.run_job(topo, stock, assets, 2, flags, {"UCP_TITAN_METRICS": str(stock / "loss.json")}, config=tr.STOCK_CONFIG)
    log = (ours / "log.txt").read_text()
    assert "UCP: loaded Hugging Face" in log and "UCP: saved Hugging Face" in log, log[-2000:]
    a, b = tr.losses(ours / "loss.json"), tr.losses(stock / "loss.json")
    assert abs(a[1] - b[1]) <= TOL_FIRST * abs(b[1]), (a, b)

    export = ours / "checkpoint" / "step-2"
    assert (export / "model.safetensors.index.json").exists(), "torchtitan recognises the step folder"
    assert not (ours / "checkpoint" / ".ucp-hf-scratch").exists()
    hf = _from_pretrained(export)  # every q/k/v (and all else) present
    saved = load_file(export / "model.safetensors")
    assert {k for k in saved if "self_attn.k_proj" in k} and len(saved) == len(hf.state_dict())
    trained = {
        k.replace("._checkpoint_wrapped_module", ""): v  # activation-checkpoint wrappers' segment
        for k, v in torch.load(ours / "trained.pt", weights_only=False).items()
    }
    model = _titan(model_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(trained[f"param/{name}"])
    tokens = torch.randint(0, model_config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    want = _titan_logits(model, tokens)
    with torch.no_grad():
        _close(want, hf(tokens).logits)
