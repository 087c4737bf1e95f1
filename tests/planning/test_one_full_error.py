"""One full error per job (issue 47): when several ranks find the same problem, the lowest of them raises it in
full and every other one a one-line error naming that rank (an instance of the same class); a rank that found
a different problem still raises its own in full.

Before, every rank printed the whole error: 26 lines a rank for one resized layer of an FSDP2 model (104 at 4
ranks under torchrun), 15 a rank for one wrong tensor of 16 (60 at 4 ranks). The pure tests pin the rule in
``ucp_dcp.errors.root_cause``; the multi-process one counts what the ranks of a real load print.
"""

import pickle
import traceback

import dist as D
import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp
from ucp_dcp.errors import (
    MissingAtomsError,
    PeerFailedError,
    ShapeMismatchError,
    peer_error,
    root_cause,
    same_as,
    same_problem,
    ucp_errors,
    user_frames,
)


def _shape(atom: str = "w", wanted: tuple = (2, 5), more: str = "") -> ShapeMismatchError:
    """A rank's own error as the load planner builds it (a fresh object per rank, as DCP unpickles them)."""
    return ShapeMismatchError(
        f"Size mismatch between saved torch.Size([2, 4]) and current: torch.Size({list(wanted)}) for {atom}\n"
        f"atom {atom!r}: saved shape (2, 4), wanted shape {wanted}.{more}",
        atom=atom,
        saved=(2, 4),
        wanted=wanted,
        hint="load into a model built with the saved configuration",
    )


def _each_rank(failures: dict) -> dict:
    return {me: root_cause(failures.items(), me) for me in failures}


# -- the rule, no process group -------------------------------------------------------------------------------


def test_the_same_problem_on_every_rank_is_in_full_on_the_lowest_and_one_line_naming_it_on_the_others():
    failures = {r: _shape() for r in range(4)}
    got = _each_rank(failures)
    assert got[0] is failures[0]  # in full: the atom, saved, wanted and the hint
    assert "atom 'w': saved shape (2, 4), wanted shape (2, 5)" in str(got[0]) and "hint: load into" in str(got[0])
    for me in (1, 2, 3):
        err = got[me]
        assert isinstance(err, ShapeMismatchError) and isinstance(err, ValueError), type(err)  # except still works
        assert isinstance(err, PeerFailedError) and err.same and err.rank == 0, err
        assert str(err) == (
            "the same as rank 0, which prints it in full: ShapeMismatchError: "
            "Size mismatch between saved torch.Size([2, 4]) and current: torch.Size([2, 5]) for w"
        ), str(err)
        # one line, and the fields are this rank's own for code that reads them
        assert (err.atom, err.saved, err.wanted) == ("w", (2, 4), (2, 5)) and err.hint.startswith("load into"), err


def test_a_different_problem_on_another_rank_is_raised_in_full_there():
    cases = {
        "another atom": _shape(atom="v"),
        "another wanted shape": _shape(wanted=(2, 6)),
        "one more problem in the aggregated list": _shape(more="\n1 more problem(s):\n  - Size mismatch for v"),
        "another class, the same text": MissingAtomsError(_shape().message, atom="w", saved=(2, 4), wanted=(2, 5)),
    }
    for why, other in cases.items():
        failures = {0: _shape(), 1: other, 2: _shape()}
        got = _each_rank(failures)
        assert got[0] is failures[0] and got[1] is other, why  # each problem in full where it was found
        assert got[2].same and got[2].rank == 0, why  # rank 2's is rank 0's: one line
    differ_only_in_wanted = _shape()
    differ_only_in_wanted.wanted = (9, 9)  # a field the text does not show is still compared
    assert not same_problem(_shape(), differ_only_in_wanted) and same_problem(_shape(), _shape())


def test_ranks_with_two_problems_and_a_rank_that_only_saw_a_peer_fail():
    a, b = _shape(), _shape(atom="v")
    failures = {0: a, 1: b, 2: _shape(), 3: _shape(atom="v"), 4: peer_error(0, a)}
    got = _each_rank(failures)
    assert got[0] is a and got[1] is b
    assert got[2].same and got[2].rank == 0 and got[3].same and got[3].rank == 1, (got[2], got[3])
    assert isinstance(got[4], ShapeMismatchError) and not got[4].same and str(got[4]).startswith("rank 0 failed:")


def test_the_one_line_error_stays_one_line_after_a_pickle_round_trip():
    err = root_cause({0: _shape(), 1: _shape()}.items(), 1)
    back = pickle.loads(pickle.dumps(err))  # an async save's future, a pool's result
    assert type(back) is type(err) and back.same and back.rank == 0 and str(back) == str(err)
    assert len(str(back).splitlines()) == 1 and back.hint == err.hint


def _raise_through_ucp_errors(err: BaseException) -> None:
    with ucp_errors():  # as ucp_dcp.load wraps dcp.load
        raise CheckpointException("load", {0: err})


def test_the_traceback_of_an_error_out_of_dcps_wrapper_holds_one_ucp_dcp_frame():
    cut = user_frames(_raise_through_ucp_errors)
    with pytest.raises(ShapeMismatchError) as e:
        cut(_shape())
    frames = traceback.extract_tb(e.value.__traceback__)
    inside = [f for f in frames if "/ucp_dcp/" in f.filename]
    assert [(f.name, f.line) for f in inside] == [("call", "raise err from None")], frames
    assert "contextlib" not in "".join(traceback.format_exception(e.value))
    assert isinstance(e.value.checkpoint_exception, CheckpointException)  # DCP's wrapper, with every rank's stack

    def direct() -> None:  # raised by ucp_dcp itself, not out of DCP's wrapper: its frames say where
        raise _shape()

    with pytest.raises(ShapeMismatchError) as e2:
        user_frames(direct)()
    assert [f.name for f in traceback.extract_tb(e2.value.__traceback__)][-1] == "direct"


# -- a real load on 4 ranks -----------------------------------------------------------------------------------


def _load_worker(rank, world, root, how):
    ucp_dcp.save({"w": torch.arange(8.0).reshape(2, 4)}, root)
    cols = 6 if (how == "rank 1 differs" and rank == 1) else 5
    try:
        ucp_dcp.load({"w": torch.zeros(2, cols)}, root)
    except ShapeMismatchError as e:
        return {
            "error": type(e).__name__,
            "str": str(e),
            "same": getattr(e, "same", False),
            "rank": getattr(e, "rank", None),
            "printed": "".join(traceback.format_exception(e)),  # as Python prints it uncaught (from this frame)
        }
    return {"error": None}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_rank_with_the_same_shape_mistake_prints_it_once_in_full():
    res = D.run(_load_worker, 4, D.tmpdir(), "all the same")
    full, peers = res[0], res[1:]
    assert full["error"] == "ShapeMismatchError" and not full["same"], full
    assert "atom 'w': saved shape (2, 4), wanted shape (2, 5)" in full["str"] and "hint:" in full["str"], full
    for r in peers:
        assert r["error"] == "PeerShapeMismatchError" and r["same"] and r["rank"] == 0, r
        assert len(r["str"].splitlines()) == 1 and r["str"].startswith("the same as rank 0"), r["str"]
        assert r["str"].endswith("Size mismatch between saved torch.Size([2, 4]) and current: torch.Size([2, 5]) for w")
    printed = [r["printed"].splitlines() for r in res]
    # the traceback header, this frame and one line of ucp_dcp's (2 lines each), then the error: 8 lines in full
    # (Size mismatch, atom, hint), 6 for each one-line peer; before, 15 on every rank
    assert [len(p) for p in printed] == [8, 6, 6, 6], "\n".join("\n".join(p) for p in printed)
    assert all(sum("/ucp_dcp/" in ln for ln in p) == 1 for p in printed), printed


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_rank_whose_mistake_differs_still_prints_its_own_in_full():
    res = D.run(_load_worker, 4, D.tmpdir(), "rank 1 differs")
    assert [(r["error"], r["same"]) for r in res] == [
        ("ShapeMismatchError", False),
        ("ShapeMismatchError", False),
        ("PeerShapeMismatchError", True),
        ("PeerShapeMismatchError", True),
    ], res
    assert "wanted shape (2, 6)" in res[1]["str"] and "wanted shape (2, 5)" in res[0]["str"], res
    assert all(r["rank"] == 0 and "torch.Size([2, 5])" in r["str"] for r in res[2:]), res


def test_many_problems_of_one_mistake_print_three_on_their_own_lines_and_name_the_rest_on_one():
    from ucp_dcp.planning.load_steps import combine_problems

    problems = [_shape(atom=f"layers.{i}.w{j}") for i in range(9) for j in range(4)]  # one resized layer kind
    msg = combine_problems(problems).message.splitlines()
    assert msg[2] == "35 more problem(s):" and len(msg) == 2 + 1 + 3 + 1, msg  # was 2 + 1 + 9 + 1 (+ "... and 26")
    assert [m.rsplit(" for ", 1)[1] for m in msg[3:6]] == ["layers.0.w1", "layers.0.w2", "layers.0.w3"], msg
    assert msg[6].startswith("  - ... and 32 more, for layers.1.w0, layers.1.w1,") and msg[6].endswith(" others"), msg
    assert len(msg[6]) < 200, msg[6]
    few = combine_problems(problems[:3]).message.splitlines()
    assert few[2:] == ["2 more problem(s):"] + [f"  - {p.message.splitlines()[0]}" for p in problems[1:3]], few


# -- what an uncaught peer error prints ------------------------------------------------------------------------

_UNCAUGHT = """
from torch.distributed.checkpoint.api import CheckpointException
from ucp_dcp.errors import ShapeMismatchError, same_as, ucp_errors, user_frames

own = ShapeMismatchError("Size mismatch for w\\natom 'w': saved (2, 4), wanted (2, 5).", atom="w", hint="rebuild")

@user_frames
def load():
    with ucp_errors():
        raise CheckpointException("load", {1: same_as(0, own)})

load()
"""


def test_an_uncaught_peer_error_prints_its_one_line_without_a_traceback(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_UNCAUGHT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    # before: the traceback header, the job's frame, ucp_dcp's `raise err from None`, then this line (6 lines)
    assert out.stderr.splitlines() == [
        "ucp_dcp.errors.PeerShapeMismatchError: the same as rank 0, which prints it in full: "
        "ShapeMismatchError: Size mismatch for w"
    ], out.stderr


def test_the_hook_drops_the_traceback_of_that_error_only_and_hands_every_error_to_the_hook_behind_it(monkeypatch):
    import sys

    seen = []  # the hook that was there before the call: torch's "[rankN]: " prefix, or a job's logger
    monkeypatch.setattr(sys, "excepthook", lambda tp, value, tb: seen.append((tp.__name__, tb is not None)))
    with pytest.raises(ShapeMismatchError) as peer:
        user_frames(_raise_through_ucp_errors)(same_as(0, _shape()))
    with pytest.raises(ShapeMismatchError) as own:  # a rank's own error, in full: not brief
        user_frames(_raise_through_ucp_errors)(_shape())
    try:
        raise RuntimeError("the job's own error") from peer.value
    except RuntimeError as e:
        chained = e
    for err in (peer.value, own.value, chained):  # as Python calls the hook for an uncaught error
        sys.excepthook(type(err), err, err.__traceback__)
    assert seen == [("PeerShapeMismatchError", False), ("ShapeMismatchError", True), ("RuntimeError", True)], seen
    assert chained.__cause__ is peer.value and peer.value.__traceback__ is None  # the chain prints it, frames gone
    first = sys.excepthook
    with pytest.raises(ShapeMismatchError):  # a second brief error does not stack a second hook
        user_frames(_raise_through_ucp_errors)(same_as(0, _shape()))
    assert sys.excepthook is first and first.__wrapped_by_ucp_dcp__
