import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The support modules (tests/support: the pool `dist`, `helpers`, the harnesses) are importable by their names,
# here and in the worker processes: pyproject's [tool.pytest.ini_options] pythonpath puts tests/support on sys.path
# (the workers inherit it); this line does the same for a run that does not read that config (pytest -c ...).
# The toy model and trainer come from the package (ucp_dcp.toy): nothing from recipes/ is imported here.
SUPPORT = os.path.join(os.path.dirname(__file__), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=300,
    deadline=None,
    print_blob=True,
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
    """The session's pools of gloo workers (tests/support/dist.py) are stopped when the session ends."""
    yield
    dist = sys.modules.get("dist")
    if dist is not None:
        dist.shutdown()


@pytest.fixture(scope="session")
def reconfig_runs():
    """``run(save, load)``: one transition of the reconfiguration set on the pool (tests/support/reconfig_set.py),
    run once per session by whichever test asks first: test_reconfig.py checks the resume, test_dryrun_reconfig.py
    plans the same load against its ReadStats; neither depends on the other having run."""
    from reconfig_set import run_transition

    done: dict[tuple[str, str], dict] = {}

    def run(save: str, load: str) -> dict:
        if (save, load) not in done:
            done[(save, load)] = run_transition(save, load)
        return done[(save, load)]

    return run
