"""The DCP calls of ``UCPCheckpointManager.dcp_save`` / ``dcp_load``, with ucp_dcp's planners and storage.

The manager overrides torchtitan's ``dcp_save``/``dcp_load`` (torchtitan 0.3.0 saves and loads only through
them) and makes the same ``dcp.save``/``dcp.async_save``/``dcp.load`` calls they make -- the async modes, the
manager's process group and stager, garbage collection, the model reload after a load -- adding the UCP
planner and the UCP storage writer or reader (checksums, atomic commit, safe
opening). A ``checkpoint_id`` on an object store (``--checkpoint.folder s3://bucket/run``) gets them too: the
writer's commit there is one single-object write (:mod:`ucp_dcp.storage.object_commit`), the reader's reads
exact ranged GETs; other fsspec protocols, which promise no atomic write, are left to DCP's writer. Nothing
global is patched: two managers in one process (threads included) each make their own
calls.

A torchtitan release that calls DCP from another method would save that path with DCP's defaults, silently
stock; :func:`check_dcp_paths` reads the manager's torchtitan classes once and refuses, at construction, any
DCP call outside the methods ucp_dcp overrides.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
import types
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import AsyncMode
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.tools.utils import GarbageCollection

from ..errors import UCPError
from ..planning.checkpoint_group import enabled, guarded
from ..planning.load_planner import UCPLoadPlanner
from ..planning.save_planner import UCPSavePlanner
from ..storage.object_store import OBJECT_PROTOCOLS, object_protocol
from ..storage.reader import UCPFileSystemReader
from ..storage.writer import UCPFileSystemWriter

__all__ = ["OVERRIDDEN", "check_dcp_paths", "dcp_calls_outside", "ucp_dcp_load", "ucp_dcp_save", "ucp_reader"]

logger = logging.getLogger(__name__)

OVERRIDDEN = ("dcp_save", "dcp_load")
"""The torchtitan methods that make DCP calls and ``UCPCheckpointManager`` overrides."""
_DCP_CALLS = ("save", "async_save", "load")


def _ours(checkpoint_id: Any) -> bool:
    """A local folder or an object-store URL: where ``UCPFileSystemWriter`` commits atomically."""
    if checkpoint_id is None:
        return False
    proto = object_protocol(checkpoint_id)
    return proto is None or proto == "file" or proto in OBJECT_PROTOCOLS


@torch.no_grad()
def ucp_dcp_save(
    manager: Any, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any, planner: UCPSavePlanner, gc: bool
) -> Any:
    """torchtitan 0.3.0's ``dcp_save`` (not to Hugging Face) with ``planner`` and, for a local folder or an object
    store, our writer: returns what its DCP call returns (None, a ``Future`` or an ``AsyncSaveResponse``)."""
    writer = UCPFileSystemWriter(checkpoint_id) if _ours(checkpoint_id) else None
    common: dict[str, Any] = {"storage_writer": writer, "checkpoint_id": checkpoint_id, "planner": planner}
    if async_mode == AsyncMode.ASYNC:
        ret = dcp.async_save(state_dict, process_group=manager.pg, **common)
    elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
        ret = dcp.async_save(
            state_dict,
            process_group=manager.pg,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=manager.stager,
            **common,
        )
    else:
        with guarded(None, _choice(manager), "save") as group:
            ret = dcp.save(state_dict, process_group=group, **common)
    if gc:
        GarbageCollection.collect("GC collection invoked by checkpointer.")
    return ret


@torch.no_grad()
def ucp_reader(checkpoint_id: Any) -> UCPFileSystemReader | None:
    """Our reader for a local folder or an fsspec URL (object stores: exact ranged GETs)."""
    return UCPFileSystemReader(checkpoint_id) if checkpoint_id is not None else None


def ucp_dcp_load(
    manager: Any,
    state_dict: dict[str, Any],
    checkpoint_id: str,
    planner: UCPLoadPlanner,
    reader: UCPFileSystemReader | None,
) -> None:
    """torchtitan 0.3.0's ``dcp_load`` (not from Hugging Face) with ``planner`` and ``reader``
    (:func:`ucp_reader`); the model is reloaded from the flattened state afterwards, as torchtitan does."""
    with guarded(None, _choice(manager), "load") as group:
        dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=reader, planner=planner, process_group=group)
    if MODEL in manager.states:
        manager.states[MODEL].load_state_dict(state_dict)


def _choice(manager: Any) -> bool:
    """Whether a synchronous save or load runs DCP's collectives on the checkpoint group over the world:
    unless ``checkpoint.control_group`` or ``$UCP_DCP_CONTROL_GROUP`` turns it off (then DCP's default)."""
    config = getattr(manager, "ucp", None)
    return enabled(getattr(config, "control_group", None)) and enabled()


def dcp_calls_outside(cls: type, allowed: tuple[str, ...] = OVERRIDDEN, library: str = "torchtitan") -> list[str]:
    """``Class.method`` of every method of ``cls``'s classes from ``library`` (its MRO) that calls DCP's
    save/async_save/load but is not in ``allowed``. A class whose source cannot be read is named too."""
    out = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith(library):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            out.append(f"{klass.__qualname__} (source unreadable)")
            continue
        names = _dcp_names(inspect.getmodule(klass))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in allowed:
                if any(_is_dcp_call(c, names) for c in ast.walk(node) if isinstance(c, ast.Call)):
                    out.append(f"{klass.__qualname__}.{node.name}")
    return out


def _dcp_names(module: types.ModuleType | None) -> tuple[set[str], set[str]]:
    """Names in ``module`` bound to ``torch.distributed.checkpoint`` and to its save/load functions."""
    glob = vars(module) if module is not None else {}
    modules = {n for n, v in glob.items() if v is dcp}
    funcs = {n for n, v in glob.items() if any(v is getattr(dcp, f) for f in _DCP_CALLS)}
    return modules, funcs


def _is_dcp_call(call: ast.Call, names: tuple[set[str], set[str]]) -> bool:
    modules, funcs = names
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr in _DCP_CALLS and isinstance(f.value, ast.Name):
        return f.value.id in modules
    return isinstance(f, ast.Name) and f.id in funcs


@functools.cache
def check_dcp_paths(cls: type, library: str = "torchtitan") -> None:
    """Refuse a torchtitan checkpoint manager that calls DCP outside the methods ucp_dcp overrides: that
    path would save or load with DCP's planner and storage, silently stock (once per class)."""
    outside = dcp_calls_outside(cls, library=library)
    if outside:
        raise UCPError(
            f"torchtitan's checkpoint manager calls DCP from {', '.join(outside)}, which ucp_dcp does not override "
            f"(only {', '.join(OVERRIDDEN)}): those saves or loads would run without ucp_dcp's planner and storage",
            wanted=list(OVERRIDDEN),
            saved=outside,
            hint="use a torchtitan release ucp_dcp supports (ucp_dcp.torchtitan._compat.TESTED_TORCHTITAN), or "
            "turn the ucp_dcp checkpoint option off",
        )
