"""ucp_dcp: Universal Checkpointing for ``torch.distributed.checkpoint``.

Save, and load at any parallel layout, with checksums on every byte and an atomic commit::

    ucp_dcp.save(state_dict, path)              # or fut = ucp_dcp.async_save(state_dict, path)
    ucp_dcp.load(state_dict, path)

which is ``dcp.save``/``dcp.load`` with :class:`UCPSavePlanner`/:class:`UCPLoadPlanner` and
:class:`UCPFileSystemWriter`/:class:`UCPFileSystemReader`.
"""

from ._probes import check_torch as _check_torch
from ._version import __version__

_check_torch()

from .api import async_save, load, save  # noqa: E402
from .errors import (  # noqa: E402
    AmbiguousLayoutError,
    CatalogError,
    CatalogVersionError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    CoverageError,
    DtypeConversionError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    MissingAtomsError,
    MissingFileError,
    ParamGroupError,
    PatternError,
    ReplicaMismatchError,
    RuleArgumentError,
    ShapeMismatchError,
    StaleObjectsWarning,
    StorageAccessError,
    TruncatedFileError,
    UCPError,
    UnexpectedArgumentError,
    UnsafeCheckpointError,
    UnsupportedTorchError,
    UntestedTorchWarning,
    UnverifiedCheckpointWarning,
    first_ucp_error,
    raise_first_ucp_error,
    ucp_errors,
)
from .layout.index_maps import Chunk, IndexMap, expert_map, stage_map  # noqa: E402
from .layout.naming import NameRules  # noqa: E402
from .layout.patterns import Fused, Padded, Reduce, Replicated, Rule, Tied  # noqa: E402
from .options import UCPOptions  # noqa: E402
from .planning.catalog import CATALOG_KEY, read_catalog  # noqa: E402
from .planning.checkpoint_group import guarded as control_group  # noqa: E402
from .planning.load_planner import UCPLoadPlanner  # noqa: E402
from .planning.save_planner import UCPSavePlanner  # noqa: E402
from .sources.foreign import DeepSpeedReader, ForeignReader, MegatronReader  # noqa: E402
from .sources.hf import HFMapping, HFRule, HFStorageReader, export_hf, load_hf  # noqa: E402
from .storage.reader import UCPFileSystemReader  # noqa: E402
from .storage.writer import UCPFileSystemWriter  # noqa: E402
from .train_state import GlobalSampler, RNGState  # noqa: E402

__all__ = [
    "__version__",
    "save",
    "async_save",
    "control_group",
    "load",
    "UCPSavePlanner",
    "UCPLoadPlanner",
    "NameRules",
    "UCPOptions",
    "RNGState",
    "GlobalSampler",
    "Rule",
    "Fused",
    "Padded",
    "Replicated",
    "Reduce",
    "Tied",
    "Chunk",
    "IndexMap",
    "stage_map",
    "expert_map",
    "UCPFileSystemWriter",
    "UCPFileSystemReader",
    "CATALOG_KEY",
    "read_catalog",
    "load_hf",
    "export_hf",
    "HFMapping",
    "HFRule",
    "HFStorageReader",
    "ForeignReader",
    "DeepSpeedReader",
    "MegatronReader",
    "UCPError",
    "InvalidArgumentError",
    "UnexpectedArgumentError",
    "AmbiguousLayoutError",
    "CatalogError",
    "CatalogVersionError",
    "ChecksumError",
    "CheckpointNotFoundError",
    "StorageAccessError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "MissingFileError",
    "TruncatedFileError",
    "UnsafeCheckpointError",
    "UnverifiedCheckpointWarning",
    "CoverageError",
    "DtypeConversionError",
    "MissingAtomsError",
    "ParamGroupError",
    "PatternError",
    "RuleArgumentError",
    "ReplicaMismatchError",
    "ShapeMismatchError",
    "UnsupportedTorchError",
    "StaleObjectsWarning",
    "UntestedTorchWarning",
    "first_ucp_error",
    "raise_first_ucp_error",
    "ucp_errors",
]
