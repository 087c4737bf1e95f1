"""torchtitan's version check and the private torchtitan names the integration uses, in one place.

The integration subclasses torchtitan's ``CheckpointManager`` and wraps its ``dcp_save`` /
``dcp_load``, whose signatures and call order change between torchtitan releases; an untested
release fails at import (like :func:`ucp_dcp._probes.check_torch`) unless
``UCP_DCP_ALLOW_UNTESTED_TORCHTITAN=1``. Checked against torchtitan 0.3.0.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Any

from .. import settings
from ..errors import UnsupportedTorchError

TESTED_TORCHTITAN = ("0.3",)
"""``major.minor`` releases of torchtitan the integration's tests run on."""
ALLOW_ENV = settings.ENV["torchtitan"]


def check_torchtitan() -> None:
    try:
        found = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:  # a source checkout: trust its own attribute
        import torchtitan

        found = str(getattr(torchtitan, "__version__", "unknown"))
    if ".".join(found.split(".")[:2]) in TESTED_TORCHTITAN:
        return
    msg = (
        f"ucp_dcp.torchtitan is tested with torchtitan {', '.join(v + '.x' for v in TESTED_TORCHTITAN)}, found "
        f"{found}. It overrides torchtitan's checkpoint manager and dataloader internals, which change between "
        f"releases; install a tested torchtitan (pip install 'ucp-dcp[torchtitan]') or set {ALLOW_ENV}=1 to try "
        "anyway at your own risk."
    )
    if settings.allow_untested("torchtitan"):
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


# -- private torchtitan names the integration uses (torchtitan 0.3), each in one place -----------------


def states_to_load(manager: Any, model_only: bool) -> dict[str, Any]:
    """What a ``CheckpointManager`` hands ``dcp.load`` at a resume (its ``_states_to_load``)."""
    return manager._states_to_load(model_only)


def flattened_model_states_sd(manager: Any) -> dict[str, Any]:
    """The state dict a ``CheckpointManager`` saves: model entries flattened to the top level
    (its ``_flattened_model_states_sd``)."""
    return manager._flattened_model_states_sd()


def find_load_step(manager: Any) -> int:
    """The newest durable ``step-N`` a ``CheckpointManager`` would resume from, -1 for none (its
    ``_find_load_step``)."""
    return int(manager._find_load_step())


def should_purge(manager: Any) -> bool:
    """Whether this rank of a ``CheckpointManager`` purges stale step folders (its ``_should_purge``: rank 0,
    ``keep_latest_k`` set, the folder there; subclasses add guards)."""
    return bool(manager._should_purge())


def qkv_split_hook() -> Any:
    """``FusedQKVLinear``'s state-dict post-hook that splits ``wqkv`` into ``wq``/``wk``/``wv`` on save."""
    from torchtitan.models.common.attention import FusedQKVLinear

    return FusedQKVLinear._split_qkv_on_save


def text_dataset_parts(ds: Any) -> tuple[Any, Any, Any]:
    """A ``HuggingFaceTextDataset``'s map-style data, tokenizer and text processor (``_data``,
    ``_tokenizer``, ``_text_processor``)."""
    return ds._data, ds._tokenizer, ds._text_processor


def router_forces_round_robin(router_config: Any) -> bool:
    """Whether a ``TokenChoiceTopKRouter.Config`` has its debug round-robin routing on (its private
    ``_debug_force_load_balance``: experts assigned by position, not by score)."""
    return bool(getattr(router_config, "_debug_force_load_balance", False))
