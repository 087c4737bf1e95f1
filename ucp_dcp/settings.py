"""Process settings: every environment variable ucp_dcp reads, parsed and checked in this one module.

A call's arguments (``ucp_dcp.save(..., control_group=...)``, :class:`~ucp_dcp.options.UCPOptions`, the
planners' and storage's constructors) come first; these are the process-wide defaults behind them, for
what a launcher or a test sets for every rank at once (the peer timeout of a job, simulated hosts). They
are read when a call needs them, not at import, so a test or launcher that sets one before the call is
seen by it. The table in ``docs/guide.md`` ("Settings") lists them; :data:`ENV` holds their names.

| variable | default | read by |
|---|---|---|
| ``UCP_DCP_PEER_TIMEOUT_S`` | 30 | the bound on waiting for another rank (gates, the read-once exchange) |
| ``UCP_DCP_BEAT_S`` | peer timeout / 10 | how long a rank may stay silent in a call before it beats |
| ``UCP_DCP_CONTROL_GROUP`` | on | DCP's collectives on a checkpoint group (``control_group=None``) |
| ``UCP_DCP_P2P`` | default | ``side``: host-byte messages on a gloo group of their own even on gloo |
| ``UCP_DCP_HOST`` | the machine's name | the host a rank is on (read-once groups, the memory tier) |
| ``UCP_DCP_STAGING`` | auto | ``always``: CPU targets go through device staging too |
| ``UCP_DCP_PROGRESS`` | stderr is a terminal | progress lines on rank 0 |
| ``UCP_DCP_SHM_ROOT`` | /dev/shm/ucp_dcp | the memory tier's root |
| ``UCP_DCP_PLAN_WORKERS`` | one per 256 ranks | processes ``ucp_dcp plan`` plans with |
| ``UCP_DCP_ALLOW_UNTESTED_TORCH`` | unset | ``1``: import on a torch whose probes fail (a warning) |
| ``UCP_DCP_ALLOW_UNTESTED_TORCHTITAN`` | unset | ``1``: the torchtitan option on an untested release |
| ``LOCAL_WORLD_SIZE`` | 1 | torchrun's: ranks on this host share its cores for I/O threads |
"""

from __future__ import annotations

import os
import socket

from .errors import InvalidArgumentError

__all__ = [
    "ENV",
    "DEFAULT_PEER_TIMEOUT_S",
    "peer_timeout_s",
    "beat_s",
    "control_group",
    "p2p_side",
    "host",
    "staging",
    "progress",
    "shm_root",
    "plan_workers",
    "allow_untested",
    "local_world_size",
]

ENV = {
    "peer_timeout_s": "UCP_DCP_PEER_TIMEOUT_S",
    "beat_s": "UCP_DCP_BEAT_S",
    "control_group": "UCP_DCP_CONTROL_GROUP",
    "p2p": "UCP_DCP_P2P",
    "host": "UCP_DCP_HOST",
    "staging": "UCP_DCP_STAGING",
    "progress": "UCP_DCP_PROGRESS",
    "shm_root": "UCP_DCP_SHM_ROOT",
    "plan_workers": "UCP_DCP_PLAN_WORKERS",
    "torch": "UCP_DCP_ALLOW_UNTESTED_TORCH",
    "torchtitan": "UCP_DCP_ALLOW_UNTESTED_TORCHTITAN",
}
"""Setting -> the environment variable that sets it."""

DEFAULT_PEER_TIMEOUT_S = 30.0
"""Default bound on waiting for another rank's step or message (independent of the process group's timeout)."""

_OFF = ("0", "off", "false", "no")


def _raw(name: str) -> str:
    return os.environ.get(ENV[name], "").strip()


def _seconds(name: str) -> float | None:
    """A positive number of seconds, None when unset; anything else is refused with the variable named."""
    raw = _raw(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:  # also NaN
        raise InvalidArgumentError(f"{ENV[name]}={raw!r}: expected seconds (a number > 0)", wanted="seconds > 0")
    return value


def peer_timeout_s() -> float:
    """Seconds to wait for another rank (``UCP_DCP_PEER_TIMEOUT_S``, default 30)."""
    value = _seconds("peer_timeout_s")
    return DEFAULT_PEER_TIMEOUT_S if value is None else value


def beat_s() -> float:
    """Seconds a rank may say nothing in a call before its thread beats (``UCP_DCP_BEAT_S``; default a tenth of
    the peer timeout): a watcher judges a beat that stood still for the whole peer timeout, so ten fit in it."""
    value = _seconds("beat_s")
    return peer_timeout_s() / 10 if value is None else value


def control_group(choice: bool | None = None) -> bool:
    """``choice`` if given, else ``UCP_DCP_CONTROL_GROUP`` (on unless ``off``/``0``/``false``/``no``)."""
    return choice if choice is not None else _raw("control_group").lower() not in _OFF


def p2p_side() -> bool:
    """``UCP_DCP_P2P=side``: host-byte messages on a gloo group of their own even when the default group is gloo."""
    return _raw("p2p") == "side"


def host() -> str:
    """This process's host: ``UCP_DCP_HOST`` (tests and the dry run simulate hosts with it), else the machine's name."""
    return _raw("host") or socket.gethostname()


def staging(mode: str | None = None) -> str:
    """``mode`` if given, else ``UCP_DCP_STAGING`` (default ``auto``); ``auto`` or ``always``."""
    chosen = mode if mode is not None else (_raw("staging") or "auto")
    if chosen not in ("auto", "always"):
        where = "" if mode is not None else f" (${ENV['staging']})"
        raise InvalidArgumentError(f"staging must be 'auto' or 'always', got {chosen!r}{where}", wanted="auto | always")
    return chosen


def progress() -> bool | None:
    """``UCP_DCP_PROGRESS``: True or False when set, None (ask the terminal) when not."""
    raw = _raw("progress").lower()
    return None if not raw else raw not in _OFF


def shm_root() -> str:
    """The memory tier's root: ``UCP_DCP_SHM_ROOT``, else ``/dev/shm/ucp_dcp`` (tmpfs: host memory that outlives a
    process)."""
    return _raw("shm_root") or "/dev/shm/ucp_dcp"


def plan_workers() -> int | None:
    """``UCP_DCP_PLAN_WORKERS`` when a whole number, else None (``ucp_dcp plan`` chooses)."""
    raw = _raw("plan_workers")
    return int(raw) if raw.isdigit() else None


def allow_untested(what: str) -> bool:
    """Whether to go on with an untested ``what`` (``torch`` or ``torchtitan``): its variable set to ``1``."""
    return _raw(what) == "1"


def local_world_size() -> int:
    """Ranks on this host, as torchrun says (``LOCAL_WORLD_SIZE``; 1 when not under torchrun)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1
