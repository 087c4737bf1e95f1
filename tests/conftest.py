import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Make the `tests/` helpers (dist, helpers, training) importable here and in the worker processes. The toy
# model and trainer come from the package (ucp_dcp.toy): nothing from recipes/ is imported into the test process.
sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "ci", derandomize=True, max_examples=300, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="collect the GPU tier (tests/gpu; make test-gpu)")


def pytest_ignore_collect(collection_path, config):
    # `make test` stays CPU-only: the GPU tier is collected only when asked for
    if collection_path.name == "gpu" and collection_path.parent == Path(__file__).parent:
        return None if config.getoption("--gpu") else True
    return None


@pytest.fixture(scope="session", autouse=True)
def _worker_pools():
    """The session's pools of gloo workers (tests/dist.py) are stopped when the session ends."""
    yield
    dist = sys.modules.get("dist")
    if dist is not None:
        dist.shutdown()
