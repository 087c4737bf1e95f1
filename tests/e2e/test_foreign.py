"""DeepSpeed and Megatron-Core checkpoints resumed inside ``dcp.load``, no conversion (issue 15).

The foreign checkpoints are produced here by the real libraries on CPU (``ucp_dev.testing.foreign``):
DeepSpeed ZeRO-1, -2 and -3 runs of the toy LLM (3 ranks, so the flat groups and ZeRO-3's per-param
pieces are padded) plus DeepSpeed's own ``ds_to_universal`` output, and a Megatron-Core GPT trained
at tp=2 and saved in ``torch_dist`` (plain and ``fully_reshardable`` optimizer state). Each is loaded
into the toy trainer at new layouts (dp=2·tp=2, pp=2) on the pool of gloo workers, and the loaded
state — parameters, Adam moments and step in torch AdamW, group hyperparameters — is compared
bitwise with the library's *own* view of its checkpoint (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint`` and live optimizer, Megatron's load at tp=1).
"""

import importlib.util
import os
import subprocess
import sys

import dist as D
import pytest
import torch

import ucp_dev
from ucp_dcp.errors import UCPError
from ucp_dcp.planning.opened import UnopenedMetadata, raise_if_unopened

# found, not imported: importing them costs every collection (make test's too) 5 s; the runs import them
if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs deepspeed and megatron-core (the foreign extra)", allow_module_level=True)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CODE_PATH = ucp_dev.code_path()  # this ucp_dcp and this ucp_dev, first on the jobs' PYTHONPATH


def _run(module, *args):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=CODE_PATH)
    res = subprocess.run(
        [sys.executable, "-m", f"ucp_dev.testing.foreign.{module}", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    for stage in (1, 2, 3):
        _run(
            "make_deepspeed",
            "--out",
            str(root / f"zero{stage}"),
            "--stage",
            str(stage),
            "--world",
            "3",
            "--universal",
        )
    return root


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    _run("make_megatron", "--out", str(root / "plain"), "--tp", "2", "--dist-opt", "none", "--port", "0")
    _run("make_megatron", "--out", str(root / "full"), "--tp", "2", "--dist-opt", "full", "--port", "0")
    return root


def _load_worker(rank, world, topo_text, kind, path, options):
    import warnings

    from ucp_dev.testing.foreign.views import load_into_toy

    warnings.simplefilter("ignore")
    return load_into_toy(topo_text, kind, path, options)


def _check(view, state):
    from ucp_dev.testing.foreign.views import compare

    n, bad = compare(view, state)
    assert n > 100 and not bad, bad[:10]


DS_CASES = {
    f"zero{s}-{form}-{topo.replace('=', '').replace(',', '')}": (s, form, topo)
    for s in (1, 2, 3)
    for form in ("zero", "universal")
    for topo in ("dp=2,tp=2", "pp=2")
    if form == "zero" or topo == "dp=2,tp=2"
}


@pytest.mark.parametrize("case", DS_CASES)
def test_deepspeed_checkpoint_loads_bitwise_into_a_new_layout(deepspeed_runs, case):
    from ucp_dev.toy import Topology

    stage, form, topo = DS_CASES[case]
    path = deepspeed_runs / f"zero{stage}"
    state = D.run(
        _load_worker, Topology.parse(topo).world, topo, "deepspeed", str(path), {"universal": form == "universal"}
    )[0]
    from ucp_dev.testing.foreign.views import deepspeed_view

    _check(deepspeed_view(str(path)), state)


MG_CASES = {
    "plain-dp2tp2": ("plain", "dp=2,tp=2"),
    "plain-pp2": ("plain", "pp=2"),
    "fully_reshardable-dp2tp2": ("full", "dp=2,tp=2"),
}


@pytest.mark.parametrize("case", MG_CASES)
def test_megatron_torch_dist_loads_bitwise_into_a_new_layout(megatron_runs, case):
    from ucp_dev.toy import Topology

    variant, topo = MG_CASES[case]
    path = megatron_runs / variant
    state = D.run(_load_worker, Topology.parse(topo).world, topo, "megatron", str(path), {})[0]
    from ucp_dev.testing.foreign.views import megatron_view

    view = megatron_view(str(path))
    assert view[2], "the Megatron run saved optimizer state"
    _check(view, state)


def test_megatron_dp_reshardable_is_refused_with_the_fix(megatron_runs, tmp_path):
    """Flat distributed-optimizer buffers carry no parameter names: refused before any read."""
    import shutil

    from ucp_dcp.sources.foreign.megatron import MegatronReader

    bad = tmp_path / "dp"
    shutil.copytree(megatron_runs / "full", bad)
    common = torch.load(bad / "common.pt", weights_only=False)
    common["optimizer"]["param_state_sharding_type"] = "dp_reshardable"
    torch.save(common, bad / "common.pt")
    md = MegatronReader(bad).read_metadata()
    assert isinstance(md, UnopenedMetadata)
    with pytest.raises(UCPError, match="(?s)dp_reshardable.*fully_reshardable"):
        raise_if_unopened(md)


def test_megatron_rotary_mismatch_is_refused(megatron_runs):
    from ucp_dcp.sources.foreign.megatron import MegatronReader

    md = MegatronReader(megatron_runs / "plain", target_rotary="rotate_half").read_metadata()
    assert isinstance(md, UnopenedMetadata)
    with pytest.raises(UCPError, match="interleaved rotary embeddings, the target uses rotate_half"):
        raise_if_unopened(md)


def test_deepspeed_files_are_parsed_without_importing_deepspeed(deepspeed_runs):
    """A fresh interpreter reads a ZeRO-3 checkpoint's metadata with deepspeed made unimportable."""
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from ucp_dcp.sources.foreign.deepspeed import DeepSpeedReader\n"
        f"md = DeepSpeedReader({str(deepspeed_runs / 'zero3')!r}).read_metadata()\n"
        "from ucp_dcp.planning.opened import CheckedMetadata\n"
        "assert isinstance(md, CheckedMetadata), md\n"
        "print(len(md.state_dict_metadata))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=CODE_PATH)
    )
    assert res.returncode == 0 and int(res.stdout.strip()) > 100, res.stderr[-2000:]
