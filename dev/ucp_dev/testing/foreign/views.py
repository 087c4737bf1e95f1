"""The foreign libraries' own views of their checkpoints, as the toy LLM's logical state.

:mod:`.make_deepspeed` writes DeepSpeed's view (``ds_view_fp32.pt``: ``get_fp32_state_dict_from_zero_checkpoint``;
``ds_view_optim.pt``: the live engine's moments, step and groups), :mod:`.make_deepspeed_moe` the same for
its MoE run (``ds_view_moe.pt``, global expert names) and :mod:`.make_megatron` Megatron's
(``mcore_view.pt``: a tp=1 load through ``dist_checkpointing.load``; :mod:`.make_megatron_moe` the same
at tp=ep=1 for a MoE GPT, read as the toy Mixtral). :func:`compare` checks a loaded
toy trainer's logical state (``ucp_dev.toy.logical_state``, independent of ucp_dcp) against them,
bitwise. Used by ``tests/e2e/test_foreign.py``, ``tests/e2e/test_foreign_moe_deepspeed.py``,
``tests/e2e/test_foreign_moe_megatron.py`` and ``recipes/foreign_demo.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


def deepspeed_config() -> Any:
    from ucp_dev.toy.model import ModelConfig

    from .deepspeed_job import CFG_KW

    return ModelConfig(**CFG_KW)


def deepspeed_moe_config() -> Any:
    from ucp_dev.toy.model import ModelConfig

    from .deepspeed_job import MOE_CFG_KW

    return ModelConfig(**MOE_CFG_KW)


def megatron_config() -> Any:
    from ucp_dev.toy.hf_presets import TOY_LLAMA

    return TOY_LLAMA


def parts(cfg: Any, name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """A source parameter (fused wqkv / w13, padded embedding) as its logical parameters."""
    from ucp_dev.toy.model import deinterleave

    hd = cfg.head_dim
    if name.endswith("wqkv.weight"):
        ps = deinterleave(full, [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd], cfg.n_kv_heads)
        return {name.replace("wqkv", f"w{x}"): p for x, p in zip("qkv", ps)}
    if name.endswith("w13.weight"):
        return {name.replace("w13", "w1"): full[: cfg.ffn_dim], name.replace("w13", "w3"): full[cfg.ffn_dim :]}
    if name in ("tok_embeddings.weight", "output.weight"):
        return {"tok_embeddings.weight": full[: cfg.vocab]}
    return {name: full}


def _source(logical: str) -> str:
    for a, b in (
        (".wq.", ".wqkv."),
        (".wk.", ".wqkv."),
        (".wv.", ".wqkv."),
        (".ffn.w1.", ".ffn.w13."),
        (".ffn.w3.", ".ffn.w13."),
    ):
        logical = logical.replace(a, b)
    return logical


def megatron_name(name: str) -> str:
    """A Megatron parameter name (``decoder.layers.0.self_attention.linear_qkv.weight``) as the toy's."""
    n = name.replace("decoder.", "")
    for a, b in (
        ("self_attention.linear_qkv", "attn.wqkv"),
        ("self_attention.linear_proj", "attn.wo"),
        ("mlp.linear_fc1", "ffn.w13"),
        ("mlp.linear_fc2", "ffn.w2"),
        ("input_layernorm", "attn_norm"),
        ("pre_mlp_layernorm", "ffn_norm"),
        ("final_layernorm", "norm"),
        ("embedding.word_embeddings", "tok_embeddings"),
    ):
        n = n.replace(a, b)
    return n


def deepspeed_view(path: str) -> tuple[Any, dict, dict, Callable[[str], dict]]:
    """``(cfg, params, optimizer state, group of a logical param)`` as DeepSpeed sees its checkpoint."""
    optim = torch.load(os.path.join(path, "ds_view_optim.pt"), weights_only=False)
    by_name = {n: g for g in optim.pop("__groups__") for n in g["names"]}
    params = torch.load(os.path.join(path, "ds_view_fp32.pt"), weights_only=False)
    params.pop("output.weight", None)  # the tied alias (zero_to_fp32 copies it)
    return deepspeed_config(), params, optim, lambda logical: by_name[_source(logical)]


def toy_moe_name(name: str) -> str:
    """A DeepSpeed MoE param name (global expert numbers) as the toy's list-MoE name."""
    return name.replace(".deepspeed_moe.gate.wg.", ".router.").replace(
        ".deepspeed_moe.experts.deepspeed_experts.", ".experts."
    )


def deepspeed_moe_view(path: str) -> tuple[Any, dict, dict, Callable[[str], dict]]:
    """The same for ``make_deepspeed_moe.py``'s checkpoint: the live engine's view (``ds_view_moe.pt``)."""
    view = torch.load(os.path.join(path, "ds_view_moe.pt"), weights_only=False)
    by_name = {toy_moe_name(n): g for g in view.pop("__groups__") for n in g["names"]}
    params = {toy_moe_name(k): v["fp32"] for k, v in view.items()}
    optim = {toy_moe_name(k): v for k, v in view.items()}
    return deepspeed_moe_config(), params, optim, lambda logical: by_name[_source(logical)]


def megatron_view(path: str) -> tuple[Any, dict, dict, Callable[[str], dict]]:
    """The same for a Megatron ``torch_dist`` checkpoint (groups: Megatron's default split)."""
    from ucp_dcp.sources.foreign.inert import load_inert

    view = torch.load(os.path.join(path, "mcore_view.pt"), weights_only=False)
    params = {megatron_name(k): v for k, v in view["params"].items()}
    optim = {megatron_name(k): v for k, v in view["optim"].items()}
    common = load_inert(os.path.join(path, "common.pt")).obj["optimizer"]
    pgs = common.get("optimizer", common)["param_groups"]
    decay = next(g for g in pgs if g["wd_mult"] == 1.0)
    no_decay = next(g for g in pgs if g["wd_mult"] == 0.0)
    return megatron_config(), params, optim, lambda logical: no_decay if "norm" in logical else decay


def _moe_logical(cfg: Any, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron MoE names (``decoder.layers.<i>.mlp.experts.local_experts.<e>.linear_fc1.weight``,
    global experts at ep=1) as the toy's logical ones: stacked ``[E, F, D]`` or per-expert by layer."""
    import re

    out, stacks = {}, {}
    for name, t in named.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc(\d)\.weight", name)
        if m is None:
            out[megatron_name(name).replace("mlp.router", "moe.router")] = t
            continue
        i, e, fc = int(m[1]), int(m[2]), m[3]
        ws = {"w1": t[: cfg.expert_dim], "w3": t[cfg.expert_dim :]} if fc == "1" else {"w2": t}
        for w, part in ws.items():
            if cfg.ffn_kind(i) == "stacked":
                stacks.setdefault(f"layers.{i}.moe.experts.{w}", {})[e] = part
            else:
                out[f"layers.{i}.moe.experts.{e}.{w}.weight"] = part
    out.update({k: torch.stack([v[e] for e in sorted(v)]) for k, v in stacks.items()})
    return out


def megatron_moe_view(path: str) -> tuple[Any, dict, dict, Callable[[str], dict]]:
    """:func:`megatron_view` of a ``make_megatron_moe.py`` run as the toy Mixtral's logical state
    (expert parameters' groups from Megatron's expert-parallel optimizer)."""
    from ucp_dcp.sources.foreign.inert import load_inert
    from ucp_dev.toy.hf_presets import TOY_MIXTRAL

    view = torch.load(os.path.join(path, "mcore_view.pt"), weights_only=False)
    params = _moe_logical(TOY_MIXTRAL, view["params"])
    optim: dict[str, dict] = {}
    for kind in ("exp_avg", "exp_avg_sq"):
        for k, v in _moe_logical(TOY_MIXTRAL, {n: st[kind] for n, st in view["optim"].items()}).items():
            optim.setdefault(k, {})[kind] = v
    steps = {float(st["step"]) for st in view["optim"].values()}
    assert len(steps) == 1, steps
    step = steps.pop()
    for st in optim.values():
        st["step"] = step
    common = load_inert(os.path.join(path, "common.pt")).obj["optimizer"]
    groups = {
        (g.get("is_expert_parallel", False), g["wd_mult"]): g
        for sub in common.values()
        for g in sub["optimizer"]["param_groups"]
    }

    def group(logical: str) -> dict:
        return groups[(".experts." in logical, 0.0 if "norm" in logical else 1.0)]

    return TOY_MIXTRAL, params, optim, group


def compare(view: tuple[Any, dict, dict, Callable[[str], dict]], state: dict) -> tuple[int, list[str]]:
    """Bitwise: every logical parameter, both Adam moments and the step, and the groups' lr, betas,
    eps and weight decay. Returns (tensors compared, mismatches)."""
    cfg, params, optim, groups = view
    bad, n = [], 0
    for name, full in params.items():
        for logical, want in parts(cfg, name, full).items():
            n += 1
            if not torch.equal(state[f"param/{logical}"], want):
                bad.append(f"param {logical}")
    for name, st in optim.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            for logical, want in parts(cfg, name, st[kind]).items():
                n += 1
                if not torch.equal(state[f"state/{logical}/{kind}"], want):
                    bad.append(f"{kind} {logical}")
        for logical in parts(cfg, name, st["exp_avg"]):
            if float(state[f"state/{logical}/step"]) != float(st["step"]):
                bad.append(f"step {logical}")
            hp = dict(eval(state[f"group/{logical}"], {"__builtins__": {}}))  # noqa: S307  (the oracle's own repr)
            want = groups(logical)
            bad += [
                f"group {logical} {k} {hp[k]} != {want[k]}"
                for k in ("lr", "betas", "eps", "weight_decay")
                if hp[k] != want[k]
            ]
    return n, bad


def load_into_toy(topo_text: str, kind: str, path: str, options: dict | None = None) -> dict | None:
    """On every rank of the current process group: the toy trainer at ``topo_text`` loads the
    foreign checkpoint (model and torch AdamW) with ucp_dcp; returns the logical state on rank 0."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ucp_dcp.errors import ucp_errors
    from ucp_dcp.planning.load_planner import UCPLoadPlanner
    from ucp_dcp.sources.foreign.deepspeed import DeepSpeedReader
    from ucp_dcp.sources.foreign.deepspeed_moe import TOY_NAMES
    from ucp_dcp.sources.foreign.megatron import MegatronReader
    from ucp_dcp.sources.foreign.megatron_rules import moe_rules
    from ucp_dev.toy import Topology, build_job, build_trainer, logical_state, ucp_options
    from ucp_dev.toy.hf_presets import TOY_MIXTRAL

    configs = {"deepspeed": deepspeed_config, "deepspeed_moe": deepspeed_moe_config, "megatron": megatron_config}
    cfg = configs.get(kind, lambda: TOY_MIXTRAL)()
    if kind == "megatron-moe":
        options = {"rules": moe_rules(cfg.stacked_moe_layers, cfg.list_moe_layers), **(options or {})}
    job = build_job(Topology.parse(topo_text))
    tr = build_trainer(cfg, job, seed=99)
    opts = ucp_options(cfg, job.topo, job.coord, model_only=True)
    options = dict(options or {})
    if kind == "deepspeed_moe":
        options.setdefault("names", TOY_NAMES)
    reader_cls = MegatronReader if kind.startswith("megatron") else DeepSpeedReader
    reader = reader_cls(path, patterns=opts["patterns"], **options)
    sd = tr.state_dict()
    sd.pop("train_state")
    with ucp_errors():
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(**opts))
    tr.load_state_dict({**sd, "train_state": {"step": 0, "tokens_seen": 0}})
    state = logical_state(tr)
    state["__bytes_read__"] = reader.stats.bytes_read
    return state if dist.get_rank() == 0 else None
