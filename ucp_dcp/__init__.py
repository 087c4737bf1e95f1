"""ucp_dcp: Universal Checkpointing for ``torch.distributed.checkpoint``.

Save with :class:`UCPSavePlanner`, load with :class:`UCPLoadPlanner`, at any parallel layout::

    dcp.save(state_dict, checkpoint_id=path, planner=UCPSavePlanner())
    dcp.load(state_dict, checkpoint_id=path, planner=UCPLoadPlanner())
"""

__version__ = "0.1.0"

from ._compat import check_torch as _check_torch

_check_torch()

from .catalog import CATALOG_KEY, read_catalog  # noqa: E402
from .errors import (  # noqa: E402
    AmbiguousLayoutError,
    CatalogVersionError,
    ChecksumError,
    CoverageError,
    MissingAtomsError,
    ParamGroupError,
    PatternError,
    ReplicaMismatchError,
    ShapeMismatchError,
    UCPError,
    UnsupportedTorchError,
    first_ucp_error,
    raise_first_ucp_error,
    ucp_errors,
)
from .load_planner import UCPLoadPlanner  # noqa: E402
from .naming import NameRules  # noqa: E402
from .reader import UCPFileSystemReader  # noqa: E402
from .save_planner import UCPSavePlanner  # noqa: E402
from .writer import UCPFileSystemWriter  # noqa: E402

__all__ = [
    "__version__",
    "UCPSavePlanner",
    "UCPLoadPlanner",
    "NameRules",
    "UCPFileSystemWriter",
    "UCPFileSystemReader",
    "CATALOG_KEY",
    "read_catalog",
    "UCPError",
    "AmbiguousLayoutError",
    "CatalogVersionError",
    "ChecksumError",
    "CoverageError",
    "MissingAtomsError",
    "ParamGroupError",
    "PatternError",
    "ReplicaMismatchError",
    "ShapeMismatchError",
    "UnsupportedTorchError",
    "first_ucp_error",
    "raise_first_ucp_error",
    "ucp_errors",
]
