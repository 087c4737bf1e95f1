"""Keys of cached load plans (:mod:`ucp_dcp.planning.plan_cache`): digests of everything a plan depends on.

A rank's plan key covers the checkpoint's metadata (:func:`metadata_digest`), the resolved target
(:func:`target_signature`) and the planner's options, class, coordinator role and staging settings
(``UCPLoadPlanner._plan_key``); a reader's key adds what its read-once summary depends on
(:func:`reader_key`). Equal keys mean equal plans: a key that misses something a plan depends on would load
wrong state, so the tests check that every field of the resolved target is covered (:data:`SIGNED_FIELDS`).
"""

from __future__ import annotations

import hashlib
import marshal
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from .. import settings
from .opened import CheckedMetadata

__all__ = ["SIGNED_FIELDS", "digest", "metadata_digest", "target_signature", "reader_key", "this_host"]


def digest(*parts: Any) -> bytes:
    """16-byte BLAKE2b of ``parts``: bytes as they are, anything else by its ``repr`` (value-based for the
    dataclasses, tuples and dicts keys are made of)."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        b = p if isinstance(p, bytes) else repr(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def metadata_digest(md: Metadata) -> bytes | None:
    """What identifies the checkpoint's metadata: the hash of its ``.metadata`` bytes when a ucp_dcp reader
    opened it, else a hash of the pickled tables (None: they do not pickle)."""
    if isinstance(md, CheckedMetadata) and md.digest:
        return md.digest.encode()
    try:
        data = pickle.dumps((md.state_dict_metadata, md.planner_data, md.storage_data, md.version), protocol=5)
    except Exception:  # metadata of a foreign reader holding objects pickle refuses: not cached, planned afresh
        return None
    return hashlib.blake2b(data, digest_size=16).digest()


def _memory(t: torch.Tensor, storages: dict[tuple[Any, Any], int], names: dict[Any, str]) -> tuple[Any, ...]:
    """A tensor's memory as the plan sees it; its storage as the ordinal of its first sighting (the start of
    its storage: ``data_ptr`` less the offset, without building a storage object). ``names``: dtype, device
    and layout names (their ``repr`` is slow)."""
    offset = t.storage_offset()
    device = t.device
    ordinal = storages.setdefault((device, t.data_ptr() - offset * t.element_size()), len(storages))
    kind = (t.dtype, device, t.layout)
    name = names.get(kind)
    if name is None:
        name = names[kind] = str(kind)
    return (name, tuple(t.shape), t.stride(), offset, ordinal)


def _fragments(fs: Sequence[Any] | None) -> Any:
    """Fragments as plain tuples (their dataclass ``repr`` costs as much as the rest of a signature)."""
    if fs is None:
        return None
    return [(f.atom, f.box.offsets, f.box.sizes, f.local.offsets, f.local.sizes, f.view_shape, f.shard) for f in fs]


SIGNED_FIELDS = {
    "Resolved": (
        "entry",
        "atom",
        "atoms",
        "paths",
        "fragments",
        "fills",
        "fill_value",
        "padding_rule",
        "fanout",
        "present",
        "tied",
        "replicated",
        "reduce",
        "index_claims",
        "unsplit",
        "memory",
    ),
    "Entry": ("key", "atom", "value", "path", "stock"),
    "Fragment": ("atom", "box", "local", "view_shape", "shard"),
    "Box": ("offsets", "sizes"),
    "GroupTarget": ("group", "prefix", "index", "params", "hyperparams"),
}
"""The fields of the resolved target :func:`target_signature` covers (a test checks no field is added unseen)."""


def target_signature(targets: Iterable[Any], raw: Any, groups: Sequence[Any]) -> bytes | None:
    """A digest of everything ``UCPLoadPlanner.create_local_plan`` reads of the resolved target: per entry its
    key, paths, atoms and their records (shapes, dtypes, DTensor meshes and placements), fragments, fills and
    rules, and its local memory (dtype, device, shape, strides, offset, and which entries share a storage:
    aliasing decides reads); the raw optimizers' parameter positions; the param groups' names. Values never
    count (an entry's own atom is its ``Entry.atom`` renamed). None when some memory cannot be described (no
    plain storage)."""
    storages: dict[tuple[Any, Any], int] = {}
    names: dict[Any, str] = {}
    rows: list[Any] = []
    try:
        for r in targets:
            e = r.entry
            mem: Any = None
            if isinstance(e.value, torch.Tensor):
                local = r.local  # ``memory`` when set, else the value's local tensor
                mem = (
                    tuple(_memory(t, storages, names) for t in local)
                    if isinstance(local, tuple)
                    else _memory(local, storages, names)
                )
            rows.append(
                (
                    e.key,
                    e.path,
                    e.stock,
                    type(e.value).__module__,
                    type(e.value).__qualname__,
                    r.atom.prefix,
                    r.atom.param,
                    r.atom.suffix,
                    r.atom.kind,
                    r.atom.path,
                    r.atom.form,
                    r.atoms,
                    r.paths,
                    _fragments(r.fragments),
                    [(b.offsets, b.sizes) for b in r.fills],
                    r.fill_value,
                    _rule(r.padding_rule),
                    r.fanout,
                    r.present,
                    r.tied,
                    _rule(r.replicated),
                    _rule(r.reduce),
                    r.index_claims,
                    _fragments(r.unsplit),
                    mem,
                )
            )
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without plain storage
        return None
    groups_sig = [(g.prefix, g.index, g.params, g.hyperparams) for g in groups]
    return digest(b"ucp-load-target-1", _encode(rows), raw, groups_sig)


def _rule(rule: Any) -> str | None:
    return None if rule is None else repr(rule)  # a frozen dataclass: its repr is its value


def _encode(rows: list[Any]) -> bytes:
    """``rows`` as bytes: ``marshal`` format 2 (value-based: no references between objects; five times faster
    than ``repr``), or their ``repr`` when they hold other types."""
    try:
        return b"m" + marshal.dumps(rows, 2)
    except ValueError:
        return b"r" + repr(rows).encode()


def this_host() -> str:
    """The host read-once groups ranks by (as :func:`ucp_dcp.storage.transport.local_summary` names it)."""
    return settings.host()


def reader_key(plan_key: bytes, reader: type, mode: str) -> bytes:
    """The key of a reader's summary of the plan ``plan_key``: what else the summary depends on."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return digest(b"ucp-load-reader-1", plan_key, f"{reader.__module__}.{reader.__qualname__}", mode, rank, this_host())
