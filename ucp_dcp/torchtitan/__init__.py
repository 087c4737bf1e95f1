"""torchtitan integration (``pip install ucp-dcp[torchtitan]``, torchtitan 0.3.0).

* ``UCPCheckpointManager``: torchtitan's checkpoint manager with ucp_dcp's planners;
* ``GlobalCursorTextDataLoader``: a text loader that resumes at any data-parallel degree;
* ``InterleavedGlobalCursorDataLoader``: the same for weighted interleaved sources;
* ``--override.imports ucp_dcp.torchtitan.overrides.checkpointer,ucp_dcp.torchtitan.overrides.dataloader``
  switches a stock config; ``--module ucp_dcp.torchtitan --config llama3_debugmodel_ucp`` is a
  registry entry. See docs/torchtitan.md.
"""

try:
    import torchtitan  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ucp_dcp.torchtitan needs torchtitan (and triton to import it): pip install 'ucp-dcp[torchtitan]'"
    ) from e

from ._compat import TESTED_TORCHTITAN, check_torchtitan  # noqa: E402

check_torchtitan()

from .dataloader import GlobalCursorTextDataLoader, GlobalWindowDataset  # noqa: E402
from .interleave import InterleavedGlobalCursorDataLoader  # noqa: E402
from .manager import UCPCheckpointManager  # noqa: E402

__all__ = [
    "UCPCheckpointManager",
    "GlobalCursorTextDataLoader",
    "GlobalWindowDataset",
    "InterleavedGlobalCursorDataLoader",
    "TESTED_TORCHTITAN",
]
