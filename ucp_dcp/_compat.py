"""Refuse to run on a torch release ucp_dcp was not tested with.

ucp_dcp relies on private DTensor/DCP internals (``_StridedShard`` semantics, planner hooks such as
``_create_global_plan`` and the plan cache). A different torch may change them silently, which in a
checkpoint layer means silently wrong loads, so an untested torch fails at import time.
"""

from __future__ import annotations

import os
import warnings

import torch

from .errors import UnsupportedTorchError

TESTED_TORCH = ((2, 13),)
"""``(major, minor)`` releases the test-suite runs on."""
ALLOW_ENV = "UCP_DCP_ALLOW_UNTESTED_TORCH"


def check_torch() -> None:
    base = torch.__version__.split("+")[0]
    try:
        major, minor = (int(x) for x in base.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    if (major, minor) in TESTED_TORCH:
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_TORCH)
    msg = (
        f"ucp_dcp is tested with torch {tested}, found torch {torch.__version__}. It depends on private "
        f"DTensor/DCP internals that change between releases; install a tested torch "
        f"(e.g. `pip install torch==2.13.0`) or set {ALLOW_ENV}=1 to try anyway at your own risk."
    )
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(msg, stacklevel=3)
        return
    raise UnsupportedTorchError(msg, hint=f"pip install torch==2.13.0 (or set {ALLOW_ENV}=1)")
