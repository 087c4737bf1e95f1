"""A stage or expert map the checkpoint was saved with, forgotten at load on plain tensors.

Saved with a ``stage_map`` (``expert_map``) and loaded at the same layout without it, every stage
(expert rank) names its entries ``layers.0``, ``layers.1``, ...: its local numbers. DTensor targets show
the mistake by their meshes (:mod:`ucp_dcp.layout.structure`); plain tensors have none, so one stage
cannot be told from a data-parallel replica and every stage would load the first stage's layers. What
is left to see is at the global plan: ranks read the same map-numbered atoms while entries of the
checkpoint go unread by every rank. Each rank sends the map-numbered atoms it reads (only when a map
is lacking) and the coordinator refuses such a load on every rank, or, with ``allow_partial_load``,
logs it and lets it go on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import AmbiguousLayoutError
from ..layout.index_maps import IndexMap, map_position
from .catalog_record import Catalog

__all__ = ["lacking_maps", "map_reads", "forgotten_map_problem", "check_forgotten_maps"]

logger = logging.getLogger(__name__)

_MAP_ARG = {"layers": "stage_map", "experts": "expert_map"}


def lacking_maps(catalog: Catalog | None, maps: Iterable[IndexMap]) -> list[str]:
    """Keys of the index maps the checkpoint was saved with that this load (``maps``) does not pass."""
    return sorted(set(catalog.maps if catalog is not None else ()) - {m.key for m in maps})


def map_reads(catalog: Catalog | None, maps: Iterable[IndexMap], reads: Iterable[ReadItem]) -> list[str]:
    """The saved atoms a rank's ``reads`` read that number an entry of a map the load lacks (``layers.<i>``)."""
    lacking = lacking_maps(catalog, maps)
    if not lacking:
        return []
    return sorted({n for n in (it.storage_index.fqn for it in reads) if any(map_position(n, k) for k in lacking)})


def check_forgotten_maps(
    catalog: Catalog | None,
    md: Metadata,
    maps: Iterable[IndexMap],
    reads: Sequence[Iterable[str]],
    allow_partial_load: bool,
) -> None:
    """At the global plan: refuse the load :func:`forgotten_map_problem` finds in the checkpoint ``md``
    (``reads``: each rank's :func:`map_reads`), or, with ``allow_partial_load``, log it and let it go on."""
    lacking = lacking_maps(catalog, maps)
    problem = forgotten_map_problem(md.state_dict_metadata, lacking, reads) if lacking else None
    if problem is not None and not allow_partial_load:
        raise problem
    if problem is not None:
        logger.warning("UCP partial load (allow_partial_load=True) goes on: %s", problem.message)


def forgotten_map_problem(
    saved: Iterable[str], lacking: Sequence[str], reads: Sequence[Iterable[str]]
) -> AmbiguousLayoutError | None:
    """A map the checkpoint was saved with (``lacking``: its keys) forgotten at load on targets that
    cannot show it by their meshes (plain tensors): ranks read the same map-numbered atoms while the
    checkpoint holds entries that no rank reads at all -- every stage (expert rank) loads the first
    stage's layers (experts) into its own. ``saved``: the checkpoint's atom names; ``reads``: per rank
    of the load (plan order), the saved atoms it reads that are numbered by a lacking map.

    An entry counts as read when any atom numbered by it is (a load of the model alone, or of an
    optimizer with state for some parameters only, reads every entry through some atom)."""
    reads = [set(r) for r in reads]
    for key in lacking:
        saved_at: dict[int, list[str]] = {}
        for name in saved:
            pos = map_position(name, key)
            if pos is not None:
                saved_at.setdefault(pos[1], []).append(name)
        readers: dict[str, list[int]] = {}
        read_at: set[int] = set()
        for rank, names in enumerate(reads):
            for name in names:
                pos = map_position(name, key)
                if pos is not None:
                    read_at.add(pos[1])
                    readers.setdefault(name, []).append(rank)
        unread = sorted(set(saved_at) - read_at)
        shared = {n: r for n, r in sorted(readers.items()) if len(r) > 1}
        if not (unread and shared):
            continue
        arg = _MAP_ARG.get(key, f"IndexMap({key!r})")
        examples = sorted(n for i in unread[:2] for n in saved_at[i])[:4]
        more = sum(len(saved_at[i]) for i in unread) - len(examples)
        ranks = sorted({r for rs in shared.values() for r in rs})
        return AmbiguousLayoutError(
            f"the checkpoint was saved with index map '{key}' ({arg}) and this load passes none: ranks {ranks} of "
            f"the load read the same {key} atoms ({', '.join(list(shared)[:3])}{', ...' if len(shared) > 3 else ''}) "
            f"while no rank reads {key} {unread[:10]}{' ...' if len(unread) > 10 else ''} of the checkpoint "
            f"({', '.join(examples)}{f' and {more} more atom(s)' if more else ''}): without the map each rank's "
            f"local {key}.0, {key}.1, ... load the first saved {key} instead of its own",
            atom=examples[0],
            saved=[f"{key}.{i}" for i in unread],
            wanted={n: shared[n] for n in list(shared)[:10]},
            hint=f"pass the {arg} of this layout on every rank, as at save; to load only part of the checkpoint's "
            f"{key} on purpose, pass allow_partial_load=True",
        )
    return None
