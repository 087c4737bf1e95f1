"""Hugging Face in and out for torchtitan models (ucp_dcp.torchtitan.mappings, UCPCheckpointManager's HF path).

Single process: a random ``transformers`` Llama / Qwen3 built from the config our mapping emits is
loaded into torchtitan's llama3 / qwen3 debug model through ``HFStorageReader`` + ``UCPLoadPlanner``
(fused wqkv from separate q/k/v, rotary rows permuted for llama, tied head for qwen3): same logits
as transformers; exported back (ucp_dcp checkpoint + ``export_hf``), ``from_pretrained`` gives the
same logits again. End to end (slow): the real Trainer starts from that HF folder
(``initial_load_in_hf``) at tp=2 with the option on and stock (same layout, same data), trains 2 steps and
writes its last save in HF (``last_save_in_hf``); the first losses agree and transformers loads our
export with every tensor equal to the trained parameters."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
from helpers import skip_unless_torchtitan_runs, torchtitan_forward  # noqa: E402
from titan_harness import _close, _from_pretrained, _titan, _titan_logits  # noqa: E402

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


def _hf_model(mapping, folder, seed=0):
    """A random transformers model built from the mapping's config.json, saved to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(mapping.config)
    arch = cfg.pop("architectures")
    config = AutoConfig.for_model(**cfg)
    config.architectures = arch
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from 1 and weights large enough that a wrong row order shows
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    hf.save_pretrained(folder)
    return hf


@torchtitan_forward
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
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


def test_moe_models_are_refused_with_the_reason():
    with pytest.raises(UCPError, match="mixture-of-experts"):
        hf_mapping(_spec("qwen3", "debugmodel_moe").model)


# -- the real Trainer -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("topo", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_trainer_loads_and_saves_hf_through_ucp(tmp_path, topo):
    """HF folder (transformers, GQA llama3 debug model) -> Trainer at tp=2 with the one-flag option
    (HFStorageReader + Fused rule into TP shards of wqkv) and stock (the same layout, so the same
    batches): equal first losses.
    Our last save in HF loads in transformers and holds exactly the trained parameters."""
    import titan_harness as tr
    from safetensors.torch import load_file

    from ucp_dcp.torchtitan.config_registry import llama3_debugmodel_gqa

    model_config = llama3_debugmodel_gqa().model_spec.model
    mapping = hf_mapping(model_config)
    _hf_model(mapping, tmp_path / "hf")
    assets = tr.make_assets(tmp_path / "assets")
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
    a, b = tr._losses(ours / "loss.json"), tr._losses(stock / "loss.json")
    assert abs(a[1] - b[1]) <= tr.TOL_FIRST * abs(b[1]), (a, b)

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
