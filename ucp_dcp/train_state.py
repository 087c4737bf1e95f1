"""The train state besides the model and optimizer, saved so that it resumes at another world size.

* :class:`RNGState`: this rank's random generators (torch's CPU generator, each visible CUDA device's,
  numpy's global ``RandomState``, Python's ``random``). At save every rank's generators are gathered into
  one entry (the same on every rank); at load rank ``r`` gets rank ``r``'s saved generators when the
  checkpoint has them, and generators seeded by :func:`derived_seed` when it does not.
* :class:`GlobalSampler`: a batch sampler whose position is global (samples of the epoch consumed by all
  data-parallel ranks together), so a resume at another data-parallel degree continues the epoch.
* The LR scheduler and the step need nothing of their own: they are the same on every rank, saved once
  and compared across ranks by the replica check (``docs/guide.md``, step 9).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import Sampler

from .errors import InvalidArgumentError, UCPError

__all__ = ["RNGState", "GlobalSampler", "derived_seed", "GENERATORS"]

logger = logging.getLogger(__name__)

GENERATORS = ("torch", "numpy", "python")
"""The host generators every rank's saved state holds (CUDA devices come as ``cuda:<d>``)."""
_FORMAT = 1
"""The layout of one rank's saved state (``version``): a later change can still read this one."""
_PERSON = b"ucp_dcp.rng.v1"
"""BLAKE2b personalisation of :func:`derived_seed`: a changed derivation gets a new name."""


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


# -- one rank's generators ------------------------------------------------------------------------------


def _capture(cuda: bool) -> dict[str, Any]:
    """This process's generators as tensors and plain values: what ``torch.load(weights_only=True)``
    decodes, so a load never has to run code from the checkpoint."""
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # the legacy tuple (MT19937, ...)
    version, internal, gauss_next = random.getstate()
    return {
        "version": _FORMAT,
        "torch": torch.get_rng_state(),
        "cuda": tuple(torch.cuda.get_rng_state_all()) if cuda else (),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }


def _restore_host(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss_next"]))


def _seed_host(base: Mapping[str, Any], rank: int) -> None:
    torch.default_generator.manual_seed(derived_seed(base, rank, "torch"))  # not torch.manual_seed: it seeds CUDA too
    np.random.seed(_numpy_seed(derived_seed(base, rank, "numpy")))
    random.seed(derived_seed(base, rank, "python"))


def _numpy_seed(seed: int) -> list[int]:
    """numpy's legacy seeding takes 32-bit words: the 64-bit seed as [low, high]."""
    return [seed & 0xFFFFFFFF, seed >> 32]


def _set_cuda(saved: Sequence[torch.Tensor], base: Mapping[str, Any], rank: int) -> None:
    """Each visible device gets its saved state, or one seeded by :func:`derived_seed` (``cuda:<d>``) when this
    rank saved fewer devices (or none: a checkpoint written on CPU)."""
    torch.cuda.init()  # default_generators is filled by CUDA's initialisation
    for d in range(torch.cuda.device_count()):
        if d < len(saved):
            torch.cuda.set_rng_state(saved[d], d)
        else:
            torch.cuda.default_generators[d].manual_seed(derived_seed(base, rank, f"cuda:{d}"))


def _state_bytes(state: Mapping[str, Any]) -> bytes:
    """The host generators of one saved state, as bytes (CUDA's left out: a rank derives the same host
    states whether the checkpoint was written on CPU or GPU)."""
    p = state["python"]
    n = state["numpy"]
    parts = [
        state["torch"].numpy().tobytes(),
        n["keys"].numpy().astype(np.int64).tobytes(),
        int(n["pos"]).to_bytes(8, "little"),
        p["state"].numpy().astype(np.int64).tobytes(),
    ]
    return b"".join(parts)


def derived_seed(base: Mapping[str, Any], rank: int, generator: str) -> int:
    """The 64-bit seed of ``generator`` (``"torch"``, ``"numpy"``, ``"python"`` or ``"cuda:<d>"``) for a rank
    the checkpoint holds no state of: BLAKE2b with an 8-byte digest (read little-endian), personalised
    ``ucp_dcp.rng.v1``, over saved rank 0's torch, numpy and Python states, the rank (8 bytes, little-endian)
    and the generator's name (UTF-8).

    The same checkpoint gives a rank the same seeds at every load; ranks and generators get different ones, and
    a later save (rank 0's state moved on) gives new ranks new streams. :class:`RNGState` seeds torch's CPU
    generator with ``torch.default_generator.manual_seed(seed)``, numpy with ``np.random.seed([seed & 0xFFFFFFFF,
    seed >> 32])``, Python with ``random.seed(seed)`` and device ``d`` with its default generator's
    ``manual_seed``."""
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(_state_bytes(base))
    h.update(int(rank).to_bytes(8, "little"))
    h.update(generator.encode())
    return int.from_bytes(h.digest(), "little")


def _checked_ranks(state: Any) -> tuple[Mapping[str, Any], ...]:
    ranks = state.get("ranks") if isinstance(state, Mapping) else None
    if (
        not isinstance(ranks, (tuple, list))
        or not ranks
        or not all(isinstance(s, Mapping) and {"torch", "numpy", "python"} <= set(s) for s in ranks)
    ):
        raise UCPError(
            "the checkpoint's RNG entry is not an RNGState's (a tuple of each saved rank's generators)",
            saved=type(ranks if ranks is not None else state).__name__,
            wanted="{'ranks': (rank 0's generators, rank 1's, ...)}",
            hint="load the entry into what saved it (ucp_dcp.RNGState at save and at load), or leave it out of the load",
        )
    versions = {s.get("version", _FORMAT) for s in ranks}
    if versions - {_FORMAT}:
        raise UCPError(
            f"the checkpoint's RNG states have format {sorted(versions)}; this ucp_dcp reads format {_FORMAT}",
            saved=sorted(versions),
            wanted=_FORMAT,
            hint="load with the ucp_dcp version that saved them, or leave the RNG entry out of the load",
        )
    return tuple(ranks)


# -- the RNG entry -----------------------------------------------------------------------------------------


class RNGState(Stateful):
    """Every rank's random generators as one state-dict entry that loads at any world size.

    Put it in the state dict at save and at load (``{"rng": RNGState(), ...}``); ``ucp_dcp.save``/``load`` call
    :meth:`state_dict` and :meth:`load_state_dict`, as DCP does for every ``Stateful``. It holds this process's torch CPU
    generator, each visible CUDA device's generator (``cuda``: default when ``torch.cuda.is_available()``),
    numpy's global ``RandomState`` and Python's ``random`` state; generators of your own (a ``torch.Generator``
    given to a sampler, ``np.random.default_rng()``) are not included.

    **At save** :meth:`state_dict` gathers every rank's generators over ``process_group`` (``all_gather_object``,
    a collective: every rank of the group calls it, as every rank calls ``ucp_dcp.save``) into one tuple, the same on
    every rank, so the checkpoint holds it once (about 17 KB per rank on CPU) and the replica check passes. **At load**,
    in a group of any size, group rank ``r`` takes:

    * ``r`` below the saved world size: exactly rank ``r``'s saved generators (CUDA device ``d`` its saved state
      when rank ``r`` saved at least ``d + 1`` devices);
    * ``r`` at or beyond it, and devices rank ``r`` did not save: generators seeded by :func:`derived_seed` from
      saved rank 0's state and ``r``: deterministic (the same at every load of that checkpoint) and different on
      every rank;
    * saved ranks at or beyond the new world size are not loaded.

    Group rank 0 logs a warning when the world size changed. Pass the ``process_group`` given to
    ``ucp_dcp.save``/``load`` (default: the default group; a single process without ``torch.distributed`` is
    rank 0 of 1). The load's own gather (DCP asks :meth:`state_dict` for the target) costs one small collective.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, cuda: bool | None = None) -> None:
        if cuda is not None and not isinstance(cuda, bool):
            raise InvalidArgumentError(f"RNGState: cuda={cuda!r}; expected True, False or None", saved=cuda)
        self.process_group = process_group
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.saved_world_size: int | None = None
        """After a load: the number of ranks the checkpoint's generators came from."""
        self.derived = False
        """After a load: whether this rank's host generators were derived (its rank was not in the checkpoint)."""

    def state_dict(self) -> dict[str, Any]:
        """``{"ranks": (rank 0's generators, rank 1's, ...)}``, gathered over the group (a collective)."""
        mine = _capture(self.cuda)
        _, size = _group_rank_size(self.process_group)
        if size == 1:
            return {"ranks": (mine,)}
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, mine, group=self.process_group)
        # a tuple, not a list: DCP keeps a tuple as one value, where a list of dicts would be flattened into one
        # key per saved rank (and a load at another world size would ask for keys the checkpoint lacks)
        return {"ranks": tuple(gathered)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set this rank's generators from the loaded entry (see the class for which ones)."""
        ranks = _checked_ranks(state_dict)
        rank, size = _group_rank_size(self.process_group)
        base = ranks[0]
        self.saved_world_size = len(ranks)
        self.derived = rank >= len(ranks)
        if self.derived:
            _seed_host(base, rank)
        else:
            _restore_host(ranks[rank])
        if self.cuda:
            _set_cuda(() if self.derived else tuple(ranks[rank].get("cuda", ())), base, rank)
        if rank == 0 and size != len(ranks):
            logger.warning(
                "UCP: RNG states saved at %d rank(s), loaded at %d: %s",
                len(ranks),
                size,
                f"ranks {len(ranks)}..{size - 1} get generators seeded by ucp_dcp.train_state.derived_seed"
                if size > len(ranks)
                else f"the saved states of ranks {size}..{len(ranks) - 1} are not loaded",
            )


# -- the data position ------------------------------------------------------------------------------------


class GlobalSampler(Sampler[list[int]], Stateful):
    """A batch sampler (``DataLoader(dataset, batch_sampler=...)``) for one data-parallel rank whose saved position
    is global, so it resumes at any data-parallel degree.

    Epoch ``e`` orders ``range(num_samples)`` by ``torch.randperm`` from a generator seeded with ``seed + e``
    (``shuffle=False``: in order). From the position ``p`` (samples of the epoch consumed by all ranks together),
    the rest of the epoch is cut into global batches of ``G = batch_size * dp_size`` samples; rank ``dp_rank`` takes
    the ``dp_rank``-th ``batch_size`` slice of each. The samples that do not fill a global batch end the epoch
    unused (as ``drop_last=True``).

    The position moves when the loop says a batch was consumed: call :meth:`step` after each batch, on every rank
    (like ``scheduler.step()``). Iterating does not move it, since a ``DataLoader`` with workers draws batches
    ahead of the ones trained on. The saved state (``epoch``, ``position``, ``num_samples``, ``seed``, ``shuffle``)
    is the same on every rank, so it is saved once, and ranks out of step are refused by the replica check.

    **At another data-parallel degree** (or another ``batch_size``) the epoch continues from the saved position with
    the new global batch: no sample of the epoch is repeated or skipped, except the tail that does not fill a
    new global batch. A load into a sampler of another ``num_samples``, ``seed`` or ``shuffle`` is refused.
    """

    def __init__(
        self, num_samples: int, batch_size: int, *, dp_rank: int, dp_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        for name, v, low in (("num_samples", num_samples, 0), ("batch_size", batch_size, 1), ("dp_size", dp_size, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise InvalidArgumentError(f"GlobalSampler: {name}={v!r}; expected an int >= {low}", saved=v)
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise InvalidArgumentError(
                f"GlobalSampler: dp_rank={dp_rank!r}; expected an int in [0, dp_size={dp_size})", saved=dp_rank
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        """Samples of the current epoch consumed by all data-parallel ranks together."""

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_size

    def order(self, epoch: int) -> torch.Tensor:
        """The global order of the samples of ``epoch``."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __len__(self) -> int:
        """This rank's batches left in the epoch."""
        return (self.num_samples - self.position) // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        start = self.position + self.dp_rank * self.batch_size
        for k in range(len(self)):
            at = start + k * self.global_batch
            yield order[at : at + self.batch_size].tolist()

    def step(self, batches: int = 1) -> None:
        """``batches`` global batches were consumed (every rank calls this); past the last full one, the next
        epoch starts."""
        self.position += batches * self.global_batch
        self._roll()

    def _roll(self) -> None:
        if self.num_samples - self.position < self.global_batch:
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = {"num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle}
        saved = {k: state_dict.get(k) for k in mine}
        if saved != mine:
            raise UCPError(
                "the saved data position is of another dataset or order: "
                + ", ".join(f"{k} {saved[k]!r} saved, {mine[k]!r} here" for k in mine if saved[k] != mine[k]),
                saved=saved,
                wanted=mine,
                hint="build the GlobalSampler with the saved num_samples, seed and shuffle, or leave the data "
                "position out of the load (the epoch then starts again)",
            )
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])
        self._roll()  # at a larger global batch the rest of the epoch may not fill one
