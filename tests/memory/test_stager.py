"""The memory tier's staging copy (:mod:`ucp_dcp.memory.staging`): what a planner sees of it, buffers kept
between saves, independence from the originals (no process group)."""

import torch

from ucp_dcp.memory.staging import Stager


class _Counter:  # a Stateful value: staged through its state_dict(), as DCP saves it
    def __init__(self) -> None:
        self.n = 7

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def _state() -> dict:
    emb = torch.randn(8, 4)
    return {
        "emb": emb,
        "out": emb,  # tied: the same tensor under two keys
        "rows": emb[2:5],  # a view of it that is not the same view
        "opt": {"step": torch.tensor(3.0), "moments": [torch.randn(3), torch.randn(2, 2).t()]},
        "counter": _Counter(),
        "tag": "run-1",
    }


def test_the_copy_equals_the_state_and_keeps_its_aliasing_and_nesting():
    sd = _state()
    got = Stager().stage(sd)
    assert got["out"] is got["emb"]  # a tied pair stays one tensor: the planner sees it tied
    assert got["rows"] is not got["emb"] and torch.equal(got["rows"], sd["rows"])
    assert torch.equal(got["emb"], sd["emb"]) and got["emb"].data_ptr() != sd["emb"].data_ptr()
    assert torch.equal(got["opt"]["step"], sd["opt"]["step"]) and got["opt"]["step"].dim() == 0
    assert all(torch.equal(a, b) for a, b in zip(got["opt"]["moments"], sd["opt"]["moments"]))
    assert got["counter"] == {"n": 7} and got["tag"] == "run-1"


def test_buffers_are_reused_and_the_copy_does_not_follow_the_originals():
    sd, st = _state(), Stager()
    first = st.stage(sd)
    ptr = first["emb"].data_ptr()
    before = sd["emb"].clone()
    sd["emb"].add_(1.0)  # training goes on after the save returned
    assert torch.equal(first["emb"], before)
    second = st.stage(sd)
    assert second["emb"].data_ptr() == ptr and torch.equal(second["emb"], sd["emb"])  # the same buffer, no new memory
    assert st.bytes == sum(
        t.numel() * t.element_size() for t in (sd["emb"], sd["rows"], sd["opt"]["step"], *sd["opt"]["moments"])
    )


def test_a_changed_shape_gets_a_new_buffer_and_a_dropped_entry_frees_its_own():
    sd, st = _state(), Stager()
    st.stage(sd)
    sd["emb"] = torch.randn(10, 4)
    sd["out"] = sd["emb"]
    del sd["rows"]
    got = st.stage(sd)
    assert got["emb"].shape == (10, 4) and torch.equal(got["emb"], sd["emb"]) and got["out"] is got["emb"]
    assert ".rows" not in st._buffers
