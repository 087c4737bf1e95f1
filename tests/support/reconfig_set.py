"""The reconfiguration set (``ucp_dev.testing.elastic.RECONFIG_SET``, the one recipes/reconfig.py runs) and one
transition run on the pool. tests/planning/test_reconfig.py checks each resume,
tests/tools/test_dryrun_reconfig.py plans the same loads against their ReadStats; both take the runs
from the session fixture ``reconfig_runs`` (tests/conftest.py), so each transition runs once per session
whichever test asks first, and either file runs alone."""

from __future__ import annotations

import logging
import time

import dist as D

from ucp_dev.testing.elastic import RECONFIG_SET, elastic_resume
from ucp_dev.toy import Topology

STEPS = 1
"""Training steps of the save job and of the resumed job (one each: the resumed step already uses every loaded
optimizer moment; two cost make test ~5 s more per transition). ``make reconfig`` runs its own count."""


def world(text: str) -> int:
    return Topology.parse(text).world


TRANSITIONS = RECONFIG_SET
MAKE_TEST = [("dp=4", "dpr=2,dp=2")]
"""The transition ``make test`` runs (HSDP with its traffic check; PP re-staging is there in the mistake sample's and
the torch_checkpointing resharder's dp=2,pp=2 -> pp=4 and in tests/layout/test_structure.py; EP layouts are covered there by
the HF Mixtral/Qwen3-MoE and forgotten-expert-map cases, EP to DP here in ``make test-full``; virtual stages are
tests/torchtitan/test_interleave.py's); the rest of the set runs in ``make test-full``; the e2e tier's mistake
set loads every transition bitwise (CI: a sample each run, all of it over the rotating shards)."""


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
