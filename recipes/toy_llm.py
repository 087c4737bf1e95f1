"""A small decoder-only transformer, its FSDP2/TP parallelization, data and training step.

Used by the elastic-resume recipe and the tests. The dims are chosen so FSDP shards are uneven at
dp=3 and dp=4 (vocab 61) and some shards are empty (the per-layer residual gains have 2 entries);
TP up to 4 divides the heads (8 query / 4 key-value heads) and the FFN width (52).
Nothing here imports ucp_dcp: the oracle and the training loop must not depend on the code under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

GLOBAL_BATCH = 24
"""Sequences per step; divisible by every data-parallel degree the recipe supports (1, 2, 3, 4, 6, 8)."""


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 61
    dim: int = 40
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 52
    seq_len: int = 12

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class Topology:
    """Parallel degrees; world size is their product."""

    dp: int = 1
    tp: int = 1

    @staticmethod
    def parse(text: str) -> "Topology":
        """``"dp=2,tp=2"`` -> ``Topology(dp=2, tp=2)``; missing keys default to 1."""
        kw: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, val = part.partition("=")
            if key not in ("dp", "tp") or not val.isdigit() or int(val) < 1:
                raise ValueError(f"bad topology item {part!r} in {text!r} (expected dp=N,tp=N)")
            kw[key] = int(val)
        return Topology(**kw)

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp}"


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # TP shards heads: each rank sees its local heads as plain tensors (CPU SDPA has no DTensor rule)
        q = _local(self.wq(x)).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = _local(self.wk(x)).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = _local(self.wv(x)).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.ffn = FeedForward(cfg)
        # learned residual gains (attention, ffn): two entries, so FSDP shards are empty at dp >= 3
        self.res_gain = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.res_gain
        x = x + g[0] * self.attn(self.attn_norm(x))
        return x + g[1] * self.ffn(self.ffn_norm(x))


class ToyLLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build_mesh(topo: Topology) -> DeviceMesh:
    return init_device_mesh("cpu", (topo.dp, topo.tp), mesh_dim_names=("dp", "tp"))


def build_model(cfg: ModelConfig, mesh: DeviceMesh, seed: int = 0) -> ToyLLM:
    """Same initial weights at every layout (seeded full init before sharding)."""
    torch.manual_seed(seed)
    model = ToyLLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    tp = mesh["tp"].size()
    if tp > 1:
        for block in model.layers:
            parallelize_module(block.attn, mesh["tp"], {
                "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel(),
            })
            parallelize_module(block.ffn, mesh["tp"], {
                "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(),
            })
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), foreach=False,
    )


def global_batch(cfg: ModelConfig, step: int, seed: int = 1234) -> torch.Tensor:
    """Token ids ``(GLOBAL_BATCH, seq_len + 1)`` for ``step``; a noisy walk so the loss can fall.
    Depends only on (seed, step), never on the layout."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, cfg.vocab, (GLOBAL_BATCH, 1), generator=g)
    steps = torch.randint(1, 4, (GLOBAL_BATCH, cfg.seq_len), generator=g)
    return torch.cat([start, start + steps.cumsum(1)], 1) % cfg.vocab


def train_step(model: nn.Module, opt: torch.optim.Optimizer, mesh: DeviceMesh, step: int) -> float:
    """One AdamW step on the global batch; returns the global mean token loss (same on all ranks).

    Each data-parallel rank takes its slice; the loss is token-sum / global tokens, scaled by dp
    because FSDP averages gradients over dp.
    """
    cfg: ModelConfig = model.cfg
    dp_mesh = mesh["dp"]
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    tokens = global_batch(cfg, step)
    per = GLOBAL_BATCH // dp
    local = tokens[dp_rank * per:(dp_rank + 1) * per]
    inp, tgt = local[:, :-1], local[:, 1:]
    global_tokens = GLOBAL_BATCH * cfg.seq_len
    logits = model(inp)
    loss_sum = F.cross_entropy(_local(logits).reshape(-1, cfg.vocab).float(), tgt.reshape(-1), reduction="sum")
    (loss_sum * dp / global_tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss_sum.detach().clone()
    dist.all_reduce(total, group=dp_mesh.get_group())
    return float(total) / global_tokens


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """Every parameter and optimizer entry as a full (unsharded) CPU value, keyed by a readable
    name. Collective: every rank must call it; the result is the same everywhere."""
    out: dict[str, object] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out[f"param/{n}"] = _full(p.detach())
    for gi, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if k != "params":
                out[f"group{gi}/{k}"] = v
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                out[f"state/{names[id(p)]}/{k}"] = _full(v) if isinstance(v, torch.Tensor) else v
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
