"""DeepSpeed MoE checkpoints (``deepspeed.moe.layer.MoE``, expert parallel) resumed inside ``dcp.load``.

``ucp_dev.testing.foreign.make_deepspeed_moe`` trains the toy LLM with two DeepSpeed MoE layers (4 experts,
ep=2) with the real engine on CPU and saves with ``engine.save_checkpoint``: ZeRO-1 on 4 ranks (each
expert group split over 2 expert-data-parallel ranks) and ZeRO-2 on 2 ranks. Each is loaded into the
toy trainer's list-of-experts MoE at other EP layouts (ep=4, ep=1 with dp=2, ep=2 x tp=2, pp=2 x ep=2)
and compared bitwise, per expert, moment and step, with the live engine's view (``safe_get_full_*``
gathered over the ranks); the expert files are DeepSpeed's own view of the expert weights. Sabotage:
a swapped row in an expert file or in a rank's expert moments shows as exactly that expert's
mismatch; swapped or missing expert files are refused naming the atom.
"""

import os
import shutil
import subprocess
import sys

import dist as D
import pytest
import torch

import ucp_dev
from ucp_dcp.errors import CheckpointNotFoundError, CorruptCheckpointError
from ucp_dcp.planning.opened import UnopenedMetadata, raise_if_unopened

pytest.importorskip("deepspeed")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CODE_PATH = ucp_dev.code_path()  # this ucp_dcp and this ucp_dev, first on the jobs' PYTHONPATH
EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


def _run(*args):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=CODE_PATH)
    cmd = [sys.executable, "-m", "ucp_dev.testing.foreign.make_deepspeed_moe", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed_moe")
    _run("--out", str(root / "zero1"), "--stage", "1", "--world", "4", "--ep", "2")
    _run("--out", str(root / "zero2"), "--stage", "2", "--world", "2", "--ep", "2")
    return root


def _tag(path):
    with open(os.path.join(path, "latest")) as f:
        return os.path.join(path, f.read().strip())


def _load_worker(rank, world, topo_text, path):
    import warnings

    from ucp_dev.testing.foreign.views import load_into_toy

    warnings.simplefilter("ignore")
    return load_into_toy(topo_text, "deepspeed_moe", path)


def _load(path, topo):
    from ucp_dev.toy import Topology

    return D.run(_load_worker, Topology.parse(topo).world, topo, str(path))[0]


def _mismatches(path, state):
    from ucp_dev.testing.foreign.views import compare, deepspeed_moe_view

    view = deepspeed_moe_view(str(path))
    experts = [n for n in view[1] if ".experts." in n]
    assert len(experts) == 2 * 4 * 3, experts  # 2 MoE layers x 4 experts x (w1, w3, w2)
    n, bad = compare(view, state)
    assert n > 150
    return bad


CASES = {
    "zero1-ep2dp2-to-ep4": ("zero1", "ep=4"),
    "zero1-ep2dp2-to-ep1dp2": ("zero1", "dp=2"),
    "zero1-ep2dp2-to-pp2ep2": ("zero1", "pp=2,ep=2"),
    "zero2-ep2-to-ep4": ("zero2", "ep=4"),
    "zero2-ep2-to-ep2tp2": ("zero2", "ep=2,tp=2"),
}


@pytest.mark.parametrize("case", CASES)
def test_deepspeed_moe_loads_bitwise_at_another_ep_layout(moe_runs, case):
    run, topo = CASES[case]
    assert _mismatches(moe_runs / run, _load(moe_runs / run, topo)) == []


@pytest.mark.parametrize("run", ["zero1", "zero2"])
def test_the_expert_files_are_the_engines_expert_weights(moe_runs, run):
    """DeepSpeed's expert files (what its load_checkpoint loads) hold, per global expert, the live fp32 master."""
    view = torch.load(moe_runs / run / "ds_view_moe.pt", weights_only=False)
    tag = _tag(moe_runs / run)
    files = sorted(f for f in os.listdir(tag) if f.startswith("layer_"))
    assert len(files) == 8
    seen = 0
    for f in files:
        for name, t in torch.load(os.path.join(tag, f), weights_only=True).items():
            assert torch.equal(t, view[name]["fp32"]), (f, name)
            seen += 1
    assert seen == 24


def _sabotaged(moe_runs, tmp_path):
    bad = tmp_path / "zero1"
    shutil.copytree(moe_runs / "zero1", bad)
    return bad, _tag(bad)


def test_a_swapped_row_in_an_expert_file_is_that_experts_mismatch(moe_runs, tmp_path):
    bad, tag = _sabotaged(moe_runs, tmp_path)
    f = os.path.join(tag, "layer_1_expert_3_mp_rank_00_model_states.pt")
    sd = torch.load(f, weights_only=True)
    w = sd[f"layers.3.moe{EXPERTS}3.w1.weight"]
    sd[f"layers.3.moe{EXPERTS}3.w1.weight"] = w[[1, 0, *range(2, w.shape[0])]].clone()
    torch.save(sd, f)
    assert _mismatches(bad, _load(bad, "ep=4")) == ["param layers.3.moe.experts.3.w1.weight"]


def test_a_swapped_moment_row_of_an_expert_partition_is_that_experts_mismatch(moe_runs, tmp_path):
    """Rank 3 = EP rank 1, expert-DP rank 1: the second half of EP rank 1's expert group, which
    starts with layer 3's local expert 0 = global expert 2 (checks the rank -> expert mapping)."""
    bad, tag = _sabotaged(moe_runs, tmp_path)
    f = os.path.join(tag, "zero_pp_rank_3_mp_rank_00_optim_states.pt")
    sd = torch.load(f, weights_only=False)
    moe = next(
        i for i, g in enumerate(sd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]) if g.get("moe")
    )
    m = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][moe]["exp_avg"]
    m[:56], m[56:112] = m[56:112].clone(), m[:56].clone()  # rows 0 and 1 of w1 [24, 56]
    torch.save(sd, f)
    assert _mismatches(bad, _load(bad, "ep=4")) == ["exp_avg layers.3.moe.experts.2.w1.weight"]


def _refused(path):
    from ucp_dcp.sources.foreign.deepspeed import DeepSpeedReader
    from ucp_dcp.sources.foreign.deepspeed_moe import TOY_NAMES

    md = DeepSpeedReader(path, names=TOY_NAMES).read_metadata()
    assert isinstance(md, UnopenedMetadata)
    raise_if_unopened(md)


def test_swapped_expert_files_are_refused(moe_runs, tmp_path):
    bad, tag = _sabotaged(moe_runs, tmp_path)
    a, b = (os.path.join(tag, f"layer_0_expert_{e}_mp_rank_00_model_states.pt") for e in (1, 2))
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    with pytest.raises(CorruptCheckpointError, match="expected the params of expert 1") as e:
        _refused(bad)
    assert e.value.atom == "model.layers.1.moe.experts.1.w1.weight"


def test_a_missing_expert_file_is_refused_naming_the_atom(moe_runs, tmp_path):
    bad, tag = _sabotaged(moe_runs, tmp_path)
    os.remove(os.path.join(tag, "layer_1_expert_2_mp_rank_00_model_states.pt"))
    with pytest.raises(CheckpointNotFoundError, match="layer_1_expert_2") as e:
        _refused(bad)
    assert e.value.atom == "model.layers.3.moe.experts.2.w1.weight"


def test_moe_files_are_parsed_without_importing_deepspeed(moe_runs):
    """A fresh interpreter reads the ZeRO-1 MoE checkpoint's metadata with deepspeed made unimportable."""
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from ucp_dcp.sources.foreign.deepspeed import DeepSpeedReader\n"
        "from ucp_dcp.sources.foreign.deepspeed_moe import TOY_NAMES\n"
        f"md = DeepSpeedReader({str(moe_runs / 'zero1')!r}, names=TOY_NAMES).read_metadata()\n"
        "from ucp_dcp.planning.opened import CheckedMetadata\n"
        "assert isinstance(md, CheckedMetadata), md\n"
        "print(sum('.experts.' in k for k in md.state_dict_metadata))"
    )
    env = dict(os.environ, PYTHONPATH=CODE_PATH)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and int(res.stdout.strip()) >= 24 * 4, res.stderr[-2000:]
