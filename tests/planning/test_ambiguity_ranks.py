"""Ambiguity errors name the ranks that hold the clashing descriptions. The coordinator merges one catalog
per distinct rank structure, so the index of a structure is not a rank: with ranks 0 and 1 alike and ranks
2 and 3 alike, the second structure is ranks [2, 3], not "rank 1" (4 gloo ranks)."""

from __future__ import annotations

import dist as D
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import ucp_failure
from torch.distributed.checkpoint.api import CheckpointException

from ucp_dcp import AmbiguousLayoutError, UCPSavePlanner

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def _save_dtype_clash(rank, world, root, first_differs):
    # ranks whose dtype differs: the last two, or only rank 0 (then the structures are [0] and [1, 2, 3])
    odd = rank == 0 if first_differs else rank >= 2
    value = torch.arange(4, dtype=torch.float64 if odd else torch.float32)
    try:
        dcp.save({"x": value}, checkpoint_id=f"{root}/ck", planner=UCPSavePlanner(check_replicas="off"))
    except CheckpointException as e:
        err = ucp_failure(e)
        return type(err).__name__, str(err)
    finally:
        dist.barrier()
    return "no error", ""


@pytest.mark.parametrize(
    "first_differs,named",
    [
        (False, "by ranks [0, 1] but dtype='float64' by ranks [2, 3]"),
        # the singular form of the same message: make test-full (make test keeps its 5 minutes)
        pytest.param(True, "by rank 0 but dtype='float32' by ranks [1, 2, 3]", marks=pytest.mark.full),
    ],
    ids=["ranks-0-1-vs-2-3", "rank-0-vs-1-2-3"],
)
def test_dtype_clash_names_the_ranks_of_each_structure(first_differs, named):
    out = D.run(_save_dtype_clash, 4, D.tmpdir(), first_differs)
    kind, message = out[0]
    assert kind == AmbiguousLayoutError.__name__, out[0]
    assert named in message, message
