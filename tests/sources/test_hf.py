"""Hugging Face safetensors in and out (ucp_dcp.sources.hf), proven with the real ``transformers``.

``transformers`` builds a tiny random Llama from the config our toy mapping emits and
``save_pretrained``s it (no download); we load it into the toy LLM at dp=2·tp=2, dp=4 (FSDP cuts
inside rotary heads) and pp=2, and its logits equal transformers' on the same tokens; after
training steps we export (collectively, box by box) and ``from_pretrained`` of the export gives our
logits. Single-process tests cover the format, the row math and the refusals. Multi-process cases
run on the session's pool of gloo workers (tests/support/dist.py), one case per item.
"""

import json
import os
import struct

import dist as D
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import ucp_dcp
from ucp_dcp import UCPLoadPlanner
from ucp_dcp.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingAtomsError,
    TruncatedFileError,
    UCPError,
    ucp_errors,
)
from ucp_dcp.sources.hf import HFMapping, HFRule, HFStorageReader
from ucp_dcp.sources.hf.files import HFTensor, create_files, plan_files, write_box
from ucp_dcp.sources.hf.mapping import atom_rows, hf_rows
from ucp_dcp.sources.hf.publish import export_hf
from ucp_dcp.sources.hf.safetensors import encode_header, read_header
from ucp_dev.toy.hf_presets import TOY_LLAMA, TOY_MIXTRAL, toy_llama, toy_mixtral

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::ucp_dcp.errors.UnverifiedCheckpointWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CFG = TOY_LLAMA
KINDS = {
    "llama": (TOY_LLAMA, toy_llama, "LlamaForCausalLM", "LlamaConfig"),
    "mixtral": (TOY_MIXTRAL, toy_mixtral, "MixtralForCausalLM", "MixtralConfig"),
}
TOKENS = torch.randint(0, CFG.vocab, (3, CFG.seq_len), generator=torch.Generator().manual_seed(5))


def _hf_model(seed: int = 0, kind: str = "llama"):
    cfg, preset, model_cls, config_cls = KINDS[kind]
    torch.manual_seed(seed)
    conf = {k: v for k, v in preset(cfg).config.items() if k not in ("architectures", "model_type")}
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**conf)).eval()


def _load(sd, reader) -> None:
    """One-process dcp.load whose failure is the UCPError itself (not DCP's wrapper)."""
    with ucp_errors():
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers-saved random toy Llama (fp32, sharded into several files) and its logits."""
    d = tmp_path_factory.mktemp("hf") / "llama"
    m = _hf_model()
    m.save_pretrained(d, max_shard_size="100KB")
    return str(d), _logits(m)


@pytest.fixture(scope="module")
def hf_mixtral_dir(tmp_path_factory):
    """A transformers-saved random toy Mixtral (every layer MoE; experts one tensor each)."""
    d = tmp_path_factory.mktemp("hf") / "mixtral"
    m = _hf_model(seed=2, kind="mixtral")
    m.save_pretrained(d)
    return str(d), _logits(m)


@pytest.fixture(scope="module")
def hf_bf16_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "llama-bf16"
    m = _hf_model(seed=1).to(torch.bfloat16)
    m.save_pretrained(d)
    return str(d), _logits(m.float())


# -- the format --------------------------------------------------------------------------------------


def _write_st(path, tensors: dict[str, torch.Tensor]) -> None:
    head, offs = encode_header([(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    with open(path, "wb") as f:
        f.write(head)
        for v in tensors.values():
            f.write(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def test_our_files_are_safetensors(tmp_path):
    from safetensors.torch import load_file

    ts = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 2).bfloat16()}
    _write_st(tmp_path / "x.safetensors", ts)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in ts.items())
    parsed = read_header(tmp_path / "x.safetensors")
    assert {k: (i.dtype, i.shape) for k, i in parsed.tensors.items()} == {
        k: (v.dtype, tuple(v.shape)) for k, v in ts.items()
    }


def _raw_file(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "header,data,err,words",
    [
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, bytes(16), CorruptCheckpointError, "needs 16"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            CorruptCheckpointError,
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(10), TruncatedFileError, "truncated"),
        (
            {"a": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}},
            bytes(4),
            CorruptCheckpointError,
            "unknown dtype",
        ),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), CorruptCheckpointError, "bad shape"),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}},
            bytes(4),
            CorruptCheckpointError,
            "data_offsets",
        ),
    ],
    ids=["size", "overlap", "truncated", "dtype", "shape", "offsets"],
)
def test_bad_headers_are_refused(tmp_path, header, data, err, words):
    _raw_file(tmp_path / "x.safetensors", header, data)
    with pytest.raises(err, match=words):
        read_header(tmp_path / "x.safetensors")


def test_header_length_is_bounded(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="header of"):
        read_header(tmp_path / "x.safetensors")


@pytest.mark.parametrize("name", ["../evil.safetensors", "/etc/passwd", "sub/x.safetensors", "x.bin"])
def test_index_cannot_point_outside_the_folder(tmp_path, name):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": name}}))
    with pytest.raises(CorruptCheckpointError, match="not a .safetensors file of the folder"):
        _load({"a": torch.zeros(1)}, HFStorageReader(tmp_path, HFMapping((HFRule("a", "a"),))))


def test_no_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="neither model.safetensors"):
        _load({"a": torch.zeros(1)}, HFStorageReader(tmp_path, HFMapping((HFRule("a", "a"),))))


# -- the row math ------------------------------------------------------------------------------------


def _titan_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's llama3 ``to_hf`` permutation, written out independently (the oracle)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 6), half=st.integers(1, 5), cols=st.integers(1, 3))
def test_rotary_rows_match_the_reference_permutation(heads, half, cols):
    rows = heads * half * 2
    w = torch.arange(rows * cols).reshape(rows, cols)
    hf = _titan_to_hf(w, heads)
    idx = hf_rows(np.arange(rows), rows, heads)
    assert torch.equal(hf[torch.from_numpy(idx)], w)  # atom row r lives at HF row hf_rows(r)
    assert (atom_rows(idx, rows, heads) == np.arange(rows)).all()


def test_odd_head_size_is_refused():
    with pytest.raises(UCPError, match="rotary heads of an even size"):
        hf_rows(np.arange(3), 15, 3, "q")


@settings(max_examples=40, deadline=None)
@given(
    heads=st.integers(1, 4),
    half=st.integers(1, 4),
    cols=st.integers(1, 5),
    cuts=st.data(),
    rotary=st.booleans(),
    bf16=st.booleans(),
)
def test_boxes_written_anywhere_make_the_whole_tensor(tmp_path_factory, heads, half, cols, cuts, rotary, bf16):
    rows = heads * half * 2
    w = torch.randn(rows, cols)
    r = sorted(set(cuts.draw(st.lists(st.integers(1, rows - 1), max_size=4)))) if rows > 1 else []
    c = sorted(set(cuts.draw(st.lists(st.integers(1, cols - 1), max_size=2)))) if cols > 1 else []
    rb, cb = list(zip([0, *r], [*r, rows])), list(zip([0, *c], [*c, cols]))
    dtype = torch.bfloat16 if bf16 else torch.float32
    t = HFTensor("w", dtype, (rows, cols), heads if rotary else None)
    placed, files = plan_files([t, HFTensor("z", torch.float32, (3,))], 1 << 20)
    folder = tmp_path_factory.mktemp("boxes")
    create_files(str(folder), files)
    fd = os.open(folder / files[0].name, os.O_WRONLY)
    try:
        for r0, r1 in rb:
            for c0, c1 in cb:
                write_box(fd, placed[0], (r0, c0), w[r0:r1, c0:c1])
    finally:
        os.close(fd)
    from safetensors.torch import load_file

    got = load_file(str(folder / files[0].name))["w"]
    want = (_titan_to_hf(w, heads) if rotary else w).to(dtype)
    assert torch.equal(got, want)


# -- refusals at load ----------------------------------------------------------------------------------


def test_an_hf_tensor_no_rule_maps_is_named(hf_dir, tmp_path):
    m = toy_llama(CFG)
    m = HFMapping(tuple(r for r in m.rules if "down_proj" not in r.hf), prefix=m.prefix, ignore=m.ignore)
    with pytest.raises(UCPError, match=r"match no rule.*down_proj"):
        _load({"model.norm.weight": torch.zeros(CFG.dim)}, HFStorageReader(hf_dir[0], m))


def test_a_target_atom_the_hf_folder_lacks_is_named(hf_dir):
    sd = {"model.norm.weight": torch.zeros(CFG.dim), "model.layers.0.res_gain": torch.zeros(2)}
    with pytest.raises(MissingAtomsError, match="layers.0.res_gain"):
        _load(sd, HFStorageReader(hf_dir[0], toy_llama(CFG)))


def test_plain_tensors_load_in_one_process_with_dtype_conversion(hf_bf16_dir):
    from safetensors.torch import load_file

    hf = load_file(os.path.join(hf_bf16_dir[0], "model.safetensors"))
    sd = {
        "model.layers.1.attn.wk.weight": torch.zeros(CFG.n_kv_heads * CFG.head_dim, CFG.dim),
        "model.norm.weight": torch.zeros(CFG.dim, dtype=torch.float64),
    }
    _load(sd, HFStorageReader(hf_bf16_dir[0], toy_llama(CFG)))
    k = hf["model.layers.1.self_attn.k_proj.weight"].float()
    assert torch.equal(_titan_to_hf(sd["model.layers.1.attn.wk.weight"], CFG.n_kv_heads), k)
    assert torch.equal(sd["model.norm.weight"], hf["model.norm.weight"].double())


# -- multi-process: import, train, export ------------------------------------------------------------------


def _import_worker(rank, world, topo_text, hf_path, tokens, export_to, steps, kind="llama"):
    import warnings

    from ucp_dev.toy import Topology, build_job, build_trainer, live_logits, train_step, ucp_options

    warnings.simplefilter("ignore")
    cfg, preset = KINDS[kind][:2]
    job = build_job(Topology.parse(topo_text))
    tr = build_trainer(cfg, job, seed=123)  # other weights than the HF model's: the load must replace all
    opts = ucp_options(cfg, job.topo, job.coord, model_only=True)
    reader = HFStorageReader(hf_path, preset(cfg))
    sd = {"model": tr.state_dict()["model"]}
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(**opts))
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for c in tr.chunks for p in c.parameters())
    out = {"logits": live_logits(tr, tokens), "read": reader.stats.bytes_read, "local": local}
    if export_to:
        for _ in range(steps):
            train_step(tr)
        ckpt = export_to + "-ckpt"
        ucp_dcp.save({"model": tr.state_dict()["model"]}, ckpt, **opts)
        stats = export_hf(ckpt, export_to, preset(cfg), max_shard_bytes=60_000)
        out.update(trained=live_logits(tr, tokens), written=stats.bytes_written)
    return out


IMPORTS = {"dp2-tp2": "dp=2,tp=2", "dp4": "dp=4", "pp2": "pp=2", "tp2-pp2": "pp=2,tp=2"}
QUICK_IMPORTS = {"dp2-tp2", "tp2-pp2"}
"""``make test``'s layouts (FSDP x TP, and TP inside pipeline stages); the others run in ``make test-full``."""


def _quick(names, quick):
    return [pytest.param(n, marks=() if n in quick else pytest.mark.full) for n in names]


@pytest.mark.slow
@pytest.mark.parametrize("name", _quick(IMPORTS, QUICK_IMPORTS))
def test_hf_llama_loads_at_any_layout_with_transformers_logits(hf_dir, name):
    from ucp_dev.toy import Topology

    topo = Topology.parse(IMPORTS[name])
    res = D.run(_import_worker, topo.world, IMPORTS[name], hf_dir[0], TOKENS, None, 0)
    logits = [r["logits"] for r in res if r["logits"] is not None]
    assert logits
    for lg in logits:
        torch.testing.assert_close(lg, hf_dir[1], rtol=0, atol=2e-5)
    total = sum(os.path.getsize(os.path.join(hf_dir[0], f)) for f in os.listdir(hf_dir[0]) if f.endswith("safetensors"))
    for r in res:  # only the byte ranges of its own shards (never more than its own memory holds)
        assert 0 < r["read"] <= r["local"], r
        if topo.world >= 4 and topo.tp == 1:
            assert r["read"] < total / 2, r


MOE = {"dp2-ep2": "dp=2,ep=2", "ep2-tp2": "ep=2,tp=2", "pp2-ep2": "pp=2,ep=2"}


@pytest.mark.slow
@pytest.mark.parametrize("name", _quick(MOE, {"ep2-tp2", "pp2-ep2"}))
def test_hf_mixtral_experts_load_at_any_expert_layout(hf_mixtral_dir, name):
    """Per-expert HF tensors become slices of stacked [E, F, D] atoms (ep x tp DTensors) and the
    expert lists' local numbers: equal logits, each rank reading at most its own bytes."""
    from ucp_dev.toy import Topology

    topo = Topology.parse(MOE[name])
    res = D.run(_import_worker, topo.world, MOE[name], hf_mixtral_dir[0], TOKENS, None, 0, "mixtral")
    logits = [r["logits"] for r in res if r["logits"] is not None]
    assert logits
    for lg in logits:
        torch.testing.assert_close(lg, hf_mixtral_dir[1], rtol=0, atol=2e-5)
    for r in res:
        assert 0 < r["read"] <= r["local"], r


@pytest.mark.slow
def test_mixtral_export_after_training_loads_in_transformers(hf_mixtral_dir, tmp_path):
    out = str(tmp_path / "export")
    res = D.run(_import_worker, 4, "ep=2,tp=2", hf_mixtral_dir[0], TOKENS, out, 1, "mixtral")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(back), res[0]["trained"], rtol=0, atol=2e-5)
    assert sum(r["written"] for r in res) == sum(p.numel() * 4 for p in back.parameters())


@pytest.mark.slow
def test_bf16_hf_weights_convert_on_the_fly(hf_bf16_dir):
    res = D.run(_import_worker, 4, "dp=2,tp=2", hf_bf16_dir[0], TOKENS, None, 0)
    torch.testing.assert_close(res[0]["logits"], hf_bf16_dir[1], rtol=0, atol=2e-5)
    assert res[0]["read"] <= res[0]["local"] // 2  # bf16 on disk: half the bytes of the fp32 target


@pytest.mark.slow
@pytest.mark.parametrize("topo", _quick(["dp=2,tp=2", "pp=2"], {"dp=2,tp=2"}))
def test_export_after_training_loads_in_transformers(hf_dir, tmp_path, topo):
    from ucp_dev.toy import Topology

    out = str(tmp_path / "export")
    res = D.run(_import_worker, Topology.parse(topo).world, topo, hf_dir[0], TOKENS, out, 2)
    trained = next(r["trained"] for r in res if r["trained"] is not None)
    assert not torch.allclose(trained, hf_dir[1], atol=1e-3)  # training moved the weights
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and "config.json" in files and len(files) > 3
    assert not any(f.endswith(".tmp") for f in os.listdir(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(back), trained, rtol=0, atol=2e-5)
    # every byte written once, by one rank (parameters() lists the tied embedding once)
    assert sum(r["written"] for r in res) == sum(p.numel() * 4 for p in back.parameters())


def test_export_refuses_a_checkpoint_without_mapped_atoms(tmp_path):
    ucp_dcp.save({"other": torch.zeros(3)}, str(tmp_path / "c"))
    with pytest.raises(UCPError, match="no atom of the checkpoint maps"):
        export_hf(str(tmp_path / "c"), str(tmp_path / "o"), toy_llama(CFG))
    assert not os.path.exists(tmp_path / "o")


def test_zero_atoms_load_as_zero_and_refuse_a_nonzero_export(tmp_path):
    """``HFMapping.zero``: state HF has no tensor for, meaning zero there. ``load_hf`` zeroes it without
    reading (whatever the target held); an export writes nothing for it at zero and refuses it non-zero,
    before any file is written."""
    from safetensors.torch import load_file, save_file

    from ucp_dcp.sources.hf import load_hf

    m = HFMapping((HFRule("w", "net.w"),), zero=(r"net\.bias_E",))
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "model.safetensors")
    sd = {"net.w": torch.zeros(2, 3), "net.bias_E": torch.ones(4)}
    load_hf(sd, tmp_path, m, quiet=True)
    assert torch.equal(sd["net.w"], torch.arange(6.0).reshape(2, 3)) and not sd["net.bias_E"].any()
    ucp_dcp.save(sd, tmp_path / "zero")
    export_hf(tmp_path / "zero", tmp_path / "ok", m)
    assert set(load_file(tmp_path / "ok" / "model.safetensors")) == {"w"}
    sd["net.bias_E"][2] = 1e-6
    ucp_dcp.save(sd, tmp_path / "nonzero")
    with pytest.raises(UCPError, match="not zero") as e:
        export_hf(tmp_path / "nonzero", tmp_path / "out", m)
    assert e.value.atom == "net.bias_E" and not (tmp_path / "out").exists()


def test_cli_exports_with_a_mapping_named_by_module(tmp_path, capsys):
    """``export --to hf --mapping ucp_dev.toy.hf_presets:toy_llama_mapping`` of a one-process checkpoint of the
    toy's logical parameters: transformers loads it and its q/k rows are in HF's rotate-half order."""
    from ucp_dcp.__main__ import main
    from ucp_dev.toy.model import logical_params

    params = logical_params(CFG, seed=4)
    ucp_dcp.save({"model": params}, str(tmp_path / "ckpt"))
    assert (
        main(
            [
                "export",
                "--to",
                "hf",
                str(tmp_path / "ckpt"),
                str(tmp_path / "out"),
                "--mapping",
                "ucp_dev.toy.hf_presets:toy_llama_mapping",
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    ), capsys.readouterr().err
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    q = back.model.layers[2].self_attn.q_proj.weight
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, _titan_to_hf(params["layers.2.attn.wq.weight"], CFG.n_heads).bfloat16())
    assert torch.equal(back.model.embed_tokens.weight, params["tok_embeddings.weight"].bfloat16())
    assert main(["export", "--to", "hf", str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--mapping", "os:getcwd"]) == 2
    assert "not an HFMapping" in capsys.readouterr().err
