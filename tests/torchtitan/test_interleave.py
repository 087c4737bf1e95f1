"""The global-cursor interleaver: weighted sources of different kinds (map-style, streaming with one
or four shards) mixed by torchtitan's seeded draws, one global window sequence. A resume -- at the
same or another DP degree, over several epochs of the sources, with either stopping strategy, with
DataLoader workers -- continues with exactly the uninterrupted run's batches (compared by hash), or
is refused with the reason. Single process, no process group; tiny local datasets."""

import hashlib
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from datasets import load_dataset  # noqa: E402
from torchtitan.components.tokenizer import HuggingFaceTokenizer  # noqa: E402
from torchtitan.hf_datasets import DatasetConfig  # noqa: E402
from torchtitan.hf_datasets.text_datasets import (  # noqa: E402
    DATASETS,
    HFDataSource,
    InterleavedHuggingFaceTextDataLoader,
)

from ucp_dcp.errors import UCPError  # noqa: E402
from ucp_dcp.torchtitan.dataloader import GlobalWindowDataset  # noqa: E402
from ucp_dcp.torchtitan.interleave import (  # noqa: E402
    STATE_KEYS,
    InterleavedGlobalCursorDataLoader,
    InterleavedWindowDataset,
)
from ucp_dev.testing.titan.assets import make_assets, texts  # noqa: E402

B, SEQ, SEED = 12, 32, 5  # global batch (sequences), window length, interleaving seed
MIX = (("map", 1.0), ("four", 2.0), ("one", 0.5))
"""Sources (registered below) and their unequal weights."""


def _stream_files(folder: Path, shards: int, docs: int, seed: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    all_docs = texts(shards * docs, seed=seed)
    for s in range(shards):
        with open(folder / f"part-{s:02d}.json", "w") as f:
            for t in all_docs[s * docs : (s + 1) * docs]:
                f.write(json.dumps({"text": t}) + "\n")
    return str(folder)


def _streaming(path: str):
    files = sorted(str(p) for p in Path(path).glob("part-*.json"))
    return load_dataset("json", data_files=files, split="train", streaming=True)


def _mapstyle(path: str):
    return load_dataset("json", data_files=str(Path(path) / "data.json"), split="train")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tokenizer, and three sources: ``ilv_map`` (map-style, 40 documents), ``ilv_four`` (streaming,
    4 shards of 10) and ``ilv_one`` (streaming, 1 shard of 15), registered as torchtitan datasets."""
    root = tmp_path_factory.mktemp("ilv")
    folder = make_assets(root / "assets", n_docs=40, seed=3)
    added = {
        "ilv_map": (str(folder / "dataset"), _mapstyle),
        "ilv_four": (_stream_files(root / "four", 4, 10, seed=1), _streaming),
        "ilv_one": (_stream_files(root / "one", 1, 15, seed=2), _streaming),
    }
    for name, (path, loader) in added.items():
        DATASETS[name] = DatasetConfig(path=path, loader=loader, sample_processor=lambda sample: sample["text"])
    yield folder
    for name in added:
        DATASETS.pop(name, None)


def _tok(assets):
    return HuggingFaceTokenizer(tokenizer_path=str(assets / "tokenizer"))


def _sources(infinite=True, mix=MIX, paths=None):
    return [
        HFDataSource(dataset=f"ilv_{name}", weight=w, infinite=infinite, dataset_path=(paths or {}).get(name))
        for name, w in mix
    ]


def _datasets(assets, d, state=None, *, seed=SEED, strategy="on_first_exhausted", **kw):
    out = [InterleavedWindowDataset(_sources(**kw), _tok(assets), SEQ, r, d, seed, strategy) for r in range(d)]
    for ds in out if state is not None else []:
        ds.load_state_dict(state)
    return out


def _steps(datasets, n):
    """n global steps (each rank pulls B/d windows); ``{window: (source, tokens)}`` per step. A step cut
    short by the end of the data keeps what the ranks got."""
    its = [ds.iter_windows() for ds in datasets]
    per = B // len(datasets)
    steps = []
    for _ in range(n):
        got = {}
        for it in its:
            for _ in range(per):
                item = next(it, None)
                if item is not None:
                    w, s, inp, lab = item
                    got[w] = (s, inp["input"].tolist(), lab.tolist(), inp["positions"].tolist())
        if not got:
            break
        steps.append(got)
    return steps


def _digest(steps) -> list[str]:
    return [hashlib.sha256(repr(sorted(s.items())).encode()).hexdigest()[:16] for s in steps]


def _state(datasets):
    states = [ds.state_dict() for ds in datasets]
    assert all(st == states[0] for st in states), "the state must be identical on every rank"
    return states[0]


def _resumed(assets, plan, **kw):
    """Run ``plan`` = ((degree, steps), ...), each phase resumed from the previous one's state."""
    run, state, states = [], None, []
    for d, n in plan:
        ds = _datasets(assets, d, state, **kw)
        run += _steps(ds, n)
        state = _state(ds)
        states.append(state)
    return run, states


# -- infinite sources: resumes at new degrees across epochs --------------------------------------------------

STEPS = 30


def test_resume_at_new_dp_across_epochs_equals_uninterrupted(assets):
    ref = _steps(_datasets(assets, 1), STEPS)
    run, states = _resumed(assets, ((4, 8), (2, 7), (3, 8), (1, 7)))
    epochs = states[-1]["epoch"]
    assert epochs[0] >= 1 and epochs[1] >= 3 and epochs[2] >= 2, epochs  # map-style, 4 shards, 1 shard
    assert len({tuple(st["epoch"]) for st in states}) == len(states), "each save is in other epochs"
    assert [st["cursor"] for st in states] == [8 * B, 15 * B, 23 * B, 30 * B]
    assert _digest(run) == _digest(ref)
    sources = [s for step in ref for s, *_ in step.values()]
    assert sorted(set(sources)) == [0, 1, 2] and sources.count(1) > 2 * sources.count(2), "unequal mixing"


def test_resume_without_the_saved_interleaver_state_differs(assets):
    # the check above can fail: the same state with the interleaver's draws restarted resumes elsewhere
    ds = _datasets(assets, 2)
    _steps(ds, 8)
    st = _state(ds)
    ref = _steps(_datasets(assets, 2, st), 4)
    restarted = {**st, "draws": 0, "rng": json.dumps(random.Random(SEED).getstate())}
    assert _digest(_steps(_datasets(assets, 2, restarted), 4)) != _digest(ref)


# -- finite sources: torchtitan's stopping strategies -------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "mix", "reloops"),
    [
        ("on_first_exhausted", (("map", 1.0), ("four", 2.0)), [0, 0]),
        ("all_exhausted", (("one", 1.0), ("four", 3.0)), [1, 0]),
        ("all_exhausted", (("map", 1.0), ("four", 2.0), ("one", 0.5)), [0, 2, 1]),  # four shards: reordered epoch 2
    ],
)
def test_finite_sources_stop_as_torchtitans_interleaver(assets, strategy, mix, reloops):
    """At dp=1 the windows are torchtitan's own loader's, to the last one (its draws, its exhaustion
    and re-loops; a re-looped map-style source would differ: its epoch shuffle is not torchtitan's)."""
    cfg = InterleavedHuggingFaceTextDataLoader.Config(
        sources=_sources(False, mix), seed=SEED, stopping_strategy=strategy
    )
    stock = cfg.build(dp_world_size=1, dp_rank=0, tokenizer=_tok(assets), seq_len=SEQ, local_batch_size=1)
    want = [(x["input"][0].tolist(), y[0].tolist(), x["positions"][0].tolist()) for x, y in stock]
    ours = InterleavedWindowDataset(_sources(False, mix), _tok(assets), SEQ, 0, 1, SEED, strategy)
    got = [(x["input"].tolist(), y.tolist(), x["positions"].tolist()) for _, _, x, y in ours.iter_windows()]
    assert got == want
    st = ours.state_dict()
    assert st["reloops"] == reloops
    resumed = InterleavedWindowDataset(_sources(False, mix), _tok(assets), SEQ, 0, 1, SEED, strategy)
    resumed.load_state_dict(st)
    assert list(resumed.iter_windows()) == [], "resumed after the last window, the data ends there again"
    assert resumed.state_dict()["done"] is False and st["cursor"] == len(want)


@pytest.mark.parametrize("strategy", ["on_first_exhausted", "all_exhausted"])
def test_finite_sources_resume_at_new_dp_to_the_end(assets, strategy):
    ref = _steps(_datasets(assets, 1, strategy=strategy, infinite=False), 10**6)  # to the end: 8 or 17 steps
    plan = ((2, 3), (3, 3), (1, 10**6)) if strategy == "on_first_exhausted" else ((2, 6), (3, 5), (1, 10**6))
    run, states = _resumed(assets, plan, strategy=strategy, infinite=False)
    if strategy == "all_exhausted":
        assert max(states[1]["reloops"]) >= 1, "a save after a source was re-looped"
    assert len(ref) > 7 and len(ref[-1]) < B, "the data ends mid-step"
    assert _digest(run) == _digest(ref)


# -- the loader class: workers, override -------------------------------------------------------------------


def _loader(assets, d, r, workers=0):
    cfg = InterleavedGlobalCursorDataLoader.Config(sources=_sources(), seed=SEED, num_workers=workers)
    return InterleavedGlobalCursorDataLoader(
        cfg, dp_world_size=d, dp_rank=r, tokenizer=_tok(assets), seq_len=SEQ, local_batch_size=B // d
    )


def _batches(loaders, n):
    """n global batches, one hash each (rank r's j-th row is window s*B + r + j*d), and the state."""
    its, d, out = [iter(dl) for dl in loaders], len(loaders), []
    for _ in range(n):
        rows = {}
        for r, it in enumerate(its):
            inputs, labels = next(it)
            for j in range(len(labels)):
                rows[r + j * d] = (inputs["input"][j].tolist(), inputs["positions"][j].tolist(), labels[j].tolist())
        out.append(hashlib.sha256(repr(sorted(rows.items())).encode()).hexdigest()[:16])
    states = [dl.state_dict() for dl in loaders]
    assert all(s == states[0] for s in states)
    return out, states[0]


def test_loader_with_workers_resumes_exactly_at_new_dp(assets):
    ref, _ = _batches([_loader(assets, 1, 0)], 16)
    first, st = _batches([_loader(assets, 2, r, workers=2) for r in range(2)], 9)  # workers prefetch ahead
    assert st["cursor"] == 9 * B, "the state is the last batch handed out's, not the workers' prefetch"
    rest = [_loader(assets, 3, r, workers=2) for r in range(3)]
    for dl in rest:
        dl.load_state_dict(st)
    second, st2 = _batches(rest, 7)
    assert st2["cursor"] == 16 * B and st2["epoch"][1] > st["epoch"][1] >= 1, (st["epoch"], st2["epoch"])
    assert first + second == ref


def test_override_swaps_torchtitans_interleaved_loader_keeping_its_fields(assets):
    from ucp_dcp.torchtitan.overrides import interleaved_dataloader

    stock = InterleavedHuggingFaceTextDataLoader.Config(
        sources=_sources(), seed=SEED, stopping_strategy="all_exhausted", num_workers=2, prefetch_factor=3
    )
    cfg = interleaved_dataloader(stock)
    assert type(cfg) is InterleavedGlobalCursorDataLoader.Config
    assert (cfg.sources, cfg.seed, cfg.stopping_strategy, cfg.num_workers, cfg.prefetch_factor) == (
        stock.sources,
        SEED,
        "all_exhausted",
        2,
        3,
    )
    dl = cfg.build(dp_world_size=1, dp_rank=0, tokenizer=_tok(assets), seq_len=SEQ, local_batch_size=2)
    assert isinstance(dl, InterleavedGlobalCursorDataLoader)


def test_both_loader_overrides_apply_to_one_config_tree():
    """Listed together, each claims only its own loader: the interleaved config's sources (subclasses of
    the single-source config) are left alone, and the two claims do not conflict."""
    from dataclasses import dataclass

    from torchtitan.config import Configurable
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from ucp_dcp.torchtitan.dataloader import GlobalCursorTextDataLoader

    @dataclass(kw_only=True, slots=True)
    class Root(Configurable.Config):
        train: InterleavedHuggingFaceTextDataLoader.Config
        validation: HuggingFaceTextDataLoader.Config

    root = Root(
        train=InterleavedHuggingFaceTextDataLoader.Config(sources=_sources(), seed=SEED),
        validation=HuggingFaceTextDataLoader.Config(dataset="ilv_map"),
    )
    lines = apply_overrides(
        OverrideConfig(
            imports=["ucp_dcp.torchtitan.overrides.dataloader", "ucp_dcp.torchtitan.overrides.interleaved_dataloader"]
        ),
        root,
    )
    assert len(lines) == 2, lines
    assert type(root.train) is InterleavedGlobalCursorDataLoader.Config
    assert type(root.validation) is GlobalCursorTextDataLoader.Config
    assert [type(s) for s in root.train.sources] == [HFDataSource] * len(MIX)


# -- state: keys, refusals ---------------------------------------------------------------------------------


def test_state_keys_are_the_same_on_every_rank_and_round_trip(assets):
    fresh = _state(_datasets(assets, 2))
    assert tuple(fresh) == STATE_KEYS and fresh["cursor"] == 0
    ds = _datasets(assets, 4)
    _steps(ds, 3)
    st = _state(ds)
    assert tuple(st) == STATE_KEYS and st["cursor"] == 3 * B and st["draws"] == 3 * B
    assert _state(_datasets(assets, 3, st)) == st, "a loaded state reads back unchanged"


def _saved(assets, steps=3, d=2):
    ds = _datasets(assets, d)
    _steps(ds, steps)
    return _state(ds)


@pytest.mark.parametrize(
    ("change", "atom"),
    [
        ({"seed": SEED + 1}, "seed"),
        ({"mix": (("map", 1.0), ("four", 3.0), ("one", 0.5))}, "weights"),
        ({"mix": (("four", 2.0), ("map", 1.0), ("one", 0.5))}, "sources"),
        ({"strategy": "all_exhausted"}, "stopping_strategy"),
        ({"infinite": False}, "infinite"),
    ],
)
def test_changed_interleaving_is_refused(assets, change, atom):
    st = _saved(assets)
    with pytest.raises(UCPError, match=f"saved with {atom}=") as e:
        _datasets(assets, 2, st, **change)
    assert e.value.atom == f"dataloader.{atom}"


def test_scaled_weights_are_the_same_mixture(assets):
    st = _saved(assets)
    ref = _steps(_datasets(assets, 2, st), 3)
    doubled = tuple((name, 2 * w) for name, w in MIX)  # normalised: the same draws
    assert _digest(_steps(_datasets(assets, 2, st, mix=doubled), 3)) == _digest(ref)


def test_edited_source_is_refused(assets, tmp_path):
    st = _saved(assets, steps=4)
    lines = (assets / "dataset" / "data.json").read_text().splitlines()
    doc = st["doc"][0]
    assert st["epoch"][0] == 0, "in epoch 0 the map-style source's document index is its line"
    lines[doc] = json.dumps({"text": "an edited document"})
    (tmp_path / "data.json").write_text("\n".join(lines) + "\n")
    with pytest.raises(UCPError, match="not the one the checkpoint was saved at"):
        _steps(_datasets(assets, 2, st, paths={"map": str(tmp_path)}), 4)


def test_mid_step_cursor_and_other_loaders_states_are_refused(assets):
    ds = _datasets(assets, 1)
    it = ds[0].iter_windows()
    for _ in range(5):
        next(it)
    st = ds[0].state_dict()
    with pytest.raises(UCPError, match="not a multiple of the new data-parallel degree 2"):
        _datasets(assets, 2, st)
    with pytest.raises(UCPError, match="saved with seq_len=64"):
        _datasets(assets, 1, {**st, "seq_len": 2 * SEQ})
    single = GlobalWindowDataset("ilv_map", None, _tok(assets), SEQ, 0, 1)
    with pytest.raises(UCPError, match="single-source loader's"):
        _datasets(assets, 1, single.state_dict())
    with pytest.raises(UCPError, match="an interleaved loader's"):
        single.load_state_dict(st)


def test_export_to_torchtitan_refuses_the_interleaved_state():
    from ucp_dcp.torchtitan.to_stock_data import dataloader_entries, saved_dataloader

    keys = {f"dataloader.{k}" for k in STATE_KEYS}
    assert saved_dataloader(keys)[0] == "interleaved", "not taken for the single-source cursor (it has its keys)"
    with pytest.raises(UCPError, match="interleaved loader's state"):
        dataloader_entries(None, "step-3", keys, 1)
