"""ucp_dcp's development package: what the tests and the recipes share, outside the library.

* :mod:`ucp_dev.toy`: the recipes' toy LLM and its pp x dpr x dp x ep x tp trainer (and its ``plan`` target),
* :mod:`ucp_dev.testing`: the fixtures (torchtitan jobs on CPU, DeepSpeed / Megatron-Core job makers, the
  mistake set, the S3 test server, chaos, ...).

It lives in the checkout (``dev/``), not in the ``ucp-dcp`` wheel: ``make setup`` installs it in editable
mode, and the Makefile's other venvs find it on ``PYTHONPATH``. No ucp_dcp module imports it
(tests/test_architecture.py); its API may change without notice.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEV_ROOT = Path(__file__).resolve().parents[1]
"""The folder holding this ``ucp_dev`` (the checkout's ``dev/``)."""


def code_path() -> str:
    """A ``PYTHONPATH`` that puts this ``ucp_dcp`` and this ``ucp_dev`` first: for the subprocesses the tests
    and recipes start (torchrun jobs, the foreign job makers), so they run the caller's code in any venv."""
    spec = importlib.util.find_spec("ucp_dcp")  # located, not imported (that would import torch here)
    assert spec is not None and spec.origin is not None, "ucp_dcp is not importable"
    return os.pathsep.join([str(Path(spec.origin).resolve().parents[1]), str(DEV_ROOT)])
