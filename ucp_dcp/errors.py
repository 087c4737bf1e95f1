"""User-facing errors.

Inside ``dcp.save``/``dcp.load`` DCP catches every planner exception, pickles it to the
coordinator and raises a ``CheckpointException`` (a ``BaseException``) whose ``failures`` map
rank -> (exception, traceback). Every error here therefore survives a pickle round trip with its
structured fields intact, and :func:`raise_first_ucp_error` / :func:`ucp_errors` turn the wrapper
back into a plain ``UCPError`` for callers who prefer one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "UCPError",
    "InvalidArgumentError",
    "UnexpectedArgumentError",
    "AmbiguousLayoutError",
    "CoverageError",
    "ShapeMismatchError",
    "DtypeConversionError",
    "MissingAtomsError",
    "ParamGroupError",
    "CatalogVersionError",
    "CatalogError",
    "PatternError",
    "ReplicaMismatchError",
    "ChecksumError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "MissingFileError",
    "CorruptCheckpointError",
    "TruncatedFileError",
    "UnsafeCheckpointError",
    "UnverifiedCheckpointWarning",
    "UnsupportedTorchError",
    "UntestedTorchWarning",
    "first_ucp_error",
    "raise_first_ucp_error",
    "ucp_errors",
]


def _rebuild(cls: type, message: str, fields: dict[str, Any]) -> UCPError:
    err = cls.__new__(cls)
    UCPError.__init__(err, message, **fields)
    return err


class UCPError(Exception):
    """Base class of every ucp_dcp failure.

    ``atom`` names the logical tensor involved (when there is one); ``saved``/``wanted`` describe
    what the checkpoint holds and what the caller asked for; ``hint`` says what to do.
    """

    def __init__(
        self,
        message: str,
        *,
        atom: str | None = None,
        saved: Any = None,
        wanted: Any = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.atom = atom
        self.saved = saved
        self.wanted = wanted
        self.hint = hint
        text = message
        if hint and hint not in message:
            text = f"{message}\n  hint: {hint}"
        super().__init__(text)

    def _fields(self) -> dict[str, Any]:
        return {"atom": self.atom, "saved": self.saved, "wanted": self.wanted, "hint": self.hint}

    def __reduce__(self):  # keyword-only fields do not survive Exception's default pickling
        return (_rebuild, (type(self), self.message, self._fields()))


class InvalidArgumentError(UCPError, ValueError):
    """An argument or setting of a public call (a planner, reader or writer option, a torchtitan config
    field, an environment variable) has a value it does not accept.

    Also a ``ValueError``, what Python code raises for such values: ``except ValueError`` keeps working."""


class UnexpectedArgumentError(UCPError, TypeError):
    """A public call was given an argument it does not take, or in a place it does not take it.

    Also a ``TypeError``, what Python raises for an unexpected keyword argument."""


class AmbiguousLayoutError(UCPError):
    """Save cannot decide what the logical tensor is: two live keys for one atom, a ``Partial``
    placement, or a value shared by name whose contents differ across ranks."""


class ReplicaMismatchError(AmbiguousLayoutError):
    """Replicas of one atom (same name on several ranks) hold different values at save."""


class CoverageError(UCPError):
    """The saved chunks of an atom do not cover a wanted box exactly once."""


class ShapeMismatchError(UCPError, ValueError):
    """The saved logical shape of an atom differs from the wanted one (and no pattern maps them), or
    a tensor was saved where the target holds an object (or the reverse).

    Also a ``ValueError``, the type DCP's default planner raises for a size mismatch; the message
    starts with DCP's own words (``Size mismatch between saved ... and current: ... for <key>``), so
    code written against DCP (``except ValueError``, a match on ``"Size mismatch"``) still works."""


class DtypeConversionError(UCPError):
    """Loading an atom into the target's dtype would lose values: a lossy kind of conversion
    (float -> int, complex -> real, non-bool -> bool), or saved values outside the target's range."""


class MissingAtomsError(UCPError, RuntimeError):
    """Atoms wanted by the target state dict are absent from the checkpoint.

    Also a ``RuntimeError``, the type DCP's default planner raises for a missing key; the message
    starts with DCP's own words (``Missing key in checkpoint state_dict: <key>.``)."""


class ParamGroupError(UCPError):
    """Optimizer param groups that cannot be filled right: hyperparameters that must agree within a
    target group do not, or a raw ``optimizer.state_dict()`` whose parameter positions differ from
    the checkpoint's."""


class CatalogVersionError(UCPError):
    """The checkpoint's catalog was written by an incompatible (newer) ucp_dcp."""


class CatalogError(CatalogVersionError, ValueError):
    """The checkpoint's catalog (``planner_data["__ucp__"]``) has a field of the wrong type or value:
    a damaged checkpoint or another tool's record under ucp_dcp's key. Names the field. (A
    ``CatalogVersionError``, which already covered a catalog this ucp_dcp cannot read, and a ``ValueError``.)"""


class PatternError(UCPError):
    """A declared pattern rule is malformed, matches nothing, or conflicts with another rule."""


class CheckpointNotFoundError(UCPError, FileNotFoundError):
    """No checkpoint at the path: the folder does not exist or holds no checkpoint files."""


class IncompleteCheckpointError(UCPError):
    """The folder holds pieces of a save that never committed (data files without ``.metadata``),
    or a committed checkpoint lacks files it references."""


class MissingFileError(IncompleteCheckpointError, FileNotFoundError):
    """A file the checkpoint's metadata references is not there."""


class CorruptCheckpointError(UCPError):
    """Bytes of the checkpoint differ from what was written: a table that does not parse or agree
    with itself, a metadata file that matches no integrity record, a checksum mismatch."""


class ChecksumError(CorruptCheckpointError):
    """Bytes read from storage do not match the checksum recorded at save."""


class TruncatedFileError(CorruptCheckpointError):
    """A checkpoint file is shorter (or longer) than the data written into it."""


class UnsafeCheckpointError(UCPError):
    """Opening the checkpoint would run code or build objects outside the safe set of types
    (tensors, numbers, strings, lists, dicts, tuples, ...); needs an explicit ``trust=True``."""


class UnverifiedCheckpointWarning(UserWarning):
    """A load reads bytes that no checksum covers (a checkpoint or reader without checksums)."""


class UnsupportedTorchError(UCPError, ImportError):
    """The installed torch fails a probe of the private behaviour ucp_dcp relies on (``ucp_dcp._probes``)."""


class UntestedTorchWarning(UserWarning):
    """The installed torch passes ucp_dcp's probes but is outside the releases its tests ran on (or a
    probe failed and ``UCP_DCP_ALLOW_UNTESTED_TORCH=1`` let the import go on)."""


def first_ucp_error(exc: BaseException) -> UCPError | None:
    """Return the first ``UCPError`` carried by ``exc`` (itself, a DCP ``CheckpointException``'s
    per-rank failures in rank order, or the ``__cause__``/``__context__`` chain)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UCPError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for rank in sorted(failures):
                item = failures[rank]
                inner = item[0] if isinstance(item, tuple) else item
                if isinstance(inner, BaseException):
                    todo.append(inner)
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)
    return None


def raise_first_ucp_error(exc: BaseException) -> None:
    """Re-raise the first ``UCPError`` inside ``exc`` as a plain exception; else re-raise ``exc``."""
    err = first_ucp_error(exc)
    if err is None:
        raise exc
    raise err from exc


@contextlib.contextmanager
def ucp_errors() -> Iterator[None]:
    """Context manager: ``with ucp_errors(): dcp.load(...)`` raises a ``UCPError`` instead of DCP's
    ``CheckpointException`` whenever some rank failed with one."""
    try:
        yield
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        err = first_ucp_error(exc)
        if err is None:
            raise
        raise err from exc
