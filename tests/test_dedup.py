"""Writer choice for items several ranks hold."""

import torch
from hypothesis import given, strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ucp_dcp.dedup import balanced_dedup


def _item(name, numel):
    return WriteItem(
        index=MetadataIndex(name, (0,)), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0]), torch.Size([numel])),
                                    TensorProperties(dtype=torch.float32), torch.Size([numel])),
    )


@given(st.lists(st.tuples(st.integers(1, 1000), st.sets(st.integers(0, 3), min_size=1)), min_size=1, max_size=40))
def test_every_item_written_once_by_a_holder(spec):
    plans = [SavePlan([_item(f"a{i}", n) for i, (n, holders) in enumerate(spec) if r in holders]) for r in range(4)]
    out = balanced_dedup(plans)
    written = [it.index.fqn for p in out for it in p.items]
    assert sorted(written) == sorted(f"a{i}" for i in range(len(spec)))
    for r, p in enumerate(out):
        assert all(r in spec[int(it.index.fqn[1:])][1] for it in p.items)


def test_replicas_go_to_the_least_loaded_ranks():
    # rank 0 already writes a big shard; 6 equal replicated items should avoid it
    plans = [SavePlan([_item("big", 3000)] + [_item(f"r{i}", 1000) for i in range(6)])]
    plans += [SavePlan([_item(f"r{i}", 1000) for i in range(6)]) for _ in range(3)]
    out = balanced_dedup(plans)
    bytes_per_rank = [sum(it.tensor_storage_size() for it in p.items) for p in out]
    assert bytes_per_rank == [12000, 8000, 8000, 8000]
