"""torchtitan's version check and the private torchtitan names the integration uses, in one place.

The integration subclasses torchtitan's ``CheckpointManager`` and wraps its ``dcp_save`` /
``dcp_load``, whose signatures and call order change between torchtitan releases; an untested
release fails at import (like :func:`ucp_dcp._compat.check_torch`) unless
``UCP_DCP_ALLOW_UNTESTED_TORCHTITAN=1``. Checked against torchtitan 0.3.0.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

from ..errors import UnsupportedTorchError

TESTED_TORCHTITAN = ("0.3",)
"""``major.minor`` releases of torchtitan the integration's tests run on."""
ALLOW_ENV = "UCP_DCP_ALLOW_UNTESTED_TORCHTITAN"


def check_torchtitan() -> None:
    try:
        found = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:  # a source checkout: trust its own attribute
        import torchtitan

        found = str(getattr(torchtitan, "__version__", "unknown"))
    if ".".join(found.split(".")[:2]) in TESTED_TORCHTITAN:
        return
    msg = (f"ucp_dcp.torchtitan is tested with torchtitan {', '.join(v + '.x' for v in TESTED_TORCHTITAN)}, found "
           f"{found}. It overrides torchtitan's checkpoint manager and dataloader internals, which change between "
           f"releases; install a tested torchtitan (pip install 'ucp-dcp[torchtitan]') or set {ALLOW_ENV}=1 to try "
           "anyway at your own risk.")
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(msg, stacklevel=3)
        return
    raise UnsupportedTorchError(msg, hint=f"pip install torchtitan==0.3.0 (or set {ALLOW_ENV}=1)")


def validate_dataset(*args, **kwargs):
    """torchtitan's (private) dataset-name/path resolution for its text datasets."""
    from torchtitan.hf_datasets.text_datasets import _validate_dataset

    return _validate_dataset(*args, **kwargs)


def datasets_iterable_kinds(ds) -> set[str] | None:
    """Class names of the example iterables a ``datasets.IterableDataset`` is built from (its private
    ``_ex_iterable`` chain: their states do not all name their type), None if it has no such chain."""
    root = getattr(ds, "_ex_iterable", None)
    if root is None:
        return None
    kinds, todo = set(), [root]
    while todo:
        it = todo.pop()
        kinds.add(type(it).__name__)
        todo += [x for x in [getattr(it, "ex_iterable", None)] if x is not None]
        todo += list(getattr(it, "ex_iterables", None) or [])
    return kinds
