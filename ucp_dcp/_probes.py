"""Checks, at import, that the installed torch still behaves the way ucp_dcp relies on.

ucp_dcp leans on private DTensor/DCP behaviour that a torch release may change without notice, and
in a checkpoint layer a changed behaviour means silently wrong loads. Instead of pinning a version,
:func:`check_torch` runs a few cheap probes of exactly what the code depends on (well under a
millisecond each, once per process):

* ``strided_shard``: which rows ``_StridedShard`` gives a rank in two known cases, by torch's own
  split code, its index helper and its local-shape helper, equal to ucp_dcp's fragment math;
* ``storage_records``: the fields and pickled name of DCP's ``_StorageInfo``/``_StoragePrefix``
  records, its byte-range file view and its bucketing helper (our files stay readable by DCP);
* ``planner_hooks``: the argument lists of the DCP planner and storage hooks our classes override;
* ``state_dict_traversal``: DCP's flattening (keys and paths), ``set_element``, narrowing to a box;
* ``checkpointable_tensor`` (torch >= 2.14): the four fields of DCP's ``CheckpointableTensor``.

A failed probe refuses the import (:class:`~ucp_dcp.errors.UnsupportedTorchError`, naming the
probe, what it found and what to do) unless ``UCP_DCP_ALLOW_UNTESTED_TORCH=1`` (then a warning). A
torch outside the tested releases whose probes pass imports with an
:class:`~ucp_dcp.errors.UntestedTorchWarning`.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import pickle
import warnings
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.tensor import Shard

from . import _compat as C
from . import settings
from .errors import UnsupportedTorchError, UntestedTorchWarning
from .layout.fragments import layout_fragments
from .layout.placements import Layout, Placement

__all__ = ["PROBES", "run_probes", "check_torch"]


class ProbeFailed(AssertionError):
    """One probe's finding (internal: collected by :func:`run_probes`)."""


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ProbeFailed(what)


def _rows(frags: list) -> list[int]:
    return [f.box.offsets[0] + j for f in frags for j in range(f.box.sizes[0])]


def _probe_strided_shard() -> None:
    # 1-D: _StridedShard(0, split_factor=2) over 2 ranks, 8 rows: rank 0 holds rows 0, 1, 4, 5
    p = C._StridedShard(0, split_factor=2)
    _expect((p.dim, p.split_factor) == (0, 2), f"_StridedShard(0, split_factor=2) reads back as {p!r}")
    pieces = C.split_tensor(p, torch.arange(8), 2)
    ours = [_rows(layout_fragments("p", (8,), Layout((2,), (Placement.from_torch(p),)), (i,))) for i in range(2)]
    theirs = [t.tolist() for t in pieces]
    _expect(
        theirs == ours == [[0, 1, 4, 5], [2, 3, 6, 7]],
        f"_StridedShard(0, 2) splits rows 0..7 over 2 ranks as {theirs}, ucp_dcp's math as {ours}; "
        "expected [[0, 1, 4, 5], [2, 3, 6, 7]]",
    )
    helper = [C.strided_shard_indices(p, 8, 2, i) for i in range(2)]
    _expect(helper == ours, f"_StridedShard.local_shard_size_and_offset gives rows {helper}, expected {ours}")
    # 2-D, FSDP2 x TP on one dim: [Shard(0), _StridedShard(0, 2)] on a 2x2 mesh, shape (8, 3):
    # rank (0, 0) holds rows {0, 2} (not one range: DCP's "offset + size" would say rows 0..1)
    placements = [Shard(0), C._StridedShard(0, split_factor=2)]
    layout = Layout((2, 2), tuple(Placement.from_torch(q) for q in placements))
    t = torch.arange(24).reshape(8, 3)
    local = C.split_tensor(placements[1], C.split_tensor(placements[0], t, 2)[0], 2)[0]
    rows = _rows(layout_fragments("p", (8, 3), layout, (0, 0)))
    _expect(
        local[:, 0].div(3, rounding_mode="floor").tolist() == rows == [0, 2],
        f"[Shard(0), _StridedShard(0, 2)] gives rank (0, 0) rows {local[:, 0].div(3, rounding_mode='floor').tolist()}, "
        f"ucp_dcp's math {rows}; expected [0, 2]",
    )
    shape, _ = C._compute_local_shape_and_global_offset((8, 3), (2, 2), [0, 0], placements)
    _expect(
        tuple(shape) == (2, 3), f"the local shape of that case is {tuple(shape)} by torch's helper, expected (2, 3)"
    )


def _probe_storage_records() -> None:
    names = [f.name for f in dataclasses.fields(C._StorageInfo)]
    _expect(
        names[:3] == ["relative_path", "offset", "length"],
        f"_StorageInfo's fields are {names}, expected relative_path, offset, length first",
    )
    info = C._StorageInfo("__0_0.distcp", 7, 11)
    _expect(
        (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 7, 11),
        f"_StorageInfo('__0_0.distcp', 7, 11) reads back as {info!r}",
    )
    back = pickle.loads(pickle.dumps(info))
    _expect(
        (back.relative_path, back.offset, back.length) == ("__0_0.distcp", 7, 11),
        f"_StorageInfo does not survive a pickle round trip ({back!r})",
    )
    where = (C._StorageInfo.__module__, C._StorageInfo.__qualname__)
    _expect(
        where == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        f"_StorageInfo pickles as {where}: our sidecar's safe unpickler and stock readers name it "
        "torch.distributed.checkpoint.filesystem._StorageInfo",
    )
    _expect(C._StoragePrefix("__3_").prefix == "__3_", "_StoragePrefix('__3_').prefix is not '__3_'")
    view = C._create_file_view(io.BytesIO(b"abcdefgh"), 2, 3)
    _expect(view.read() == b"cde", "_create_file_view(file, 2, 3) does not read bytes 2..4")
    items = ["a", "b"]
    _expect(C._split_by_size_and_type(1, items) == [items], "_split_by_size_and_type(1, items) is not [items]")


_HOOKS: dict[type, dict[str, int]] = {
    SavePlanner: {
        "set_up_planner": 3,
        "create_local_plan": 0,
        "create_global_plan": 1,
        "finish_plan": 1,
        "resolve_data": 1,
    },
    LoadPlanner: {
        "set_up_planner": 3,
        "create_local_plan": 0,
        "create_global_plan": 1,
        "finish_plan": 1,
        "load_bytes": 2,
        "resolve_tensor": 1,
        "commit_tensor": 2,
    },
    StorageWriter: {"prepare_local_plan": 1, "prepare_global_plan": 1, "write_data": 2, "finish": 2},
    StorageReader: {
        "read_metadata": 0,
        "set_up_storage_reader": 2,
        "prepare_local_plan": 1,
        "prepare_global_plan": 1,
        "read_data": 2,
    },
}
"""The DCP hooks ucp_dcp's planners and storage override -> their positional arguments (self not
counted; ``*args``/``**kwargs`` not counted)."""


def _probe_planner_hooks() -> None:
    bad = []
    for cls, hooks in _HOOKS.items():
        for name, want in hooks.items():
            fn = getattr(cls, name, None)
            if fn is None:
                bad.append(f"{cls.__name__}.{name} is gone")
                continue
            params = [
                p
                for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
            ]
            if len(params) != want:
                bad.append(f"{cls.__name__}.{name} takes {[p.name for p in params]}, expected {want} argument(s)")
    _expect(not bad, "; ".join(bad))


def _probe_state_dict_traversal() -> None:
    t = torch.zeros(2)
    flat, paths = C.flatten_state_dict({"optim": {"state": {"w": {"exp_avg": t}}, "lr": [0.1]}})
    _expect(
        set(flat) == {"optim.state.w.exp_avg", "optim.lr"} and flat["optim.state.w.exp_avg"] is t,
        f"flatten_state_dict gives keys {sorted(flat)}, expected optim.state.w.exp_avg and optim.lr",
    )
    _expect(
        tuple(paths["optim.state.w.exp_avg"]) == ("optim", "state", "w", "exp_avg"),
        f"flatten_state_dict maps optim.state.w.exp_avg to {paths['optim.state.w.exp_avg']}",
    )
    d: dict = {}
    C.set_element(d, ("a", "b"), 5)
    _expect(d == {"a": {"b": 5}}, f"set_element(d, ('a', 'b'), 5) gives {d}")
    box = C.narrow_tensor_by_index(torch.arange(12).reshape(3, 4), (1, 1), (2, 2))
    _expect(box.tolist() == [[5, 6], [9, 10]], f"narrow_tensor_by_index(.., (1, 1), (2, 2)) gives {box.tolist()}")
    _expect(
        len(inspect.signature(C._init_state_dict).parameters) == 1, "_init_state_dict no longer takes one state dict"
    )


def _probe_checkpointable_tensor() -> None:
    if C.CheckpointableTensor is None:
        return  # torch < 2.14: the protocol does not exist, and nothing uses it
    fields = set(getattr(C.CheckpointableTensor, "__annotations__", {}))
    want = {"global_shape", "global_offsets", "local_offsets", "local_sizes"}
    _expect(fields == want, f"CheckpointableTensor's fields are {sorted(fields)}, expected {sorted(want)}")
    t = torch.zeros(2, 3)
    t.global_shape, t.global_offsets, t.local_offsets, t.local_sizes = (4, 3), ((2, 0),), ((0, 0),), ((2, 3),)
    _expect(
        C.is_checkpointable_tensor(t) and not C.is_checkpointable_tensor(torch.zeros(1)),
        "a tensor carrying the four fields is not recognized as a CheckpointableTensor (or a bare one is)",
    )


PROBES: dict[str, tuple[Callable[[], None], str]] = {
    "strided_shard": (
        _probe_strided_shard,
        "non-contiguous FSDP2 x TP shards would be saved or loaded at the wrong rows",
    ),
    "storage_records": (_probe_storage_records, "checkpoints would not be written or read in DCP's file format"),
    "planner_hooks": (_probe_planner_hooks, "DCP would call ucp_dcp's planners and storage with other arguments"),
    "state_dict_traversal": (
        _probe_state_dict_traversal,
        "state-dict keys or loaded values would land in the wrong place",
    ),
    "checkpointable_tensor": (
        _probe_checkpointable_tensor,
        "CheckpointableTensor values would be saved with wrong boxes",
    ),
}
"""Probe name -> (check, what goes wrong if it fails)."""


def run_probes() -> list[tuple[str, str, str]]:
    """``(probe, finding, consequence)`` for every probe that fails on the installed torch."""
    failed = []
    for name, (fn, consequence) in PROBES.items():
        try:
            fn()
        except Exception as e:  # a probe that raises anything (an API gone, a new signature) failed
            finding = str(e) if isinstance(e, ProbeFailed) else f"{type(e).__name__}: {e}"
            failed.append((name, finding, consequence))
    return failed


def _tested() -> str:
    lo, hi = C.TESTED_TORCH[0], C.TESTED_TORCH[-1]
    return f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"


def check_torch() -> None:
    """Refuse (or, with the override, warn about) a torch that fails a probe; warn about a torch
    outside the tested releases that passes them."""
    failed = run_probes()
    tested = _tested()
    fix = f"pip install 'torch>={C.TESTED_TORCH[0][0]}.{C.TESTED_TORCH[0][1]},<{C.TESTED_TORCH[-1][0]}.{C.TESTED_TORCH[-1][1] + 1}'"
    if failed:
        lines = "\n".join(f"  - probe '{n}': {finding} (if ignored: {why})" for n, finding, why in failed)
        msg = (
            f"ucp_dcp cannot rely on torch {torch.__version__}: {len(failed)} probe(s) of the private torch "
            f"behaviour it depends on failed:\n{lines}\nucp_dcp is tested with torch {tested}; install one "
            f"(`{fix}`), or set {C.ALLOW_ENV}=1 to import anyway at your own risk (loads may be wrong), "
            "and report the failed probe."
        )
        if settings.allow_untested("torch"):
            warnings.warn(msg, UntestedTorchWarning, stacklevel=3)
            return
        raise UnsupportedTorchError(
            msg, wanted=f"torch {tested}", saved=torch.__version__, hint=f"{fix} (or set {C.ALLOW_ENV}=1)"
        )
    if C.torch_release() not in C.TESTED_TORCH:
        warnings.warn(
            f"ucp_dcp is tested with torch {tested}, found torch {torch.__version__}. Its probes of the private "
            "torch behaviour it relies on pass, so it imports; run your own save/load round trip before trusting "
            f"it, or install a tested torch (`{fix}`).",
            UntestedTorchWarning,
            stacklevel=3,
        )
