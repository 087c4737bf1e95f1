"""Topologies (pp x dpr x dp x ep x tp), meshes, parallelization, the training step and the oracle.

Mesh dims are ordered (pp, dpr, dp, ep, tp); ``dpr`` is the HSDP replicate degree. EP ranks are
data-parallel for dense parameters: dense weights are FSDP-sharded over the flattened (dp, ep) dims
(and replicated over dpr) and each (dpr, dp, ep) coordinate takes its own slice of the global batch;
experts are Shard(0) over ep, sharded on their hidden dim over tp, and FSDP-sharded over dp. Pipeline chunks number their layers locally. All collectives use the
job's own groups, so a test can run several jobs on sub-groups of one process world.

:func:`build_trainer` with ``device="meta"`` builds the same sharded structure without weights (no
pipeline schedule): its ``state_dict()`` is what a load at that layout hands to ``dcp.load``, for
planning a load without running it (e.g. on torch's fake process group).

Kept in one module (over 400 lines): the parallelization and the oracle (:func:`logical_state`) are
each other's inverse over the same mesh dims; they are read and changed together.
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from .model import Groups, ModelConfig, StageModel, deinterleave, logical_params

GLOBAL_BATCH = 24
"""Sequences per step; divisible by every data-parallel degree (dp x ep) the recipe uses."""
KEYS = ("pp", "dpr", "dp", "ep", "tp", "vpp")


@dataclass(frozen=True)
class Topology:
    """Parallel degrees; world size = pp * dpr * dp * ep * tp. ``dpr`` = HSDP replicas, ``vpp`` =
    model chunks per pipeline rank."""

    pp: int = 1
    dpr: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1
    vpp: int = 1

    @staticmethod
    def parse(text: str) -> Topology:
        """``"dp=2,tp=2,pp=2"`` -> ``Topology(...)``; missing keys default to 1."""
        kw: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, val = part.partition("=")
            if key not in KEYS or not val.isdigit() or int(val) < 1:
                raise ValueError(f"bad topology item {part!r} in {text!r} (keys: {', '.join(KEYS)})")
            kw[key] = int(val)
        return Topology(**kw)

    @property
    def world(self) -> int:
        return self.pp * self.dpr * self.dp * self.ep * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that take their own slice of the global batch."""
        return self.dpr * self.dp * self.ep

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp

    def __str__(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in KEYS if getattr(self, k) > 1]
        return ",".join(parts) or "dp=1"


@dataclass
class Job:
    """One training job's meshes and groups (every process of the world builds every job's groups)."""

    topo: Topology
    ranks: list[int]
    group: dist.ProcessGroup | None = None
    full: DeviceMesh | None = None
    dense: DeviceMesh | None = None
    coord: dict[str, int] = field(default_factory=dict)

    @property
    def member(self) -> bool:
        return self.full is not None and self.full.get_coordinate() is not None


def build_job(topo: Topology, ranks: list[int] | None = None) -> Job:
    """Meshes for ``topo`` on ``ranks`` (default: the whole world). Collective over the world."""
    ranks = list(range(topo.world)) if ranks is None else ranks
    t = topo
    grid = torch.tensor(ranks).reshape(t.pp, t.dpr, t.dp, t.ep, t.tp)
    job = Job(topo, ranks)
    job.group = dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
    job.full = DeviceMesh("cpu", grid, mesh_dim_names=("pp", "dpr", "dp", "ep", "tp"))
    job.dense = DeviceMesh(
        "cpu", grid.reshape(t.pp, t.dpr, t.dp * t.ep, t.tp), mesh_dim_names=("pp", "dpr", "dp_ep", "tp")
    )
    coord = job.full.get_coordinate()
    if coord is not None:
        job.coord = dict(zip(("pp", "dpr", "dp", "ep", "tp"), coord))
    return job


def layer_split(cfg: ModelConfig, n_stages: int) -> list[list[int]]:
    """Layers of each pipeline stage (uneven when n_stages does not divide n_layers)."""
    return [c.tolist() for c in torch.arange(cfg.n_layers).tensor_split(n_stages)]


def stage_ids(topo: Topology, pp_rank: int) -> list[int]:
    """Stage ids pipeline rank ``pp_rank`` runs (interleaved: pp rank r runs r, r + pp, ...)."""
    return [pp_rank + v * topo.pp for v in range(topo.vpp)]


def my_stages(job: Job) -> list[int]:
    """Stage ids this rank runs (:func:`stage_ids` of its pp coordinate)."""
    return stage_ids(job.topo, job.coord["pp"])


@dataclass
class Trainer:
    """The model chunks, optimizers and schedule of one rank."""

    job: Job
    cfg: ModelConfig
    chunks: list[StageModel]
    optims: list[torch.optim.Optimizer]
    stage_ids: list[int]
    schedule: object | None
    tokens_seen: int = 0
    step: int = 0

    def state_dict(self) -> dict:
        """``{"model": {"c<v>": ...}, "optim": {"c<v>": ...}, "train_state": {...}}``: chunk
        namespaces keep two chunks of one rank apart; their layer names are chunk-local."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = {}, {}
        for v, (m, o) in enumerate(zip(self.chunks, self.optims)):
            model[f"c{v}"], optim[f"c{v}"] = get_state_dict(m, o)
        return {"model": model, "optim": optim, "train_state": {"step": self.step, "tokens_seen": self.tokens_seen}}

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        for v, (m, o) in enumerate(zip(self.chunks, self.optims)):
            set_state_dict(m, o, model_state_dict=sd["model"][f"c{v}"], optim_state_dict=sd["optim"][f"c{v}"])
        self.step = sd["train_state"]["step"]
        self.tokens_seen = sd["train_state"]["tokens_seen"]


def build_trainer(cfg: ModelConfig, job: Job, seed: int = 0, device: str = "cpu") -> Trainer:
    """This rank's chunks of the model at ``job``'s layout, initialised from :func:`logical_params`
    of ``seed``, parallelized, with their optimizers and (pp > 1) pipeline schedule.

    ``device="meta"``: the chunks are built on the meta device (no weights, no ``seed``), nothing is
    loaded, TP/EP shards are laid out without communication (``src_data_rank=None``) and no schedule
    is built (``schedule=None``: such a trainer cannot train); FSDP, TP, expert DTensors and
    optimizers are as for ``"cpu"``, so ``state_dict()`` has the same keys, placements, meshes,
    shapes and dtypes as a cpu build at this layout."""
    if device not in ("cpu", "meta"):
        raise ValueError(f"device must be 'cpu' or 'meta', got {device!r}")
    meta = device == "meta"
    t, c = job.topo, job.coord
    if cfg.n_experts % t.ep or cfg.n_kv_heads % t.tp:
        raise SystemExit(f"{t}: experts ({cfg.n_experts}) and KV heads ({cfg.n_kv_heads}) must divide by ep and tp")
    logical = None if meta else logical_params(cfg, seed)
    split = layer_split(cfg, t.n_stages)  # on the CPU: torch.arange fails under a meta device context
    groups = Groups(
        tp=job.full["tp"].get_group() if t.tp > 1 else None,
        ep=job.full["ep"].get_group() if t.ep > 1 else None,
        ep_rank=c["ep"],
        ep_size=t.ep,
        loss_scale=float(t.data_parallel),
        global_tokens=GLOBAL_BATCH * cfg.seq_len,
    )
    chunks, optims, sids = [], [], my_stages(job)
    for sid in sids:
        with torch.device("meta") if meta else contextlib.nullcontext():  # only the modules on meta
            m = StageModel(cfg, split[sid], sid == 0, sid == t.n_stages - 1, t.tp, t.ep)
        if logical is not None:
            m.load_logical(logical, t.tp, c["ep"], t.ep)
        m.groups = groups
        _parallelize(m, job, src_data_rank=None if meta else 0)
        chunks.append(m)
        optims.append(_optimizer(m))
    schedule = None
    if t.pp > 1 and not meta:
        pp_group = job.full["pp"].get_group()
        stages = [
            PipelineStage(m, sid, t.n_stages, torch.device("cpu"), group=pp_group) for m, sid in zip(chunks, sids)
        ]
        loss = _loss_fn(cfg, t)
        n_mb = 2 if t.vpp == 1 else t.pp
        # the loss is already a sum over tokens / global tokens: microbatch gradients must add up, not average
        schedule = (
            ScheduleGPipe(stages[0], n_mb, loss_fn=loss, scale_grads=False)
            if t.vpp == 1
            else ScheduleInterleaved1F1B(stages, n_mb, loss_fn=loss, scale_grads=False)
        )
    return Trainer(job, cfg, chunks, optims, sids, schedule)


def _parallelize(m: StageModel, job: Job, src_data_rank: int | None = 0) -> None:
    """TP, stacked experts as ep x tp DTensors, FSDP; ``src_data_rank=None``: shard every rank's own
    copy without communication (TP by default scatters rank 0's copy; the experts never send)."""
    t = job.topo
    tp_dense, tp_full = job.dense["tp"], job.full["tp"]
    par = functools.partial(parallelize_module, src_data_rank=src_data_rank)
    if t.tp > 1:
        if m.first:
            par(m, tp_dense, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate())})
        if m.last:
            par(m, tp_dense, {"output": ColwiseParallel(output_layouts=Replicate())})
        for blk in m.layers:
            par(blk.attn, tp_dense, {"wqkv": ColwiseParallel(), "wo": RowwiseParallel()})
            if hasattr(blk, "ffn"):
                par(blk.ffn, tp_dense, {"w13": ColwiseParallel(), "w2": RowwiseParallel()})
            elif not hasattr(blk.moe.experts, "w1"):
                for e in blk.moe.experts:
                    par(e, tp_full, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
    for blk in m.layers:
        if hasattr(blk, "moe"):
            ex = blk.moe.experts
            if hasattr(ex, "w1"):  # stacked: experts over ep, hidden over tp
                for name, hidden in (("w1", 1), ("w3", 1), ("w2", 2)):
                    full = ex.get_parameter(name).detach()
                    dt = distribute_tensor(full, job.full["ep", "tp"], [Shard(0), Shard(hidden)], src_data_rank=None)
                    setattr(ex, name, nn.Parameter(dt))
            fully_shard(ex, mesh=_fsdp_mesh(job.full, "dp", t))
        fully_shard(blk, mesh=_fsdp_mesh(job.dense, "dp_ep", t))
    fully_shard(m, mesh=_fsdp_mesh(job.dense, "dp_ep", t))


def _fsdp_mesh(mesh: DeviceMesh, shard_dim: str, t: Topology) -> DeviceMesh:
    """FSDP over ``shard_dim``; HSDP (replicate over dpr, shard over ``shard_dim``) when dpr > 1."""
    return mesh["dpr", shard_dim] if t.dpr > 1 else mesh[shard_dim]


def _optimizer(m: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in m.parameters() if p.ndim >= 2]
    no_decay = [p for p in m.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        foreach=False,
    )


def global_batch(cfg: ModelConfig, step: int, seed: int = 1234) -> torch.Tensor:
    """Token ids ``(GLOBAL_BATCH, seq_len + 1)``; depends only on (seed, step)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, cfg.vocab, (GLOBAL_BATCH, 1), generator=g)
    steps = torch.randint(1, 4, (GLOBAL_BATCH, cfg.seq_len), generator=g)
    return torch.cat([start, start + steps.cumsum(1)], 1) % cfg.vocab


def _loss_fn(cfg: ModelConfig, t: Topology):
    scale = t.data_parallel / (GLOBAL_BATCH * cfg.seq_len)

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="sum") * scale
        )

    return loss


def train_step(tr: Trainer) -> float:
    """One AdamW step on the global batch; returns the global mean token loss (same on all ranks)."""
    job, t, cfg = tr.job, tr.job.topo, tr.cfg
    tr.step += 1
    tokens = global_batch(cfg, tr.step)
    slot = (job.coord["dpr"] * t.dp + job.coord["dp"]) * t.ep + job.coord["ep"]
    per = GLOBAL_BATCH // t.data_parallel
    local = tokens[slot * per : (slot + 1) * per]
    # contiguous: torch 2.11's pipeline stages check each microbatch's strides against the first's
    inp, tgt = local[:, :-1].contiguous(), local[:, 1:]
    loss_fn = _loss_fn(cfg, t)
    last = (t.n_stages - 1) in tr.stage_ids
    if tr.schedule is None:
        loss = loss_fn(tr.chunks[0](inp), tgt)
        loss.backward()
        local_loss = loss.detach()
    else:
        losses: list[torch.Tensor] = []
        first = 0 in tr.stage_ids
        # no positional input on later stages (torch 2.11 takes even a None there for shape-inference args)
        tr.schedule.step(*((inp,) if first else ()), target=tgt if last else None, losses=losses if last else None)
        local_loss = torch.stack(losses).sum().detach() if last else torch.zeros(())
    _sync_tied_grads(tr)
    if t.ep > 1:  # experts saw the tokens of all EP ranks: undo the ep-fold gradient
        for m in tr.chunks:
            for name, p in m.named_parameters():
                if ".experts." in name and p.grad is not None:
                    p.grad.mul_(1.0 / t.ep)
    for o in tr.optims:
        o.step()
        o.zero_grad(set_to_none=True)
    counts = last and job.coord["tp"] == 0
    if counts:
        tr.tokens_seen += int(tgt.numel())
    total = (local_loss / t.data_parallel if counts else torch.zeros(())).reshape(1).double()
    dist.all_reduce(total, group=job.group)
    return float(total)


def live_logits(tr: Trainer, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits over the logical vocabulary of the live (sharded) model on ``tokens`` (the same on
    every rank), on the ranks of the last pipeline stage (None elsewhere): the hidden states go
    stage to stage by point-to-point sends (one chunk per rank, ``vpp=1``). Collective over the job."""
    job, t = tr.job, tr.job.topo
    if t.vpp != 1:
        raise ValueError("live_logits runs one model chunk per rank (vpp=1)")
    m = tr.chunks[0]

    def peer(pp: int) -> int:
        c = dict(job.coord, pp=pp)
        return int(job.full.mesh[c["pp"], c["dpr"], c["dp"], c["ep"], c["tp"]])

    with torch.no_grad():
        x = tokens
        if not m.first:
            x = torch.empty(*tokens.shape, tr.cfg.dim)
            dist.recv(x, peer(job.coord["pp"] - 1))
        y = m(x)
        if not m.last:
            dist.send(y.contiguous(), peer(job.coord["pp"] + 1))
            return None
        return y[..., : tr.cfg.vocab]


def _sync_tied_grads(tr: Trainer) -> None:
    """Sum the gradients of the tied embedding (first stage) and output head (last stage)."""
    job, t = tr.job, tr.job.topo
    emb = next((m.tok_embeddings.weight for m in tr.chunks if m.first), None)
    out = next((m.output.weight for m in tr.chunks if m.last), None)
    if emb is None and out is None:
        return
    if emb is not None and out is not None:
        total = emb.grad.to_local() + out.grad.to_local()
        emb.grad.to_local().copy_(total)
        out.grad.to_local().copy_(total)
        return
    mine = (emb if emb is not None else out).grad.to_local()
    other_pp = t.pp - 1 if emb is not None else 0
    c = dict(job.coord, pp=other_pp)
    peer = int(job.full.mesh[c["pp"], c["dpr"], c["dp"], c["ep"], c["tp"]])
    buf = torch.empty_like(mine)
    reqs = [dist.isend(mine.contiguous(), peer), dist.irecv(buf, peer)]
    for r in reqs:
        r.wait()
    mine.copy_(mine + buf if emb is not None else buf + mine)


# -- the oracle: logical full state, independent of ucp_dcp ------------------------------------------


def logical_state(tr: Trainer) -> dict[str, object]:
    """Every logical parameter and optimizer entry as a full tensor (unfused, unpadded, global names),
    gathered on every rank of the job. Collective over the job."""
    cfg, t = tr.cfg, tr.job.topo
    out: dict[str, object] = {}

    def put(key: str, v: object) -> None:  # tied copies (embedding, output head) must agree
        out[key] = "<copies differ>" if key in out and not _same(out[key], v) else out.get(key, v)

    for m, opt in zip(tr.chunks, tr.optims):
        names = {id(p): n for n, p in m.named_parameters()}
        for n, p in m.named_parameters():
            for k, v in _logical(cfg, t, tr, m, n, _full(p)).items():
                put(f"param/{k}", v)
            for sk, sv in opt.state.get(p, {}).items():
                for k, v in _logical(cfg, t, tr, m, names[id(p)], _full(sv)).items():
                    put(f"state/{k}/{sk}", v)
        for _gi, group in enumerate(opt.param_groups):
            hp = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                for k in _logical(cfg, t, tr, m, names[id(p)], None):
                    put(f"group/{k}", repr(sorted(hp.items())))
    gathered: list[dict] = [None] * dist.get_world_size(tr.job.group)  # type: ignore[list-item]
    dist.all_gather_object(gathered, {k: _Packed.of(v) for k, v in out.items()}, group=tr.job.group)
    merged: dict[str, object] = {}
    for d in gathered:
        for k, packed in d.items():
            v = packed.tensor() if isinstance(packed, _Packed) else packed
            if k in merged and not _same(merged[k], v):
                merged[k] = "<copies differ>"
            merged.setdefault(k, v)
    merged["train_state/step"] = tr.step
    counts = torch.tensor([tr.tokens_seen], dtype=torch.int64)
    dist.all_reduce(counts, group=tr.job.group)
    merged["train_state/tokens_seen(sum)"] = int(counts)
    return merged


@dataclass(frozen=True)
class _Packed:
    """A tensor as raw bytes for ``all_gather_object``: pickling a tensor goes through ``torch.save`` per
    tensor, which dominated the oracle's cost on 8 ranks; bytes round-trip bit for bit."""

    dtype: torch.dtype
    """The tensor's dtype."""
    shape: tuple[int, ...]
    """Its shape."""
    data: bytes
    """Its elements, row-major."""

    @staticmethod
    def of(v: object) -> object:
        if not isinstance(v, torch.Tensor):
            return v
        flat = v.detach().contiguous().reshape(-1)
        return _Packed(v.dtype, tuple(v.shape), flat.view(torch.uint8).numpy().tobytes())

    def tensor(self) -> torch.Tensor:
        raw = (
            torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw.view(self.dtype).reshape(self.shape)


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def _full(t):
    if t is None or not isinstance(t, torch.Tensor):
        return t
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _logical(cfg: ModelConfig, topo: Topology, tr: Trainer, m: StageModel, live: str, full) -> dict[str, object]:
    """Live (chunk-local, fused, padded) parameter -> its logical parameters."""
    name = re.sub(r"^layers\.(\d+)\.", lambda x: f"layers.{m.layer_ids[int(x.group(1))]}.", live)
    n_local = cfg.n_experts // topo.ep
    name = re.sub(r"\.experts\.(\d+)\.", lambda x: f".experts.{tr.job.coord['ep'] * n_local + int(x.group(1))}.", name)
    if name in ("tok_embeddings.weight", "output.weight"):
        return {"tok_embeddings.weight": full[: cfg.vocab] if isinstance(full, torch.Tensor) and full.ndim else full}
    hd = cfg.head_dim
    if name.endswith("attn.wqkv.weight"):
        base = name[: -len("wqkv.weight")]
        sizes = [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd]
        parts = (
            deinterleave(full, sizes, cfg.n_kv_heads) if isinstance(full, torch.Tensor) and full.ndim else [full] * 3
        )
        return {f"{base}w{x}.weight": v for x, v in zip("qkv", parts)}
    if name.endswith("ffn.w13.weight"):
        base = name[: -len("w13.weight")]
        sizes = [cfg.ffn_dim, cfg.ffn_dim]
        parts = deinterleave(full, sizes, topo.tp) if isinstance(full, torch.Tensor) and full.ndim else [full] * 2
        return {f"{base}w1.weight": parts[0], f"{base}w3.weight": parts[1]}
    return {name: full}
