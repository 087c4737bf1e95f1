"""The GPU tier (``make test-gpu``): collected only with ``--gpu``; skipped, with one line, without CUDA."""

import pytest
import torch

NO_GPU = "no CUDA GPU on this machine (torch.cuda.is_available() is False): the GPU tier did not run"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NO_GPU))
