"""Mistake injection: every ordinary user mistake, on every transition of the reconfiguration set, must end
either bitwise equal to the correct reshard or in a ``UCPError`` that names the atom and the fix.

A *mistake* is one change to a correct save -> load run of the toy trainer (``ucp_dcp.toy``), the run of
``recipes/elastic_resume.py`` and tests/support/training.py::elastic_resume:

* ``drop`` / ``alter`` a declared rule or map (:data:`RULES`) at ``save``, at ``load`` or at ``both``;
* ``reorder`` the target optimizer's two param groups (decay / no-decay: different weight decay) at load;
* ``perturb`` one replica before the save: a TP-replicated norm (``tp_norm``), an HSDP replica of an FSDP
  shard (``hsdp``), a plain per-rank value (``plain``: ``train_state.step`` on one rank);
* ``writer`` swap: the checkpoint written by stock ``dcp.save`` (``DefaultSavePlanner``, ``FileSystemWriter``),
  loaded by ucp_dcp (also into reordered groups, and ``over``: saved by stock DCP into the folder that holds our
  checkpoint of the same state); ``reader`` swap: our checkpoint loaded by stock DCP (``DefaultLoadPlanner``,
  ``FileSystemReader``);
* ``plain``: the state handed to DCP with every DTensor of a one-rank mesh as its local tensor (what a job
  without FSDP on those ranks saves: pipeline stages, expert lists), at save and at load, saved with the maps;
  ``plain`` alone keeps the maps at load (it must load right), ``plain-<map>-load`` forgets one there.

Each run ends in one :data:`Outcome`: ``ok`` (returned, state bitwise the oracle's), ``refused`` (a ``UCPError``
with ``atom`` and ``hint``), ``unclear`` (a ``UCPError`` without them), ``crash`` (another exception), ``silent``
(returned with wrong state; for a ``perturb``: returned at all, the divergence went unreported). Runs loaded
by stock DCP's planner are ours to report, not to fix: their outcomes get a ``stock-`` prefix and count apart.

Cost: each transition is one task on the shared worker pool (tests/support/dist.py): one training run and its oracle,
one save per save-side variant, every load-side variant reusing that checkpoint, a fresh load trainer per run
(a load that skips an entry must not find the previous run's correct value there). Rank 0 appends each
result to ``<root>/results.jsonl`` as it finishes, so a hang still leaves the runs before it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import traceback
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from training import compare_state

from ucp_dcp.toy import ModelConfig, Topology, build_job, build_trainer, logical_state, train_step, ucp_options

RULES = ("fused_wqkv", "fused_w13", "tied", "padded", "replicated", "reduce", "stage_map", "expert_map")
"""The toy's declared rules and maps (ucp_dcp/toy/layouts.py), by the harness's key."""
ALTERABLE = ("fused_wqkv", "fused_w13", "tied", "padded", "reduce", "stage_map", "expert_map")
"""Rules with a meaningful wrong value (:func:`_altered`); a ``Replicated`` rule has none (its ``check`` mode
matters only with a perturbed replica, which ``perturb`` covers)."""
PERTURB = ("tp_norm", "hsdp", "plain")
VOCAB = ("fused", "tied", "padded", "replica", "reduce", "stage_map", "expert_map", "param group")
"""Words a refusal's message or hint may use to name the cause; a refusal that does not name the mistaken
rule (:func:`names_cause`) still counts as refused but is listed apart ("refused, other cause")."""
STEPS = 2

Kind = Literal["none", "drop", "alter", "reorder", "perturb", "writer", "reader", "plain"]
Side = Literal["", "save", "load", "both"]
Outcome = Literal["ok", "refused", "unclear", "crash", "silent", "stock-ok", "stock-refused", "stock-silent"]


@dataclass(frozen=True)
class Mistake:
    """One change to a correct save -> load run."""

    kind: Kind
    """What is done wrong."""
    target: str = ""
    """The rule/map key (drop, alter, plain), the replica (perturb), ``norules`` / ``reorder`` / ``over`` for
    the writer swaps (:data:`SWAPS`); empty otherwise."""
    side: Side = ""
    """Where a drop/alter happens."""

    @property
    def name(self) -> str:
        return "-".join(x for x in (self.kind, self.target, self.side) if x)

    @property
    def save_variant(self) -> tuple[str, ...]:
        """The checkpoint this run loads (runs with equal variants share one save)."""
        if self.kind in ("drop", "alter") and self.side in ("save", "both"):
            return (self.kind, self.target)
        if self.kind == "writer":
            return ("writer", "over" if self.target == "over" else "stock")
        if self.kind == "perturb":
            return ("perturb", self.target)
        if self.kind == "plain":
            return ("plain",)
        return ("correct",)

    @property
    def load_variant(self) -> tuple[str, ...]:
        if self.kind in ("drop", "alter") and self.side in ("load", "both"):
            return (self.kind, self.target)
        if self.kind == "reorder":
            return ("reorder",)
        if self.kind == "writer" and self.target in ("norules", "reorder"):  # loaded by ucp_dcp without rules
            return ("reorder", "norules") if self.target == "reorder" else ("norules",)
        if self.kind == "reader":
            return ("stock",)
        if self.kind == "plain":
            return ("plain", self.target) if self.target else ("plain",)
        return ("correct",)


def all_mistakes(writer_swap: bool = True) -> list[Mistake]:
    """Every mistake class (the baseline ``none`` first); ``writer_swap=False`` leaves out the writer and
    reader swaps (run on a subset of transitions: :data:`WRITER_SWAP_TRANSITIONS`)."""
    out = [Mistake("none")]
    for side in ("save", "load", "both"):
        out += [Mistake("drop", r, side) for r in RULES]
        out += [Mistake("alter", r, side) for r in ALTERABLE]
    out.append(Mistake("reorder"))
    out += [Mistake("perturb", p) for p in PERTURB]
    out += PLAIN
    if writer_swap:
        out += SWAPS
    return out


SWAPS = [
    Mistake("writer"),
    Mistake("writer", "norules"),
    Mistake("writer", "reorder"),
    Mistake("writer", "over"),
    Mistake("reader"),
]
"""The writer/reader swaps: a stock checkpoint loaded by ucp_dcp with the toy's rules, without rules, without
rules into reordered param groups, with the toy's rules from the folder that held our checkpoint (stock saved
over ours); our checkpoint loaded by stock DCP."""

PLAIN = [Mistake("plain"), Mistake("plain", "stage_map", "load"), Mistake("plain", "expert_map", "load")]
"""Plain tensors where the layout has one-rank meshes: with the maps (must load right), and each map forgotten at
load, where no mesh tells a pipeline stage (an expert rank) from a data-parallel replica."""


WRITER_SWAP_TRANSITIONS = {
    ("dp=4", "dp=2,tp=2"),
    ("dp=2,tp=2,pp=2", "dp=2,tp=2"),
    ("ep=4", "dp=4"),
    ("dp=4", "dpr=2,dp=2"),
}
"""Where the writer/reader swaps run: a plain reshard, pipeline stages merged, expert lists, HSDP (the swaps
exercise the reader and writer, not the transition; four cover every kind of piece the toy has)."""
SAME_LAYOUT = [("dp=4", "dp=4"), ("tp=2,pp=2", "tp=2,pp=2")]
"""Same-layout runs of the swaps only (plus the baseline): where stock DCP's own checkpoint and planner are
expected to be right, so a difference is ours (e.g. param groups matched by list position)."""

USER_OWNED: dict[str, str] = {
    "drop-fused_w13-both": "w13's per-TP-rank [w1_r; w3_r] blocks are what the tensor means; declared at neither side, "
    "the saved full tensor is a different (valid) tensor and no checkpoint fact tells them apart",
    "alter-fused_w13-both": "the same: a consistent blocks=1 at both sides declares another meaning of the bytes",
    "alter-reduce-both": "the op is the counter's meaning: 'max' declared at save and load is a valid reduction, "
    "saved and reapplied as declared",
    "alter-expert_map-both": "a consistent permutation of expert numbers at both sides: experts are symmetric in "
    "shape, so a wrong but consistent numbering is indistinguishable from a real one",
    "alter-expert_map-save": "refused wherever both sides have several expert owners (the catalog's map order differs "
    "from the load's); against a load with one owner (ep=1) nothing fixes a direction, and a "
    "self-consistent reversed numbering is a valid one",
    "alter-expert_map-load": "the same, with the roles swapped",
}
"""Mistakes whose silent outcome is the user's to own (excluded from the silent count, still listed)."""


# -- the mistakes applied -------------------------------------------------------------------------


def rule_key(rule) -> str:
    """The harness's key of one of the toy's pattern rules."""
    kind = type(rule).__name__.lower()
    if kind == "fused":
        return "fused_wqkv" if "wqkv" in rule.pattern else "fused_w13"
    return kind


def is_noop(m: Mistake, save: Topology, load: Topology) -> bool:
    """The mistake changes nothing at this transition (skipped, not a run)."""
    if m.kind == "plain":  # only where the load has stages (expert lists) whose numbers a map changes
        need = {"stage_map": load.n_stages > 1, "expert_map": load.ep > 1, "": load.n_stages > 1 or load.ep > 1}
        return not need[m.target]
    sides = {"save": [save], "load": [load], "both": [save, load]}.get(m.side, [])
    if m.target == "expert_map" and m.kind in ("drop", "alter"):
        return all(t.ep == 1 for t in sides)  # the identity numbering
    if m.target == "fused_w13" and m.kind == "alter":
        return all(t.tp == 1 for t in sides)  # blocks="tp" is 1 block when not sharded over tp
    if m.kind == "perturb":
        return {"tp_norm": save.tp == 1, "hsdp": save.dpr == 1, "plain": save.world == 1}[m.target]
    return False


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


# -- one transition on the workers ------------------------------------------------------------------


def _classify_exc(e: BaseException) -> dict:
    import ucp_dcp

    err = ucp_dcp.first_ucp_error(e)
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


def _agree(job, mine: dict | None) -> dict | None:
    """Every member's phase result -> the first failure (or None): the members go on or stop together."""
    everyone: list = [None] * dist.get_world_size(job.group)
    dist.all_gather_object(everyone, mine, group=job.group)
    return next((x for x in everyone if x is not None), None)


def _save(cfg, tr, job, variant, folder) -> dict | None:
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    import ucp_dcp

    sd = tr.state_dict()
    undo = perturb(tr, sd, variant[1]) if variant[0] == "perturb" else []
    try:
        if variant != ("writer", "stock"):  # ours (also first, for the stock save over it)
            dcp.save(
                plain(sd) if variant == ("plain",) else sd,
                storage_writer=ucp_dcp.UCPFileSystemWriter(folder),
                process_group=job.group,
                planner=ucp_dcp.UCPSavePlanner(**options(cfg, job, variant)),
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

    import ucp_dcp

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
                storage_reader=ucp_dcp.UCPFileSystemReader(folder),
                process_group=job.group,
                planner=ucp_dcp.UCPLoadPlanner(**opts),
            )
            if target is not sd:
                take_values(sd, target)
        tr.load_state_dict(sd)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failure = {"phase": "load", **_classify_exc(e)}
    failure = _agree(job, failure)
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
        saved = _agree(s_job, _save(cfg, tr, s_job, sv, folder)) if s_job.member else None
        dist.barrier()
        saved = _bcast(saved)
        for m in runs:
            if saved is not None:
                res = _verdict(m, saved, None)
            else:
                failure, loaded = _load(trainers, cfg, l_job, m.load_variant, folder) if l_job.member else (None, None)
                res = _verdict(m, failure, compare_state(oracle, loaded) if rank == 0 and loaded is not None else None)
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


# -- the set ----------------------------------------------------------------------------------------


def plan(
    transitions: list[tuple[str, str]],
    sample: list[tuple[str, str, str]] | None = None,
    same_layout: list[tuple[str, str]] = (),
):
    """(save, load, [mistake names]) per transition and the skipped count: every mistake class on
    every transition where it is not a no-op, the writer swaps on :data:`WRITER_SWAP_TRANSITIONS`;
    the baseline and the swaps alone at ``same_layout`` (e.g. :data:`SAME_LAYOUT`); ``sample``: only these (save, load, mistake name) runs."""
    jobs, skipped = [], 0
    for save, load in transitions:
        ms = all_mistakes(writer_swap=(save, load) in WRITER_SWAP_TRANSITIONS)
        if sample is not None:
            ms = [m for m in ms if (save, load, m.name) in sample]
        keep = [m for m in ms if not is_noop(m, Topology.parse(save), Topology.parse(load))]
        skipped += len(ms) - len(keep)
        if keep:
            jobs.append((save, load, [m.name for m in keep]))
    jobs += [(save, load, ["none"] + [m.name for m in SWAPS]) for save, load in same_layout]
    return jobs, skipped


def names_cause(r: dict) -> bool:
    """Whether a refusal's message or hint names the mistaken rule or map (or, for a perturbed replica, the
    replicas; for reordered groups, the param groups)."""
    target = r["mistake"].split("-")[1] if "-" in r["mistake"] else r["mistake"]
    word = {
        "fused_wqkv": "fused",
        "fused_w13": "fused",
        "replicated": "replica",
        "tp_norm": "replica",
        "hsdp": "replica",
        "plain": "replica",
        "reorder": "param group",
    }.get(target, target)
    return word in r.get("mentions", [word])


def counted(r: dict) -> str:
    """The outcome as the summary counts it: a silent run on the user-owned list is ``user-owned``."""
    if r["outcome"] == "silent" and r["mistake"] in USER_OWNED:
        return "user-owned"
    return r["outcome"]


FAILING = ("silent", "crash", "unclear")


def summary(results: list[dict], skipped: int) -> tuple[list[str], bool]:
    """One line per failing run (silent, crash, unclear), per stock-loader surprise and per user-owned
    silent run, then the verdict line: ``MISTAKES OK: N runs, 0 silent`` or ``MISTAKES FAILED: ...``."""
    lines = []
    for r in results:
        c = counted(r)
        if c in FAILING or c in ("stock-silent", "user-owned"):
            detail = r.get("error") or f"{r.get('diffs')} entries differ: {', '.join(r.get('first', []))}"
            lines.append(f"{c.upper():<12} {r['save']} -> {r['load']}: {r['mistake']}: {detail}")
    n = {
        k: sum(1 for r in results if counted(r) == k)
        for k in ("silent", "crash", "unclear", "ok", "refused", "user-owned")
    }
    stock = sum(1 for r in results if r["outcome"].startswith("stock-"))
    swaps = ("writer", "writer-over")  # a stock checkpoint: its refusal names whatever stock DCP got wrong
    other = [r for r in results if r["outcome"] == "refused" and r["mistake"] not in swaps and not names_cause(r)]
    for r in other:
        lines.append(
            f"{'REFUSED?':<12} {r['save']} -> {r['load']}: {r['mistake']}: the error names another cause: "
            f"{r['error'][:160]}"
        )
    tail = (
        f"({n['ok']} ok, {n['refused']} refused ({len(other)} naming another cause), {n['user-owned']} user-owned, "
        f"{stock} stock-loaded, "
        f"{skipped} skipped as no-ops)"
    )
    ok = n["silent"] == n["crash"] == n["unclear"] == 0
    if ok:
        lines.append(f"MISTAKES OK: {len(results)} runs, 0 silent {tail}")
    else:
        lines.append(
            f"MISTAKES FAILED: {len(results)} runs, {n['silent']} silent, {n['crash']} crashed, "
            f"{n['unclear']} unclear {tail}"
        )
    return lines, ok
