"""The global-cursor dataloader: the same windows make the same global batch at every DP degree,
and a resume at another degree continues with no window repeated or skipped."""

import pytest

pytest.importorskip("torchtitan")

from titan_harness import make_assets  # noqa: E402
from torchtitan.components.tokenizer import HuggingFaceTokenizer  # noqa: E402

from ucp_dcp.errors import UCPError  # noqa: E402
from ucp_dcp.torchtitan.dataloader import GlobalWindowDataset  # noqa: E402

B, SEQ = 12, 32  # global batch (sequences), window length


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("titan_assets"), n_docs=300)


def _loaders(assets, d, state=None):
    tok = HuggingFaceTokenizer(tokenizer_path=str(assets / "tokenizer"))
    out = [GlobalWindowDataset("c4_test", str(assets / "dataset"), tok, SEQ, r, d, infinite=True) for r in range(d)]
    if state is not None:
        for ds in out:
            ds.load_state_dict(state)
    return out


def _steps(loaders, n):
    """Run n steps: each rank pulls B/d windows per step; returns the window ids and samples per step."""
    its = [ds.iter_windows() for ds in loaders]
    per = B // len(loaders)
    steps = []
    for _ in range(n):
        got = {}
        for it in its:
            for _ in range(per):
                w, inp, lab = next(it)
                got[w] = (inp["input"].tolist(), lab.tolist(), inp["positions"].tolist())
        steps.append(got)
    return steps


def test_windows_per_step_match_across_dp_4_2_3(assets):
    reference = _steps(_loaders(assets, 1), 9)  # uninterrupted, dp=1
    for s, got in enumerate(reference):
        assert sorted(got) == list(range(s * B, (s + 1) * B))
    run, state = [], None
    for d, n in ((4, 3), (2, 3), (3, 3)):
        loaders = _loaders(assets, d, state)
        run += _steps(loaders, n)
        states = [ds.state_dict() for ds in loaders]
        assert all(st == states[0] for st in states), "the state must be identical on every rank"
        state = states[0]
    assert [sorted(s) for s in run] == [sorted(s) for s in reference]
    assert run == reference, "same window ids must carry the same tokens"
    assert state["cursor"] == 9 * B


def test_epochs_wrap_and_resume(assets):
    # a small dataset read several times over: the cursor also carries the epoch
    ref = _steps(_loaders(assets, 2), 60)
    loaders = _loaders(assets, 4)
    first = _steps(loaders, 40)
    st = loaders[0].state_dict()
    assert st["epoch"] >= 1
    assert first + _steps(_loaders(assets, 3, st), 20) == ref


def test_bad_resume_degrees_and_mismatched_data(assets):
    loaders = _loaders(assets, 1)
    it = loaders[0].iter_windows()
    for _ in range(5):
        next(it)
    st = loaders[0].state_dict()
    with pytest.raises(UCPError, match="not a multiple of the new data-parallel degree 2"):
        _loaders(assets, 2, st)
    with pytest.raises(UCPError, match="seq_len"):
        _loaders(assets, 1, {**st, "seq_len": SEQ * 2})
