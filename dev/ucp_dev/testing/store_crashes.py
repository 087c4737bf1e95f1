"""Kills of real rank processes at every request of a save on an object store (``make faults`` with
``--store s3``): the crash set of ``recipes/faults.py`` against a local S3 server.

A save of ``WORLD`` ranks over an existing checkpoint on ``s3://`` is run once cleanly, counting every store
request each rank makes (:meth:`~ucp_dcp.storage.object_store.ObjectStore.call`: HEADs, PUTs, multipart
parts, the commit's PUT of ``.metadata``, the clean-up's listings and DELETEs). Then, for each kill point
``(rank, n)`` -- every request of the coordinator and of one other rank -- a fresh job saves the next
generation and that rank SIGKILLs itself just before its ``n``-th request (the others are killed with the
job). After each kill:

* the prefix must load the previous generation or the new one bitwise (*lost* otherwise);
* a save that wrote anything and did not commit must be detected: every object in the prefix that the
  committed checkpoint does not name is reported as a stray by ``inspect`` (``open_path``), and multipart
  uploads it left open are counted (the next save aborts them).

After the walk a clean save must leave no strays and no open uploads. Data objects are made multipart
uploads of two parts (the part and single-PUT sizes lowered to 5 MiB in the ranks), so kills land between
parts too.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["WORLD", "StoreCrashes", "kill_points", "store_crash_trials"]

WORLD = 4
"""Ranks of every save."""
ROWS, COLS = 2048, 1024
"""Rows per rank of the sharded parameter (8 MiB of fp32 per rank: one object of two 5 MiB-parts)."""


@dataclass
class StoreCrashes:
    """The outcome of a kill walk."""

    trials: int = 0
    """Kills run."""
    lost: int = 0
    """Kills after which the prefix loaded neither generation (or the final clean save failed)."""
    undetected: int = 0
    """Kills that left objects of an uncommitted save that ``inspect`` did not report as strays."""
    kept: dict[str, int] = field(default_factory=lambda: {"previous": 0, "new": 0})
    """Which generation the prefix held after the kills."""
    uploads_left: int = 0
    """Kills that left multipart uploads open (invisible to readers; aborted by the next save)."""
    notes: list[str] = field(default_factory=list)
    """What went wrong, one line each."""


def _state(rank: int, world: int, gen: int, target: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(500 + gen)
    full = torch.randn(world * ROWS, COLS, generator=g)
    norm = torch.randn(COLS, generator=g)
    mesh = DeviceMesh("cpu", torch.arange(world))
    if target:
        full, norm = torch.zeros_like(full), torch.zeros_like(norm)
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
        "norm": norm,
        "train": {"step": -1 if target else gen, "tag": "" if target else f"g{gen}"},
    }


def _arm(kill_at: int | None) -> list[int]:
    """Count this process's store requests; SIGKILL it just before request ``kill_at`` (1-based)."""
    from ucp_dcp.storage import object_store as OS
    from ucp_dcp.storage import object_streams as streams

    streams.PART_BYTES = streams.SINGLE_PUT_BYTES = 5 << 20  # two parts per data object: kills between parts too
    count = [0]
    lock = threading.Lock()
    real = OS.ObjectStore.call

    def call(self: Any, op: str, path: str, fn: Any) -> Any:
        with lock:
            count[0] += 1
            n = count[0]
        if n == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, op, path, fn)

    OS.ObjectStore.call = call  # type: ignore[method-assign]
    return count


def _save_rank(rank: int, world: int, env: dict[str, str], url: str, gen: int, victim: int, kill_at: int) -> int:
    os.environ.update(env)
    warnings.simplefilter("ignore")
    from ucp_dcp.api import save

    count = _arm(kill_at if rank == victim else None)
    save(_state(rank, world, gen), url)
    return count[0]


def _load(url: str) -> dict[str, Any]:
    """The whole state in this process (a resharding load of every shard)."""
    from ucp_dcp.api import load

    sd = {"w": torch.zeros(WORLD * ROWS, COLS), "norm": torch.zeros(COLS), "train": {"step": -1, "tag": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(sd, url)
    return sd


def _generation(sd: dict[str, Any], gens: tuple[int, ...]) -> int | None:
    for gen in gens:
        g = torch.Generator().manual_seed(500 + gen)
        full = torch.randn(WORLD * ROWS, COLS, generator=g)
        norm = torch.randn(COLS, generator=g)
        if (
            torch.equal(sd["w"], full)
            and torch.equal(sd["norm"], norm)
            and sd["train"] == {"step": gen, "tag": f"g{gen}"}
        ):
            return gen
    return None


def _uploads(url: str) -> list[str]:
    from ucp_dcp.storage.object_store import ObjectStore

    store = ObjectStore(url)
    bucket, _, prefix = store.root.partition("/")
    out = store.s3_call("list_multipart_uploads", Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
    return [u["Key"] for u in out.get("Uploads", []) or []]


def _undetected(url: str) -> list[str]:
    """Objects under ``url`` that are neither the committed checkpoint's nor reported as strays."""
    from ucp_dcp.storage.commit import METADATA
    from ucp_dcp.storage.object_store import ObjectStore
    from ucp_dcp.storage.opening import open_path

    _, integ = open_path(url)
    named = set(integ.files or {}) | {METADATA} | ({integ.sidecar} if integ.sidecar else set())
    return sorted(n for n in ObjectStore(url).names() or [] if n not in named and n not in integ.strays)


def kill_points(counts: list[int], victims: tuple[int, ...] = (0, 1)) -> list[tuple[int, int]]:
    """``(rank, n)``: a kill before each request ``n`` of each victim rank's clean save."""
    return [(r, n) for r in victims for n in range(1, counts[r] + 1)]


def store_crash_trials(env: dict[str, str], url: str, limit: int | None = None) -> StoreCrashes:
    """The kill walk on ``url`` (the store reached through ``env``); ``limit``: at most that many kill points,
    spread evenly over the walk (None: all of them)."""
    from ucp_dev.testing.processes import RanksFailed, run_ranks

    out = StoreCrashes()
    for k, v in env.items():
        os.environ[k] = v
    run_ranks(_save_rank, WORLD, env, url, 0, -1, 0, timeout=300)  # the checkpoint every kill saves over
    counts = run_ranks(_save_rank, WORLD, env, url, 1, -1, 0, timeout=300)  # a clean save over it: requests per rank
    current = 1
    points = kill_points(counts)
    if limit is not None and limit < len(points):
        points = [points[round(i * (len(points) - 1) / max(1, limit - 1))] for i in range(limit)]
    for i, (victim, n) in enumerate(points):
        gen = current + 1 + i
        try:
            run_ranks(_save_rank, WORLD, env, url, gen, victim, n, timeout=300)
            out.notes.append(f"rank {victim} request {n}: the save finished (the kill point was not reached)")
        except RanksFailed:
            pass
        out.trials += 1
        try:
            which = _generation(_load(url), (current, gen))
        except Exception as e:  # noqa: BLE001 - any failure to load is a lost checkpoint
            which = None
            out.notes.append(f"rank {victim} killed before request {n}: load raised {e!r}"[:300])
        if which is None:
            out.lost += 1
            out.notes.append(f"rank {victim} killed before request {n}: neither generation {current} nor {gen}")
            continue
        out.kept["previous" if which == current else "new"] += 1
        current = which
        missed = _undetected(url)
        if missed:
            out.undetected += 1
            out.notes.append(f"rank {victim} killed before request {n}: not reported as strays: {missed[:4]}")
        out.uploads_left += bool(_uploads(url))
    final = current + len(points) + 1
    run_ranks(_save_rank, WORLD, env, url, final, -1, 0, timeout=300)
    try:
        ok = _generation(_load(url), (final,)) == final
    except Exception as e:  # noqa: BLE001
        ok = False
        out.notes.append(f"the clean save after the kills did not load: {e!r}"[:300])
    from ucp_dcp.storage.opening import open_path

    strays, uploads = open_path(url)[1].strays, _uploads(url)
    if not ok or strays or uploads:
        out.lost += 1
        out.notes.append(f"after a clean save: loads {ok}, strays {strays[:4]}, open uploads {uploads[:4]}")
    out.notes.append(
        f"requests per rank of a clean save: {counts}; kill points {len(points)}; after the kills the prefix held "
        f"the previous checkpoint {out.kept['previous']}x, the new one {out.kept['new']}x; {out.uploads_left} "
        "kill(s) left multipart uploads open (aborted by the next save)"
    )
    return out
