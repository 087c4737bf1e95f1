"""Choose one writer for every item several ranks hold (replicated fragments, plain tensors, objects).

DCP's ``dedup_save_plans`` balances only the replicated bytes it assigns, ignoring what each rank
already writes for its own shards, so the rank with the biggest shards can also receive the biggest
replicas. Here each rank starts with its unique bytes and replicated items are placed largest
first on the least-loaded holder (longest-processing-time greedy), deterministic for a given plan.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

__all__ = ["balanced_dedup"]


def _size(item: WriteItem) -> int:
    return item.tensor_storage_size() or 1


def balanced_dedup(plans: list[SavePlan]) -> list[SavePlan]:
    holders: dict[MetadataIndex, list[int]] = defaultdict(list)
    sizes: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders[item.index].append(rank)
            sizes[item.index] = _size(item)
    load = [0] * len(plans)
    shared = []
    for index, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += sizes[index]
        else:
            shared.append(index)
    owner: dict[MetadataIndex, int] = {}
    for index in sorted(shared, key=lambda i: (-sizes[i], i.fqn, tuple(i.offset or ()))):
        rank = min(holders[index], key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += sizes[index]
    return [
        dataclasses.replace(plan, items=[it for it in plan.items if owner.get(it.index, rank) == rank])
        for rank, plan in enumerate(plans)
    ]
