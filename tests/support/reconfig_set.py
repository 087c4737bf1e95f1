"""The reconfiguration set (``TRANSITIONS`` in recipes/reconfig.py, read as data: nothing from recipes/ is
imported) and one transition run on the pool. tests/planning/test_reconfig.py checks each resume,
tests/tools/test_dryrun_reconfig.py plans the same loads against their ReadStats; both take the runs
from the session fixture ``reconfig_runs`` (tests/conftest.py), so each transition runs once per session
whichever test asks first, and either file runs alone."""

from __future__ import annotations

import ast
import logging
import time

import dist as D
from helpers import ROOT
from training import elastic_resume

from ucp_dcp.toy import Topology

STEPS = 2
"""Training steps of the save job and of the resumed job."""


def _recipe_transitions() -> list[tuple[str, str]]:
    tree = ast.parse((ROOT / "recipes" / "reconfig.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TRANSITIONS" for t in node.targets):
            return [tuple(t) for t in ast.literal_eval(node.value)]
    raise AssertionError("recipes/reconfig.py has no TRANSITIONS list")


def world(text: str) -> int:
    return Topology.parse(text).world


TRANSITIONS = _recipe_transitions()
MAKE_TEST = [("dp=4", "dpr=2,dp=2"), ("ep=4", "dp=4"), ("pp=3", "pp=2"), ("pp=2,vpp=2", "dp=1"), ("dp=2,pp=2", "pp=4")]
"""The transitions ``make test`` runs (HSDP with its traffic check, EP to DP, PP re-staging, virtual stages,
PP with DP); the rest of the set runs in ``make test-full``; the e2e tier's mistake set loads every transition bitwise."""


def transition_id(t) -> str:
    return f"{t[0]}-to-{t[1]}".replace("=", "").replace(",", "")


def _transition_worker(rank, world, root, save, load, steps):
    D.setenv("UCP_DCP_HOST", f"node{rank // 2}")  # two simulated hosts of two ranks: read-once sends across
    # the oracle's full_tensor() of FSDP x TP weights logs a performance warning per call
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    out = elastic_resume(Topology.parse(save), Topology.parse(load), steps, root)
    if out is not None:
        out["seconds"] = time.perf_counter() - t0
    return out


def run_transition(save: str, load: str) -> dict:
    """Save at ``save``, resume at ``load`` (on the 4-process pool, or the 8-process one when either side
    needs more ranks): rank 0's answer, with the checkpoint and every load rank's ReadStats."""
    n = 4 if max(world(save), world(load)) <= 4 else 8
    return D.run(_transition_worker, n, D.tmpdir(), save, load, STEPS)[0]
