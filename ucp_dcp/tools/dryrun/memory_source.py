"""``plan`` pointed at a memory-tier root: which generation a restart would load, and which tier serves
each rank (its own host's memory, a peer host's, or the durable copy).

The root is read the way a restarted job's host leaders read it (:func:`ucp_dcp.memory.locate.inspect_host`,
markers and file sizes) and the same choice is made (:func:`ucp_dcp.memory.locate.choose`). The load is
planned against a view of the chosen generation: a temporary folder of links to its commit and to one
intact copy of each data file, so the planner and the per-rank read model run unchanged. Each rank's
files are then matched against what its host holds.

Hosts: the target's node ``i`` (``rank // ranks_per_node``) is ``hosts[i]``; a host with no folder under
the root is a fresh, empty host. Without ``hosts`` the root's hosts are taken in name order, and nodes
beyond them are fresh. On a real cluster each host's ``/dev/shm`` is its own: point ``plan`` at a root
that gathers the hosts' folders (or run it where they are), as the simulated hosts of the tests share one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ...memory.drain import durable_dir, durable_generations
from ...memory.locate import choose, inspect_host
from ...memory.store import gen_dir, read_commit
from ...storage.commit import METADATA
from ...storage.sidecar import metadata_hash, sidecar_name

__all__ = ["is_memory_root", "MemoryView", "open_view", "annotate"]

_HOST = "host-"


def is_memory_root(path: str) -> bool:
    """Does ``path`` hold memory-tier host folders (``host-<name>/gen-<n>``)?"""
    try:
        return any(n.startswith(_HOST) and os.path.isdir(os.path.join(path, n)) for n in os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return False


@dataclass
class MemoryView:
    """The generation a restart would load from a memory root, and a folder to plan it against."""

    root: str
    """The memory root."""
    tier: str
    """``memory`` or ``durable``."""
    generation: int
    """The generation chosen."""
    path: str
    """The folder to plan against (a temporary view for tier ``memory``)."""
    holders: dict[str, list[str]] = field(default_factory=dict)
    """Tier ``memory``: every data file -> the hosts holding a copy."""
    notes: list[str] = field(default_factory=list)
    """Fresher generations passed over, and why."""
    step: int | None = None
    """The training step of the generation, when its saver said."""
    temporary: bool = False

    def close(self) -> None:
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> MemoryView:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def root_hosts(root: str) -> list[str]:
    """The hosts with a folder under ``root``, sorted."""
    return sorted(n[len(_HOST) :] for n in os.listdir(root) if n.startswith(_HOST))


def open_view(root: str, durable: str | None, hosts: list[str] | None = None) -> MemoryView:
    """Choose the generation as a restart on ``hosts`` (default: the root's) would, from what those
    hosts hold (raises ``CheckpointNotFoundError`` when nothing is complete on them nor durable), and
    build the folder to plan it against."""
    present = set(root_hosts(root))
    job = [h for h in (hosts or sorted(present)) if h in present]
    holdings = [h for host in job for h in inspect_host(root, host, verify=False)]
    tier, gen, holders, notes = choose(holdings, durable_generations(durable))
    if tier == "durable":
        assert durable is not None
        return MemoryView(root, tier, gen, durable_dir(durable, gen), notes=notes)
    host = next(h.host for h in holdings if h.gen == gen and h.complete)
    commit = read_commit(gen_dir(root, host, gen))
    assert commit is not None  # complete implies committed
    view = tempfile.mkdtemp(prefix="ucp-plan-memory-")
    md, sidecar = commit
    for name, data in ((METADATA, md), (sidecar_name(metadata_hash(md)), sidecar)):
        with open(os.path.join(view, name), "wb") as f:
            f.write(data)
    for name, hs in holders.items():
        os.symlink(os.path.join(gen_dir(root, hs[0], gen), name), os.path.join(view, name))
    step = next((h.step for h in holdings if h.gen == gen and h.complete), None)
    return MemoryView(root, tier, gen, view, holders, notes, step, temporary=True)


def annotate(report: Any, view: MemoryView, hosts: list[str] | None) -> None:
    """Set each rank's ``source`` in ``report`` (a ``PlanReport``) and name the root as its checkpoint."""
    if view.tier == "durable":
        report.checkpoint = f"{view.root} -> durable generation {view.generation} ({view.path})"
        for r in report.ranks:
            r.source = "durable"
        return
    report.checkpoint = (
        f"{view.root} (memory generation {view.generation}"
        + (f", step {view.step}" if view.step is not None else "")
        + ")"
    )
    names = hosts or root_hosts(view.root)
    for r in report.ranks:
        host = names[r.node] if r.node < len(names) else f"fresh node {r.node}"
        own = [f for f in r.files if host in view.holders.get(f, [])]
        peers = sorted({view.holders[f][0] for f in r.files if f not in own and f in view.holders})
        if not r.files:
            r.source = f"nothing to read ({host})"
        elif not peers:
            r.source = f"own host memory ({host})"
        elif not own:
            r.source = f"peer host memory ({', '.join(peers)}) for {host}"
        else:
            r.source = f"own host memory ({host}) + peer host memory ({', '.join(peers)})"
