"""The train state besides model and optimizer at a new layout (issue 47): ``RNGState``, the LR scheduler, the step
and ``GlobalSampler``, saved with ``ucp_dcp.save`` on 2 gloo ranks and loaded at 1, 3 and 4; the
``ReplicaMismatchError`` hint for a naively saved per-rank RNG state names the recipe.

Bitwise: a rank the checkpoint holds draws exactly what it drew after the save; a new rank draws what
``derived_seed``'s documented seeding gives (recomputed here with generators of their own), the same at two loads.
"""

import contextlib
import logging
import random
import re
from pathlib import Path

import dist as D
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import StepLR

import ucp_dcp
from ucp_dcp.train_state import GENERATORS, GlobalSampler, RNGState, _capture, _restore_host, derived_seed

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"
N, BATCH, SEED = 50, 3, 7  # the sampler: 50 samples, 3 per rank and batch
STEPS = 4  # batches consumed before the save (at dp=2: 24 samples)


def _seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _draws():
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]


def _python_draws(seed):
    r = random.Random(seed)
    return [r.random() for _ in range(4)]


def _scheduler(lr):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=lr)
    return opt, StepLR(opt, step_size=2, gamma=0.5)


# -- multi-rank: save at 2, load at 1, 3, 4 ---------------------------------------------------------------


def _train_state_worker(rank, world, root):
    groups = {n: dist.new_group(list(range(n))) for n in (1, 2, 3)}
    groups[4] = None  # the default group
    out = {}
    if rank < 2:
        _seed_all(100 + rank)
        _draws()  # every generator moved off its seed
        opt, sched = _scheduler(0.1)
        for _ in range(5):
            opt.step()
            sched.step()
        sampler = GlobalSampler(N, BATCH, dp_rank=rank, dp_size=2, seed=SEED)
        it = iter(sampler)
        consumed = []
        for _ in range(STEPS):
            consumed.append(next(it))
            sampler.step()
        sd = {"rng": RNGState(groups[2]), "scheduler": sched, "train": {"step": 5}, "dataloader": sampler}
        mine = _capture(False)
        ref = _draws()  # what this rank draws next, then rewound: the save captures the state before the draws
        _restore_host(mine)
        ucp_dcp.save(sd, root, process_group=groups[2])
        out["saved"] = {"state": mine, "draws": ref, "sched": sched.state_dict(), "consumed": consumed}
    dist.barrier()
    out["loads"] = []
    for n in (1, 3, 4, 4):
        if rank < n:
            _seed_all(999 + rank)  # other generators than saved: the load must set them
            opt, sched = _scheduler(1.0)
            sampler = GlobalSampler(N, BATCH, dp_rank=rank, dp_size=n, seed=SEED)
            rng = RNGState(groups[n])
            sd = {"rng": rng, "scheduler": sched, "train": {"step": 0}, "dataloader": sampler}
            with _logged("ucp_dcp.train_state") as warned:
                ucp_dcp.load(sd, root, process_group=groups[n])
            out["loads"].append(
                {
                    "n": n,
                    "draws": _draws(),
                    "sched": sched.state_dict(),
                    "lr": sched.get_last_lr(),
                    "step": sd["train"]["step"],
                    "saved_world_size": rng.saved_world_size,
                    "derived": rng.derived,
                    "batches": list(sampler),
                    "sampler": sampler.state_dict(),
                    "warned": warned,
                }
            )
        dist.barrier()
    return out


@contextlib.contextmanager
def _logged(name):
    """The messages of logger ``name`` at WARNING and above while the block runs."""
    got = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: got.append(record.getMessage())
    logging.getLogger(name).addHandler(handler)
    try:
        yield got
    finally:
        logging.getLogger(name).removeHandler(handler)


@pytest.fixture(scope="module")
def resumed():
    return D.run(_train_state_worker, 4, D.tmpdir())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("n", [1, 3, 4])
def test_saved_ranks_draw_exactly_what_they_drew_after_the_save(resumed, n):
    for rank in range(min(n, 2)):
        load = next(x for x in resumed[rank]["loads"] if x["n"] == n)
        assert load["saved_world_size"] == 2 and not load["derived"]
        assert load["draws"] == resumed[rank]["saved"]["draws"], f"rank {rank} at {n} ranks"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("n", [3, 4])
def test_new_ranks_draw_from_the_documented_derived_seeds(resumed, n):
    base = resumed[0]["saved"]["state"]
    for rank in range(2, n):
        loads = [x for x in resumed[rank]["loads"] if x["n"] == n]
        g = torch.Generator()
        g.manual_seed(derived_seed(base, rank, "torch"))
        s = derived_seed(base, rank, "numpy")
        expected = (
            torch.rand(4, generator=g).tolist(),
            np.random.RandomState([s & 0xFFFFFFFF, s >> 32]).rand(4).tolist(),
            _python_draws(derived_seed(base, rank, "python")),
        )
        for load in loads:  # two loads at 4 ranks: the same derived states
            assert load["derived"] and load["saved_world_size"] == 2
            assert load["draws"] == expected, f"rank {rank} at {n} ranks"
    if n == 4:
        assert resumed[2]["loads"][-1]["draws"] != resumed[3]["loads"][-1]["draws"], "new ranks share a stream"
        assert resumed[2]["loads"][-1]["draws"] not in (resumed[0]["saved"]["draws"], resumed[1]["saved"]["draws"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_scheduler_and_step_load_equal_at_every_world_size(resumed):
    saved = resumed[0]["saved"]["sched"]
    assert saved == resumed[1]["saved"]["sched"] and saved["last_epoch"] == 5
    for rank in range(4):
        for load in resumed[rank]["loads"]:
            assert load["sched"] == saved and load["lr"] == saved["_last_lr"] and load["step"] == 5


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_rank_0_warns_when_the_world_size_changed(resumed):
    warned = {x["n"]: x["warned"] for x in resumed[0]["loads"]}
    assert warned[1] == [
        "UCP: RNG states saved at 2 rank(s), loaded at 1: the saved states of ranks 1..1 are not loaded"
    ]
    assert warned[4] == [
        "UCP: RNG states saved at 2 rank(s), loaded at 4: ranks 2..3 get generators seeded by "
        "ucp_dcp.train_state.derived_seed"
    ]
    assert not any(x["warned"] for r in (1, 2, 3) for x in resumed[r]["loads"]), "only rank 0 warns"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("n", [1, 3, 4])
def test_the_epoch_continues_from_the_global_position_at_another_dp_degree(resumed, n):
    order = GlobalSampler(N, BATCH, dp_rank=0, dp_size=1, seed=SEED).order(0).tolist()
    consumed = [i for rank in (0, 1) for b in resumed[rank]["saved"]["consumed"] for i in b]
    assert sorted(consumed) == sorted(order[: STEPS * BATCH * 2])
    rest = [
        i for rank in range(n) for b in next(x for x in resumed[rank]["loads"] if x["n"] == n)["batches"] for i in b
    ]
    kept = (N - len(consumed)) // (BATCH * n) * BATCH * n  # full global batches of the new degree
    assert len(rest) == kept and not set(rest) & set(consumed), "a sample repeated"
    assert set(rest) | set(consumed) == set(order[: len(consumed) + kept]), "a sample skipped"
    for rank in range(n):
        load = next(x for x in resumed[rank]["loads"] if x["n"] == n)
        assert load["sampler"] == {"epoch": 0, "position": 24, "num_samples": N, "seed": SEED, "shuffle": True}


# -- the replica check's hint for per-rank values ------------------------------------------------------------


def _naive_worker(rank, world, root):
    torch.manual_seed(rank)
    got = {}
    cases = {
        "rng": {"rng": torch.get_rng_state()},  # per-rank generators under one name
        "sampler": {"dataloader": GlobalSampler(N, BATCH, dp_rank=rank, dp_size=4)},
    }
    opt, cases["scheduler"] = _scheduler(0.1)
    if rank == 1:
        cases["sampler"]["dataloader"].step()  # one rank a batch ahead: ranks out of step
        opt.step()
        cases["scheduler"].step()
    cases["scheduler"] = {"scheduler": cases["scheduler"]}
    for name, sd in cases.items():
        try:
            ucp_dcp.save(sd, f"{root}/{name}")
            got[name] = None
        except ucp_dcp.ReplicaMismatchError as e:
            got[name] = (e.atom, e.hint)
    # the old hint's way out, per-rank names: saved at 2 ranks, a load at 4 asks for names the checkpoint lacks
    g2 = dist.new_group([0, 1])
    if rank < 2:
        ucp_dcp.save({f"rng_rank_{rank}": torch.get_rng_state()}, f"{root}/names", process_group=g2)
    dist.barrier()
    try:
        ucp_dcp.load({f"rng_rank_{rank}": torch.get_rng_state()}, f"{root}/names")
        got["names"] = None
    except ucp_dcp.UCPError as e:
        got["names"] = type(e).__name__
    return got


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_per_rank_rng_state_is_refused_with_a_hint_at_the_recipe():
    every = D.run(_naive_worker, 4, D.tmpdir())
    got = every[0]
    assert got["rng"] is not None and got["rng"][0] == "rng", got
    assert got["sampler"] is not None and got["sampler"][0] == "dataloader.position", got
    assert got["scheduler"] is not None and got["scheduler"][0].startswith("scheduler."), got
    assert [r["names"] for r in every[2:]] == ["MissingAtomsError"] * 2, [r["names"] for r in every]
    hint = got["rng"][1]
    assert "distinct names" not in hint, "the old hint gives a checkpoint that cannot load at another world size"
    assert "ucp_dcp.RNGState" in hint and "ucp_dcp.GlobalSampler" in hint, hint
    anchor = re.search(r"docs/guide\.md#([\w-]+)", hint)
    assert anchor, hint
    headings = {_anchor(m) for m in re.findall(r"^##+ (.+)$", GUIDE.read_text(), re.M)}
    assert anchor.group(1) in headings, f"the hint's guide section #{anchor.group(1)} is not in docs/guide.md"


def _anchor(heading):
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# -- one process: the derivation, the entry's checks, the sampler ------------------------------------------


def test_derived_seed_is_deterministic_and_differs_by_rank_generator_and_checkpoint():
    _seed_all(3)
    base = _capture(False)
    again = _capture(False)
    names = [*GENERATORS, "cuda:0", "cuda:1"]
    seeds = {(r, g): derived_seed(base, r, g) for r in range(6) for g in names}
    assert seeds == {(r, g): derived_seed(again, r, g) for r in range(6) for g in names}
    assert len(set(seeds.values())) == len(seeds), "two ranks or generators share a seed"
    assert all(0 <= s < 2**64 for s in seeds.values())
    torch.rand(1)  # rank 0's state moved on: a later checkpoint
    assert derived_seed(_capture(False), 2, "torch") != seeds[(2, "torch")]
    with_cuda = dict(base, cuda=(torch.zeros(16, dtype=torch.uint8),))
    assert derived_seed(with_cuda, 2, "torch") == seeds[(2, "torch")], "CUDA states change the host seeds"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_one_process_round_trip_and_a_larger_checkpoint_gives_rank_0_its_own(tmp_path):
    _seed_all(11)
    rng = RNGState()
    ucp_dcp.save({"rng": rng}, tmp_path / "one")
    ref = _draws()
    _seed_all(12)
    ucp_dcp.load({"rng": rng}, tmp_path / "one")
    assert _draws() == ref and rng.saved_world_size == 1 and not rng.derived
    _seed_all(21)
    first = _capture(False)
    ref = _draws()
    _seed_all(22)
    rng.load_state_dict({"ranks": (first, _capture(False))})  # saved at 2 ranks, loaded by rank 0 of 1
    assert _draws() == ref


def test_an_entry_that_is_not_an_rng_state_is_refused():
    with pytest.raises(ucp_dcp.UCPError, match="not an RNGState's"):
        RNGState().load_state_dict({"ranks": [torch.get_rng_state()]})
    with pytest.raises(ucp_dcp.UCPError, match="format"):
        RNGState().load_state_dict({"ranks": (dict(_capture(False), version=99),)})
    with pytest.raises(ucp_dcp.InvalidArgumentError):
        RNGState(cuda="yes")


def test_without_cuda_nothing_of_cuda_is_saved_or_touched():
    assert RNGState(cuda=False).state_dict()["ranks"][0]["cuda"] == ()
    if not torch.cuda.is_available():
        assert RNGState().cuda is False


def _rest(samplers):
    return [i for s in samplers for b in s for i in b]


@pytest.mark.parametrize("old, new", [(2, 1), (2, 3), (4, 2), (1, 4), (3, 5)])
def test_sampler_position_is_global_at_any_dp_degree(old, new):
    before = [GlobalSampler(N, BATCH, dp_rank=r, dp_size=old, seed=5) for r in range(old)]
    iters = [iter(s) for s in before]
    consumed = []
    for _ in range(2):
        for it in iters:
            consumed += next(it)
        for s in before:
            s.step()
    states = {str(s.state_dict()) for s in before}
    assert len(states) == 1, "ranks in step hold one state"
    after = [GlobalSampler(N, BATCH, dp_rank=r, dp_size=new, seed=5) for r in range(new)]
    for s in after:
        s.load_state_dict(before[0].state_dict())
    rest = _rest(after)
    order = before[0].order(0).tolist()
    kept = (N - len(consumed)) // (BATCH * new) * BATCH * new
    assert sorted(consumed + rest) == sorted(order[: len(consumed) + kept])
    assert [len(s) for s in after] == [kept // (BATCH * new)] * new


def test_sampler_rolls_into_the_next_epoch_and_refuses_another_dataset():
    s = GlobalSampler(10, 2, dp_rank=0, dp_size=2, seed=1)
    first = s.order(0).tolist()
    s.step(2)  # 8 of 10 consumed: the 2 left do not fill a global batch of 4
    assert (s.epoch, s.position) == (1, 0) and s.order(1).tolist() != first
    assert list(s) == [s.order(1)[:2].tolist(), s.order(1)[4:6].tolist()]
    big = GlobalSampler(10, 4, dp_rank=0, dp_size=2, seed=1)  # a global batch of 8: position 4 leaves 6
    big.load_state_dict({"epoch": 0, "position": 4, "num_samples": 10, "seed": 1, "shuffle": True})
    assert (big.epoch, big.position) == (1, 0)
    with pytest.raises(ucp_dcp.UCPError, match="num_samples 12 saved, 10 here"):
        s.load_state_dict({"epoch": 0, "position": 0, "num_samples": 12, "seed": 1, "shuffle": True})
    for bad in ({"batch_size": 0}, {"dp_rank": 2}, {"dp_size": 0}):
        with pytest.raises(ucp_dcp.InvalidArgumentError):
            GlobalSampler(10, **{"batch_size": 2, "dp_rank": 0, "dp_size": 2, **bad})
