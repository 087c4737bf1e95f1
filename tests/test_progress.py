"""Progress of long work (issue 34): shown on the coordinating rank after ``MIN_SECONDS``, on by default only
on a terminal, ``UCP_DCP_PROGRESS`` / ``set_enabled`` / ``plan --no-progress`` turn it off or on."""

import io
import time

import pytest

from ucp_dcp import progress as P


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def _default(monkeypatch):
    monkeypatch.delenv(P.ENV, raising=False)
    P.set_enabled(None)
    yield
    P.set_enabled(None)


def test_on_by_default_only_on_a_terminal_and_the_environment_decides_first(monkeypatch):
    assert P.enabled(_Tty()) and not P.enabled(io.StringIO())
    monkeypatch.setenv(P.ENV, "0")
    assert not P.enabled(_Tty())
    monkeypatch.setenv(P.ENV, "1")
    assert P.enabled(io.StringIO())
    P.set_enabled(False)
    assert not P.enabled(io.StringIO())


def test_plan_progress_counts_ranks_and_ends_with_a_line():
    out = _Tty()
    rp = P.RankProgress("plan", stream=out, min_seconds=0.0)
    for r in range(1, 5):
        rp(r, 4)
    text = out.getvalue()
    assert "plan: 1/4 ranks planned" in text and text.rstrip("\n").endswith("s") and text.endswith("\n")
    assert "plan: 4/4 ranks planned" in text


def test_nothing_is_printed_before_the_time_threshold_or_when_off():
    out = _Tty()
    rp = P.RankProgress("plan", stream=out)  # MIN_SECONDS not reached
    rp(1, 2)
    rp(2, 2)
    P.set_enabled(False)
    quiet = _Tty()
    P.RankProgress("plan", stream=quiet, min_seconds=0.0)(1, 1)
    assert out.getvalue() == "" and quiet.getvalue() == ""


def test_bytes_progress_shows_size_and_rate_while_the_work_runs():
    out = _Tty()
    n = [0]
    with P.BytesProgress("load", lambda: n[0], stream=out, min_seconds=0.05):
        for _ in range(6):
            n[0] += 3 * 2**20
            time.sleep(0.05)
    text = out.getvalue()
    assert "ucp_dcp load (rank 0): 18.0 MiB, " in text and "MiB/s" in text and text.endswith("\n"), text


def test_a_short_save_prints_nothing():
    out = _Tty()
    with P.BytesProgress("save", lambda: 1, stream=out):
        pass
    assert out.getvalue() == ""


def test_recipe_steps_print_one_whole_line_each_with_the_time_left_on_a_terminal_only():
    out, log = _Tty(), io.StringIO()
    sp, quiet = P.StepProgress("chaos", 3, "cases", stream=out, min_seconds=0.0), P.StepProgress("chaos", 3, stream=log)
    for name in ("exit@read", "hang@load-plan", "dtype"):
        sp(name)
        quiet(name)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["chaos: 1/3 cases", "chaos: 2/3 cases", "chaos: 3/3 cases"]
    assert "left (exit@read)" in lines[0] and lines[2].endswith(" s (dtype)")  # no time left after the last
    assert log.getvalue() == ""  # not a terminal: off
