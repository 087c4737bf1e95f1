"""Megatron-Core MoE ``torch_dist`` checkpoints inside ``dcp.load`` at other EP layouts (issue 26).

The checkpoints are written by the real megatron-core on CPU (``ucp_dev.testing.foreign.make_megatron_moe``):
a MoE GPT (every layer MoE, 4 ``SequentialMLP`` experts, top-2) trained at ep=2 (dp=2) with Megatron's
distributed optimizer (a ChainedOptimizer: dense and expert-parallel groups) and saved
``fully_reshardable``. Megatron's own view is a fresh tp=ep=1 model loading it with
``dist_checkpointing.load``.

* plain (``singleton_local_shards`` off: layer- and expert-stacked keys) -> the toy Mixtral (stacked ``[E, F, D]`` experts in
  layers 0 and 2, one module per expert in 1 and 3) at ep=4, at tp=2·pp=2 (ep=1) and at dp=2·ep=2 —
  parameters, both Adam moments, step and groups bitwise;
* extras (``singleton_local_shards`` keys, linear biases, QK layer norms, the sigmoid router's
  ``expert_bias``: none of which the toy has) -> a plain DTensor target that declares those
  parameters, at ep=4 over 4 ranks, bitwise;
* a flipped expert row in the saved file is caught in exactly that atom; the toy's rules on the
  extras checkpoint name the keys they do not map.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import dist as D
import pytest
import torch

import ucp_dev
from ucp_dcp.errors import UCPError
from ucp_dcp.planning.opened import UnopenedMetadata, raise_if_unopened

# found, not imported: importing it costs every collection (make test's too) 4 s; the runs import it
if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core (the foreign extra)", allow_module_level=True)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CODE_PATH = ucp_dev.code_path()  # this ucp_dcp and this ucp_dev, first on the jobs' PYTHONPATH


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CODE_PATH)
    cmd = [sys.executable, "-m", "ucp_dev.testing.foreign.make_megatron_moe", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_moe")
    _run("--out", str(root / "plain"), "--ep", "2", "--port", "0")
    _run("--out", str(root / "extras"), "--ep", "2", "--extras", "--singleton", "--port", "0")
    return root


def _load_worker(rank, world, topo_text, path):
    import warnings

    from ucp_dev.testing.foreign.views import load_into_toy

    warnings.simplefilter("ignore")
    return load_into_toy(topo_text, "megatron-moe", path)


TOPOLOGIES = {"ep4": "ep=4", "tp2pp2": "tp=2,pp=2", "dp2ep2": "dp=2,ep=2"}


@pytest.mark.parametrize("case", TOPOLOGIES)
def test_megatron_moe_loads_bitwise_at_another_ep_layout(runs, case):
    from ucp_dev.testing.foreign.views import compare, megatron_moe_view
    from ucp_dev.toy import Topology

    topo = TOPOLOGIES[case]
    state = D.run(_load_worker, Topology.parse(topo).world, topo, str(runs / "plain"))[0]
    view = megatron_moe_view(str(runs / "plain"))
    n, bad = compare(view, state)
    experts = [k for k in state if ".moe.experts." in k and k.startswith("state/") and k.endswith("exp_avg")]
    # 60 logical parameters (30 of them experts: 2 stacked layers x 3, 2 list layers x 4 experts x 3),
    # each compared as parameter, exp_avg and exp_avg_sq (plus step and groups)
    assert n == 180 and len(experts) == 30 and not bad, (n, bad[:10])


def test_a_flipped_expert_row_in_the_file_is_caught(runs, tmp_path):
    """Sabotage: the first row of global expert 3's W1 in layer 1 (an expert-list layer; EP rank 1 of
    the save) negated in its ``.distcp`` file: exactly that parameter differs from Megatron's view."""
    from ucp_dcp.sources.foreign.megatron import MegatronReader
    from ucp_dcp.sources.foreign.megatron_rules import moe_rules
    from ucp_dev.testing.foreign.views import compare, megatron_moe_view
    from ucp_dev.toy.hf_presets import TOY_MIXTRAL

    bad = tmp_path / "bad"
    shutil.copytree(runs / "plain", bad)
    atom = "model.layers.1.moe.experts.3.w1.weight"
    rules = moe_rules(TOY_MIXTRAL.stacked_moe_layers, TOY_MIXTRAL.list_moe_layers)
    pieces, _, _ = MegatronReader(bad, rules=rules).describe()
    p = next(p for p in pieces if p.atom == atom and p.offsets == (0, 0))
    with open(bad / p.file, "r+b") as f:
        f.seek(p.byte_offset)
        row = torch.frombuffer(bytearray(f.read(p.sizes[1] * 4)), dtype=torch.float32)
        f.seek(p.byte_offset)
        f.write((-row).numpy().tobytes())
    state = D.run(_load_worker, 4, "ep=4", str(bad))[0]
    _, mismatches = compare(megatron_moe_view(str(runs / "plain")), state)
    assert mismatches == ["param layers.1.moe.experts.3.w1.weight"], mismatches


def _extras_worker(rank, world, path):
    """A plain target with the extras' parameters: experts as [E, ...] DTensors sharded over ep=4
    (one expert per rank), the rest replicated; returns the gathered full tensors on rank 0."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ucp_dcp import UCPLoadPlanner
    from ucp_dcp.errors import ucp_errors
    from ucp_dcp.sources.foreign.megatron import MegatronReader

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    reader = MegatronReader(path, rules=_extras_rules())
    md = reader.read_metadata()
    sd = {}
    for k, v in md.state_dict_metadata.items():
        if not hasattr(v, "size") or not (k.startswith("model.") or k.endswith((".exp_avg", ".exp_avg_sq"))):
            continue
        if ".moe.experts." in k:  # stacked [E, ...]: each rank holds its expert
            sd[k] = DTensor.from_local(torch.full((1, *v.size[1:]), float("nan")), mesh, [Shard(0)])
        else:
            sd[k] = torch.full(tuple(v.size), float("nan"))
    with ucp_errors():
        dcp.load(sd, storage_reader=MegatronReader(path, rules=_extras_rules()), planner=UCPLoadPlanner())
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}
    return full if dist.get_rank() == 0 else None


def _extras_rules():
    """Every key of the extras run into Qwen/Llama-style names, experts stacked ``[E, ...]``."""
    from ucp_dcp.sources.foreign.megatron_rules import EXTRA_RULES, MegatronRule, moe_rules

    out = []
    for r in moe_rules(stacked_layers=range(4)) + EXTRA_RULES:
        if r.experts:  # keep the experts stacked: drop {e} from the names
            r = MegatronRule(
                r.key,
                r.param.replace("{e}.", "").replace(".weight", "").replace(".bias", "_bias"),
                r.stacked,
                True,
                r.glu and r.glu.replace("{e}.", "").replace(".weight", "").replace(".bias", "_bias"),
            )
        out.append(r)
    return tuple(out)


def _extras_expected(path):
    """Megatron's tp=ep=1 view under the same names, sliced by hand."""
    import re

    view = torch.load(os.path.join(path, "mcore_view.pt"), weights_only=False)
    rules = {r.key: r for r in _extras_rules()}
    want = {}
    for src, pre, suf in ((view["params"], "model.", ""), (view["buffers"], "model.", "")) + tuple(
        ({n: st[k] for n, st in view["optim"].items()}, "optim.state.", f".{k}") for k in ("exp_avg", "exp_avg_sq")
    ):
        stacks = {}
        for name, t in src.items():
            m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", name)
            if m is None:
                want[pre + rules[name].param + suf] = t
                continue
            i, rest = int(m[1]), m[2]
            em = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(.*)", rest)
            if em is None:
                want[pre + rules["decoder.layers." + rest].param.format(i=i) + suf] = t
                continue
            r = rules["decoder.layers.mlp.experts.experts." + em[2]]
            halves = {r.param: t} if r.glu is None else {r.param: t[: len(t) // 2], r.glu: t[len(t) // 2 :]}
            for param, part in halves.items():
                stacks.setdefault(pre + param.format(i=i) + suf, {})[int(em[1])] = part
        want.update({k: torch.stack([v[e] for e in sorted(v)]) for k, v in stacks.items()})
    return want


def test_megatron_biases_qk_norm_and_expert_bias_load_bitwise_at_ep4(runs):
    got = D.run(_extras_worker, 4, str(runs / "extras"))[0]
    want = _extras_expected(str(runs / "extras"))
    for key in ("attn.wqkv.bias", "attn.q_norm.weight", "attn.k_norm.weight", "moe.router.expert_bias"):
        assert f"model.layers.2.{key}" in want, key
    assert "model.layers.2.moe.experts.w1_bias" in want and set(want) <= set(got), sorted(set(want) - set(got))[:5]
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert len(want) > 100 and not bad, bad[:10]


def test_the_toys_rules_name_the_keys_they_do_not_map(runs):
    from ucp_dcp.sources.foreign.megatron import MegatronReader
    from ucp_dcp.sources.foreign.megatron_rules import moe_rules

    md = MegatronReader(runs / "extras", rules=moe_rules((0, 2), (1, 3))).read_metadata()
    assert isinstance(md, UnopenedMetadata)
    with pytest.raises(UCPError, match="match no rule") as e:
        raise_if_unopened(md)
    for key in ("self_attention.linear_qkv.bias", "q_layernorm.weight", "router.expert_bias", "linear_fc1.bias"):
        assert any(key in k for k in e.value.saved), (key, e.value.saved)
