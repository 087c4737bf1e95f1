"""Mistake injection: every ordinary user mistake, on every transition of the reconfiguration set, must end
either bitwise equal to the correct reshard or in a ``UCPError`` that names the atom and the fix.

A *mistake* is one change to a correct save -> load run of the toy trainer (``ucp_dev.toy``), the run of
``ucp_dev.testing.elastic`` (``recipes/elastic_resume.py``):

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
(returned with wrong state; for a ``perturb``: returned at all, the divergence went unreported), ``overrefused``
(refused where the run must load: a dtype-edge value ``Tensor.to`` only rounds, :mod:`ucp_dev.testing.mistake_dtypes`;
a failure like ``silent``). Runs loaded
by stock DCP's planner are ours to report, not to fix: their outcomes get a ``stock-`` prefix and count apart.

This module is the set (which mistakes run where: :func:`plan`) and its verdict (:func:`summary`); the runs
themselves (the mistakes applied, one transition on its ranks) are :mod:`ucp_dev.testing.mistake_runs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ucp_dev.toy import Topology

RULES = ("fused_wqkv", "fused_w13", "tied", "padded", "replicated", "reduce", "stage_map", "expert_map")
"""The toy's declared rules and maps (dev/ucp_dev/toy/layouts.py), by the harness's key."""
ALTERABLE = ("fused_wqkv", "fused_w13", "tied", "padded", "reduce", "stage_map", "expert_map")
"""Rules with a meaningful wrong value (``mistake_runs._altered``); a ``Replicated`` rule has none (its ``check`` mode
matters only with a perturbed replica, which ``perturb`` covers)."""
PERTURB = ("tp_norm", "hsdp", "plain")
VOCAB = (
    "fused",
    "tied",
    "padded",
    "replica",
    "reduce",
    "stage_map",
    "expert_map",
    "param group",
    "raw optimizer",
    "dtype",
)
"""Words a refusal's message or hint may use to name the cause; a refusal that does not name the mistaken
rule (:func:`names_cause`) still counts as refused but is listed apart ("refused, other cause")."""

Kind = Literal["none", "drop", "alter", "reorder", "perturb", "writer", "reader", "plain"]
Side = Literal["", "save", "load", "both"]
Outcome = Literal[
    "ok", "refused", "unclear", "crash", "silent", "overrefused", "stock-ok", "stock-refused", "stock-silent"
]


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


# -- the set ----------------------------------------------------------------------------------------


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
        "raw": "raw optimizer",  # the state-form runs (ucp_dev.testing.mistake_forms)
    }.get(target, target)
    if r["mistake"].startswith("dtype-"):  # the dtype-edge runs (ucp_dev.testing.mistake_dtypes)
        word = "dtype"
    return word in r.get("mentions", [word])


def counted(r: dict) -> str:
    """The outcome as the summary counts it: a silent run on the user-owned list is ``user-owned``."""
    if r["outcome"] == "silent" and r["mistake"] in USER_OWNED:
        return "user-owned"
    return r["outcome"]


FAILING = ("silent", "crash", "unclear", "overrefused")
"""Outcomes that fail the set: ``overrefused`` is a load that must succeed refused (the dtype-edge runs:
a value ``Tensor.to`` only rounds)."""


def summary(results: list[dict], skipped: int) -> tuple[list[str], bool]:
    """One line per failing run (silent, crash, unclear, overrefused), per stock-loader surprise and per user-owned
    silent run, then the verdict line: ``MISTAKES OK: N runs, 0 silent`` or ``MISTAKES FAILED: ...``."""
    lines = []
    for r in results:
        c = counted(r)
        if c in FAILING or c in ("stock-silent", "user-owned"):
            detail = r.get("error") or f"{r.get('diffs')} entries differ: {', '.join(r.get('first', []))}"
            lines.append(f"{c.upper():<12} {r['save']} -> {r['load']}: {r['mistake']}: {detail}")
    n = {
        k: sum(1 for r in results if counted(r) == k)
        for k in ("silent", "crash", "unclear", "overrefused", "ok", "refused", "user-owned")
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
    ok = n["silent"] == n["crash"] == n["unclear"] == n["overrefused"] == 0
    wrongly = f", {n['overrefused']} refused wrongly" if n["overrefused"] else ""
    if ok:
        lines.append(f"MISTAKES OK: {len(results)} runs, 0 silent {tail}")
    else:
        lines.append(
            f"MISTAKES FAILED: {len(results)} runs, {n['silent']} silent, {n['crash']} crashed, "
            f"{n['unclear']} unclear{wrongly} {tail}"
        )
    return lines, ok
