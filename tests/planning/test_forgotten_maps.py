"""A map at save and none at load, on plain tensors (issue 31, item 5).

Saved with a ``stage_map`` (``expert_map``), loaded at the same layout without it, each stage's (expert rank's)
tensors plain: no mesh tells the stages apart, and every stage would load the first stage's layers into its own.
At the global plan the coordinator sees that ranks read the same map-numbered atoms while entries of the
checkpoint go unread by every rank, and refuses on every rank, naming the map (``allow_partial_load`` is the way
out). The pure check first, then the 4-rank runs (pp=2 x dp=2, ep=2 x dp=2: plain replicas within a stage).
"""

import logging

import dist as D
import pytest
import torch
from helpers import ucp_failure
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp
from ucp_dcp.errors import AmbiguousLayoutError
from ucp_dcp.layout.index_maps import expert_map, map_position, stage_map
from ucp_dcp.planning.load_steps import forgotten_map_problem

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SAVED = [f"model.layers.{i}.w" for i in range(4)] + [f"optim.state.layers.{i}.w.exp_avg" for i in range(4)] + ["step"]


def test_map_position_finds_the_first_numbered_entry():
    assert map_position("model.layers.2.w", "layers") == ("model.layers.*.w", 2)
    assert map_position("model.layers.3.moe.experts.5.w1", "experts") == ("model.layers.3.moe.experts.*.w1", 5)
    assert map_position("model.layers.w", "layers") is None and map_position("model.moe.experts.w1", "experts") is None


def test_ranks_reading_the_same_names_with_entries_left_unread_are_a_forgotten_map():
    local = ["model.layers.0.w", "model.layers.1.w", "optim.state.layers.0.w.exp_avg"]
    err = forgotten_map_problem(SAVED, ["layers"], [local, local])
    assert isinstance(err, AmbiguousLayoutError) and err.atom == "model.layers.2.w", err
    assert err.saved == ["layers.2", "layers.3"] and err.wanted["model.layers.0.w"] == [0, 1]
    assert "index map 'layers' (stage_map)" in err.message and "ranks [0, 1]" in err.message
    assert "stage_map" in err.hint and "allow_partial_load=True" in err.hint


@pytest.mark.parametrize(
    "reads",
    [
        pytest.param([SAVED[:4], SAVED[:4]], id="replicas-read-every-layer-model-only"),
        pytest.param([SAVED[:2] + SAVED[6:8], SAVED[2:4]], id="stages-with-global-names"),
        pytest.param([SAVED[:4] + SAVED[6:8]] * 2, id="optimizer-state-for-some-layers-only"),
        pytest.param([SAVED[:2]], id="one-rank-reads-part"),
    ],
)
def test_loads_that_read_every_entry_or_share_nothing_are_not_refused(reads):
    assert forgotten_map_problem(SAVED, ["layers"], reads) is None


def test_only_the_maps_the_load_lacks_are_checked():
    local = ["model.layers.0.w"]
    assert forgotten_map_problem(SAVED, [], [local, local]) is None
    assert forgotten_map_problem(SAVED, ["experts"], [local, local]) is None


# -- on 4 ranks: two stages (expert ranks), each a pair of plain data-parallel replicas ----------------------


def _layout(kind: str, rank: int):
    """This rank's state (its position's two entries under local names 0, 1, values of their global numbers)
    and the map that numbers them: stage / expert rank = rank // 2."""
    pos = rank // 2
    if kind == "stage":
        key, m = "layers", stage_map([2 * pos, 2 * pos + 1], total=4, stage=pos)
        return {f"model.{key}.{i}.w": torch.full((3, 2), 10.0 * (2 * pos + i)) for i in range(2)}, {"stage_map": m}
    m = expert_map(2 * pos, total=4, owner=pos)
    return {f"model.moe.experts.{i}.w1": torch.full((2, 3), 10.0 * (2 * pos + i)) for i in range(2)}, {"expert_map": m}


def _load_worker(rank, world, root, kind, how):
    state, opts = _layout(kind, rank)
    ucp_dcp.save(state, root, **opts)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load_opts = {"with the map": opts, "without": {}, "without, partial": {"allow_partial_load": True}}[how]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ucp_dcp").addHandler(handler)
    try:
        ucp_dcp.load(target, root, **load_opts)
    except ucp_dcp.UCPError as err:
        return {"error": type(err).__name__, "atom": err.atom, "text": str(err), "untouched": _zero(target)}
    except CheckpointException as e:
        err = ucp_failure(e)
        return {"error": type(err).__name__, "atom": err.atom, "text": str(err), "untouched": _zero(target)}
    finally:
        logging.getLogger("ucp_dcp").removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    return {
        "loaded": {k: v[0, 0].item() for k, v in target.items()},
        "bitwise": _equal(target, state),
        "warned": warned,
    }


def _zero(sd):
    return all(not v.any() for v in sd.values())


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kind,arg", [("stage", "stage_map"), ("expert", "expert_map")])
def test_a_map_forgotten_at_load_on_plain_tensors_is_refused_on_every_rank(kind, arg):
    out = D.run(_load_worker, 4, D.tmpdir(), kind, "without")
    key = "layers" if kind == "stage" else "experts"
    for rank, r in enumerate(out):
        assert "error" in r, f"rank {rank} loaded without the map: {r}"
        assert r["untouched"], "the target was written before the refusal"
        assert f"{key}.2" in r["atom"], r
    found = out[0]  # the coordinator's global plan finds it: in full there, one line naming rank 0 elsewhere
    assert found["error"] == "AmbiguousLayoutError", found
    assert f"index map '{key}' ({arg})" in found["text"] and f"no rank reads {key} [2, 3]" in found["text"], found
    assert "ranks [0, 1, 2, 3]" in found["text"] and "allow_partial_load=True" in found["text"], found["text"]
    for r in out[1:]:
        assert r["error"] == "PeerAmbiguousLayoutError" and "rank 0 found: AmbiguousLayoutError:" in r["text"], r


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stage", "expert"])
def test_the_same_map_at_load_loads_bitwise(kind):
    out = D.run(_load_worker, 4, D.tmpdir(), kind, "with the map")
    assert all(r.get("bitwise") for r in out), out


@pytest.mark.slow
def test_allow_partial_load_lets_the_load_go_on_with_a_warning():
    """As documented: the load then does what the names say (every stage reads layers 0 and 1), and the
    coordinator logs what a forgotten map would be."""
    out = D.run(_load_worker, 4, D.tmpdir(), "stage", "without, partial")
    for rank, r in enumerate(out):
        assert r.get("loaded") == {"model.layers.0.w": 0.0, "model.layers.1.w": 10.0}, (rank, r)
    assert any("stage_map" in w and "allow_partial_load" in w for w in out[0]["warned"]), out[0]
