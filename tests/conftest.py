import os
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The support modules (tests/support: the pool `dist`, `helpers`, the harnesses) are importable by their names,
# here and in the worker processes: pyproject's [tool.pytest.ini_options] pythonpath puts tests/support on sys.path
# (the workers inherit it); this line does the same for a run that does not read that config (pytest -c ...).
# The toy model and trainer come from the development package (ucp_dev.toy, dev/): nothing from recipes/ is imported here.
# Nothing in the tests may download: the Hugging Face libraries are told so before any of them is imported (here,
# in the pool's workers and in every job a test starts, which inherit the environment). Without it, datasets'
# load_dataset waits on a 5 s network timeout every few calls on a machine without the Hub (test_interleave.py:
# 39 s -> 13 s).
for _offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_offline, "1")

SUPPORT = os.path.join(os.path.dirname(__file__), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

# 150 examples for a property without its own @settings (300 until make test outgrew its 5 minutes); the
# properties that need more say so. HYPOTHESIS_PROFILE=thorough runs 1,000 of each.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=150,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=150, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="collect the GPU tier (tests/gpu; make test-gpu)")
    parser.addoption(
        "--e2e-shard",
        default="all",
        help="e2e items to run besides the core ones: all (default), auto (the commit's shard: CI), or a shard "
        "number (tests/support/e2e_shard.py)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``--e2e-shard``: keep the core e2e items and one shard of the others (before -m/-k, so the shards are
    the same whatever else is selected). Under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) the
    multi-process items (marker ``slow``) form one group, run by one xdist worker on one set of worker pools,
    while the other worker runs the single-process tests beside them: the pool's ranks mostly wait on each
    other, and one pytest process left a core idle most of the run."""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("pool"))
    choice = config.getoption("--e2e-shard")
    if choice == "all":
        return
    import e2e_shard as S

    e2e = [i for i in items if i.get_closest_marker("e2e")]
    durations = S.load_durations()
    core, shards = S.split(map(S.entry, e2e), durations)
    if choice == "auto":
        k, why = S.commit_shard(Path(config.rootpath))
    else:
        k, why = int(choice) % S.SHARDS, f"--e2e-shard {choice}"
    keep = set(core) | {n for u in shards[k] for n in u.items}
    dropped = [i for i in e2e if i.nodeid not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if not (i.get_closest_marker("e2e") and i.nodeid not in keep)]
    core_s = sum(durations.get(n, S.DEFAULT_SECONDS) for n in core)
    line = (
        f"e2e shard {k} of 0..{S.SHARDS - 1} ({why}): {len(core)} core items (~{core_s / 60:.1f} min recorded) + "
        f"{sum(len(u.items) for u in shards[k])} of the shard (~{sum(u.seconds for u in shards[k]) / 60:.1f} min); "
        f"rerun with --e2e-shard {k} or UCP_E2E_SHARD={k}"
    )
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


def pytest_terminal_summary(terminalreporter):
    """One line on the worker pools this run started (tests/support/dist.py): their count and start-up time."""
    dist = sys.modules.get("dist")
    starts = getattr(dist, "STARTS", None)
    if starts:
        parts = ", ".join(f"{w} ranks {s:.1f} s ({why})" for w, s, why in starts)
        terminalreporter.write_line(
            f"worker pools started: {len(starts)}, {sum(s for _, s, _ in starts):.1f} s: {parts}"
        )


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


# -- the S3-compatible server the object-store tests use (tests/storage, tests/torchtitan, tests/tools) --------

S3_BUCKET = "ucp-tests"


@pytest.fixture(scope="session")
def s3_server():
    """A running :class:`~ucp_dev.testing.s3_server.S3Server` with bucket :data:`S3_BUCKET`; this process's
    AWS settings point at it for the session (the pool's workers get them per task: ``D.setenv`` of ``server.env()``)."""
    from ucp_dev.testing.s3_server import S3Server

    server = S3Server().start()
    server.create_bucket(S3_BUCKET)
    server.bucket = S3_BUCKET
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3(s3_server):
    """The server with its faults off and counters reset, and a prefix of its own for this test."""
    s3_server.faults.clear()
    s3_server.prefix = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"
    yield s3_server
    s3_server.faults.clear()
