"""The mistakes of :mod:`ucp_dev.testing.mistakes` applied, and one transition's runs on its ranks
(:func:`transition_worker`: the tests run it on their pool of workers, ``recipes/mistakes.py`` on fresh
processes, ``ucp_dev.testing.processes``).

Cost: one transition is one run on its ranks: one training run and its oracle, one save per save-side
variant, every load-side variant reusing that checkpoint, a fresh load trainer per run (a load that skips an
entry must not find the previous run's correct value there). Rank 0 appends each result to
``<root>/results.jsonl`` as it finishes, so a hang still leaves the runs before it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ucp_dcp.errors import first_ucp_error
from ucp_dcp.planning.load_planner import UCPLoadPlanner
from ucp_dcp.planning.save_planner import UCPSavePlanner
from ucp_dcp.storage.reader import UCPFileSystemReader
from ucp_dcp.storage.writer import UCPFileSystemWriter
from ucp_dev.testing.checks import state_diffs
from ucp_dev.testing.mistakes import VOCAB, Mistake, all_mistakes
from ucp_dev.toy import ModelConfig, Topology, build_job, build_trainer, logical_state, train_step, ucp_options

STEPS = 2
"""Training steps before the save."""


# -- the mistakes applied ----------------------------------------------------------------------------


def rule_key(rule) -> str:
    """The harness's key of one of the toy's pattern rules."""
    kind = type(rule).__name__.lower()
    if kind == "fused":
        return "fused_wqkv" if "wqkv" in rule.pattern else "fused_w13"
    return kind


def _altered(key: str, value, cfg: ModelConfig, topo: Topology):
    """A wrong value of the rule/map ``key``: Fused blocks=1 (the layout is blocked), Padded one row short
    (drops a real row), Tied with the canonical name and the alias swapped, Reduce 'max' for 'sum', a
    stage_map listing the layers in reverse global order, an expert_map with the EP ranks' experts swapped."""
    from ucp_dcp.layout.index_maps import Chunk, IndexMap
    from ucp_dcp.layout.patterns import Tied

    if key in ("fused_wqkv", "fused_w13"):
        return dataclasses.replace(value, blocks=1)
    if key == "padded":
        return dataclasses.replace(value, size=cfg.vocab - 1)
    if key == "tied":
        return Tied("output.weight", (r"tok_embeddings\.weight",))
    if key == "reduce":
        return dataclasses.replace(value, op="max")
    if key == "stage_map":
        total = value.total
        return IndexMap(
            "layers",
            [dataclasses.replace(c, indices=tuple(total - 1 - i for i in c.indices)) for c in value.chunks],
            total=total,
        )
    if key == "expert_map":
        n_local = cfg.n_experts // topo.ep
        return IndexMap(
            "experts",
            [Chunk((topo.ep - 1 - c.owner) * n_local, c.prefixes, c.owner) for c in value.chunks],
            total=value.total,
        )
    raise ValueError(key)


def options(cfg: ModelConfig, job, variant: tuple[str, ...]) -> dict:
    """The rank's planner keywords (``ucp_options``) with the variant's drop/alter applied."""
    opts = ucp_options(cfg, job.topo, job.coord)
    if variant[0] not in ("drop", "alter"):
        return opts
    how, key = variant
    if key in ("stage_map", "expert_map"):
        if how == "drop":
            opts.pop(key, None)
        elif key in opts:
            opts[key] = _altered(key, opts[key], cfg, job.topo)
        return opts
    pats = []
    for r in opts["patterns"]:
        if rule_key(r) != key:
            pats.append(r)
        elif how == "alter":
            pats.append(_altered(key, r, cfg, job.topo))
    opts["patterns"] = pats
    return opts


def reorder_groups(tr) -> None:
    """Give each chunk a fresh AdamW with the param groups in reverse order (no-decay first): the same
    hyperparameters per parameter, another list position per group."""
    opts = []
    for o in tr.optims:
        groups = [dict(g) for g in reversed(o.param_groups)]
        opts.append(type(o)(groups))  # each group carries every hyperparameter
    tr.optims[:] = opts


def perturb(tr, sd: dict, target: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Change one replica in place on one rank (the last of its replica group); returns (tensor, old
    values) pairs to undo it."""
    c, t = tr.job.coord, tr.job.topo
    undo: list[tuple[torch.Tensor, torch.Tensor]] = []
    if target == "plain":
        if c == {k: getattr(t, k) - 1 for k in c}:
            sd["train_state"]["step"] += 1
        return undo
    mine = (c["tp"] == t.tp - 1) if target == "tp_norm" else (c["dpr"] == t.dpr - 1)
    if not mine:
        return undo
    for name, p in tr.chunks[0].named_parameters():
        if (target == "tp_norm" and name.endswith("attn_norm.weight")) or (target == "hsdp" and p.ndim >= 2):
            x = p.to_local() if hasattr(p, "to_local") else p
            if x.numel():
                with torch.no_grad():
                    undo.append((x, x.clone()))
                    x.view(-1)[0] += 1.0
                break
    return undo


# -- one transition on the workers ------------------------------------------------------------------


def plain(x):
    """``x`` (a nested state dict) with every DTensor of a one-rank mesh replaced by its local tensor, which
    shares its memory (a load into it fills the DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor) and x.device_mesh.size() == 1:
        return x.to_local()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [plain(v) for v in x]
    return x


def take_values(sd, loaded) -> None:
    """Put the non-tensor values a load set in ``loaded`` (a :func:`plain` copy of ``sd``) back into ``sd``
    (its tensors share memory with ``sd``'s; its containers and values are its own)."""
    for k in range(len(sd)) if isinstance(sd, list) else sd:
        if isinstance(sd[k], (dict, list)):
            take_values(sd[k], loaded[k])
        elif not isinstance(sd[k], torch.Tensor):
            sd[k] = loaded[k]


def _classify_exc(e: BaseException) -> dict:
    err = first_ucp_error(e)
    if err is None:
        return {
            "outcome": "crash",
            "error": f"{type(e).__name__}: {str(e)[:300]}",
            "where": traceback.format_exception(e)[-1][:200],
        }
    clear = bool(err.atom) and bool(err.hint)
    text = f"{err.message} {err.hint or ''}".lower()
    return {
        "outcome": "refused" if clear else "unclear",
        "error": f"{type(err).__name__}: {err.message[:300]}",
        "atom": err.atom,
        "hint": (err.hint or "")[:200],
        "mentions": [w for w in VOCAB if w in text],
    }


def agree(mine: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Every member's result -> the first one that is not None (collective): the members go on or stop
    together, and all report the same failure."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return next((x for x in everyone if x is not None), None)


def attempt(run: Callable[[str], tuple[Any, Any]], folder: str) -> tuple[dict | None, Any, Any]:
    """``run(folder)`` -> ``(expected, loaded)`` as ``(None, expected, loaded)``, or its failure classified
    (:func:`_classify_exc`) as ``(failure, None, None)``."""
    try:
        expected, loaded = run(folder)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return {"phase": "run", **_classify_exc(e)}, None, None
    return None, expected, loaded


def _save(cfg, tr, job, variant, folder) -> dict | None:
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    sd = tr.state_dict()
    undo = perturb(tr, sd, variant[1]) if variant[0] == "perturb" else []
    try:
        if variant != ("writer", "stock"):  # ours (also first, for the stock save over it)
            dcp.save(
                plain(sd) if variant == ("plain",) else sd,
                storage_writer=UCPFileSystemWriter(folder),
                process_group=job.group,
                planner=UCPSavePlanner(**options(cfg, job, variant)),
            )
        if variant[0] == "writer":
            dcp.save(sd, storage_writer=FileSystemWriter(folder), planner=DefaultSavePlanner(), process_group=job.group)
        return None
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return {"phase": "save", **_classify_exc(e)}
    finally:
        with torch.no_grad():
            for x, old in undo:
                x.copy_(old)


class FreshTrainer:
    """A load trainer (seed 1, groups reordered or not) built once per transition and put back into its
    initial state before each run: a load that skips an entry must find the seed-1 value there, never the
    previous run's correct one. Cheaper than a build per run (FSDP, TP, optimizers)."""

    def __init__(self, cfg: ModelConfig, job, reorder: bool) -> None:
        self.tr = build_trainer(cfg, job, seed=1)
        if reorder:
            reorder_groups(self.tr)
        self.tr.state_dict()  # creates the optimizer state (zeros), as the first load's target would
        self.params = [(x, x.detach().clone()) for m in self.tr.chunks for x in map(_local_of, m.parameters())]
        self.optims = [copy.deepcopy(o.state_dict()) for o in self.tr.optims]

    def reset(self):
        with torch.no_grad():
            for x, old in self.params:
                x.copy_(old)
        for o, saved in zip(self.tr.optims, self.optims):
            o.load_state_dict(copy.deepcopy(saved))
        self.tr.step = self.tr.tokens_seen = 0
        return self.tr


def _local_of(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _load(trainers: dict, cfg, job, variant, folder) -> tuple[dict | None, dict | None]:
    """Load into a reset trainer (seed 1); returns (failure, loaded logical state)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    reorder = variant[0] == "reorder"
    if reorder not in trainers:
        trainers[reorder] = FreshTrainer(cfg, job, reorder)
    tr = trainers[reorder].reset()
    failure = None
    try:
        sd = tr.state_dict()
        if variant == ("stock",):
            dcp.load(sd, storage_reader=FileSystemReader(folder), planner=DefaultLoadPlanner(), process_group=job.group)
        else:
            opts = {} if "norules" in variant else options(cfg, job, variant)
            target = sd
            if variant[0] == "plain":  # its local tensors share the DTensors' memory: sd is loaded through them
                opts = options(cfg, job, ("drop", variant[1]) if len(variant) > 1 else ("correct",))
                target = plain(sd)
            dcp.load(
                target,
                storage_reader=UCPFileSystemReader(folder),
                process_group=job.group,
                planner=UCPLoadPlanner(**opts),
            )
            if target is not sd:
                take_values(sd, target)
        tr.load_state_dict(sd)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failure = {"phase": "load", **_classify_exc(e)}
    failure = agree(failure, job.group)
    return failure, (None if failure else logical_state(tr))


def _verdict(m: Mistake, failure: dict | None, diffs: list[str] | None) -> dict:
    if failure is not None:
        out = dict(failure)
    elif diffs:
        out = {"outcome": "silent", "diffs": len(diffs), "first": diffs[:4]}
    elif m.kind == "perturb":
        out = {"outcome": "silent", "diffs": 0, "first": ["replicas differed at save; no error"]}
    else:
        out = {"outcome": "ok"}
    if m.kind in ("none", "plain") and not m.target and out["outcome"] != "ok":
        out["outcome"] = "crash" if out["outcome"] != "silent" else "silent"  # the correct run must load right
    if m.kind == "reader":  # stock DCP loaded: any error is its refusal, only a wrong return is notable
        out["outcome"] = "stock-" + (out["outcome"] if out["outcome"] in ("ok", "silent") else "refused")
    return out


def transition_worker(rank: int, world: int, root: str, save: str, load: str, names: list[str]) -> list[dict] | None:
    """Every rank: train at ``save``, then for each save variant the mistakes ``names`` need, save once and
    run every load variant on that checkpoint at ``load``. Returns the results on rank 0."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    by_name = {m.name: m for m in all_mistakes()}
    mistakes = [by_name[n] for n in names]
    cfg, s_topo, l_topo = ModelConfig(), Topology.parse(save), Topology.parse(load)
    s_job = build_job(s_topo, list(range(s_topo.world)))
    l_job = build_job(l_topo, list(range(l_topo.world)))
    tr = oracle = None
    if s_job.member:
        tr = build_trainer(cfg, s_job, seed=0)
        for _ in range(STEPS):
            train_step(tr)
        oracle = logical_state(tr)
    results: list[dict] = []
    log = os.path.join(root, "results.jsonl")
    variants: dict[tuple, list[Mistake]] = {}
    trainers: dict[bool, FreshTrainer] = {}
    for m in mistakes:
        variants.setdefault(m.save_variant, []).append(m)
    for i, (sv, runs) in enumerate(variants.items()):
        folder = os.path.join(root, f"ckpt{i}")
        saved = agree(_save(cfg, tr, s_job, sv, folder), s_job.group) if s_job.member else None
        dist.barrier()
        saved = _bcast(saved)
        for m in runs:
            if saved is not None:
                res = _verdict(m, saved, None)
            else:
                failure, loaded = _load(trainers, cfg, l_job, m.load_variant, folder) if l_job.member else (None, None)
                res = _verdict(m, failure, state_diffs(oracle, loaded) if rank == 0 and loaded is not None else None)
            dist.barrier()
            if rank == 0:
                res = {"save": save, "load": load, "mistake": m.name, **res}
                results.append(res)
                with open(log, "a") as f:
                    f.write(json.dumps(res, default=str) + "\n")
    return results if rank == 0 else None


def _bcast(x):
    box = [x]
    dist.broadcast_object_list(box, src=0)
    return box[0]
