"""Transformers-made MoE folders through the real torchtitan Trainer at expert-parallel layouts.

The one-flag option (``--override.imports ucp_dcp.torchtitan.overrides.checkpointer`` on torchtitan's own
config) starts from the HF folder (``initial_load_in_hf``) -- each rank reads its experts' ranges of the
per-expert HF tensors -- trains 2 steps and writes its last save in HF (``last_save_in_hf``):

* ``qwen3_moe_small_hf`` (the CPU-sized qwen3 MoE without the load-balancing bias, what HF's
  ``Qwen3MoeForCausalLM`` computes) at dp=2 x ep=2;
* ``deepseek_v3_small_hf`` (MLA, a dense first layer, routed + shared experts, sigmoid group-limited
  routing, the load-balancing bias = HF's ``e_score_correction_bias``) at tp=2 x ep=2.

Stock torchtitan (its own HF adapter, the same layout and data) gives the same first loss; transformers
loads our export with no key missing, every expert, router gate (and correction bias) equal to the
trained state, and logits equal to torchtitan's trained model."""

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
from helpers import skip_unless_torchtitan_runs  # noqa: E402

skip_unless_torchtitan_runs()

import titan_models as tm  # noqa: E402

from ucp_dev.testing.checks import TOL_FIRST  # noqa: E402
from ucp_dev.testing.titan import jobs as tr  # noqa: E402
from ucp_dev.testing.titan.assets import make_assets  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize(
    "config,topo",
    [("qwen3_moe_small_hf", {"dp": 2, "ep": 2}), ("deepseek_v3_small_hf", {"tp": 2, "ep": 2})],
    ids=["qwen3-dp2-ep2", "deepseek-tp2-ep2"],
)
def test_trainer_starts_from_an_hf_moe_folder_and_exports_back(tmp_path, monkeypatch, config, topo):
    from safetensors.torch import load_file

    from ucp_dcp.torchtitan.mappings import hf_mapping
    from ucp_dev.testing import config_registry

    model_config = getattr(config_registry, config)().model_spec.model
    mapping = hf_mapping(model_config)
    tm.hf_model(mapping, tmp_path / "hf")
    assets = make_assets(tmp_path / "assets")
    flags = [
        "--checkpoint.initial_load_path",
        str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",  # qwen3_moe_debug exports float16; fp32 to compare bitwise
        "float32",
        "--checkpoint.interval",
        "10",
    ]
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    env = {
        "UCP_TITAN_METRICS": str(ours / "loss.json"),
        "UCP_TITAN_STATE": str(ours / "trained.pt"),
        "UCP_TITAN_STATE_BUFFERS": "1",
    }
    tr.run_job(
        topo, ours, assets, 2, flags, {**env, "UCP_TITAN_STATE_STEP": "2"}, config=config, overrides=[tr.ONE_FLAG]
    )
    tr.run_job(topo, stock, assets, 2, flags, {"UCP_TITAN_METRICS": str(stock / "loss.json")}, config=config)
    log = (ours / "log.txt").read_text()
    assert "UCP: loaded Hugging Face" in log and "UCP: saved Hugging Face" in log, log[-2000:]
    a, b = tr.losses(ours / "loss.json"), tr.losses(stock / "loss.json")
    assert abs(a[1] - b[1]) <= TOL_FIRST * abs(b[1]), (a, b)

    export = ours / "checkpoint" / "step-2"
    saved = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}
    state = {
        k.replace("._checkpoint_wrapped_module", ""): v
        for k, v in torch.load(ours / "trained.pt", weights_only=False).items()
    }
    trained = {k.removeprefix("param/"): v for k, v in state.items() if k.startswith("param/")}
    moe = [i for i, layer in enumerate(model_config.layers) if layer.moe is not None]
    assert moe, config
    for i in moe:  # every expert of every MoE layer, at its global number
        experts = f"layers.{i}.moe.routed_experts.inner_experts."
        for e in range(trained[experts + "w1_EFD"].shape[0]):
            hf = f"model.layers.{i}.mlp.experts.{e}."
            assert torch.equal(saved[hf + "gate_proj.weight"], trained[experts + "w1_EFD"][e]), (i, e)
            assert torch.equal(saved[hf + "up_proj.weight"], trained[experts + "w3_EFD"][e]), (i, e)
            assert torch.equal(saved[hf + "down_proj.weight"], trained[experts + "w2_EDF"][e]), (i, e)
        assert torch.equal(saved[f"model.layers.{i}.mlp.gate.weight"], trained[f"layers.{i}.moe.router.gate.weight"])
        bias = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if config.startswith("deepseek"):  # the learned load-balancing bias is HF's correction bias
            assert torch.equal(saved[bias], state[f"buffer/layers.{i}.moe.expert_bias_E"]), i
        else:
            assert bias not in saved

    tm.fp32_experts(monkeypatch.setattr)
    model = tm._titan(model_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(trained[name])
        for name, b in model.named_buffers():  # deepseek's load-balancing bias routes tokens too
            if name.endswith("expert_bias_E"):
                b.copy_(state[f"buffer/{name}"])
    tokens = torch.randint(0, model_config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        tm._close(tm._titan_logits(model, tokens), tm._from_pretrained(export)(tokens).logits)
