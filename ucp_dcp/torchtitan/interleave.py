"""Weighted interleaving of several text sources behind one global cursor, so it resumes at any DP degree.

torchtitan's ``InterleavedHuggingFaceTextDataLoader`` draws, per packed sample, a source with
``random.Random(seed).choices(sources, weights)`` on each rank, from that rank's slice of each
source: its state is per rank. Here, as in :mod:`ucp_dcp.torchtitan.dataloader`, there is one global
sequence of ``seq_len`` windows and window ``w`` goes to data-parallel rank ``w mod d``:

* each source is its own global token stream (:mod:`ucp_dcp.torchtitan.stream`: map-style or
  streaming with one or many shards, epoch after epoch), packed into windows;
* the interleaver's RNG is seeded with ``seed`` and makes the same draws as torchtitan's, one per
  window (and one per exhaustion, below); window ``w`` is the next window of the source drawn for it. Every rank replays the same
  draws, so every rank and every DP degree agree on which source's which window ``w`` is;
* finite sources (``infinite=False`` on every source) stop as torchtitan's do: a draw whose source
  has no next window is *exhausted* and gives no window. ``on_first_exhausted`` ends the data there;
  ``all_exhausted`` re-loops that source into its next epoch (its token buffer carried over, as
  torchtitan's ``reloop``) and draws again, until every source has been exhausted once;
* the state is global and the same on every rank: the cursor, the interleaver's draws and RNG
  state, and per source its windows taken, re-loops, exhaustion and where its next window starts
  (with the text fingerprint that a resume checks). A resume at another degree dividing the global
  batch continues at exactly the saved window; a changed source list, weight, seed, stopping
  strategy or ``infinite`` is refused with a ``UCPError`` naming the saved and wanted values.

Kept in one module (just over 400 lines once formatted): the draw math, the schedule that replays
it, the dataset and the loader are one concept whose state encoding they all share.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import InterleavedHuggingFaceTextDataLoader

from ..errors import UCPError
from ._compat import validate_dataset as _validate_dataset
from .dataloader import GlobalCursorTextDataLoader, _collate
from .stream import Documents, Pos, TokenStream, WindowSource

__all__ = [
    "Mix",
    "mix_step",
    "draw",
    "probabilities",
    "InterleavedWindowDataset",
    "InterleavedGlobalCursorDataLoader",
    "STATE_VERSION",
    "STATE_KEYS",
    "DATASET_MARK",
]

StoppingStrategy = Literal["on_first_exhausted", "all_exhausted"]
STATE_VERSION = 1
DATASET_MARK = "interleaved"
"""``dataloader.dataset`` of an interleaved state (a single-source loader refuses it by this name)."""
SOURCE_KEYS = ("taken", "reloops", "exhausted", "epoch", "doc", "offset", "text_hash", "resume")
"""Per-source entries of the state: one list each, in the order of the config's sources."""
STATE_KEYS = (
    "version",
    "cursor",
    "dataset",
    "seq_len",
    "sources",
    "weights",
    "seed",
    "stopping_strategy",
    "infinite",
    "draws",
    "rng",
    "done",
) + SOURCE_KEYS
"""The keys of the interleaved loader's state, the same for every dataset kind and on every rank."""


@dataclass(frozen=True)
class Mix:
    """The interleaver at a global window boundary: identical on every rank."""

    draws: int
    """Source draws made (a draw that found its source exhausted counts: it used a random number)."""
    taken: tuple[int, ...]
    """Windows each source has given."""
    reloops: tuple[int, ...]
    """Times each finite source was re-looped: its windows may end in epochs ``<= reloops[s]``."""
    exhausted: tuple[bool, ...]
    """Has each source been exhausted at least once?"""
    rng: tuple
    """``random.Random.getstate()`` after ``draws`` draws."""
    done: bool = False
    """The stopping strategy ended the data."""


def probabilities(weights: list[float]) -> list[float]:
    """Weights normalised to probabilities, exactly as torchtitan's ``InterleavedDataset`` does."""
    if not weights or any(w < 0 for w in weights) or sum(weights) == 0:
        raise UCPError(f"interleaving weights must be non-negative with a positive sum, got {weights}")
    total = sum(weights)
    return [w / total for w in weights]


def draw(rng: random.Random, probs: list[float]) -> int:
    """One source draw: the same call (and so the same source) as torchtitan's ``InterleavedDataset``."""
    return rng.choices(range(len(probs)), weights=probs, k=1)[0]


def mix_step(mix: Mix, source: int, fits: bool, strategy: StoppingStrategy) -> tuple[Mix, bool]:
    """The interleaver after one draw of ``source`` (whose next window exists within its allowed epochs
    iff ``fits``), and whether that draw gave a window. ``mix.rng`` is left to the caller."""
    if fits:
        taken = list(mix.taken)
        taken[source] += 1
        return replace(mix, draws=mix.draws + 1, taken=tuple(taken)), True
    exhausted = list(mix.exhausted)
    exhausted[source] = True
    mix = replace(mix, draws=mix.draws + 1, exhausted=tuple(exhausted))
    if strategy == "on_first_exhausted" or all(exhausted):
        return replace(mix, done=True), False
    reloops = list(mix.reloops)
    reloops[source] += 1
    return replace(mix, reloops=tuple(reloops)), False


class Schedule:
    """Which source's which window each global window is, from a known :class:`Mix` on.

    ``fits(s, k, reloops)`` says whether source ``s`` has window ``k`` ending in an epoch ``<= reloops``.
    """

    def __init__(
        self,
        mix: Mix,
        first: int,
        probs: list[float],
        strategy: StoppingStrategy,
        fits: Callable[[int, int, int], bool],
    ) -> None:
        self._rng = random.Random()
        self._rng.setstate(mix.rng)
        self._probs, self._strategy, self._fits = probs, strategy, fits
        self._mix = mix
        self._next = first
        """The next global window to assign; ``self._mix`` is the interleaver just before it."""
        self._before: dict[int, Mix] = {first: mix}
        self._assigned: dict[int, tuple[int, int]] = {}

    def _advance(self) -> bool:
        mix = self._mix
        while not mix.done:
            s = draw(self._rng, self._probs)
            k = mix.taken[s]
            mix, gave = mix_step(mix, s, self._fits(s, k, mix.reloops[s]), self._strategy)
            mix = replace(mix, rng=self._rng.getstate())
            if gave:
                self._assigned[self._next] = (s, k)
                self._next += 1
                self._mix = self._before[self._next] = mix
                return True
        self._mix = mix
        return False

    def assign(self, w: int) -> tuple[int, int] | None:
        """``(source, its window index)`` of global window ``w``; None if the data ends before it."""
        while self._next <= w:
            if not self._advance():
                return None
        return self._assigned[w]

    def before(self, w: int) -> Mix:
        """The interleaver just before global window ``w`` (the final one if the data ends first)."""
        while self._next < w and self._advance():
            pass
        return self._before.get(w, self._mix)

    def forget(self, w: int) -> None:
        """Drop what is kept for windows before ``w``."""
        for old in [x for x in self._assigned if x < w]:
            del self._assigned[old]
            self._before.pop(old, None)


class InterleavedWindowDataset(IterableDataset, Stateful):
    """Rank ``dp_rank``'s share of the interleaved global window stream (see the module docstring);
    workers split this rank's batches as :class:`~ucp_dcp.torchtitan.dataloader.GlobalWindowDataset`'s."""

    def __init__(
        self,
        sources: list[Any],
        tokenizer: Any,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int = 42,
        stopping_strategy: StoppingStrategy = "on_first_exhausted",
        batch_size: int = 1,
    ) -> None:
        if stopping_strategy not in ("on_first_exhausted", "all_exhausted"):
            raise UCPError(
                f"stopping_strategy must be 'on_first_exhausted' or 'all_exhausted', got {stopping_strategy!r}"
            )
        infinite = {bool(s.infinite) for s in sources}
        if len(infinite) != 1:
            raise UCPError(
                "all interleaved sources must have the same 'infinite' setting, got "
                f"{[(s.dataset, s.infinite) for s in sources]}"
            )
        self.infinite = infinite.pop()
        self.names = [s.dataset.lower() for s in sources]
        self.weights = [float(s.weight) for s in sources]
        self.probs = probabilities(self.weights)
        self.seed, self.strategy = seed, stopping_strategy
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        read_on = self.infinite or stopping_strategy == "all_exhausted"  # re-looped sources read on
        self._streams = []
        for name, s in zip(self.names, sources):
            path, loader, text_of = _validate_dataset(name, s.dataset_path)
            self._streams.append(TokenStream(Documents(loader(path), text_of, read_on, name), tokenizer, seq_len))
        n = len(sources)
        self.cursor = 0
        """Windows consumed by the whole job."""
        self._base = 0
        """The global window the current iteration began at."""
        self._mix = Mix(0, (0,) * n, (0,) * n, (False,) * n, random.Random(seed).getstate())
        """The interleaver at ``self._base``."""
        self._starts = [Pos(0, 0, 0)] * n
        """Where each source's next window starts at ``self._base``."""
        self._live: tuple[Schedule, list[WindowSource]] | None = None
        self._static = {
            "version": STATE_VERSION,
            "dataset": DATASET_MARK,
            "seq_len": seq_len,
            "sources": self.names,
            "weights": self.probs,
            "seed": seed,
            "stopping_strategy": stopping_strategy,
            "infinite": self.infinite,
        }
        """The entries of the state that do not move."""

    def _fits(self, srcs: list[WindowSource]) -> Callable[[int, int, int], bool]:
        def fits(s: int, k: int, reloops: int) -> bool:
            end = srcs[s].end_epoch(k)
            return end is not None and (self.infinite or end <= reloops)

        return fits

    def iter_windows(self) -> Iterator[tuple[int, int, dict[str, torch.Tensor], torch.Tensor]]:
        """``(global window id, source, inputs, labels)`` for this rank (this worker), from the cursor."""
        base, d, r = self.cursor, self.dp_world_size, self.dp_rank
        info = get_worker_info()
        workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
        self._mix, self._starts = self._now(base)
        self._base = base
        srcs = [WindowSource(st, k, p) for st, k, p in zip(self._streams, self._mix.taken, self._starts)]
        sched = Schedule(self._mix, base, self.probs, self.strategy, self._fits(srcs))
        self._live = (sched, srcs)
        j = -1
        while True:
            j += 1
            if workers > 1 and (j // self.batch_size) % workers != me:
                continue
            w = base + d * j + r
            got = sched.assign(w)
            if got is None:
                return
            s, k = got
            taken = srcs[s].take(k)
            assert taken is not None, "the schedule assigned a window its source does not have"  # _fits checked it
            _, (inp, lab, positions) = taken
            self.cursor = base + d * (j + 1)
            sched.forget(w)
            yield (
                w,
                s,
                {"input": torch.LongTensor(inp), "positions": torch.LongTensor(positions)},
                torch.LongTensor(lab),
            )

    def __iter__(self):
        """``(inputs, labels, state after this sample)``, the state not yet encoded: the loader's collate
        encodes only its batch's last one (encoding the RNG state for every window costs ~0.15 ms)."""
        for _, _, inputs, labels in self.iter_windows():
            yield inputs, labels, (self._static, self.cursor, *self._now(self.cursor))

    def _now(self, window: int) -> tuple[Mix, list[Pos]]:
        """The interleaver and each source's next-window position just before global ``window``."""
        if window == self._base or self._live is None:
            return self._mix, list(self._starts)
        sched, srcs = self._live
        mix = sched.before(window)
        return mix, [src.pos(k) or Pos(-1, -1, 0) for src, k in zip(srcs, mix.taken)]

    def state_dict(self) -> dict[str, Any]:
        return _encode(self._static, self.cursor, *self._now(self.cursor))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dataset") != DATASET_MARK:
            raise UCPError(
                f"the dataloader state is a single-source loader's (dataset {state.get('dataset')!r}), this run "
                f"interleaves {self.names}",
                atom="dataloader.dataset",
                saved=state.get("dataset"),
                wanted=DATASET_MARK,
                hint="resume with the saved loader, or skip its state: checkpoint.exclude_from_loading=['dataloader']",
            )
        if state.get("version") != STATE_VERSION:
            raise UCPError(
                f"interleaved dataloader state version {state.get('version')} is not this loader's ({STATE_VERSION})",
                atom="dataloader.version",
                saved=state.get("version"),
                wanted=STATE_VERSION,
            )
        wanted = {
            "sources": self.names,
            "weights": self.probs,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "stopping_strategy": self.strategy,
            "infinite": self.infinite,
        }
        for key, want in wanted.items():
            saved = list(state[key]) if isinstance(want, list) else state.get(key)
            if saved != want:
                raise UCPError(
                    f"the interleaved dataloader state was saved with {key}={saved!r}, this run has {want!r}: "
                    "the sequence of windows would differ, so the saved position means nothing here",
                    atom=f"dataloader.{key}",
                    saved=saved,
                    wanted=want,
                    hint="resume with the saved sources, weights (normalised), seed, seq_len, stopping_strategy "
                    "and infinite, or skip the loader's state: checkpoint.exclude_from_loading=['dataloader']",
                )
        cursor = int(state["cursor"])
        if cursor % self.dp_world_size:
            raise UCPError(
                f"the saved global cursor ({cursor} windows) is not a multiple of the new data-parallel "
                f"degree {self.dp_world_size}: ranks cannot split the next global batch",
                atom="dataloader.cursor",
                saved=cursor,
                wanted=self.dp_world_size,
                hint="choose a data-parallel degree that divides the global batch size",
            )
        rng = json.loads(state["rng"])
        self._mix = Mix(
            int(state["draws"]),
            tuple(int(x) for x in state["taken"]),
            tuple(int(x) for x in state["reloops"]),
            tuple(bool(x) for x in state["exhausted"]),
            (rng[0], tuple(rng[1]), rng[2]),
            bool(state["done"]),
        )
        self._starts = [
            Pos(int(e), int(d), int(o), str(h), str(r))
            for e, d, o, h, r in zip(state["epoch"], state["doc"], state["offset"], state["text_hash"], state["resume"])
        ]
        self.cursor = self._base = cursor
        self._live = None


def _encode(static: dict[str, Any], cursor: int, mix: Mix, starts: list[Pos]) -> dict[str, Any]:
    """The state (keys in ``STATE_KEYS`` order) at global window ``cursor``."""
    return {
        "version": static["version"],
        "cursor": cursor,
        **{k: list(v) if isinstance(v, list) else v for k, v in static.items() if k != "version"},
        "draws": mix.draws,
        "rng": json.dumps(mix.rng),
        "done": mix.done,
        "taken": list(mix.taken),
        "reloops": list(mix.reloops),
        "exhausted": list(mix.exhausted),
        "epoch": [p.epoch for p in starts],
        "doc": [p.doc for p in starts],
        "offset": [p.offset for p in starts],
        "text_hash": [p.text_hash for p in starts],
        "resume": [p.resume for p in starts],
    }


def _collate_encoding(samples: list[tuple[Any, Any, tuple]]) -> tuple[Any, Any, dict[str, Any]]:
    """Collate as the single-source loader does, and encode the state after the batch's last sample."""
    inputs, labels, last = _collate(samples)
    return inputs, labels, _encode(*last)


class InterleavedGlobalCursorDataLoader(GlobalCursorTextDataLoader):
    """torchtitan's interleaved text loader with a global cursor (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(InterleavedHuggingFaceTextDataLoader.Config):
        """torchtitan's ``InterleavedHuggingFaceTextDataLoader.Config``, unchanged: ``sources`` (each with
        ``dataset``, ``dataset_path``, ``weight``, ``infinite``), ``seed``, ``stopping_strategy`` and the
        DataLoader options; only the class it builds differs."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        ds = InterleavedWindowDataset(
            config.sources,
            tokenizer,
            seq_len,
            dp_rank,
            dp_world_size,
            config.seed,
            config.stopping_strategy,
            batch_size=local_batch_size,
        )
        ParallelAwareDataloader.__init__(
            self,
            ds,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            collate_fn=_collate_encoding,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
        self._state: dict[str, Any] | None = None
        """The global state after the last batch handed out (None: none since the last load)."""
