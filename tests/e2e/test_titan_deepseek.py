"""torchtitan deepseek_v3 with the ucp_dcp option: the real Trainer (CPU launcher, gloo,
``partial_dtensor``) trains a CPU-sized deepseek_v3 (``deepseek_v3_small_ucp``: MLA attention with a
low-rank query, a dense first layer, routed experts plus shared experts, DeepSeek V3's sigmoid
group-limited router, auxiliary-loss-free load balancing) at dp_shard=4 x ep=2 on 4 ranks, and
resumes at dp_shard=2 x tp=2 x ep=4 (EP degree up, TP added, DP halved) and pp=2 x dp_shard=2 without
EP (EP degree down, stages added). Each resume must hold, right after the load, bitwise what the
uninterrupted run held right after the save -- every parameter (routed and shared experts, router
gate, MLA projections), optimizer moment, step, hyperparameter and model buffer (``expert_bias_E``
replicated, ``tokens_per_expert_E`` zero) -- train on the same sequences and continue the losses;
``ucp_dcp plan`` of both resumes must match their real reads; two swapped experts must be caught.
With one multi-token-prediction (MTP) layer (``deepseek_v3_small_mtp_ucp``, saved at dp_shard=2 x
ep=2, resumed at tp=2 x ep=2: torchtitan refuses MTP with PP) the same holds except for the MTP
layer's ``tokens_per_expert_E``, which torchtitan never zeroes nor reads (reset, as stock does).

The checkpoint is taken at step 3, not 2: with sigmoid scores near 0.5 at this size, the
load-balancing bias (sign updates of 1e-3) flips the routing every step, so every layer's bias is
back at exactly zero after even steps and a step-2 checkpoint would not show a bias being restored.
"""

import pytest

pytest.importorskip("torchtitan")
from helpers import skip_unless_torchtitan_runs  # noqa: E402

skip_unless_torchtitan_runs()

import titan_moe as tm  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]

RUN = tm.MoERun(config="deepseek_v3_small_ucp", steps=5, k=3)
SAVE = {"dp": 4, "ep": 2}
RESUMES = {
    "tp2-dp2-ep4": {"dp": 2, "tp": 2, "ep": 4},  # EP 2 -> 4 borrowing the TP ranks, DP 4 -> 2
    "pp2-dp2": {"pp": 2, "dp": 2},  # EP 2 -> 1 (experts FSDP-sharded over dp), two stages
}
MOE_LAYERS = (1, 2, 3)  # layer 0 is dense
EXPERTS = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
MTP_RUN = tm.MoERun(config="deepseek_v3_small_mtp_ucp", steps=4, k=3)
MTP_MOE = "buffer/mtp_layers.0.moe."


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tm.save(RUN, tmp_path_factory.mktemp("dsv3"), SAVE)


@pytest.fixture(scope="module")
def resumes(saved):
    """Each resume of RESUMES run once, by whichever test needs it first."""
    return tm.Resumes(RUN, saved, RESUMES)


def _check_state(state):
    """A meaningful deepseek_v3 MoE state: every bias off zero, counters zero, experts stacked,
    shared experts and the dense layer present."""
    import torch

    def entries(kind, part):
        return [k for k in state if k.startswith(kind) and part in k]

    biases, counts = entries("buffer/", "expert_bias_E"), entries("buffer/", "tokens_per_expert_E")
    assert len(biases) == len(counts) == len(MOE_LAYERS), sorted(state)[:10]
    assert all(state[k].abs().sum() > 0 for k in biases), "load balancing moved every layer's bias by step 3"
    assert all(torch.equal(state[k], torch.zeros(8)) for k in counts), "zeroed by the pre-step hook"
    experts = entries("param/", "inner_experts")
    assert len(experts) == 9 and all(state[k].shape[0] == 8 for k in experts)
    assert len(entries("param/", "shared_experts")) == 9 and len(entries("param/", "feed_forward")) == 3
    assert len(entries("state/", "shared_experts")) == len(entries("state/", "inner_experts")) == 27  # moments, step


def test_checkpoint_holds_deepseek_moe_state(saved):
    """Written through ucp_dcp (sidecar verified): one expert_bias_E per MoE layer under the
    Replicated rule recorded in the catalog, stacked experts as one [E, ...] tensor each, shared
    experts and the dense layer's FFN as plain parameters with their moments."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from ucp_dcp.planning.catalog import read_catalog
    from ucp_dcp.storage.opening import open_path
    from ucp_dcp.torchtitan.moe import EXPERT_BIAS

    _, _, save = saved
    step = save / "checkpoint" / f"step-{RUN.k}"
    meta = FileSystemReader(step).read_metadata()
    md = meta.state_dict_metadata
    assert open_path(step)[1].status == "verified"
    assert sorted(k for k in md if k.endswith("expert_bias_E")) == [f"layers.{i}.moe.expert_bias_E" for i in MOE_LAYERS]
    assert not any("tokens_per_expert" in k for k in md)
    assert tuple(md[EXPERTS].size) == (8, 64, 128)
    for k in (
        "layers.1.moe.shared_experts.w2.weight",
        "layers.0.feed_forward.w1.weight",
        "layers.1.attention.wq_a.weight",
    ):
        assert k in md and f"optimizer.state.{k}.exp_avg_sq" in md, k
    rules = read_catalog(meta.planner_data)["rules"]
    assert {"kind": "replicated", "pattern": EXPERT_BIAS, "check": "error"} in rules, rules
    _check_state(torch.load(save / "oracle.pt", weights_only=False))


@pytest.mark.parametrize("name", list(RESUMES))
def test_deepseek_resumes_at_a_new_layout(saved, resumes, name):
    oracle, loaded, load = resumes(name)
    _check_state(loaded)
    tm.assert_resumed(RUN, oracle, loaded, saved[2], load)


def test_swapped_experts_at_load_are_caught(saved):
    """Sabotage: two expert rows of layer 1 swapped right after a load at dp=2 without EP; the
    comparison names exactly that parameter (and so every other entry loaded bitwise)."""
    oracle, loaded, load = tm.resume(RUN, saved, "flip", {"dp": 2}, UCP_TITAN_FLIP_EXPERTS=EXPERTS)
    assert tm.flipped_only(oracle, loaded, load) == [f"param/{EXPERTS}"]


def test_plan_matches_the_resumes_rank_by_rank(resumes):
    """``ucp_dcp plan --target titan`` of the two resumes, in this process: per-rank bytes read, read
    calls, bytes received and fallbacks equal those of the real Trainer resumes (run here if no test
    ran them yet)."""
    tm.plan_matches(resumes, list(RESUMES))


def test_mtp_layer_resumes_with_only_its_unread_counter_reset(tmp_path_factory):
    """The MTP layer's MoE is outside torchtitan's load-balancing hook (it walks ``layers`` only):
    its bias stays zero and its token counter grows; nothing reads the counter, a non-persistent
    buffer, so a resume restarts it at zero. Everything else, MTP parameters and moments included,
    loads bitwise at tp=2 x ep=2; batches and losses continue."""
    import torch

    saved = tm.save(MTP_RUN, tmp_path_factory.mktemp("dsv3mtp"), {"dp": 2, "ep": 2})
    oracle, loaded, load = tm.resume(MTP_RUN, saved, "tp2-ep2", {"tp": 2, "ep": 2})
    counter = MTP_MOE + "tokens_per_expert_E"
    assert oracle[counter].sum() > 0 and torch.equal(loaded[counter], torch.zeros(8))
    assert torch.equal(oracle[MTP_MOE + "expert_bias_E"], torch.zeros(8))
    assert len([k for k in oracle if k.startswith("param/mtp_layers.0.")]) == 20
    tm.assert_resumed(MTP_RUN, oracle, loaded, saved[2], load, reset=(counter,))
