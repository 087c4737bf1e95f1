"""Mistakes of state-dict *form* (issue 31): the two shapes of state users hand DCP without any declaration,
run on 2 gloo ranks beside the toy trainer's transitions (:mod:`ucp_dev.testing.mistakes`).

* **ties without rules** (``form-tied-*``): a language model whose embedding and output head are one
  ``Parameter`` (most small LLMs), sharded with FSDP2, saved and loaded with no ``Tied`` rule; into the same
  tied model, into an untied one, with a rule declared at load only, from a checkpoint holding the two names
  separately (as ucp_dcp wrote ties before they were found from the state: equal copies, or copies that
  differ), from stock DCP's writer (both names as copies, no checksums: compared when read, equal or
  different), and read back by stock DCP;
* **the raw optimizer form** (``form-raw-*``): ``optimizer.state_dict()`` (parameters keyed by position)
  saved and loaded at the same layout, into plain tensors on every rank (positions unchanged), into an
  optimizer grouped otherwise, into ``get_state_dict``'s named form, from each rank's own optimizer
  (pipeline-like stages), from stock DCP's writer, and read back by stock DCP.

Each run ends in the harness's outcomes (``ok``, ``refused``, ``silent``, ...); a run whose saved copies
differ must be refused (any load loses one of them), so its returning at all is ``silent``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ucp_dcp.api import load as ucp_load
from ucp_dcp.api import save as ucp_save
from ucp_dcp.layout.patterns import Tied
from ucp_dev.testing.checks import state_diffs
from ucp_dev.testing.mistake_runs import agree, attempt

WORLD = 2


class TiedLM(nn.Module):
    """Embedding, norm and an output head; ``tied``: the head's weight *is* the embedding's."""

    def __init__(self, tied: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(12, 4)
        self.norm = nn.LayerNorm(4)
        self.output = nn.Linear(4, 12, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.tok_embeddings(x)))


def _job(tied: bool, seed: int, sharded: bool, grouping: str = "two"):
    """The model (FSDP2 over both ranks when ``sharded``) and AdamW after one step."""
    model = TiedLM(tied, seed)
    if sharded:
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    if grouping == "two":
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in model.named_parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    else:
        groups = [{"params": list(model.parameters())}]
    opt = torch.optim.AdamW(groups, lr=0.05)
    torch.manual_seed(100 + seed)
    model(torch.randint(0, 12, (2, 3))).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _full(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _flat(prefix: str, d) -> dict:
    """A nested state as ``{dotted key: full tensor or value}`` (DTensors gathered)."""
    out: dict = {}
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else None
    if items is None:
        return {prefix: _full(d)}
    for k, v in items:
        out.update(_flat(f"{prefix}.{k}", v))
    return out


def _model_state(model: nn.Module) -> dict:
    return _flat("model", dict(model.state_dict()))


def _raw_state(model, opt) -> dict:
    return {**_model_state(model), **_flat("optim", opt.state_dict())}


# -- the scenarios: each returns (the oracle, what was loaded) or raises; `save` and `load` say where ----------


@dataclass(frozen=True)
class Scenario:
    """One form mistake: what runs, and whether any return is silent."""

    run: Callable[[str], tuple[dict, dict]]
    """On every rank: save and load in ``folder``, return (expected, loaded) flat states."""
    save: str
    """The save side, as the summary prints it."""
    load: str
    """The load side."""
    must_refuse: bool = False
    """The checkpoint holds two different values for one target: only a refusal is right."""
    stock_load: bool = False
    """Loaded by stock DCP's planner and reader: its outcome is reported apart (``stock-``)."""


def _tied_same(folder: str) -> tuple[dict, dict]:
    model, opt = _job(True, 0, sharded=True)
    ucp_save(dict(zip(("model", "optim"), get_state_dict(model, opt))), folder)
    m2, o2 = _job(True, 1, sharded=True)
    sd = dict(zip(("model", "optim"), get_state_dict(m2, o2)))
    ucp_load(sd, folder)
    return _flat("", dict(zip(("model", "optim"), get_state_dict(model, opt)))), _flat("", sd)


def _tied_into(tied: bool, rules: list) -> Callable[[str], tuple[dict, dict]]:
    def run(folder: str) -> tuple[dict, dict]:
        model, _ = _job(True, 0, sharded=True)
        ucp_save({"model": model.state_dict()}, folder)
        m2 = TiedLM(tied, 1)
        ucp_load({"model": m2.state_dict()}, folder, patterns=rules)
        return _model_state(model), _model_state(m2)

    return run


def _tied_from_copies(differ: bool, rules: list) -> Callable[[str], tuple[dict, dict]]:
    """A checkpoint holding the two names as atoms of their own (plain tensors, equal on both ranks)."""

    def run(folder: str) -> tuple[dict, dict]:
        model, _ = _job(False, 0, sharded=False)
        with torch.no_grad():
            model.output.weight.copy_(model.tok_embeddings.weight + (1.0 if differ else 0.0))
        ucp_save({"model": model.state_dict()}, folder)
        m2, _ = _job(True, 1, sharded=True)
        ucp_load({"model": m2.state_dict()}, folder, patterns=rules)
        return _model_state(model), _model_state(m2)

    return run


def _tied_stock_writer(differ: bool) -> Callable[[str], tuple[dict, dict]]:
    """Stock DCP's planner and writer: both names written as copies, no checksums (compared when read)."""

    def run(folder: str) -> tuple[dict, dict]:
        model, _ = _job(not differ, 0, sharded=True)
        if differ:
            with torch.no_grad():
                model.output.weight.copy_(model.tok_embeddings.weight + 1.0)
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder)
        m2, _ = _job(True, 1, sharded=True)
        ucp_load({"model": m2.state_dict()}, folder)
        return _model_state(model), _model_state(m2)

    return run


def _tied_stock_reader(folder: str) -> tuple[dict, dict]:
    model, _ = _job(True, 0, sharded=True)
    ucp_save({"model": model.state_dict()}, folder)
    m2, _ = _job(True, 1, sharded=True)
    dcp.load({"model": m2.state_dict()}, checkpoint_id=folder)
    return _model_state(model), _model_state(m2)


def _raw(save_sharded: bool, load_sharded: bool, grouping: str = "two", writer: str = "ucp", reader: str = "ucp"):
    def run(folder: str) -> tuple[dict, dict]:
        model, opt = _job(False, 0, sharded=save_sharded)
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        ucp_save(sd, folder) if writer == "ucp" else dcp.save(sd, checkpoint_id=folder)
        m2, o2 = _job(False, 1, sharded=load_sharded, grouping=grouping)
        target = {"model": m2.state_dict(), "optim": copy.deepcopy(o2.state_dict())}
        if reader == "ucp":
            ucp_load(target, folder)
        else:
            dcp.load(target, checkpoint_id=folder)
        o2.load_state_dict(target["optim"])
        return _raw_state(model, opt), _raw_state(m2, o2)

    return run


def _raw_into_named(folder: str) -> tuple[dict, dict]:
    model, opt = _job(False, 0, sharded=True)
    ucp_save({"model": model.state_dict(), "optim": opt.state_dict()}, folder)
    m2, o2 = _job(False, 1, sharded=True)
    sd = dict(zip(("model", "optim"), get_state_dict(m2, o2)))
    ucp_load(sd, folder)
    return _raw_state(model, opt), _raw_state(m2, o2)


def _raw_stages(folder: str) -> tuple[dict, dict]:
    """Each rank optimizes its own part of the model (a pipeline stage): rank 0 the embedding, rank 1 the
    norm and head; a raw state dict numbers each rank's parameters from 0."""
    model = TiedLM(False, 0)
    mine = [model.tok_embeddings.weight] if dist.get_rank() == 0 else [*model.norm.parameters(), model.output.weight]
    opt = torch.optim.AdamW(mine, lr=0.05)
    model(torch.randint(0, 12, (2, 3))).square().sum().backward()
    opt.step()
    ucp_save({"optim": opt.state_dict()}, folder)
    return {}, {}


SCENARIOS: dict[str, Scenario] = {
    "form-tied-same": Scenario(_tied_same, "tied fsdp2 dp=2 (get_state_dict)", "tied fsdp2 dp=2"),
    "form-tied-plain": Scenario(_tied_into(True, []), "tied fsdp2 dp=2", "tied, plain on each rank"),
    "form-tied-untied": Scenario(_tied_into(False, []), "tied fsdp2 dp=2", "untied, plain on each rank"),
    "form-tied-rule": Scenario(
        _tied_into(True, [Tied("tok_embeddings.weight", (r"output\.weight",))]),
        "tied fsdp2 dp=2",
        "tied, Tied declared at load only",
    ),
    "form-tied-copies": Scenario(_tied_from_copies(False, []), "equal copies saved separately", "tied fsdp2 dp=2"),
    "form-tied-differ": Scenario(
        _tied_from_copies(True, []), "different copies saved separately", "tied fsdp2 dp=2", must_refuse=True
    ),
    "form-tied-differrule": Scenario(
        _tied_from_copies(True, [Tied("tok_embeddings.weight", (r"output\.weight",))]),
        "different copies saved separately",
        "tied fsdp2 dp=2, Tied declared at load",
        must_refuse=True,
    ),
    "form-tied-stockwriter": Scenario(_tied_stock_writer(False), "tied fsdp2 dp=2, stock dcp.save", "tied fsdp2 dp=2"),
    "form-tied-stockdiffer": Scenario(
        _tied_stock_writer(True), "different copies, stock dcp.save", "tied fsdp2 dp=2", must_refuse=True
    ),
    "form-tied-reader": Scenario(
        _tied_stock_reader, "tied fsdp2 dp=2", "tied fsdp2 dp=2, stock dcp.load", stock_load=True
    ),
    "form-raw-same": Scenario(_raw(True, True), "raw optimizer.state_dict() fsdp2 dp=2", "raw, fsdp2 dp=2"),
    "form-raw-plain": Scenario(_raw(True, False), "raw fsdp2 dp=2", "raw, plain on each rank"),
    "form-raw-regrouped": Scenario(_raw(True, True, grouping="one"), "raw fsdp2 dp=2", "raw, one param group"),
    "form-raw-named": Scenario(_raw_into_named, "raw fsdp2 dp=2", "get_state_dict form"),
    "form-raw-stages": Scenario(_raw_stages, "raw, each rank its own optimizer", "-", must_refuse=True),
    "form-raw-stockwriter": Scenario(_raw(True, True, writer="stock"), "raw fsdp2 dp=2, stock dcp.save", "raw"),
    "form-raw-reader": Scenario(
        _raw(True, True, reader="stock"), "raw fsdp2 dp=2", "raw, stock dcp.load", stock_load=True
    ),
}
"""Every form mistake, by the name the summary prints."""


def form_worker(rank: int, world: int, root: str, names: list[str]) -> list[dict] | None:
    """Every rank: run the scenarios ``names`` (one folder each); rank 0 returns the harness's result dicts."""
    results = []
    for name in names:
        sc = SCENARIOS[name]
        failure, expected, loaded = attempt(sc.run, os.path.join(root, name))
        failure = agree(failure)
        dist.barrier()
        if failure is not None:
            res = dict(failure)
        elif sc.must_refuse:
            res = {
                "outcome": "silent",
                "diffs": 0,
                "first": ["the checkpoint held two values for one tensor; no error"],
            }
        else:
            diffs = state_diffs(expected, loaded)
            res = {"outcome": "silent", "diffs": len(diffs), "first": diffs[:4]} if diffs else {"outcome": "ok"}
        if sc.stock_load:
            res["outcome"] = "stock-" + (res["outcome"] if res["outcome"] in ("ok", "silent") else "refused")
        results.append({"save": sc.save, "load": sc.load, "mistake": name, **res})
    return results if rank == 0 else None
