"""User-facing errors.

Inside ``dcp.save``/``dcp.load`` DCP catches every planner exception, pickles it to the
coordinator and raises a ``CheckpointException`` (a ``BaseException``) whose ``failures`` map
rank -> (exception, traceback). Every error here therefore survives a pickle round trip with its
structured fields intact, and :func:`raise_first_ucp_error` / :func:`ucp_errors` turn the wrapper
back into a plain ``UCPError`` for callers who prefer one.

Kept in one module (about 750 lines): every public error class in one place, the module users import
them from, and beside them their peer classes (``Peer<Name>``, one written per class: :data:`_PEER_CLASSES`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

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
    "RuleArgumentError",
    "ReplicaMismatchError",
    "ChecksumError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "MissingFileError",
    "CorruptCheckpointError",
    "TruncatedFileError",
    "UnsafeCheckpointError",
    "StorageAccessError",
    "UnverifiedCheckpointWarning",
    "UnsupportedTorchError",
    "StaleObjectsWarning",
    "UntestedTorchWarning",
    "PeerFailedError",
    "PeerLostError",
    "peer_error",
    "same_problem",
    "first_ucp_error",
    "raise_first_ucp_error",
    "ucp_errors",
    "ucp_error_of",
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

    checkpoint_exception: BaseException | None = None
    """The DCP ``CheckpointException`` this error came out of (set by :func:`ucp_errors`), else None."""

    collective: bool = False
    """Raised by the coordinator's global plan: a finding about every rank's plans. The rank that
    found it (``found_by``) raises it in full; every other rank a one-line :class:`PeerFailedError`
    naming that rank and the problem."""

    found_by: int | None = None
    """The global rank whose global plan step raised this error (``collective`` errors)."""

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
        state = {"collective": self.collective, "found_by": self.found_by}
        return (_rebuild, (type(self), self.message, self._fields()), state)


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
    (float -> int, complex -> real, non-bool -> bool), or saved values that torch's cast would change beyond
    rounding (outside an integer target's range, past a floating target's largest finite value by more than
    half an ulp, an inf the target cannot hold: ``ucp_dcp.layout.dtypes``)."""


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


class RuleArgumentError(InvalidArgumentError, PatternError):
    """A pattern rule (``Fused``, ``Padded``, ``Replicated``, ``Reduce``, ``Tied``), index map (``Chunk``,
    ``IndexMap``, ``stage_map``, ``expert_map``), ``NameRules`` or HF rule (``HFRule``, ``HFMapping``) was built
    with an argument it cannot take: a negative size or dim, a regex that does not compile, an op outside the
    allowed set, a bare string where a sequence goes. Raised by the constructor, where the mistake is, naming
    the rule, the argument, what was given and what is allowed (``wanted``).

    An :class:`InvalidArgumentError` (so a ``ValueError``) and a :class:`PatternError`, the error such a rule
    raised before, when it was found at all."""


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


class StorageAccessError(UCPError, OSError):
    """The storage refused or failed a request: a bucket that does not exist, missing or rejected
    credentials, a denied write, a request still throttled after retries with backoff. Also an
    ``OSError``, what file and fsspec code raises for such failures."""


class UnsafeCheckpointError(UCPError):
    """Opening the checkpoint would run code or build objects outside the safe set of types
    (tensors, numbers, strings, lists, dicts, tuples, ...); needs an explicit ``trust=True``."""


class UnverifiedCheckpointWarning(UserWarning):
    """A load reads bytes that no checksum covers (a checkpoint or reader without checksums)."""


class UnsupportedTorchError(UCPError, ImportError):
    """The installed torch fails a probe of the private behaviour ucp_dcp relies on (``ucp_dcp._probes``)."""


class StaleObjectsWarning(UserWarning):
    """A save committed but its clean-up afterwards failed (a store that denies deletes or does not list
    multipart uploads, a folder whose old files may not be removed): stale objects, files or open uploads
    of earlier saves are left, taking space, never loaded."""


class UntestedTorchWarning(UserWarning):
    """The installed torch passes ucp_dcp's probes but is outside the releases its tests ran on (or a
    probe failed and ``UCP_DCP_ALLOW_UNTESTED_TORCH=1`` let the import go on)."""


def first_ucp_error(exc: BaseException) -> UCPError | None:
    """Return the first ``UCPError`` carried by ``exc`` (itself, a DCP ``CheckpointException``'s
    per-rank failures in rank order, or the ``__cause__``/``__context__`` chain). Of DCP's per-rank
    failures, this rank's own error wins; else another rank's cause, as a
    :class:`~ucp_dcp.errors.PeerFailedError` naming that rank (an instance of the cause's class)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):  # DCP's per-rank failures: the root cause, not a peer's "rank k failed"
        found = root_cause(((r, f[0] if isinstance(f, tuple) else f) for r, f in failures.items()), this_rank())
        if found is not None:
            return found
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
    err = ucp_error_of(exc)
    raise err if err is exc else err from None


@contextlib.contextmanager
def ucp_errors() -> Iterator[None]:
    """Context manager: ``with ucp_errors(): dcp.load(...)`` raises a ``UCPError`` instead of DCP's
    ``CheckpointException`` whenever some rank failed with one."""
    try:
        yield
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        err = ucp_error_of(exc)
        if err is exc:
            raise
        raise err from None


def user_frames(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator of the public calls (``ucp_dcp.save``/``load``): a ``UCPError`` that came out of DCP's wrapper
    leaves with none of ucp_dcp's frames in its traceback but this one line. Those frames were only the path
    that re-raised it (``ucp_errors``, ``contextlib``, the call's own: 9 lines on every rank); where it was
    raised is in DCP's wrapper, ``err.checkpoint_exception``. Other errors keep their traceback.

    A :class:`PeerFailedError` that leaves this way is also marked *brief*: if nothing catches it, the process
    prints it as its one line, without the traceback above it (:func:`_brief_excepthook`). The rank it names
    prints the problem in full; the others' tracebacks would only repeat the user's call N-1 times (8 lines a
    rank, 24 of a 4-rank job's 38 for one shape change)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except UCPError as err:
            if err.checkpoint_exception is None:
                raise
            if isinstance(err, PeerFailedError):
                _print_briefly(err)
            # a statement of its own: the printed line is the whole statement, so Python adds no ^^^ under it
            err = err.with_traceback(None)
            raise err from None

    return call


def _print_briefly(err: PeerFailedError) -> None:
    """Mark ``err`` to be printed as one line if it ends the process, and put :func:`_brief_excepthook` in
    front of the process's hook (once). The mark is on this exception object only: an error the user raises
    from it, or any other error, prints as Python prints it."""
    err.brief = True
    if getattr(sys.excepthook, "__wrapped_by_ucp_dcp__", False):
        return
    previous = sys.excepthook

    def _brief_excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, PeerFailedError) and value.brief:
            # Without a traceback Python prints the error's line alone (its class and message, its notes). The
            # hooks behind this one still print it: torch's (init_process_group's) prefixes "[rankN]: ", a job's own
            # may log it. (Python's own hook reads the error's __traceback__, not its argument: both go.)
            value, tb = value.with_traceback(None), None
        previous(tp, value, tb)

    _brief_excepthook.__wrapped_by_ucp_dcp__ = True  # type: ignore[attr-defined]
    sys.excepthook = _brief_excepthook


def ucp_error_of(exc: BaseException) -> BaseException:
    """The ``UCPError`` to raise for ``exc`` (else ``exc``), without DCP's wrapper chained to it: the wrapper's
    text holds every rank's traceback, so chaining printed each rank's error three times on every rank. The
    wrapper stays on ``err.checkpoint_exception``."""
    err = first_ucp_error(exc)
    if err is None or err is exc:
        return exc
    err.checkpoint_exception = exc
    return err.with_traceback(None)


# -- errors about other ranks ----------------------------------------------------------------------------------
# A rank that fails raises its own error; a rank that fails because of it raises a PeerFailedError naming that
# rank and the cause in one line. Its class is the cause's peer class: ``Peer<Name>(PeerFailedError, <Name>)``,
# written below for every error class of this module and for the builtin exceptions code commonly catches, so
# that `except ChecksumError` (or `except OSError`) catches a peer's too; a cause of another class gets the peer
# class of the nearest base that has one (a subclass of ChecksumError: PeerChecksumError), else PeerFailedError.
# The error classes of higher layers (the test hooks' FaultInjected, PlanCacheMissError, the memory tier's) have
# their peer classes beside them, entered here by the decorator @peer_class: this module imports nothing of
# ucp_dcp (the lowest layer), so it cannot name them. Module-level classes pickle by reference; nothing is made
# at runtime, and a cause's class name from another rank (:func:`error_from_wire`) is looked up, never imported.


class PeerFailedError(UCPError):
    """Another rank failed, and this rank could not finish without it, or (``same``) this rank failed with the
    same problem, which that rank prints in full. ``rank`` is that rank, ``cause_class`` the name of its error's
    class. The error is of the cause's peer class, ``Peer<Name>`` (``PeerChecksumError``: also a ``ChecksumError``;
    :data:`_PEER_CLASSES`), or of the nearest base's that has one; else this class."""

    rank: int = -1
    cause_class: str = "UCPError"
    same: bool = False
    """This rank failed too, with the same problem as rank ``rank`` (:func:`same_problem`), which prints it in
    full: this error is one line (its ``atom``, ``saved``, ``wanted`` and ``hint`` are still this rank's own)."""
    brief: bool = False
    """Left a public call (:func:`user_frames`): uncaught, the process prints this error's line alone."""

    def __reduce__(self):  # the class by reference (module level); the fields, keyword-only, as arguments
        return (_build, (type(self), self.rank, self.message, self._fields(), self.same, self.cause_class))


class PeerLostError(PeerFailedError):
    """Another rank stopped answering (its process died, or it did not reach the exchange within
    the peer timeout, ``UCP_DCP_PEER_TIMEOUT_S``)."""


# the peer classes of this module's error classes


class PeerInvalidArgumentError(PeerFailedError, InvalidArgumentError):
    """Another rank's :class:`InvalidArgumentError`."""


class PeerUnexpectedArgumentError(PeerFailedError, UnexpectedArgumentError):
    """Another rank's :class:`UnexpectedArgumentError`."""


class PeerAmbiguousLayoutError(PeerFailedError, AmbiguousLayoutError):
    """Another rank's :class:`AmbiguousLayoutError`."""


class PeerReplicaMismatchError(PeerFailedError, ReplicaMismatchError):
    """Another rank's :class:`ReplicaMismatchError`."""


class PeerCoverageError(PeerFailedError, CoverageError):
    """Another rank's :class:`CoverageError`."""


class PeerShapeMismatchError(PeerFailedError, ShapeMismatchError):
    """Another rank's :class:`ShapeMismatchError`."""


class PeerDtypeConversionError(PeerFailedError, DtypeConversionError):
    """Another rank's :class:`DtypeConversionError`."""


class PeerMissingAtomsError(PeerFailedError, MissingAtomsError):
    """Another rank's :class:`MissingAtomsError`."""


class PeerParamGroupError(PeerFailedError, ParamGroupError):
    """Another rank's :class:`ParamGroupError`."""


class PeerCatalogVersionError(PeerFailedError, CatalogVersionError):
    """Another rank's :class:`CatalogVersionError`."""


class PeerCatalogError(PeerFailedError, CatalogError):
    """Another rank's :class:`CatalogError`."""


class PeerPatternError(PeerFailedError, PatternError):
    """Another rank's :class:`PatternError`."""


class PeerRuleArgumentError(PeerFailedError, RuleArgumentError):
    """Another rank's :class:`RuleArgumentError`."""


class PeerCheckpointNotFoundError(PeerFailedError, CheckpointNotFoundError):
    """Another rank's :class:`CheckpointNotFoundError`."""


class PeerIncompleteCheckpointError(PeerFailedError, IncompleteCheckpointError):
    """Another rank's :class:`IncompleteCheckpointError`."""


class PeerMissingFileError(PeerFailedError, MissingFileError):
    """Another rank's :class:`MissingFileError`."""


class PeerCorruptCheckpointError(PeerFailedError, CorruptCheckpointError):
    """Another rank's :class:`CorruptCheckpointError`."""


class PeerChecksumError(PeerFailedError, ChecksumError):
    """Another rank's :class:`ChecksumError`."""


class PeerTruncatedFileError(PeerFailedError, TruncatedFileError):
    """Another rank's :class:`TruncatedFileError`."""


class PeerStorageAccessError(PeerFailedError, StorageAccessError):
    """Another rank's :class:`StorageAccessError`."""


class PeerUnsafeCheckpointError(PeerFailedError, UnsafeCheckpointError):
    """Another rank's :class:`UnsafeCheckpointError`."""


class PeerUnsupportedTorchError(PeerFailedError, UnsupportedTorchError):
    """Another rank's :class:`UnsupportedTorchError`."""


# the peer classes of builtin exceptions: a rank's failure outside ucp_dcp's own errors (user code's, torch's:
# a CUDA OOM is a RuntimeError, a gloo "Connection closed" too) still catches as its builtin base on every rank


class PeerValueError(PeerFailedError, ValueError):
    """Another rank's ``ValueError`` (or a subclass of it without a peer class of its own)."""


class PeerTypeError(PeerFailedError, TypeError):
    """Another rank's ``TypeError``."""


class PeerKeyError(PeerFailedError, KeyError):
    """Another rank's ``KeyError``."""

    __str__ = BaseException.__str__  # the text as written: KeyError's own str() quotes it ('rank 1 failed: ...')


class PeerIndexError(PeerFailedError, IndexError):
    """Another rank's ``IndexError``."""


class PeerAttributeError(PeerFailedError, AttributeError):
    """Another rank's ``AttributeError``."""


class PeerAssertionError(PeerFailedError, AssertionError):
    """Another rank's ``AssertionError``."""


class PeerRuntimeError(PeerFailedError, RuntimeError):
    """Another rank's ``RuntimeError`` (torch's errors, a CUDA out-of-memory, gloo's, are mostly ones)."""


class PeerNotImplementedError(PeerFailedError, NotImplementedError):
    """Another rank's ``NotImplementedError``."""


class PeerMemoryError(PeerFailedError, MemoryError):
    """Another rank's ``MemoryError``."""


class PeerImportError(PeerFailedError, ImportError):
    """Another rank's ``ImportError``."""


class PeerOSError(PeerFailedError, OSError):
    """Another rank's ``OSError`` (or a subclass of it without a peer class of its own)."""


class PeerFileNotFoundError(PeerFailedError, FileNotFoundError):
    """Another rank's ``FileNotFoundError``."""


class PeerPermissionError(PeerFailedError, PermissionError):
    """Another rank's ``PermissionError``."""


class PeerTimeoutError(PeerFailedError, TimeoutError):
    """Another rank's ``TimeoutError``."""


class PeerConnectionError(PeerFailedError, ConnectionError):
    """Another rank's ``ConnectionError``."""


_PEER_CLASSES: dict[type, type[PeerFailedError]] = {
    InvalidArgumentError: PeerInvalidArgumentError,
    UnexpectedArgumentError: PeerUnexpectedArgumentError,
    AmbiguousLayoutError: PeerAmbiguousLayoutError,
    ReplicaMismatchError: PeerReplicaMismatchError,
    CoverageError: PeerCoverageError,
    ShapeMismatchError: PeerShapeMismatchError,
    DtypeConversionError: PeerDtypeConversionError,
    MissingAtomsError: PeerMissingAtomsError,
    ParamGroupError: PeerParamGroupError,
    CatalogVersionError: PeerCatalogVersionError,
    CatalogError: PeerCatalogError,
    PatternError: PeerPatternError,
    RuleArgumentError: PeerRuleArgumentError,
    CheckpointNotFoundError: PeerCheckpointNotFoundError,
    IncompleteCheckpointError: PeerIncompleteCheckpointError,
    MissingFileError: PeerMissingFileError,
    CorruptCheckpointError: PeerCorruptCheckpointError,
    ChecksumError: PeerChecksumError,
    TruncatedFileError: PeerTruncatedFileError,
    StorageAccessError: PeerStorageAccessError,
    UnsafeCheckpointError: PeerUnsafeCheckpointError,
    UnsupportedTorchError: PeerUnsupportedTorchError,
    ValueError: PeerValueError,
    TypeError: PeerTypeError,
    KeyError: PeerKeyError,
    IndexError: PeerIndexError,
    AttributeError: PeerAttributeError,
    AssertionError: PeerAssertionError,
    RuntimeError: PeerRuntimeError,
    NotImplementedError: PeerNotImplementedError,
    MemoryError: PeerMemoryError,
    ImportError: PeerImportError,
    OSError: PeerOSError,
    FileNotFoundError: PeerFileNotFoundError,
    PermissionError: PeerPermissionError,
    TimeoutError: PeerTimeoutError,
    ConnectionError: PeerConnectionError,
}
"""Cause class -> its peer class (``Peer<Name>(PeerFailedError, <Name>)``): this module's error classes, the
builtin exceptions above, and the classes of higher layers entered by :func:`peer_class` when their modules load."""

_PC = TypeVar("_PC", bound=PeerFailedError)


def peer_class(peer: type[_PC]) -> type[_PC]:
    """Class decorator: ``peer``, written ``class Peer<Name>(PeerFailedError, <Name>)`` beside an error class of
    a module above this one, is ``<Name>``'s peer class (entered in :data:`_PEER_CLASSES`)."""
    bases = peer.__bases__
    if len(bases) != 2 or bases[0] is not PeerFailedError or peer.__name__ != f"Peer{bases[1].__name__}":
        raise TypeError(f"a peer class is written `class Peer<Name>(PeerFailedError, <Name>)`, not {peer.__name__}")
    _PEER_CLASSES[bases[1]] = peer
    return peer


def _peer_class(cause: type) -> type[PeerFailedError]:
    """The class of a peer error for a cause of class ``cause``: its own peer class or its nearest base's in
    :data:`_PEER_CLASSES` (a peer error's class is its own), else :class:`PeerFailedError`."""
    if issubclass(cause, PeerFailedError):
        return cause
    for base in cause.__mro__:
        peer = _PEER_CLASSES.get(base)
        if peer is not None:
            return peer
    return PeerFailedError


def _cause_base(cls: type) -> type:
    """The class a peer class stands for (``ChecksumError`` for ``PeerChecksumError``), ``UCPError`` for the
    plain peer errors."""
    return next((b for b in cls.__mro__[1:] if not issubclass(b, PeerFailedError)), UCPError)


def _cause_name(cause: type) -> str:
    """``cause_class`` of a peer error for a cause of class ``cause`` (a peer error's: the class it stands for)."""
    return _cause_base(cause).__name__ if issubclass(cause, PeerFailedError) else cause.__name__


def _build(
    cls: type[PeerFailedError],
    rank: int,
    message: str,
    fields: dict[str, Any],
    same: bool = False,
    cause_class: str | None = None,
) -> PeerFailedError:
    err = cls.__new__(cls)
    if same:  # one line: rank `rank` prints the hint with the full text; the field keeps it for code
        UCPError.__init__(err, message, **{**fields, "hint": None})
        err.hint, err.same = fields.get("hint"), True
    else:
        UCPError.__init__(err, message, **fields)
    err.rank = rank
    err.cause_class = cause_class or _cause_base(cls).__name__
    return err


def _wire_class(module: str, qualname: str) -> type:
    """A cause class by the name another rank sent: a builtin exception class, ``UCPError``, ``PeerFailedError``
    or a cause class of :data:`_PEER_CLASSES`; else ``UCPError``. Looked up only: nothing imported or called."""
    if module == "builtins":
        found = getattr(builtins, qualname, None) if qualname.isidentifier() else None
        return found if isinstance(found, type) and issubclass(found, Exception) else UCPError
    for cls in (UCPError, PeerFailedError, *_PEER_CLASSES):
        if cls.__module__ == module and cls.__qualname__ == qualname:
            return cls
    return UCPError


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def peer_error(rank: int, cause: BaseException, found: bool = False) -> PeerFailedError:
    """This rank's error for ``cause``, raised on rank ``rank``: one line naming both, an instance
    of ``cause``'s class. A cause that is itself a peer error is passed on unchanged. ``found``: the
    cause is a finding of ``rank``'s global plan about the whole job ("rank 0 found: ..."), not a
    failure of that rank alone ("rank 1 failed: ...")."""
    if isinstance(cause, PeerFailedError):
        return cause
    message = cause.message if isinstance(cause, UCPError) else str(cause)
    fields = cause._fields() if isinstance(cause, UCPError) else {}
    fields["hint"] = fields.get("hint") or f"rank {rank} reports the cause in full; fix that and load again"
    text = f"rank {rank} {'found' if found else 'failed'}: {type(cause).__name__}: {_first_line(message)}"
    return _build(_peer_class(type(cause)), rank, text, fields, cause_class=_cause_name(type(cause)))


def same_problem(a: BaseException, b: BaseException) -> bool:
    """Whether two ranks' own errors are one problem, printed in full once: the same class, the same text
    (message and hint) and the same ``atom``, ``saved`` and ``wanted``. Anything that differs (another atom,
    another shape, another file, one more problem in an aggregated list) makes them two problems, each printed
    in full, so the one-line error never stands for a text that was not printed."""
    if type(a) is not type(b) or not isinstance(a, UCPError) or not isinstance(b, UCPError):
        return False
    if isinstance(a, PeerFailedError):  # a peer's error names another rank's problem, not one of its own
        return False
    if (a.message, a.hint, a.atom) != (b.message, b.hint, b.atom):
        return False
    # saved/wanted are plain values (shapes, dtypes, names, lists): repr compares them without invoking an
    # __eq__ that may not return a bool (a tensor's)
    return repr(a.saved) == repr(b.saved) and repr(a.wanted) == repr(b.wanted)


def same_as(rank: int, own: UCPError) -> PeerFailedError:
    """This rank's error ``own`` when rank ``rank`` raised the same problem (:func:`same_problem`) and prints
    it in full: one line naming that rank, an instance of ``own``'s class, with ``own``'s fields."""
    text = f"the same as rank {rank}, which prints it in full: {type(own).__name__}: {_first_line(own.message)}"
    return _build(_peer_class(type(own)), rank, text, own._fields(), same=True, cause_class=_cause_name(type(own)))


def wire_error(exc: BaseException) -> str:
    """``exc`` as text another rank can turn back into an error (:func:`error_from_wire`): JSON of its
    module, class name and first line, never a pickle (a peer's bytes are untrusted). A peer error
    passes its root cause on, not "a peer failed"."""
    cls = type(exc)
    if isinstance(exc, PeerFailedError):
        base = _cause_base(cls)
        return json.dumps({"module": base.__module__, "cls": base.__qualname__, "msg": str(exc), "rank": exc.rank})
    msg = exc.message if isinstance(exc, UCPError) else str(exc)
    return json.dumps({"module": cls.__module__, "cls": cls.__qualname__, "msg": _first_line(msg)})


def error_from_wire(src: int, data: bytes | str) -> PeerFailedError:
    """The error a rank raises for the failure rank ``src`` sent (``data`` from :func:`wire_error`): one
    line naming ``src``, of the cause's peer class when the cause's class is a builtin exception or has a peer
    class (:func:`_wire_class`: the name is looked up, never imported)."""
    try:
        d = json.loads(data.decode() if isinstance(data, bytes) else data)
        cls = _wire_class(str(d["module"]), str(d["cls"]))
        if "rank" in d:  # src forwarded another rank's failure
            return _build(_peer_class(cls), int(d["rank"]), str(d["msg"]), {}, cause_class=_cause_name(cls))
        text = f"rank {src} failed: {cls.__name__}: {d['msg']}"
    except (ValueError, KeyError, TypeError):
        cls, text = UCPError, f"rank {src} failed (see its errors)"
    hint = {"hint": f"rank {src} reports the cause in full"}
    return _build(_peer_class(cls), src, text, hint, cause_class=_cause_name(cls))


def peer_lost(rank: int, why: str, during: str = "the load") -> PeerLostError:
    """Rank ``rank`` stopped answering during ``during`` (``why``: what was seen)."""
    return _build(  # type: ignore[return-value]
        PeerLostError,
        rank,
        f"rank {rank} stopped answering during {during}: {why}",
        {"hint": "that rank's process died or hangs (see its log); the job must be restarted"},
    )


def this_rank() -> int:
    """This process's global rank (0 outside a process group: DCP then runs as rank 0)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def root_cause(failures: Iterable[tuple[int, BaseException]], me: int | None) -> UCPError | None:
    """Of DCP's per-rank failures, the one to raise on rank ``me``: its own error when it failed
    by itself (when lower ranks failed with the same problem, :func:`same_problem`, the lowest of them
    prints it in full and this rank one line naming it, :func:`same_as`: one full error per job, not one
    per rank); else the lowest rank's own (non-peer) ``UCPError``, as a peer error naming that rank;
    else the first peer error; None when no rank raised a ``UCPError``. (DCP keys failures by rank
    in its process group: with a subgroup, ``me`` is the global rank, so ranks may differ.)"""
    own: list[tuple[int, UCPError]] = []
    peers: list[UCPError] = []
    for rank, e in sorted(failures, key=lambda f: f[0]):
        if isinstance(e, UCPError) and e.collective:  # the global plan's finding: in full where it was found
            by = rank if e.found_by is None else e.found_by
            return e if by == me else peer_error(by, e, found=True)
        if isinstance(e, PeerFailedError):
            peers.append(e)
        elif isinstance(e, UCPError):
            own.append((rank, e))
    for rank, e in own:
        if rank == me:
            first = next(r for r, o in own if r == me or same_problem(o, e))  # own is in rank order
            return e if first == me else same_as(first, e)
    if own:
        rank, e = own[0]
        return peer_error(rank, e)
    return peers[0] if peers else None
