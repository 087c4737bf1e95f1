"""Progress of long work (issues 34, 47): shown on the coordinating rank after ``MIN_SECONDS``, on by default only
on a terminal, ``UCP_DCP_PROGRESS`` / ``set_enabled`` / ``plan --no-progress`` turn it off or on. A save's or
load's progress names its phases (planning, writing / reading, commit), the job's total and the time left."""

import io
import pickle
import sys

import dist as D
import pytest
import torch
import torch.distributed as dist

import ucp_dcp
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


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _call(what="save", stream=None, **kw):
    clock = _Clock()
    p = P.CallProgress(what, stream=stream if stream is not None else io.StringIO(), clock=clock, thread=False, **kw)
    return p.__enter__(), clock


def test_a_save_shows_its_phases_the_total_and_the_time_left_in_a_log():
    P.set_enabled(True)  # into a log (not a terminal): a line per phase, then every LOG_EVERY_S
    out = io.StringIO()
    p, clock = _call(stream=out)
    clock.now += 1.0
    p.tick()
    assert out.getvalue() == ""  # under MIN_SECONDS: nothing yet
    clock.now += 1.5
    p.tick()
    p.job(8 << 20, 1)
    n = [0]
    p.counting("writing", 8 << 20, lambda: n[0])
    for _ in range(2):  # 2 MiB a second from the first bytes on
        clock.now += 1.0
        n[0] += 2 << 20
        p.tick()
    p.phase("commit")
    clock.now += 0.5
    p.__exit__(None, None, None)
    lines = out.getvalue().splitlines()
    assert lines == [
        "ucp_dcp save: planning, 2.5 s",
        "ucp_dcp save: writing 4.0 MiB/8.0 MiB, 2.0 MiB/s, ~2 s left, 4.5 s",
        "ucp_dcp save: commit, 4.5 s",
        "ucp_dcp save: done in 5.0 s (planning 2.5 s, writing 2.0 s (4.0 MiB, 2.0 MiB/s), commit 0.5 s)",
    ], lines


def test_a_job_of_several_ranks_is_estimated_from_rank_0_and_says_so():
    P.set_enabled(True)
    p, clock = _call("load", min_seconds=0.0)
    p.job(32 << 20, 4)
    n = [1 << 20]
    p.counting("reading", 8 << 20, lambda: n[0])
    clock.now += 1.0
    n[0] = 4 << 20
    line = p.line()
    assert line.startswith("ucp_dcp load: reading ~16.0 MiB/32.0 MiB (4 ranks; est. from rank 0's 4.0 MiB/8.0 MiB)")
    assert "~1 s left" in line, line  # rank 0's rate since its first bytes: 3 MiB a second, 4 MiB to go


def test_a_terminal_gets_one_line_rewritten_in_place_and_a_failure_says_where():
    out = _Tty()
    p, clock = _call(stream=out, min_seconds=0.0)
    p.tick()
    clock.now += 0.2
    p.tick()  # under TTY_EVERY_S: not rewritten
    p.__exit__(RuntimeError, RuntimeError("x"), None)
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 2 and text.endswith("ucp_dcp save: failed after 0.2 s, while planning\n"), text


def test_a_short_call_prints_nothing_and_progress_travels_as_nothing():
    out = _Tty()
    with P.CallProgress("save", stream=out) as p:  # MIN_SECONDS not reached
        p.counting("writing", 10, lambda: 10)
        p.phase("commit")
    assert out.getvalue() == ""
    assert pickle.loads(pickle.dumps(p)) is None  # a writer pickled for DCP's checkpoint process leaves it here


def _force_on(monkeypatch):
    P.set_enabled(True)
    monkeypatch.setattr(P, "MIN_SECONDS", 0.0)  # a test's save is short: show its progress from the start


def test_a_one_rank_save_and_load_show_planning_the_total_and_the_commit(tmp_path, monkeypatch, capsys):
    _force_on(monkeypatch)
    sd = {f"t{i}": torch.full((256,), float(i)) for i in range(100)}  # 100 KiB of tensors
    ucp_dcp.save(sd, tmp_path)
    saved = capsys.readouterr().err
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    ucp_dcp.load(target, tmp_path)
    loaded = capsys.readouterr().err
    assert "ucp_dcp save: planning" in saved, saved
    assert "ucp_dcp save: writing 100.0 KiB/100.0 KiB" in saved and " left, " in saved, saved
    assert "ucp_dcp save: commit" in saved and "ucp_dcp save: done in " in saved, saved
    assert "ucp_dcp load: planning" in loaded and "ucp_dcp load: reading 100.0 KiB/100.0 KiB" in loaded, loaded
    assert "ucp_dcp load: done in " in loaded and "reading " in loaded.splitlines()[-1], loaded
    assert torch.equal(target["t7"], sd["t7"])


def test_an_async_save_shows_staging_to_commit_and_ends_with_its_future(tmp_path, monkeypatch, capsys):
    _force_on(monkeypatch)
    fut = ucp_dcp.async_save({f"t{i}": torch.ones(256) for i in range(10)}, tmp_path)
    fut.result()
    err = capsys.readouterr().err
    for step in ("staging", "planning", "writing 10.0 KiB/10.0 KiB", "commit", "done in "):
        assert f"ucp_dcp async save: {step}" in err, err


def _two_rank_worker(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    P.set_enabled(True)
    P.MIN_SECONDS = 0.0  # the pool restores module globals after the task
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    saved, sys.stderr = sys.stderr, io.StringIO()
    try:
        ucp_dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, root)
        target = {"w": distribute_tensor(torch.zeros(64, 64), mesh, [Shard(0)])}
        ucp_dcp.load(target, root)
        text = sys.stderr.getvalue()
    finally:
        sys.stderr = saved
    dist.barrier()
    return text


def test_on_two_ranks_rank_0_alone_shows_the_jobs_bytes_estimated_from_its_own():
    rank0, rank1 = D.run(_two_rank_worker, 2, D.tmpdir())
    assert rank1 == ""
    # 16 KiB in the job, 8 KiB of it rank 0's
    assert "ucp_dcp save: writing ~16.0 KiB/16.0 KiB (2 ranks; est. from rank 0's 8.0 KiB/8.0 KiB)" in rank0, rank0
    assert "ucp_dcp save: commit (after every rank's writes)" in rank0, rank0
    assert "ucp_dcp load: reading ~16.0 KiB/16.0 KiB (2 ranks; est. from rank 0's 8.0 KiB/8.0 KiB)" in rank0, rank0


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
