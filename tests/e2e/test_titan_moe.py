"""torchtitan mixture-of-experts with the ucp_dcp option: the real Trainer (CPU launcher, gloo,
``partial_dtensor``) trains torchtitan's qwen3 MoE architecture (``qwen3_moe_small_ucp``: stacked
experts, top-k router, auxiliary-loss-free load balancing) with expert parallelism, saves at
dp_shard=4 x ep=2 on 4 ranks, and resumes at layouts that change the EP degree both ways (ep=4,
ep=1 at dp=2), add pipeline parallelism, or add tensor parallelism (tp=2 x ep=4: dense weights TP-sharded,
experts EP-sharded over dp x tp). Each resume must hold, right after the load, bitwise what
the uninterrupted run held right after the save -- every parameter (experts, router gate), optimizer
moment, step, hyperparameter and model buffer (``expert_bias_E`` replicated, ``tokens_per_expert_E``
zero) -- train on the same sequences (batch hashes) and continue the losses. A loader that swaps two
experts must be caught (sabotage run)."""

import pytest

pytest.importorskip("torchtitan")
from helpers import skip_unless_torchtitan_runs  # noqa: E402

skip_unless_torchtitan_runs()

import titan_moe as tm  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]

RUN = tm.MoERun(config="qwen3_moe_small_ucp", steps=3, k=2)  # checkpoint at step 2; resumes run step 3
SAVE = {"dp": 4, "ep": 2}
K = RUN.k
EXPERTS = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
RESUMES = {
    "ep4": {"dp": 4, "ep": 4},  # EP degree up: 2 experts per rank instead of 4
    "ep1-dp2": {"dp": 2},  # no EP, fewer ranks: experts FSDP-sharded over dp
    "pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2},  # stages, EP kept, DP halved
    # tensor parallelism added: dense weights TP-sharded, experts EP-sharded over dp x tp (ep=4, efsdp=1)
    "tp2-dp2-ep4": {"tp": 2, "dp": 2, "ep": 4},
}
EP_RESUMES = ["ep4", "ep1-dp2", "tp2-dp2-ep4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tm.save(RUN, tmp_path_factory.mktemp("moe"), SAVE)


@pytest.fixture(scope="module")
def resumes(saved):
    """Each resume of RESUMES run once, by whichever test needs it first."""
    return tm.Resumes(RUN, saved, RESUMES)


def _check_moe_state(oracle):
    """The oracle is a meaningful MoE state: biases moved off zero, counters reset, experts stacked."""
    import torch

    biases = [k for k in oracle if k.startswith("buffer/") and k.endswith("expert_bias_E")]
    counts = [k for k in oracle if k.startswith("buffer/") and k.endswith("tokens_per_expert_E")]
    assert len(biases) == len(counts) == 4, sorted(oracle)[:10]
    # a layer's bias can be back at zero after two steps (layers 0 and 3 were, in the run that set this)
    assert any(oracle[k].abs().sum() > 0 for k in biases), "load balancing moved some layer's bias"
    assert all(torch.equal(oracle[k], torch.zeros(8)) for k in counts), "zeroed by the pre-step hook"
    experts = [k for k in oracle if k.startswith("param/") and "inner_experts" in k]
    assert len(experts) == 12 and all(oracle[k].shape[0] == 8 for k in experts)
    assert len([k for k in oracle if k.startswith("state/") and "inner_experts" in k and "exp_avg" in k]) == 24


def test_checkpoint_holds_one_replicated_expert_bias_per_layer(saved):
    """Written through ucp_dcp (integrity sidecar verified); each layer's expert_bias_E saved once
    under the manager's built-in Replicated rule (recorded in the catalog), the stacked experts as
    one [E, ...] tensor each."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from ucp_dcp.storage.opening import open_path

    _, _, save = saved
    step = save / "checkpoint" / f"step-{K}"
    md = FileSystemReader(step).read_metadata().state_dict_metadata
    assert open_path(step)[1].status == "verified"
    biases = sorted(k for k in md if k.endswith("expert_bias_E"))
    assert biases == [f"layers.{i}.moe.expert_bias_E" for i in range(4)], biases
    assert tuple(md[EXPERTS].size) == (8, 128, 256)
    assert f"optimizer.state.{EXPERTS}.exp_avg" in md
    from ucp_dcp.planning.catalog import read_catalog
    from ucp_dcp.torchtitan.moe import EXPERT_BIAS

    rules = read_catalog(FileSystemReader(step).read_metadata().planner_data)["rules"]
    assert {"kind": "replicated", "pattern": EXPERT_BIAS, "check": "error"} in rules, rules
    oracle = torch.load(save / "oracle.pt", weights_only=False)
    _check_moe_state(oracle)


@pytest.mark.parametrize("name", list(RESUMES))
def test_moe_resumes_at_a_new_layout(saved, resumes, name):
    oracle, loaded, load = resumes(name)
    _check_moe_state(loaded)
    tm.assert_resumed(RUN, oracle, loaded, saved[2], load)


def test_swapped_experts_at_load_are_caught(saved):
    """Sabotage: two expert rows of one layer swapped right after the load (ep=1, dp=2). The
    comparison must name exactly that parameter."""
    oracle, loaded, load = tm.resume(RUN, saved, "flip", {"dp": 2}, UCP_TITAN_FLIP_EXPERTS=EXPERTS)
    bad = tm.flipped_only(oracle, loaded, load)
    assert bad == [f"param/{EXPERTS}"], bad


def test_plan_matches_the_ep_resumes_rank_by_rank(resumes):
    """``ucp_dcp plan --target titan`` of the ep=4, ep=1 (dp=2) and tp=2 x ep=4 resumes from the same checkpoint,
    in this process: per-rank bytes read, read calls, bytes received and fallbacks equal those of the
    real Trainer resumes (their readers' ReadStats; the resumes run here if no test ran them yet)."""
    tm.plan_matches(resumes, EP_RESUMES)
