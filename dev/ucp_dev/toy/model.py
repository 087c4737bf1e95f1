"""A small decoder-only transformer exercising every layout ucp_dcp's patterns describe.

* fused QKV with GQA in torchtitan's group-major layout (rows grouped by KV head: TP-invariant),
* fused SwiGLU gate/up ``w13`` in Megatron's per-TP-rank block layout ``[w1_r; w3_r]``,
* vocabulary padded to a multiple of 7 x TP, with logits at or beyond the logical vocab masked,
* embedding and output head tied (one logical tensor; two copies under pipeline parallelism),
* MoE layers: one with stacked experts ``[E, F, D]`` (DTensors over ep x tp), one with an expert
  list (local indices on each EP rank); dropless top-2 routing and a router z-loss normalised by
  the global token count (a sum over tokens, so microbatching and data splits do not change it),
* learned per-layer residual gains with two entries (empty FSDP shards at dp x ep >= 3),
* optionally (``rope_theta``) rotary position embeddings in Meta's interleaved-pair order (as
  torchtitan's llama): with ``res_gain=False`` and no MoE layers the model is a Llama, so a Hugging
  Face Llama checkpoint loads into it (:mod:`ucp_dcp.sources.hf`).

Parameters are generated in their *logical* form (:func:`logical_params`) from a seed and turned
into the live layout of a topology, so every topology starts from the same model. Nothing here
imports the rest of ucp_dcp (the oracle must not depend on the code under test), and only public
torch APIs are used.

Kept in one module (over 400 lines): the model's layers, their fused/padded/tied/expert layouts and
:func:`logical_params` (the oracle's view of the same weights) must be read side by side; split, each layout
would live apart from the inverse that checks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 61
    vocab_multiple: int = 7
    dim: int = 40
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 52
    stacked_moe_layers: tuple[int, ...] = (1,)
    list_moe_layers: tuple[int, ...] = (3,)
    n_experts: int = 4
    top_k: int = 2
    expert_dim: int = 24
    z_loss: float = 1e-3
    seq_len: int = 12
    rope_theta: float | None = None
    """Rotary embeddings (interleaved pairs, Meta/torchtitan order) with this base; None: none."""
    res_gain: bool = True
    """Learned residual gains per layer (no Hugging Face counterpart)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    def padded_vocab(self, tp: int) -> int:
        m = self.vocab_multiple * tp
        return -(-self.vocab // m) * m

    def ffn_kind(self, layer: int) -> str:
        if layer in self.stacked_moe_layers:
            return "stacked"
        if layer in self.list_moe_layers:
            return "list"
        return "dense"


def logical_params(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every logical parameter (unfused, unpadded, global expert indices), from ``seed``."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(fan_in)

    d, hd, e = cfg.dim, cfg.head_dim, cfg.expert_dim
    p = {"tok_embeddings.weight": w(cfg.vocab, d, fan_in=d), "norm.weight": torch.ones(d)}
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        p[pre + "attn_norm.weight"] = torch.ones(d)
        p[pre + "ffn_norm.weight"] = torch.ones(d)
        if cfg.res_gain:
            p[pre + "res_gain"] = torch.ones(2)
        p[pre + "attn.wq.weight"] = w(cfg.n_heads * hd, d, fan_in=d)
        p[pre + "attn.wk.weight"] = w(cfg.n_kv_heads * hd, d, fan_in=d)
        p[pre + "attn.wv.weight"] = w(cfg.n_kv_heads * hd, d, fan_in=d)
        p[pre + "attn.wo.weight"] = w(d, cfg.n_heads * hd, fan_in=cfg.n_heads * hd)
        kind = cfg.ffn_kind(i)
        if kind == "dense":
            p[pre + "ffn.w1.weight"] = w(cfg.ffn_dim, d, fan_in=d)
            p[pre + "ffn.w3.weight"] = w(cfg.ffn_dim, d, fan_in=d)
            p[pre + "ffn.w2.weight"] = w(d, cfg.ffn_dim, fan_in=cfg.ffn_dim)
            continue
        p[pre + "moe.router.weight"] = w(cfg.n_experts, d, fan_in=d)
        if kind == "stacked":
            p[pre + "moe.experts.w1"] = w(cfg.n_experts, e, d, fan_in=d)
            p[pre + "moe.experts.w3"] = w(cfg.n_experts, e, d, fan_in=d)
            p[pre + "moe.experts.w2"] = w(cfg.n_experts, d, e, fan_in=e)
        else:
            for x in range(cfg.n_experts):
                p[pre + f"moe.experts.{x}.w1.weight"] = w(e, d, fan_in=d)
                p[pre + f"moe.experts.{x}.w3.weight"] = w(e, d, fan_in=d)
                p[pre + f"moe.experts.{x}.w2.weight"] = w(d, e, fan_in=e)
    return p


def interleave(parts: list[torch.Tensor], blocks: int, dim: int = 0) -> torch.Tensor:
    """Parts side by side in ``blocks`` interleaved blocks: ``[A_0; B_0; A_1; B_1; ...]``."""
    chunks = [t.chunk(blocks, dim) for t in parts]
    return torch.cat([c[b] for b in range(blocks) for c in chunks], dim)


def deinterleave(t: torch.Tensor, sizes: list[int], blocks: int, dim: int = 0) -> list[torch.Tensor]:
    """Inverse of :func:`interleave`."""
    widths = [s // blocks for s in sizes]
    pieces = t.split(widths * blocks, dim)
    return [torch.cat(pieces[i :: len(sizes)], dim) for i in range(len(sizes))]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# -- autograd collectives (Megatron's f/g pairs) ------------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    """Forward identity; backward all-reduce (input replicated over tp, consumed by local shards)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward all-reduce of partial sums; backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


class _GatherFromGroup(torch.autograd.Function):
    """Forward all-gather along dim 0; backward reduce-scatter (sum) of the gradient (what
    ``funcol.all_gather_single_autograd`` does, through the same backend ops, with public APIs)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group), None


class _ReduceScatterToGroup(torch.autograd.Function):
    """Forward reduce-scatter (sum) along dim 0; backward all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group), None


class _AttachAux(torch.autograd.Function):
    """Return ``x`` unchanged; in backward, feed ``scale`` into the auxiliary loss so it trains the
    router wherever the layer sits in a pipeline (the loss itself is not reported)."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return x

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g, torch.full_like(aux, ctx.scale), None


@dataclass
class Groups:
    """Process groups the model's layers need (None where the degree is 1)."""

    tp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    ep_rank: int
    ep_size: int
    loss_scale: float
    """dp x ep: FSDP averages dense gradients over that many ranks."""
    global_tokens: int


class RMSNorm(nn.RMSNorm):
    def __init__(self, dim: int) -> None:
        super().__init__(dim, eps=1e-5)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.cfg
        # group-major: per local KV head, n_rep query heads then its key and value head
        qkv = _local(self.wqkv(x)).view(b, s, -1, c.n_rep + 2, c.head_dim)
        q = qkv[:, :, :, : c.n_rep].reshape(b, s, -1, c.head_dim).transpose(1, 2)
        k = qkv[:, :, :, c.n_rep].transpose(1, 2)
        if c.rope_theta is not None:
            q, k = rotary(q, c.rope_theta), rotary(k, c.rope_theta)
        k = k.repeat_interleave(c.n_rep, dim=1)
        v = qkv[:, :, :, c.n_rep + 1].transpose(1, 2).repeat_interleave(c.n_rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[b, heads, s, hd]`` over positions ``0..s-1``, rotating the
    interleaved pairs ``(x[2i], x[2i+1])`` by ``pos * theta^(-2i/hd)`` (Meta's order)."""
    s, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    ang = torch.arange(s, dtype=torch.int64).float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = x.float().unflatten(-1, (hd // 2, 2)).unbind(-1)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2).type_as(x)


class DenseFFN(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)  # per TP rank: [w1_r; w3_r]
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        a, b = _local(self.w13(x)).chunk(2, -1)
        return self.w2(F.silu(a) * b)


class StackedExperts(nn.Module):
    """Experts as ``[E, F, D]`` tensors; DTensors sharded over ep (dim 0) and tp (hidden dim)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, f = cfg.n_experts, cfg.dim, cfg.expert_dim
        self.w1 = nn.Parameter(torch.empty(e, f, d))
        self.w3 = nn.Parameter(torch.empty(e, f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))

    def forward(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        """Outputs of every local expert on every token, full (summed over tp): ``[E_local, N, D]``."""
        w1, w3, w2 = _local(self.w1), _local(self.w3), _local(self.w2)
        ys = [(F.silu(x @ w1[j].T) * (x @ w3[j].T)) @ w2[j].T for j in range(w1.shape[0])]
        y = torch.stack(ys)
        return _ReduceFromGroup.apply(y, groups.tp) if groups.tp is not None else y


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.expert_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.expert_dim, bias=False)
        self.w2 = nn.Linear(cfg.expert_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _local(self.w2(F.silu(_local(self.w1(x))) * _local(self.w3(x))))


class ListExperts(nn.Module):
    """This EP rank's experts, numbered locally 0..E/ep-1 (global = ep_rank * E/ep + local).

    A plain Module with ``nn.ModuleList``'s child names (``0``, ``1``, ...) and iteration, not a
    ModuleList: torch 2.11's ``fully_shard`` refuses every ModuleList, also one with a ``forward``
    (2.12+ only those without one); the state-dict names are the same either way."""

    def __init__(self, cfg: ModelConfig, n_local: int) -> None:
        super().__init__()
        for i in range(n_local):
            self.add_module(str(i), Expert(cfg))

    def __iter__(self):
        return self.children()

    def __len__(self) -> int:
        return sum(1 for _ in self.children())

    def __getitem__(self, i: int) -> nn.Module:
        return self.get_submodule(str(i % len(self)))

    def forward(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        return torch.stack([e(x) for e in self])  # TP is inside each Expert (Colwise/Rowwise)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, n_local: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = StackedExperts(cfg) if kind == "stacked" else ListExperts(cfg, n_local)

    def forward(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        b, s, d = x.shape
        xf = x.reshape(-1, d)
        logits = xf @ _local(self.router.weight).T
        probs = logits.softmax(-1)
        top, idx = probs.topk(self.cfg.top_k, -1)
        gates = torch.zeros_like(probs).scatter(1, idx, top / top.sum(-1, keepdim=True))
        z = logits.logsumexp(-1).square().sum() * (self.cfg.z_loss / groups.global_tokens)
        if groups.ep is not None:  # dropless: every EP rank runs its experts on all tokens of its EP group
            xf = _GatherFromGroup.apply(xf, groups.ep)
            gates = _GatherFromGroup.apply(gates, groups.ep)
        if groups.tp is not None and isinstance(self.experts, StackedExperts):
            xf = _CopyToGroup.apply(xf, groups.tp)
        y = self.experts(xf, groups)  # [E_local, N, D]
        n_local = y.shape[0]
        g = gates[:, groups.ep_rank * n_local : (groups.ep_rank + 1) * n_local].T.unsqueeze(-1)
        out = (g * y).sum(0)
        if groups.ep is not None:
            out = _ReduceScatterToGroup.apply(out, groups.ep)
        return _AttachAux.apply(out.view(b, s, d), z, groups.loss_scale)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ep_size: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        kind = cfg.ffn_kind(layer)
        if kind == "dense":
            self.ffn = DenseFFN(cfg)
        else:
            self.moe = MoE(cfg, kind, cfg.n_experts // ep_size)
        if cfg.res_gain:
            self.res_gain = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        g = self.res_gain if hasattr(self, "res_gain") else (1.0, 1.0)
        x = x + g[0] * self.attn(self.attn_norm(x))
        ffn = self.ffn if hasattr(self, "ffn") else self.moe
        return x + g[1] * ffn(self.ffn_norm(x), groups)


class StageModel(nn.Module):
    """One pipeline chunk; its layers are numbered locally (``layers.0`` is its first layer)."""

    def __init__(self, cfg: ModelConfig, layer_ids: list[int], first: bool, last: bool, tp: int, ep_size: int) -> None:
        super().__init__()
        self.cfg, self.layer_ids, self.first, self.last = cfg, layer_ids, first, last
        self.vocab_p = cfg.padded_vocab(tp)
        self.groups: Groups | None = None
        if first:
            self.tok_embeddings = nn.Embedding(self.vocab_p, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i, ep_size) for i in layer_ids)
        if last:
            self.norm = RMSNorm(cfg.dim)
            self.output = nn.Linear(cfg.dim, self.vocab_p, bias=False)  # tied to tok_embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.first else x
        for layer in self.layers:
            h = layer(h, self.groups)
        if not self.last:
            return h
        logits = _local(self.output(self.norm(h)))
        # padded vocabulary rows are never a target: mask them so the numerics ignore the padding
        return logits.masked_fill(torch.arange(logits.shape[-1]) >= self.cfg.vocab, float("-inf"))

    def load_logical(self, p: dict[str, torch.Tensor], tp: int, ep_rank: int, ep_size: int) -> None:
        """Set this chunk's (unparallelized) parameters from logical ones, in the live layout."""
        c = self.cfg
        pad = self.vocab_p - c.vocab
        with torch.no_grad():
            emb = F.pad(p["tok_embeddings.weight"], (0, 0, 0, pad))
            if self.first:
                self.tok_embeddings.weight.copy_(emb)
            if self.last:
                self.norm.weight.copy_(p["norm.weight"])
                self.output.weight.copy_(emb)
            n_local = c.n_experts // ep_size
            for local, gid in enumerate(self.layer_ids):
                blk, pre = self.layers[local], f"layers.{gid}."
                for name in ("attn_norm.weight", "ffn_norm.weight", "res_gain", "attn.wo.weight"):
                    if pre + name in p:
                        blk.get_parameter(name).copy_(p[pre + name])
                qkv = [p[pre + f"attn.w{x}.weight"] for x in "qkv"]
                blk.attn.wqkv.weight.copy_(interleave(qkv, c.n_kv_heads))
                kind = c.ffn_kind(gid)
                if kind == "dense":
                    blk.ffn.w13.weight.copy_(interleave([p[pre + "ffn.w1.weight"], p[pre + "ffn.w3.weight"]], tp))
                    blk.ffn.w2.weight.copy_(p[pre + "ffn.w2.weight"])
                    continue
                blk.moe.router.weight.copy_(p[pre + "moe.router.weight"])
                if kind == "stacked":
                    for x in ("w1", "w2", "w3"):
                        blk.moe.experts.get_parameter(x).copy_(p[pre + f"moe.experts.{x}"])
                else:
                    for j in range(n_local):
                        for x in ("w1", "w2", "w3"):
                            blk.moe.experts[j].get_submodule(x).weight.copy_(
                                p[pre + f"moe.experts.{ep_rank * n_local + j}.{x}.weight"]
                            )
