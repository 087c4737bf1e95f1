"""Whatever stock DCP saves and loads, ucp_dcp saves and loads with the same values.

One state dict holds every tensor kind and item type stock ``dcp.save``/``dcp.load`` handle in one
process (dtypes, 0-d, empty, views, transposes, storage offsets, conjugate/negative views,
Parameters; objects of DCP's byte-stream items: numbers, strings, bytes, ``io.BytesIO``, sets (numpy values are refused unless allowed)
arrays, nested containers the way DCP flattens them). It is saved by stock DCP and by ucp_dcp (its
storage and planner, and its planner on DCP's storage), loaded by each reader, and every value must
equal what stock save + stock load give: bitwise for tensors, type and ``==`` for objects. Values
whose decoding could run code are refused with the exact types and the fix (bytes are not code);
what stock DCP cannot save either is refused naming the atom. Then the replica digests: values that
are equal digest equal (hypothesis). DTensor and ShardedTensor pieces run on 2 gloo ranks (slow).
"""

from __future__ import annotations

import collections
import io
import math
import random
import struct
import warnings

import dist as D
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

import ucp_dcp
from ucp_dcp import UCPError, UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.planning.digests import value_digest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Point:
    """A custom class (module level: stock DCP pickles it by reference)."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return type(other) is Point and other.x == self.x


def _bytes(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of ``dtype`` with distinct byte patterns (every bit pattern is a value here)."""
    t = torch.empty(n, dtype=dtype)
    t.view(torch.uint8).copy_(torch.arange(t.view(torch.uint8).numel(), dtype=torch.uint8) * 7 + 1)
    return t


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
]


def _bio() -> io.BytesIO:
    b = io.BytesIO(b"raw\x00bytes \xff")
    b.seek(3)  # stock DCP pickles the position too
    return b


def _conj() -> torch.Tensor:
    return torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j]).conj()


# name -> value; every one built fresh per call
CASES: dict[str, object] = {
    **{f"dtype.{str(d).split('.')[1]}": (lambda d=d: _bytes(6, d)) for d in DTYPES},
    "bool": lambda: torch.tensor([True, False, True]),
    "scalar_0d": lambda: torch.tensor(3.25),
    "empty_0x3": lambda: torch.empty(0, 3),
    "transpose": lambda: torch.arange(12.0).reshape(3, 4).t(),
    "storage_offset": lambda: torch.arange(20.0)[5:11],
    "strided_view": lambda: torch.arange(24.0).reshape(4, 6)[::2, 1::2],
    "expanded": lambda: torch.arange(3.0).expand(2, 3),
    "conj_view": _conj,
    "neg_view": lambda: torch._neg_view(torch.tensor([1.0, -2.0, 3.0])),
    "conj_neg_view": lambda: torch._neg_view(_conj()),
    "parameter": lambda: torch.nn.Parameter(torch.arange(4.0)),
    "requires_grad": lambda: torch.arange(3.0).requires_grad_(),
    "list_of_tensors": lambda: [torch.ones(2), torch.arange(3)],
    "list_of_dicts": lambda: [{"a": 1, "t": torch.ones(1)}, {"b": "x"}],
    "tuple_with_tensor": lambda: (torch.arange(3.0), "tag", 2),
    "nested_list_of_tensor_tuples": lambda: [(torch.ones(1),), [torch.zeros(2)]],
    "ordered_dict": lambda: collections.OrderedDict([("z", 1), ("a", torch.ones(2))]),
    "int_keys": lambda: {1: 5, 2: torch.arange(2)},
    "int": lambda: 7,
    "big_int": lambda: 2**100,
    "float": lambda: 1.5,
    "neg_zero": lambda: -0.0,
    "nan": lambda: float("nan"),
    "complex": lambda: 1 - 2j,
    "bool_obj": lambda: True,
    "str": lambda: "héllo",
    "none": lambda: None,
    "bytes": lambda: b"\x00\x01bytes",
    "bytearray": lambda: bytearray(b"xy"),
    "bytesio": _bio,
    "bytesio_in_list": lambda: [_bio(), 1],
    "list_of_ints": lambda: [1, 2, 3],
    "empty_list": lambda: [],
    "set": lambda: {"alpha", "beta", 3},
    "frozenset": lambda: frozenset({1, 2}),
    "slice": lambda: slice(1, 9, 2),
    "range": lambda: range(2, 10, 3),
    "ellipsis": lambda: ...,
    "torch_size": lambda: torch.Size([2, 3]),
    "torch_dtype": lambda: torch.bfloat16,
    "torch_device": lambda: torch.device("cpu"),
    "python_rng": lambda: random.Random(5).getstate(),
    "torch_rng": lambda: torch.Generator().manual_seed(3).get_state(),
    "defaultdict": lambda: collections.defaultdict(int, {"a": 1}),
}


def _target(value):
    """What a resuming job holds before the load: zeros of the same kind, other objects."""
    if isinstance(value, torch.Tensor):
        t = (
            torch.zeros(value.shape, dtype=value.dtype)
            if value.dtype != torch.float4_e2m1fn_x2
            else torch.empty(value.shape, dtype=value.dtype)
        )
        return t.conj() if value.is_conj() else t  # a conjugate view as the target too
    if isinstance(value, (dict, list)):  # DCP flattens these (lists only when they hold tensors or dicts)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        out = {k: _target(v) for k, v in items}
        if isinstance(value, list):
            return [out[i] for i in range(len(value))]
        if isinstance(value, collections.defaultdict):
            return collections.defaultdict(value.default_factory, out)
        return type(value)(out)
    return "placeholder"


def same(a, b) -> bool:
    """Equal values: bitwise for tensors (the values shown), type and == for objects (NaN bits too)."""
    if isinstance(a, torch.Tensor):  # loaded in place: the target's tensor type (Parameter or not) stays
        if not isinstance(b, torch.Tensor):
            return False
        ra, rb = (t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1) for t in (a, b))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(ra.view(torch.uint8), rb.view(torch.uint8))
    if type(a) is not type(b):
        return False
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue() and a.tell() == b.tell() and vars(a) == vars(b)
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


# -- writers and readers (one process, no process group) ---------------------------------------------


def _save_stock(sd, path):
    dcp.save(sd, checkpoint_id=path)


def _save_ucp(sd, path):
    ucp_dcp.save(sd, path)


def _save_ucp_planner_only(sd, path):  # our planner on DCP's own storage
    dcp.save(sd, checkpoint_id=path, planner=UCPSavePlanner())


def _save_ucp_storage_only(sd, path):  # our storage with DCP's planner
    dcp.save(sd, storage_writer=UCPFileSystemWriter(path))


def _load_stock(sd, path):
    dcp.load(sd, checkpoint_id=path)


def _load_ucp(sd, path):
    return ucp_dcp.load(sd, path)


def _load_ucp_planner_only(sd, path):
    dcp.load(sd, checkpoint_id=path, planner=UCPLoadPlanner())


def _load_ucp_storage_only(sd, path):
    dcp.load(sd, storage_reader=UCPFileSystemReader(path))


WRITERS = {
    "stock": _save_stock,
    "ucp": _save_ucp,
    "ucp_planner": _save_ucp_planner_only,
    "ucp_storage": _save_ucp_storage_only,
}
READERS = {
    "stock": _load_stock,
    "ucp": _load_ucp,
    "ucp_planner": _load_ucp_planner_only,
    "ucp_storage": _load_ucp_storage_only,
}
# every pair of ucp_dcp's and DCP's planner and storage, both sides (UCPFileSystemReader under DCP's own
# DefaultLoadPlanner once failed on conjugate/negative-view targets, which DCP's planner hands over as they are)
COMBOS = [(w, r) for w in WRITERS for r in READERS if (w, r) != ("stock", "stock")]


def _state() -> dict:
    return {name: make() for name, make in CASES.items()}


def _written_by(writer: str, path: str) -> None:
    """Parity holds trivially if stock DCP did the work: a writer with our planner leaves our
    catalog, one with our storage a verified sidecar, and stock DCP neither."""
    from ucp_dcp.storage.opening import open_path

    planner_data = dcp.FileSystemReader(path).read_metadata().planner_data
    assert (ucp_dcp.read_catalog(planner_data) is not None) == (writer in ("ucp", "ucp_planner")), writer
    assert (open_path(path, trust=True)[1].status == "verified") == (writer in ("ucp", "ucp_storage")), writer


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """``loaded(writer, reader)``: the full target after a load; each pair saved and loaded once."""
    paths: dict[str, str] = {}
    done: dict[tuple[str, str], dict] = {}

    def get(writer: str, reader: str) -> dict:
        if writer not in paths:
            path = str(tmp_path_factory.mktemp(f"parity_{writer}"))
            WRITERS[writer](_state(), path)
            _written_by(writer, path)
            paths[writer] = path  # kept only once checked: every item of a writer that fails the check fails
        if (writer, reader) not in done:
            target = {k: _target(v) for k, v in _state().items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                READERS[reader](target, paths[writer])
            if reader in ("ucp", "ucp_planner"):
                # our load planner placed the objects: the int-keyed value at key 1, where stock's
                # set_element leaves the placeholder (STOCK_WRONG)
                assert target["int_keys"][1] == 5 and "1" not in target["int_keys"], (writer, reader)
            done[(writer, reader)] = target
        return done[(writer, reader)]

    return get


STOCK_WRONG = {"int_keys"}
"""Cases stock dcp.load gets wrong: DCP's flatten paths hold dict keys as strings, and its
``set_element`` puts a loaded object under ``"1"`` beside the target's key ``1`` (left as it was).
Where ucp_dcp's planner loads, the value goes to key ``1``."""


@pytest.mark.parametrize("case", sorted(set(CASES) - STOCK_WRONG))
def test_stock_round_trip_is_the_value(case, loaded):
    """The reference: stock save + stock load give the value back (so parity means correct)."""
    got = loaded("stock", "stock")[case]
    assert same(got, CASES[case]()), (got, CASES[case]())


def test_stock_round_trip_of_int_keyed_dict_adds_a_string_key(loaded):
    got = loaded("stock", "stock")["int_keys"]
    assert got[1] == "placeholder" and got["1"] == 5


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("writer,reader", COMBOS, ids=[f"{w}-to-{r}" for w, r in COMBOS])
def test_same_value_as_stock(case, writer, reader, loaded):
    ours = reader in ("ucp", "ucp_planner")  # our load planner places the objects
    want = CASES[case]() if case in STOCK_WRONG and ours else loaded("stock", "stock")[case]
    got = loaded(writer, reader)[case]
    assert same(got, want), f"{writer} save -> {reader} load of {case}: {got!r} != {want!r}"


def test_same_keys_as_stock(tmp_path):
    """ucp_dcp writes the keys (and flatten mappings) stock DCP writes for these values."""
    keys = {}
    for w in ("stock", "ucp"):
        WRITERS[w](_state(), str(tmp_path / w))
        _written_by(w, str(tmp_path / w))
        md = dcp.FileSystemReader(str(tmp_path / w)).read_metadata()
        keys[w] = {k: type(v).__name__ for k, v in md.state_dict_metadata.items()}
    assert keys["ucp"] == keys["stock"]


def test_stock_pickles_bytesio_values():
    """DCP's byte-stream item for an io.BytesIO value is a torch.save of the object (position and
    attributes included), not its raw bytes: decoding it needs io.BytesIO in the safe set."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    item = WriteItem(index=MetadataIndex("b"), type=WriteItemType.BYTE_IO)
    data = DefaultSavePlanner().transform_object(item, _bio()).getvalue()
    assert data.startswith(b"PK\x03\x04")
    assert b"BytesIO" in data  # the object itself, pickled (a global only weights_only's allow-list lets through)


# -- refusals: bytes are not code; what DCP cannot save -------------------------------------------------


@pytest.mark.parametrize("writer", ["stock", "ucp"])
def test_custom_class_refused_naming_the_type_and_the_fix(tmp_path, writer):
    WRITERS[writer]({"p": Point(3)}, str(tmp_path))
    with pytest.raises(ucp_dcp.UnsafeCheckpointError) as e:
        _load_ucp({"p": None}, str(tmp_path))
    err = e.value
    assert err.atom == "p" and f"{__name__}.Point" in str(err)
    assert "trust=True" in err.hint and f"add_safe_globals([{__name__}.Point])" in err.hint


@pytest.mark.parametrize("writer", ["stock", "ucp"])
def test_custom_class_loads_with_trust_as_stock_does(tmp_path, writer):
    WRITERS[writer]({"p": Point(3)}, str(tmp_path))
    back = {"p": None}
    stats = ucp_dcp.load(back, str(tmp_path), trust=True)
    assert same(back["p"], Point(3)) and stats.bytes_read > 0, "read by UCPFileSystemReader"


def test_custom_class_loads_once_allowed(tmp_path):
    _save_stock({"p": Point(3)}, str(tmp_path))
    back = {"p": None}
    with torch.serialization.safe_globals([Point]):
        stats = ucp_dcp.load(back, str(tmp_path))
    assert same(back["p"], Point(3)) and stats.bytes_read > 0, "read by UCPFileSystemReader"


def test_bytesio_does_not_open_the_safe_set(tmp_path):
    """An io.BytesIO loads, but one carrying a custom object in its attributes is still refused."""
    b = _bio()
    b.extra = Point(1)
    _save_stock({"b": b}, str(tmp_path))
    with pytest.raises(ucp_dcp.UnsafeCheckpointError, match=f"{__name__}.Point"):
        _load_ucp({"b": None}, str(tmp_path))


def test_decoding_leaves_the_safe_globals_as_they_were(tmp_path):
    _save_stock({"b": _bio(), "f": frozenset({1})}, str(tmp_path))
    before = set(map(repr, torch.serialization.get_safe_globals()))
    with torch.serialization.safe_globals([frozenset]):  # the user's own allowance survives ours
        stats = _load_ucp({"b": None, "f": None}, str(tmp_path))
        assert frozenset in torch.serialization.get_safe_globals()
    assert stats.bytes_read > 0, "decoded by UCPFileSystemReader (stock DCP's load leaves the safe set alone)"
    assert set(map(repr, torch.serialization.get_safe_globals())) == before


@pytest.mark.parametrize(
    "value,cause",
    [
        (torch.eye(3).to_sparse(), "torch.sparse_coo"),
        (torch.zeros(4, dtype=torch.uint4), "torch.uint4"),
        (torch.zeros(4, dtype=torch.bits8), "torch.bits8"),
    ],
    ids=["sparse", "uint4", "bits8"],
)
def test_unsavable_tensor_refused_naming_atom_like_stock_fails(tmp_path, value, cause):
    with pytest.raises(dcp.api.CheckpointException):  # stock DCP cannot save it either
        _save_stock({"w": value}, str(tmp_path / "stock"))
    with pytest.raises(UCPError) as e:
        _save_ucp({"w": value}, str(tmp_path / "ucp"))
    assert e.value.atom == "w" and cause in str(e.value) and e.value.hint


def test_object_saved_where_a_tensor_is_wanted_is_refused(tmp_path):
    """Stock DCP silently replaces the target tensor by the saved object; ucp_dcp refuses."""
    _save_stock({"x": (1, 2)}, str(tmp_path))
    stock = {"x": torch.zeros(2)}
    _load_stock(stock, str(tmp_path))
    assert stock["x"] == (1, 2)
    with pytest.raises(ucp_dcp.ShapeMismatchError, match="saved as a non-tensor object"):
        _load_ucp({"x": torch.zeros(2)}, str(tmp_path))


# -- replica digests: equal values digest equal -------------------------------------------------------

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.binary(max_size=5),
)
_key = st.one_of(st.text(max_size=4), st.integers(-5, 5))
_values = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(_key, inner, max_size=4),
        st.sets(_key, max_size=4),
        st.frozensets(_key, max_size=4),
    ),
    max_leaves=15,
)


def _equal_copy(v, rnd: random.Random):
    """An equal value built another way: dicts and sets in another order, fresh str/bytes objects."""
    if type(v) is dict:
        items = list(v.items())
        rnd.shuffle(items)
        return {_equal_copy(k, rnd): _equal_copy(x, rnd) for k, x in items}
    if type(v) in (set, frozenset):
        items = list(v)
        rnd.shuffle(items)
        return type(v)(_equal_copy(x, rnd) for x in items)
    if type(v) in (list, tuple):
        return type(v)(_equal_copy(x, rnd) for x in v)
    if type(v) is str:
        return "".join(list(v))  # a distinct object (pickle's memo must not see identity)
    if type(v) is bytes:
        return bytes(bytearray(v))
    return v


def _same_value(a, b) -> bool:
    """Equal as ucp_dcp's digest promises: same types, same bits (floats), order-free dicts/sets."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b  # sets of str/int keys, ints, str, bytes, None, bools


@given(_values, st.integers(0, 2**32))
def test_digest_equal_for_equal_values_built_differently(v, seed):
    w = _equal_copy(v, random.Random(seed))
    assert value_digest(v) is not None
    assert value_digest(v) == value_digest(w)


@given(_values, _values)
def test_digest_differs_for_different_values(a, b):
    if not _same_value(a, b):
        assert value_digest(a) != value_digest(b)


@given(_values)
def test_digest_same_for_shared_and_copied_references(v):
    """``[x, x]`` and ``[x, copy(x)]`` are equal values (pickle's memo tells them apart)."""
    assert value_digest([v, v]) == value_digest([v, _equal_copy(v, random.Random(0))])


def test_digest_of_dict_ignores_order_but_ordered_dict_does_not():
    assert value_digest({"a": 1, "b": 2}) == value_digest({"b": 2, "a": 1})
    assert value_digest({1: "x", "k": 2}) == value_digest({"k": 2, 1: "x"})
    od = collections.OrderedDict
    assert value_digest(od(a=1, b=2)) != value_digest(od(b=2, a=1))  # OrderedDict equality is ordered


def test_digest_of_objects_inside_custom_objects_is_order_free():
    assert value_digest(Point({"a": {1, 2}, "b": 1})) == value_digest(Point({"b": 1, "a": {2, 1}}))


@pytest.mark.parametrize(
    "a,b",
    [(0.0, -0.0), (1, 1.0), (1, True), (b"a", bytearray(b"a")), (torch.tensor([0.0]), torch.tensor([-0.0]))],
    ids=["neg_zero", "int_float", "int_bool", "bytes_bytearray", "tensor_neg_zero"],
)
def test_digest_tells_apart_what_a_load_would_change(a, b):
    """Documented: compared by type and bits, not ==: keeping either copy would change the value."""
    assert value_digest(a) != value_digest(b)


def test_digest_of_nan_with_equal_bits_is_equal():
    assert value_digest([float("nan")]) == value_digest([float("nan")])
    assert value_digest(torch.tensor([math.nan])) == value_digest(torch.tensor([math.nan]))


def test_digest_of_views_counts_the_values_shown():
    c = torch.tensor([1 + 2j, 3 - 4j])
    assert value_digest(c.conj()) == value_digest(c.conj().resolve_conj())
    assert value_digest(c.conj()) != value_digest(c)
    n = torch._neg_view(torch.tensor([1.0, 2.0]))
    assert value_digest((n,)) == value_digest((torch.tensor([-1.0, -2.0]),))


def test_digest_of_cyclic_object_is_none():
    cyc: list = []
    cyc.append(cyc)
    assert value_digest(cyc) is None


# -- DTensor / ShardedTensor pieces and replicas, 2 gloo ranks --------------------------------------


def _dist_state(rank, world):
    from torch.distributed._shard import sharded_tensor as st_api
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(world))
    full = torch.arange(35.0).reshape(7, 5)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    sharded = st_api.empty(spec, 6, 4)
    for s in sharded.local_shards():
        s.tensor.copy_(torch.arange(24.0).reshape(6, 4)[s.metadata.shard_offsets[0] :][: s.metadata.shard_sizes[0]])
    return {
        "dt_shard": distribute_tensor(full, mesh, [Shard(0)]),
        "dt_shard1": distribute_tensor(full.to(torch.bfloat16), mesh, [Shard(1)]),
        "dt_repl": distribute_tensor(full[:2], mesh, [Replicate()]),
        "dt_empty_shard": distribute_tensor(torch.arange(1.0), mesh, [Shard(0)]),  # rank 1 holds nothing
        "st": sharded,
        "plain": torch.arange(4.0),
        "obj": {"step": 3, "b": _bio(), "s": {"x", "y"}},
    }


def _zeros_like_state(sd):
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            v._local_tensor.zero_()
        elif isinstance(v, ShardedTensor):
            for s in v.local_shards():
                s.tensor.zero_()
        elif isinstance(v, torch.Tensor):
            v = torch.zeros_like(v)
        else:
            v = _blank(v)
        out[k] = v
    return out


def _blank(v):
    """``v``'s container structure with every leaf None (DCP flattens dicts and lists into their leaves)."""
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_blank(x) for x in v]
    return None


def _local(v):
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return v.to_local().clone()
    if isinstance(v, ShardedTensor):
        return [s.tensor.clone() for s in v.local_shards()]
    return v


def _dist_parity_worker(rank, world, root):
    import torch.distributed as dist

    results = {}
    for w in ("stock", "ucp"):
        path = f"{root}/{w}"
        if w == "stock":
            dcp.save(_dist_state(rank, world), checkpoint_id=path)
        else:
            ucp_dcp.save(_dist_state(rank, world), path)
        dist.barrier()
        for r in ("stock", "ucp"):
            target = _zeros_like_state(_dist_state(rank, world))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if r == "stock":
                    dcp.load(target, checkpoint_id=path)
                else:
                    stats = ucp_dcp.load(target, path)
                    assert stats.bytes_read + stats.bytes_received > 0, "through UCPFileSystemReader"
            results[(w, r)] = {k: _local(v) for k, v in target.items()}
    want = results[("stock", "stock")]
    bad = []
    for pair, got in results.items():
        for k in want:
            a, b = got[k], want[k]
            ok = all(same(x, y) for x, y in zip(a, b)) and len(a) == len(b) if isinstance(a, list) else same(a, b)
            if not ok:
                bad.append((pair, k))
    expect = {k: _local(v) for k, v in _dist_state(rank, world).items()}
    for k in want:  # and stock gives the saved values back
        a, b = want[k], expect[k]
        if not (all(same(x, y) for x, y in zip(a, b)) if isinstance(a, list) else same(a, b)):
            bad.append((("stock", "stock", "vs saved"), k))
    return bad


@pytest.mark.slow
def test_dtensor_and_sharded_tensor_same_values_as_stock_on_2_ranks():
    root = D.tmpdir()
    assert D.run(_dist_parity_worker, 2, root) == [[], []]
    _written_by("ucp", f"{root}/ucp")


def _equal_replicas_worker(rank, world, root):
    """Equal objects built differently on each rank are one value: saved, no ReplicaMismatchError."""
    keys = ["lr", "betas", "name"] if rank == 0 else ["name", "betas", "lr"]
    vals = {"lr": 0.1, "betas": (0.9, 0.95), "name": "".join(["ada", "m"]) if rank else "adam"}
    state = {
        "cfg": {k: vals[k] for k in keys},  # dict order differs by rank
        "tags": set(["a", "b", "c"][:: 1 if rank else -1]),  # so does set insertion order
        "names": ["x" * 3, "xxx"] if rank else ["xxx"] * 2,  # shared vs copied strings
        "b": _bio(),  # DCP's byte-stream value
        "t": torch.arange(3.0),
    }
    ucp_dcp.save(state, f"{root}/eq")
    back = {"cfg": {k: None for k in keys}, "tags": None, "names": [None, None], "b": None, "t": torch.zeros(3)}
    stats = ucp_dcp.load(back, f"{root}/eq")
    return (
        stats.bytes_read + stats.bytes_received > 0,
        back["cfg"] == {"lr": 0.1, "betas": (0.9, 0.95), "name": "adam"},
        back["tags"] == {"a", "b", "c"},
        back["names"] == ["xxx", "xxx"],
        same(back["b"], _bio()),
        back["t"].tolist(),
    )


@pytest.mark.slow
def test_equal_values_built_differently_are_one_replica():
    """Saved by ucp_dcp (its replica check ran: no ReplicaMismatchError) and read back by it."""
    root = D.tmpdir()
    assert D.run(_equal_replicas_worker, 2, root) == [(True, True, True, True, True, [0.0, 1.0, 2.0])] * 2
    _written_by("ucp", f"{root}/eq")


def _neg_zero_worker(rank, world, root):
    try:
        ucp_dcp.save({"loss_scale": torch.tensor([0.0 if rank == 0 else -0.0])}, f"{root}/nz")
        return None
    except UCPError as e:
        return type(e).__name__, e.atom


@pytest.mark.slow
def test_zero_and_negative_zero_replicas_refused():
    """Documented choice: replicas compare by bits; 0.0 and -0.0 differ (1/x tells them apart)."""
    found, other = D.run(_neg_zero_worker, 2, D.tmpdir())
    assert found == ("ReplicaMismatchError", "loss_scale") and other == ("PeerReplicaMismatchError", "loss_scale")


def test_numpy_values_are_refused_unless_allowed(tmp_path):
    """numpy arrays are not decoded without the user's say: refused naming the atom, loaded with trust=True."""
    _save_stock({"n": np.arange(3.0)}, str(tmp_path))
    with pytest.raises(ucp_dcp.UnsafeCheckpointError, match="'n'"):
        _load_ucp({"n": None}, str(tmp_path))
