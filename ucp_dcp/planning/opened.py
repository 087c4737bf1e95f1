"""What ucp_dcp's storage readers hand ``dcp.load`` from ``read_metadata``: typed metadata, not attributes
hung on DCP's object.

``dcp.load`` turns an exception raised by ``read_metadata`` into a bare ``AssertionError`` string, so a
reader that cannot open a checkpoint returns :class:`UnopenedMetadata` (empty, carrying the
:class:`~ucp_dcp.errors.UCPError`), and the first ucp_dcp hook that receives it -- the reader's
``set_up_storage_reader`` or ``UCPLoadPlanner.set_up_planner`` -- raises that error
(:func:`raise_if_unopened`). Metadata a reader opened with its integrity checks comes as
:class:`CheckedMetadata`, whose ``integrity`` tells ``UCPLoadPlanner`` that the bytes are verified by the
reader (no warning about an unverifying reader). Both are DCP ``Metadata``: DCP and other planners see
the plain fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import UCPError

__all__ = ["UnopenedMetadata", "CheckedMetadata", "IntegrityStatus", "checked", "raise_if_unopened", "integrity_of"]

IntegrityStatus = Literal["verified", "partial", "none"]
"""How far a checkpoint's bytes can be verified: sidecar and checksums on everything; data only (an older
writer); nothing (no checksums)."""


@dataclass
class UnopenedMetadata(Metadata):
    """Empty metadata standing for a checkpoint the reader could not open."""

    error: UCPError | None = None
    """Why it could not be opened; raised by :func:`raise_if_unopened`."""


@dataclass
class CheckedMetadata(Metadata):
    """A checkpoint's metadata as a ucp_dcp reader opened it, with how far its bytes can be verified."""

    integrity: IntegrityStatus = "none"
    """The integrity status the reader found when opening (``Integrity.status``)."""
    digest: str | None = None
    """A hash of the checkpoint's ``.metadata`` bytes (None: unknown); cached load plans are keyed by it."""


def checked(md: Metadata, integrity: IntegrityStatus, digest: str | None = None) -> CheckedMetadata:
    """``md`` as :class:`CheckedMetadata` (the same field values, not copies)."""
    return CheckedMetadata(
        **{f.name: getattr(md, f.name) for f in dataclasses.fields(Metadata)}, integrity=integrity, digest=digest
    )


def raise_if_unopened(md: Metadata) -> None:
    """Raise the error of metadata a ucp_dcp reader could not open."""
    if isinstance(md, UnopenedMetadata) and md.error is not None:
        raise md.error


def integrity_of(md: Metadata) -> IntegrityStatus | None:
    """The integrity status a ucp_dcp reader found, None for metadata it did not open."""
    return md.integrity if isinstance(md, CheckedMetadata) else None
