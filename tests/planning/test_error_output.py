"""What a failed load prints (issue 34): each rank's error once, the others' in one line.

DCP's ``CheckpointException`` carries every rank's traceback in its text; chained to our error it printed each
rank's message three times on every rank (226 lines for one shape mismatch on 2 ranks under torchrun). The
workers format the exception ``ucp_dcp.load`` raised the way Python prints an uncaught one, and count.
"""

import traceback

import dist as D
import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

MAX_LINES = 16  # the traceback from the caller's line into ucp_dcp.load, and the message with its hint


def _printed(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def _load_worker(rank, world, root, how):
    ucp_dcp.save({"w": torch.arange(8.0).reshape(2, 4)}, root)
    target = {"w": torch.zeros(2, 5 if how == "shape" else 4)}
    if how == "extra" and rank == 1:  # only rank 1 wants an atom the checkpoint lacks
        target["extra"] = torch.zeros(3)
    try:
        ucp_dcp.load(target, root)
    except ucp_dcp.UCPError as e:
        text = _printed(e)
        return {
            "error": type(e).__name__,
            "text": text,
            "wrapped": isinstance(e.checkpoint_exception, CheckpointException),
        }
    except BaseException as e:  # DCP's wrapper (what a stock load raises)
        return {"error": type(e).__name__, "text": _printed(e), "wrapped": False}
    return {"error": None}


def test_a_shape_mismatch_on_two_ranks_prints_each_ranks_error_once():
    for rank, r in enumerate(D.run(_load_worker, 2, D.tmpdir(), "shape")):
        # the same problem on both ranks: in full on rank 0, one line naming it on rank 1 (issue 47)
        assert r["error"] == ("ShapeMismatchError" if rank == 0 else "PeerShapeMismatchError"), r
        assert r["text"].count("Size mismatch") == 1, r["text"]
        assert len(r["text"].splitlines()) <= MAX_LINES, (rank, r["text"])
        assert r["wrapped"], "DCP's exception is kept on the error for a caller who wants it"


def test_a_rank_that_fails_alone_prints_its_error_and_the_other_one_line_naming_it():
    res = D.run(_load_worker, 2, D.tmpdir(), "extra")
    assert res[1]["error"] == "MissingAtomsError" and res[1]["text"].count("Missing key") == 1, res[1]
    assert res[0]["error"] == "PeerMissingAtomsError", res[0]
    last = [ln for ln in res[0]["text"].splitlines() if not ln.startswith(" ")]
    assert last[-1].startswith("ucp_dcp.errors.PeerMissingAtomsError: rank 1 failed: MissingAtomsError: Missing key"), (
        last
    )
    assert "Traceback" not in res[0]["text"].split("PeerMissingAtomsError")[1], res[0]["text"]
    assert all(len(r["text"].splitlines()) <= MAX_LINES for r in res), res


def _save_finding_worker(rank, world, root):
    from ucp_dcp.layout.patterns import Reduce

    try:  # each rank's value differs: the coordinator's global plan finds it (no rank's own plan can)
        ucp_dcp.save({"w": torch.zeros(2), "n": 10 + rank}, root, patterns=[Reduce(r"n", "equal")])
    except ucp_dcp.UCPError as e:
        return {"error": type(e).__name__, "text": _printed(e), "message": e.message, "rank": getattr(e, "rank", None)}
    return {"error": None}


def test_a_global_plan_finding_is_printed_in_full_by_the_rank_that_found_it_and_in_one_line_by_the_others():
    res = D.run(_save_finding_worker, 2, D.tmpdir())
    found, other = res
    assert found["error"] == "ReplicaMismatchError" and found["text"].count("declared equal across ranks") == 1, found
    assert other["error"] == "PeerReplicaMismatchError" and other["rank"] == 0, other
    assert len(other["message"].splitlines()) == 1, other["message"]
    assert other["message"].startswith("rank 0 found: ReplicaMismatchError: atom 'n' is declared equal"), other
    assert "declared equal across ranks" in other["text"].splitlines()[-2] + other["text"].splitlines()[-1]
    assert all(len(r["text"].splitlines()) <= MAX_LINES for r in res), res
