"""The CI share of the e2e tier (tests/support/e2e_shard.py): the shards partition the non-core items, the
split does not depend on collection order, and the recorded durations keep the core and every shard within
their budgets; every capability has a core item."""

import json
from pathlib import Path

import e2e_shard as S
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent

UNITS = st.lists(
    st.tuples(st.text("abcdef", min_size=1, max_size=6), st.floats(0, 1000, allow_nan=False)),
    unique_by=lambda t: t[0],
    max_size=30,
).map(lambda xs: [S.Unit(k, (k,), s) for k, s in xs])


@settings(max_examples=100)
@given(UNITS, st.integers(1, 6), st.randoms(use_true_random=False))
def test_assign_partitions_balances_and_ignores_order(units, shards, rnd):
    out = S.assign(units, shards)
    assert sorted(u.key for s in out for u in s) == sorted(u.key for u in units)
    shuffled = list(units)
    rnd.shuffle(shuffled)
    assert S.assign(shuffled, shards) == out
    if units:  # greedy longest-first: no shard exceeds the mean by more than one unit
        loads = [sum(u.seconds for u in s) for s in out]
        assert max(loads) <= sum(loads) / shards + max(u.seconds for u in units) + 1e-6


def test_units_keep_a_module_fixture_together():
    got = S.units([("m.py::a", True), ("m.py::b", True), ("n.py::c", False), ("n.py::d", False)], {"m.py::a": 5})
    assert [(u.key, u.items, u.seconds) for u in got] == [
        ("m.py", ("m.py::a", "m.py::b"), 5 + S.DEFAULT_SECONDS),
        ("n.py::c", ("n.py::c",), S.DEFAULT_SECONDS),
        ("n.py::d", ("n.py::d",), S.DEFAULT_SECONDS),
    ]


class _Collect:
    def __init__(self):
        self.entries = []

    def pytest_collection_modifyitems(self, items):
        self.entries = [S.entry(i) for i in items if i.get_closest_marker("e2e")]


@pytest.fixture(scope="module")
def split():
    plugin = _Collect()
    code = pytest.main(
        ["--collect-only", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(ROOT / "tests")], plugins=[plugin]
    )
    assert code == 0 and plugin.entries
    return plugin.entries, *S.split(plugin.entries, S.load_durations())


@pytest.mark.parametrize("capability", S.CORE)
def test_every_capability_has_a_core_item(split, capability):
    """Each capability's core item exists (a renamed or removed test shows here, not as a silent gap)."""
    entries, core, _ = split
    assert S.CORE[capability] in {n for n, _, _ in entries}
    assert S.CORE[capability] in core


def test_every_item_is_core_or_in_exactly_one_shard(split):
    entries, core, shards = split
    placed = core + [n for s in shards for u in s for n in u.items]
    assert sorted(placed) == sorted(n for n, _, _ in entries)


def test_recorded_durations_fit_the_budgets(split):
    """A new slow e2e item shows here: record it (tools/e2e_durations.py), mark less as core, or add a shard."""
    _, core, shards = split
    durations = S.load_durations()
    assert sum(durations.get(n, S.DEFAULT_SECONDS) for n in core) <= S.CORE_BUDGET_S
    loads = [round(sum(u.seconds for u in s)) for s in shards]
    assert max(loads) <= S.SHARD_BUDGET_S, loads


def test_recorded_durations_name_existing_items(split):
    entries, _, _ = split
    stale = set(json.loads(S.DURATIONS.read_text())) - {n for n, _, _ in entries}
    assert not stale, f"remove or rename in {S.DURATIONS.name}: {sorted(stale)}"
