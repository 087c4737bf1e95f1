"""Where a host keeps its memory-tier generations, and what one host holds.

Every host has one folder under the root (``$UCP_DCP_SHM_ROOT``, default ``/dev/shm/ucp_dcp``: tmpfs,
so the bytes live in host memory and outlive the training processes, not the host)::

    <root>/host-<name>/gen-<n>/   __<rank>_<token>_<i>.distcp   data files of this host's ranks
                                  __<rank>_<token>_<i>.distcp   replicas of other hosts' files
                                  .metadata, .ucp.<hash>.json   the generation's commit (as on disk)
                                  .complete.json                 written last: every piece has its replicas

A generation folder is the checkpoint folder format of :mod:`ucp_dcp.storage` (same data files, same
sidecar, same ``.metadata`` rename as the commit) split over hosts, plus the completion marker
(:mod:`ucp_dcp.memory.marker`). Only a generation with a valid marker is ever loaded.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field

from .. import settings
from ..storage.commit import METADATA
from ..storage.sidecar import metadata_hash, sidecar_name

__all__ = [
    "SHM_ROOT_ENV",
    "default_root",
    "host_name",
    "host_dir",
    "gen_dir",
    "generations",
    "data_files",
    "read_commit",
    "remove_generation",
    "HostHolding",
]

SHM_ROOT_ENV = settings.ENV["shm_root"]
_GEN = re.compile(r"^gen-(\d+)$")
_DATA = re.compile(r"^__\d+_.*\.distcp$")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_root() -> str:
    """``$UCP_DCP_SHM_ROOT``, else ``/dev/shm/ucp_dcp`` (tmpfs: host memory that outlives a process)."""
    return settings.shm_root()


def host_name() -> str:
    """This process's host: ``$UCP_DCP_HOST`` (tests simulate hosts with it) or the machine's name."""
    return settings.host()


def host_dir(root: str, host: str) -> str:
    return os.path.join(root, "host-" + _SAFE.sub("_", host))


def gen_dir(root: str, host: str, gen: int) -> str:
    return os.path.join(host_dir(root, host), f"gen-{gen:08d}")


def generations(root: str, host: str) -> list[int]:
    """Generation numbers with a folder on ``host`` (committed or not), ascending."""
    try:
        names = os.listdir(host_dir(root, host))
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _GEN.match(n)))


def data_files(folder: str) -> dict[str, int]:
    """Data files in a generation folder and their sizes."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return {}
    return {n: os.path.getsize(os.path.join(folder, n)) for n in names if _DATA.match(n)}


def read_commit(folder: str) -> tuple[bytes, bytes] | None:
    """``(.metadata bytes, sidecar bytes)`` of a committed generation folder; None when it holds no
    commit (or a ``.metadata`` without its sidecar: not ours, never loaded)."""
    try:
        with open(os.path.join(folder, METADATA), "rb") as f:
            md = f.read()
        with open(os.path.join(folder, sidecar_name(metadata_hash(md))), "rb") as f:
            return md, f.read()
    except FileNotFoundError:
        return None


def remove_generation(root: str, host: str, gen: int) -> None:
    shutil.rmtree(gen_dir(root, host, gen), ignore_errors=True)


@dataclass
class HostHolding:
    """What one host holds of one generation, as its leader found it (untrusted until checked)."""

    host: str
    """The host's name."""
    gen: int
    """Generation number."""
    metadata_hash: str | None = None
    """XXH3-128 of the generation's committed ``.metadata`` here (None: not committed here)."""
    complete: bool = False
    """A completion marker that decodes, matches the commit and lists this host's files."""
    wanted: dict[str, int] = field(default_factory=dict)
    """Every data file of the generation and its size, from the marker (empty without one)."""
    files: dict[str, int] = field(default_factory=dict)
    """Data files present whose size and content match the marker (all present ones, without one)."""
    bad: dict[str, str] = field(default_factory=dict)
    """Data files present that do not match the marker: file -> why (a corrupt or short replica)."""
    problem: str | None = None
    """Why the generation is not usable from this host (no commit, no marker, damaged marker)."""
    step: int | None = None
    """The training step its saver gave, from the marker (None: not said, or no marker)."""
