"""Values, not layouts: replica digests of objects holding tensors, and dtype conversions at load."""

import os
import pickle

import dist as D
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import expect_ucp_error, ucp_failure
from torch.distributed.checkpoint.api import CheckpointException

import ucp_dcp
from ucp_dcp import DtypeConversionError, UCPFileSystemReader, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.planning.digests import value_digest
from ucp_dev.testing.checks import bitwise_equal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Holder:
    """A custom object with tensor attributes (module level: picklable by reference)."""

    def __init__(self, t, n=3):
        self.t = t
        self.n = n


# -- value digests ---------------------------------------------------------------------------------

# each case builds two *fresh* values (distinct tensors, distinct storages)
EQUAL = {
    "tuple": lambda: (torch.ones(2),),
    "nested": lambda: {"a": [torch.arange(6.0).reshape(2, 3), {"b": (torch.tensor(7), "x")}], "c": 1.5},
    "custom_attr": lambda: Holder(torch.arange(4, dtype=torch.int64)),
    "custom_in_list": lambda: [Holder(torch.zeros(3, 2)), Holder(torch.ones(1), n=5)],
    "rng_state": lambda: {"cpu": torch.random.get_rng_state(), "seed": 0},
    "noncontiguous": lambda: (torch.arange(12.0).reshape(3, 4).t(),),
    "shared_twice": lambda: (lambda t: [t, t])(torch.ones(3)),
    "storage": lambda: [torch.arange(3.0).untyped_storage()],
    "empty": lambda: (torch.empty(0, 4),),
}


@pytest.mark.parametrize("case", sorted(EQUAL))
def test_digest_equal_for_equal_valued_tensors_in_objects(case):
    a, b = EQUAL[case](), EQUAL[case]()
    assert value_digest(a) is not None
    assert value_digest(a) == value_digest(b)


def test_digest_equal_for_contiguous_and_strided_copies():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert value_digest((t,)) == value_digest((t.contiguous(),))


DIFFERENT = {
    "values": ((torch.ones(2),), (torch.tensor([1.0, 2.0]),)),
    "dtype": ((torch.ones(2),), (torch.ones(2, dtype=torch.float64),)),
    "dtype_same_bytes": ((torch.zeros(2, dtype=torch.int32),), (torch.zeros(2, dtype=torch.float32),)),
    "shape": ((torch.ones(2, 3),), (torch.ones(3, 2),)),
    "rank": ((torch.ones(4),), (torch.ones(2, 2),)),
    "nested_value": ({"a": [torch.zeros(3)]}, {"a": [torch.tensor([0.0, 0.0, 1.0])]}),
    "custom_attr_value": (Holder(torch.arange(4)), Holder(torch.arange(1, 5))),
    "custom_attr_other": (Holder(torch.arange(4), n=3), Holder(torch.arange(4), n=4)),
    "negative_zero": ((torch.tensor([0.0]),), (torch.tensor([-0.0]),)),
}


@pytest.mark.parametrize("case", sorted(DIFFERENT))
def test_digest_differs_for_different_tensors_in_objects(case):
    a, b = DIFFERENT[case]
    assert value_digest(a) is not None and value_digest(b) is not None
    assert value_digest(a) != value_digest(b)


def test_digest_of_plain_tensor_unchanged_and_by_value():
    assert value_digest(torch.ones(2)) == value_digest(torch.ones(2))
    assert value_digest(torch.ones(2)) != value_digest(torch.ones(2, dtype=torch.float16))


def test_digest_of_unpicklable_object_is_none():
    assert value_digest({"f": lambda: 1, "t": torch.ones(1)}) is None


# -- replicas of objects holding tensors, 2 gloo ranks ------------------------------------------------


def _same_object_worker(rank, world, root):
    """Identical on every rank (fresh tensors in each process): saved once, loaded back bitwise."""
    state = {"rng": (torch.ones(2),), "obj": Holder(torch.arange(3)), "w": torch.arange(4.0)}
    dcp.save(state, checkpoint_id=f"{root}/same", planner=UCPSavePlanner())
    back = {"rng": None, "w": torch.zeros(4)}
    dcp.load(back, checkpoint_id=f"{root}/same", planner=UCPLoadPlanner())
    rng = back["rng"]
    return type(rng).__name__, len(rng), rng[0].dtype, rng[0].tolist(), back["w"].tolist()


@pytest.mark.slow
def test_identical_object_with_tensor_saved_from_every_rank_loads_back():
    for out in D.run(_same_object_worker, 2, D.tmpdir()):
        assert out == ("tuple", 1, torch.float32, [1.0, 1.0], [0.0, 1.0, 2.0, 3.0])


def _differing_object_worker(rank, world, root):
    """A differing object holding a tensor: refused at save, nothing committed."""
    try:
        dcp.save({"rng": (torch.full((2,), float(rank)),)}, checkpoint_id=f"{root}/diff", planner=UCPSavePlanner())
        return None
    except CheckpointException as e:
        err = ucp_failure(e)
        return type(err).__name__, err.atom, os.path.exists(f"{root}/diff/.metadata")


@pytest.mark.slow
def test_differing_object_with_tensor_is_still_refused():
    found, other = D.run(_differing_object_worker, 2, D.tmpdir())
    assert found == ("ReplicaMismatchError", "rng", False)  # in full where the global plan found it
    assert other == ("PeerReplicaMismatchError", "rng", False)  # one line naming rank 0 on the other


def _dtensor_object_worker(rank, world, root):
    """An object holding a DTensor is not compared (its local shards differ legitimately)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(world))
    return value_digest({"x": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])})


@pytest.mark.slow
def test_object_holding_dtensor_is_not_compared():
    assert D.run(_dtensor_object_worker, 2, D.tmpdir()) == [None, None]


def _read_once_dtype_worker(rank, world, root, name, dtype):
    """Dtype checks on the read-once path (one rank reads, the other receives): the value read back,
    or (error name, atom)."""
    dcp.save(
        {"v": torch.tensor([1.5, -2.0, 3.25]), "big": torch.tensor([1.0, 1e6])},
        storage_writer=ucp_dcp.UCPFileSystemWriter(f"{root}/dt"),
        planner=UCPSavePlanner(),
    )
    n = 3 if name == "v" else 2
    back = {name: torch.zeros(n, dtype=dtype)}
    try:
        dcp.load(back, storage_reader=UCPFileSystemReader(f"{root}/dt"), planner=UCPLoadPlanner(read_once="ranks"))
    except CheckpointException as e:
        err = ucp_failure(e)
        # the receiver may hear of the reader's own overflow first: a peer error that is still a DtypeConversionError
        return type(err).__name__.removeprefix("Peer") if isinstance(err, ucp_dcp.DtypeConversionError) else repr(
            err
        ), err.atom
    return back[name].tolist()


@pytest.mark.slow
def test_read_once_receivers_convert_in_range_values():
    for out in D.run(_read_once_dtype_worker, 2, D.tmpdir(), "v", torch.float16):
        assert out == [1.5, -2.0, 3.25]


@pytest.mark.slow
def test_read_once_receivers_refuse_overflow():
    for out in D.run(_read_once_dtype_worker, 2, D.tmpdir(), "big", torch.float16):
        assert out == ("DtypeConversionError", "big")


# -- dtype conversions at load, one process -----------------------------------------------------------

READERS = ["stock", "ucp"]


def _save(path, sd, reader):
    if reader == "ucp":
        dcp.save(sd, storage_writer=ucp_dcp.UCPFileSystemWriter(path), planner=UCPSavePlanner())
    else:
        dcp.save(sd, checkpoint_id=path, planner=UCPSavePlanner())


def _load(path, sd, reader, **kw):
    planner = UCPLoadPlanner(**kw)
    if reader == "ucp":
        dcp.load(sd, storage_reader=UCPFileSystemReader(path), planner=planner)
    else:
        dcp.load(sd, checkpoint_id=path, planner=planner)


def _round_trip(tmp_path, saved, target, reader, **kw):
    _save(tmp_path, {"model": {"w": saved}}, reader)
    sd = {"model": {"w": target}}
    _load(tmp_path, sd, reader, **kw)
    return sd["model"]["w"]


def _refused(tmp_path, saved, target, reader, **kw):
    _save(tmp_path, {"model": {"w": saved}}, reader)
    return expect_ucp_error(lambda: _load(tmp_path, {"model": {"w": target}}, reader, **kw), DtypeConversionError)


@pytest.mark.parametrize("reader", READERS)
def test_float_to_int_refused_at_plan_time(tmp_path, reader):
    target = torch.full((3,), -5, dtype=torch.int32)
    err = _refused(tmp_path, torch.tensor([1.7, -2.5, 3.0]), target, reader)
    text = str(err)
    assert err.atom == "model.w" and "'model.w'" in text
    assert "torch.float32" in text and "torch.int32" in text and "allow_lossy_dtype=True" in text
    assert err.saved == torch.float32 and err.wanted == torch.int32
    assert target.tolist() == [-5, -5, -5], "refused at planning: no byte may reach the target"


@pytest.mark.parametrize("reader", READERS)
def test_float_to_int_allowed_when_lossy_is_allowed(tmp_path, reader):
    got = _round_trip(
        tmp_path, torch.tensor([1.7, -2.5, 3.0]), torch.zeros(3, dtype=torch.int32), reader, allow_lossy_dtype=True
    )
    assert got.dtype == torch.int32 and got.tolist() == [1, -2, 3]


@pytest.mark.parametrize("reader", READERS)
def test_fp32_overflowing_fp16_refused(tmp_path, reader):
    err = _refused(tmp_path, torch.tensor([1.0, 1e6, -2.0]), torch.zeros(3, dtype=torch.float16), reader)
    text = str(err)
    assert err.atom == "model.w" and "torch.float32" in text and "torch.float16" in text and "inf" in text
    assert "1e+06" in text and "allow_lossy_dtype=True" in text


@pytest.mark.parametrize("reader", READERS)
def test_fp32_overflowing_fp16_allowed_when_lossy_is_allowed(tmp_path, reader):
    got = _round_trip(
        tmp_path, torch.tensor([1.0, 1e6]), torch.zeros(2, dtype=torch.float16), reader, allow_lossy_dtype=True
    )
    assert got.tolist() == [1.0, float("inf")]


@pytest.mark.parametrize("reader", READERS)
def test_fp32_overflowing_bf16_refused(tmp_path, reader):
    _refused(tmp_path, torch.tensor([1.0, 3.4e38]), torch.zeros(2, dtype=torch.bfloat16), reader)


@pytest.mark.parametrize("reader", READERS)
def test_fp32_to_bf16_in_range_allowed(tmp_path, reader):
    torch.manual_seed(0)
    saved = torch.randn(64, 33) * 1e3
    saved[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])  # non-finite stays non-finite
    got = _round_trip(tmp_path, saved, torch.zeros(64, 33, dtype=torch.bfloat16), reader)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, saved.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


EDGE_LOADS = [
    (65519.0, torch.float16),
    (3.39e38, torch.bfloat16),
    (460.0, torch.float8_e4m3fn),
    (60000.0, torch.float8_e5m2),
]
"""Values past the target's largest finite value that torch's cast rounds to it (issue 46): they load."""


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("value,wanted", EDGE_LOADS, ids=lambda x: str(x).removeprefix("torch."))
def test_values_rounding_to_the_largest_finite_value_load_as_to_gives_them(tmp_path, reader, value, wanted):
    saved = torch.tensor([[1.0, value, -value], [0.5, float("-inf"), float("nan")]])
    if wanted == torch.float8_e4m3fn:
        saved[1, 1] = -2.0  # no inf in float8_e4m3fn
    got = _round_trip(tmp_path, saved, torch.zeros(2, 3, dtype=wanted), reader)
    assert bitwise_equal(got, saved.to(wanted)), (got, saved.to(wanted))


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(
    "saved,wanted,first,becomes",
    [
        ([1.0, float("inf"), 2.0, float("-inf")], torch.float8_e4m3fn, "inf", "448"),  # torch: a silent 448
        ([1.0, 470.0, 2.0, 1e6], torch.float8_e4m3fn, "470", "448"),  # past the edge (464): saturated by torch
        ([1.0, 65520.0, 2.0, -7e4], torch.float16, "65520", "inf"),  # the edge: a tie, to inf
        ([1.0, 3.3962e38, 2.0, -3.4e38], torch.bfloat16, "3.3962e+38", "inf"),
    ],
    ids=["inf-e4m3fn", "past-e4m3fn", "edge-fp16", "past-bf16"],
)
def test_values_past_the_rounding_edge_are_refused(tmp_path, reader, saved, wanted, first, becomes):
    target = torch.zeros(4, dtype=wanted)
    err = _refused(tmp_path, torch.tensor(saved), target, reader)
    text = str(err)
    assert err.atom == "model.w" and "'model.w'" in text and ": 2 saved value(s) " in text, text
    assert f"(e.g. {first}, which would become {becomes})" in text and "allow_lossy_dtype=True" in err.hint, text
    assert not target.view(torch.uint8).any(), "refused before the copy: no value may reach the target"


@pytest.mark.parametrize("reader", READERS)
def test_an_inf_into_a_format_without_one_is_refused_also_when_the_range_is_the_same(tmp_path, reader):
    saved = torch.tensor([1.0, float("inf"), 57344.0]).to(torch.float8_e5m2)  # e5m2fnuz: same max, NaN for inf
    err = _refused(tmp_path, saved, torch.zeros(3, dtype=torch.float8_e5m2fnuz), reader)
    assert ": 1 saved value(s) " in str(err) and "(e.g. inf, which would become nan)" in str(err), str(err)


@pytest.mark.parametrize("reader", READERS)
def test_values_past_the_rounding_edge_load_as_to_gives_them_when_lossy_is_allowed(tmp_path, reader):
    saved = torch.tensor([1.0, float("inf"), 470.0, 1e6])
    got = _round_trip(tmp_path, saved, torch.zeros(4, dtype=torch.float8_e4m3fn), reader, allow_lossy_dtype=True)
    assert bitwise_equal(got, saved.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("reader", READERS)
def test_nan_into_an_int_target_is_refused_at_plan_time(tmp_path, reader):
    target = torch.full((2,), -5, dtype=torch.int32)
    err = _refused(tmp_path, torch.tensor([1.0, float("nan")]), target, reader)
    assert err.saved == torch.float32 and err.wanted == torch.int32 and target.tolist() == [-5, -5]


def _dtype_edge_dtensor_worker(rank, world, root):
    """DTensors (Shard(0) over every rank) of fp32 edge values, loaded into DTensor targets of narrower
    dtypes: per target dtype, whether this rank's loaded shard's bytes equal ``.to()``'s, or (error name, atom,
    text). The targets are built from local shards and compared there: gloo has no float8 type."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(world))
    cases = {
        "fp16": ([65519.0, -65519.0, 1.0, 0.5], torch.float16),
        "bf16": ([3.39e38, -3.39e38, 1.0, 0.5], torch.bfloat16),
        "e4m3fn": ([460.0, 464.0, -460.0, 1.0], torch.float8_e4m3fn),
        "e5m2": ([60000.0, -61439.0, 1.0, 0.5], torch.float8_e5m2),
        "e4m3fn_inf": ([1.0, 2.0, 3.0, float("inf")], torch.float8_e4m3fn),  # the inf on the last rank's shard
        "fp16_past": ([1.0, 2.0, 3.0, 65520.0], torch.float16),
    }
    saved = {k: distribute_tensor(torch.tensor(v), mesh, [Shard(0)]) for k, (v, _) in cases.items()}
    dcp.save(saved, storage_writer=ucp_dcp.UCPFileSystemWriter(f"{root}/edge"), planner=UCPSavePlanner())
    out = {}
    for k, (v, wanted) in cases.items():
        mine = torch.tensor(v).chunk(world)[rank]
        target = {k: DTensor.from_local(torch.zeros(len(mine), dtype=wanted), mesh, [Shard(0)], run_check=False)}
        try:
            dcp.load(target, storage_reader=UCPFileSystemReader(f"{root}/edge"), planner=UCPLoadPlanner())
        except CheckpointException as e:
            err = ucp_failure(e)
            out[k] = (type(err).__name__.removeprefix("Peer"), err.atom, str(err))
            continue
        out[k] = bitwise_equal(target[k].to_local(), mine.to(wanted))
    return out


@pytest.mark.slow
def test_dtensor_edge_values_load_as_to_gives_them_and_past_the_edge_are_refused():
    for out in D.run(_dtype_edge_dtensor_worker, 2, D.tmpdir()):
        assert out["fp16"] is out["bf16"] is out["e4m3fn"] is out["e5m2"] is True, out
        for k, first in (("e4m3fn_inf", "inf"), ("fp16_past", "65520")):
            name, atom, text = out[k]
            assert name == "DtypeConversionError" and atom == k and f"(e.g. {first}, " in text, out


@pytest.mark.parametrize("reader", READERS)
def test_int64_out_of_int32_range_refused(tmp_path, reader):
    err = _refused(tmp_path, torch.tensor([1, 2**40]), torch.zeros(2, dtype=torch.int32), reader)
    assert "torch.int64" in str(err) and "torch.int32" in str(err) and str(2**40) in str(err)


@pytest.mark.parametrize("reader", READERS)
def test_int64_in_int32_range_allowed(tmp_path, reader):
    got = _round_trip(tmp_path, torch.tensor([1, -(2**31), 2**31 - 1]), torch.zeros(3, dtype=torch.int32), reader)
    assert got.tolist() == [1, -(2**31), 2**31 - 1]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(
    "saved,wanted",
    [
        (torch.int32, torch.int64),
        (torch.float32, torch.float64),
        (torch.int32, torch.float32),
        (torch.bool, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.complex64),
    ],
    ids=lambda d: str(d).removeprefix("torch."),
)
def test_widening_conversions_allowed(tmp_path, reader, saved, wanted):
    values = torch.tensor([0, 1, 5, 7]).to(saved)
    got = _round_trip(tmp_path, values, torch.zeros(4, dtype=wanted), reader)
    assert torch.equal(got, values.to(wanted))


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(
    "saved,wanted",
    [
        (torch.complex64, torch.float32),
        (torch.float32, torch.bool),
        (torch.int64, torch.bool),
        (torch.float64, torch.int64),
    ],
    ids=lambda d: str(d).removeprefix("torch."),
)
def test_lossy_kind_conversions_refused(tmp_path, reader, saved, wanted):
    err = _refused(tmp_path, torch.tensor([0, 1, 5, 7]).to(saved), torch.zeros(4, dtype=wanted), reader)
    assert str(saved) in str(err) and str(wanted) in str(err)


def test_kind_refusal_lists_every_atom(tmp_path):
    dcp.save({"a": torch.ones(2), "b": torch.ones(2)}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    err = expect_ucp_error(
        lambda: dcp.load(
            {"a": torch.zeros(2, dtype=torch.int8), "b": torch.zeros(2, dtype=torch.int8)},
            checkpoint_id=tmp_path,
            planner=UCPLoadPlanner(),
        ),
        DtypeConversionError,
    )
    assert "'a'" in str(err) and "'b'" in str(err)


def test_narrowing_into_2d_target_in_range(tmp_path):
    dcp.save({"w": torch.arange(12, dtype=torch.int64).reshape(3, 4)}, checkpoint_id=tmp_path, planner=UCPSavePlanner())
    sd = {"w": torch.zeros(3, 4, dtype=torch.int8)}
    dcp.load(sd, checkpoint_id=tmp_path, planner=UCPLoadPlanner())
    assert sd["w"].tolist() == torch.arange(12).reshape(3, 4).tolist()


class _Spy(UCPLoadPlanner):
    """Records whether each resolved tensor shares memory with the load target."""

    def resolve_tensor(self, read_item):
        t = super().resolve_tensor(read_item)
        r = self._targets[read_item.dest_index.fqn]
        self.aliases.append(t.untyped_storage().data_ptr() == r.local.untyped_storage().data_ptr())
        return t


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(
    "wanted,alias",
    [(torch.float32, True), (torch.float64, True), (torch.float16, False)],
    ids=["same", "widening", "narrowing"],
)
def test_only_narrowing_reads_go_through_a_scratch_tensor(tmp_path, reader, wanted, alias):
    _save(tmp_path, {"w": torch.arange(6.0)}, reader)
    planner = _Spy()
    planner.aliases = []
    sd = {"w": torch.zeros(6, dtype=wanted)}
    if reader == "ucp":
        dcp.load(sd, storage_reader=UCPFileSystemReader(tmp_path), planner=planner)
    else:
        dcp.load(sd, checkpoint_id=tmp_path, planner=planner)
    assert planner.aliases and set(planner.aliases) == {alias}
    assert sd["w"].tolist() == list(range(6))


def test_dtype_error_survives_pickle():
    err = DtypeConversionError("x", atom="a", saved=torch.float32, wanted=torch.int32, hint="h")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is DtypeConversionError and back.saved == torch.float32 and back.wanted == torch.int32


def test_allow_lossy_dtype_survives_planner_pickle():
    assert pickle.loads(pickle.dumps(UCPLoadPlanner(allow_lossy_dtype=True))).allow_lossy_dtype is True
    assert pickle.loads(pickle.dumps(UCPLoadPlanner())).allow_lossy_dtype is False


def test_sets_digest_alike_whatever_the_hash_seed():
    """A set's pickle follows the process's string-hash seed; ranks differ in it (PYTHONHASHSEED)."""
    import subprocess
    import sys

    code = (
        "from ucp_dcp.planning.digests import value_digest; "
        "print(value_digest({'tags': {'alpha', 'beta', 'gamma', 'delta'}, 'f': frozenset({'x', 'y', 'z'})}))"
    )
    # the two interpreters start at once: each spends its time importing torch
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)},
        )
        for seed in (1, 2)
    ]
    outs = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert len(outs) == 1 and outs != {""} and outs != {"None"}, outs
