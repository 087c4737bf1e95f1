"""The CI share of the end-to-end tier: every run takes the core items, plus one shard of the rest.

``make test-e2e`` runs every e2e item (about an hour on the 2-core CI machine); CI cannot. So CI runs
``pytest -m e2e --e2e-shard auto``:

* the **core** items (marker ``e2e_core``) every time: one per capability (a dense torchtitan resume at a new
  layout, an MoE resume, HF in and out, a foreign checkpoint, a sample of the mistake set and of the fault set,
  ``plan`` against a real load, a sample of one-rank failures);
* one of :data:`SHARDS` shards of the other items, chosen from the commit (``git rev-list --count HEAD`` modulo
  :data:`SHARDS`): the same commit always runs the same shard, so a failure reproduces, and successive landings
  walk through the shards, so every item runs in CI over a few landings. ``--e2e-shard K`` (or
  ``UCP_E2E_SHARD=K``) runs shard K by hand; ``--e2e-shard all`` (the default) runs everything.

Shards are balanced by the measured durations in ``tests/e2e_durations.json`` (written by
``tools/e2e_durations.py`` from a run's JUnit XML; an item not listed counts :data:`DEFAULT_SECONDS`). Items
that share a module-scoped fixture (a saved checkpoint, a trained job) stay in one shard, so no shard pays for
that set-up twice.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

CORE = {
    "a dense torchtitan resume at a new layout": "tests/e2e/test_titan_trainer.py::test_real_trainer_resumes_at_a_new_dp_degree",
    "an MoE resume at a new layout": "tests/e2e/test_titan_moe.py::test_moe_resumes_at_a_new_layout[ep4]",
    "Hugging Face in and out through the Trainer": "tests/torchtitan/test_mappings.py::test_trainer_loads_and_saves_hf_through_ucp[pp2]",
    "a foreign checkpoint at a new layout": "tests/e2e/test_foreign.py::test_megatron_torch_dist_loads_bitwise_into_a_new_layout[plain-dp2tp2]",
    "a transition of the mistake set": "tests/planning/test_mistakes.py::test_no_mistake_is_silent[dp4-to-dp2tp2]",
    "the fault set's bit flips": "tests/storage/test_commit.py::test_fault_injection[flips-args0-flips 16/16 caught]",
    "plan against a real load": "tests/e2e/test_plan_target.py::test_plan_matches_a_real_resume_rank_by_rank",
    "one-rank failures end every rank with the cause (a killed rank included)": "tests/storage/test_peer_failures.py::test_make_chaos_sample_ends_every_case_with_the_cause",
}
"""The e2e items every CI run takes, one per capability (items marked ``e2e_core`` are core too)."""
SHARDS = 6
"""How many shards the non-core items are split into; each should fit :data:`SHARD_BUDGET_S`."""
SHARD_BUDGET_S = 660.0
"""The most one shard may take by the recorded durations (the e2e share's budget in docs/testing.md is core + one shard)."""
CORE_BUDGET_S = 600.0
"""The most the core items may take by the recorded durations."""
DEFAULT_SECONDS = 60.0
"""What an item without a recorded duration is assumed to take (a typical torchrun job of the tier)."""
DURATIONS = Path(__file__).resolve().parents[1] / "e2e_durations.json"


@dataclass(frozen=True)
class Unit:
    """Items that are scheduled together."""

    key: str
    """The module's node id when its items share a module-scoped fixture, else the item's node id."""
    items: tuple[str, ...]
    """Node ids of the items, in collection order."""
    seconds: float
    """Their recorded durations summed (set-up included: JUnit times hold set-up, call and tear-down)."""


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def units(items: Iterable[tuple[str, bool]], durations: Mapping[str, float]) -> list[Unit]:
    """Group ``(nodeid, shares_module_fixture)`` pairs into units, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for nodeid, together in items:
        key = nodeid.split("::", 1)[0] if together else nodeid
        groups.setdefault(key, []).append(nodeid)
    return [Unit(k, tuple(v), sum(durations.get(i, DEFAULT_SECONDS) for i in v)) for k, v in groups.items()]


def assign(all_units: list[Unit], shards: int = SHARDS) -> list[list[Unit]]:
    """Longest-first greedy onto the least-loaded shard: deterministic (ties broken by key) and within 4/3 of
    the best balance. Depends only on the units, never on the order they were collected in."""
    out: list[list[Unit]] = [[] for _ in range(shards)]
    load = [0.0] * shards
    for u in sorted(all_units, key=lambda u: (-u.seconds, u.key)):
        k = min(range(shards), key=lambda s: (load[s], s))
        out[k].append(u)
        load[k] += u.seconds
    return out


def entry(item) -> tuple[str, bool, bool]:
    """``(nodeid, shares_module_fixture, is_core)`` of a collected pytest item: whether it uses a module-scoped
    fixture defined in its own module (a saved checkpoint, a trained job), and whether it is marked core."""
    module = item.nodeid.split("::", 1)[0]
    defs = getattr(item, "_fixtureinfo", None)
    together = bool(defs) and any(
        fd.scope != "function" and getattr(fd, "baseid", "") == module
        for fds in defs.name2fixturedefs.values()
        for fd in fds
    )
    return item.nodeid, together, item.nodeid in CORE.values() or item.get_closest_marker("e2e_core") is not None


def split(
    items: Iterable[tuple[str, bool, bool]], durations: Mapping[str, float], shards: int = SHARDS
) -> tuple[list[str], list[list[Unit]]]:
    """The core items and the shards of the others, from ``(nodeid, shares_module_fixture, is_core)`` triples."""
    items = list(items)
    core = [n for n, _, c in items if c]
    return core, assign(units(((n, t) for n, t, c in items if not c), durations), shards)


def commit_shard(root: Path, shards: int = SHARDS) -> tuple[int, str]:
    """The shard of the checked-out commit: its depth (commits reachable from HEAD) modulo ``shards``."""
    env = os.environ.get("UCP_E2E_SHARD")
    if env not in (None, "", "auto"):
        return int(env) % shards, f"UCP_E2E_SHARD={env}"
    git = ["git", "-C", str(root)]
    count = int(
        subprocess.run([*git, "rev-list", "--count", "HEAD"], capture_output=True, text=True, check=True).stdout
    )
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout
    return count % shards, f"commit {head.strip()}, {count} commits deep"
