"""A text dataloader whose position is a global cursor, so it resumes at any data-parallel degree.

torchtitan's text loader splits the dataset per rank (``split_dataset_by_node``) and keeps per-rank
token buffers, so its state (``dataloader.dp_rank_<r>``) has no meaning at another DP degree.
Here there is one global token stream -- every document tokenized in order, next-token shifted
within each document exactly like torchtitan's loader, packed into ``seq_len`` windows -- and
window ``w`` goes to data-parallel rank ``w mod d``. Over a step, the ``d`` ranks together take
``B`` consecutive windows (``B`` = global batch in sequences, fixed), so at *any* DP degree that
divides ``B`` step ``s`` trains on windows ``[sB, (s+1)B)``: the same global batch. The state is one
global value, identical on every rank -- the number of windows consumed (``cursor``) plus where
window ``cursor`` starts in the stream -- so a resume at another degree continues at window
``cursor`` with no window repeated or skipped.

Streaming datasets resume in each epoch's actual order and every resume checks the document it
lands on (:mod:`ucp_dcp.torchtitan.stream`). With ``num_workers > 0`` worker ``k`` produces this
rank's batches ``k, k + n, ...``; each batch carries the global state after it, so the state saved
is the one of the last batch handed to the trainer, whatever the workers have prefetched.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torchtitan.components.dataloader import ParallelAwareDataloader

from ..errors import UCPError
from ._compat import validate_dataset as _validate_dataset
from .stream import Documents, Pos, TokenStream, WindowSource

__all__ = ["GlobalWindowDataset", "GlobalCursorTextDataLoader", "STATE_VERSION", "STATE_KEYS"]

STATE_VERSION = 2
"""1: no ``text_hash``/``resume`` (streaming data resumed in the wrong order after epoch 0)."""
STATE_KEYS = ("version", "cursor", "epoch", "doc", "offset", "text_hash", "resume", "seq_len", "dataset")
"""The keys of the loader's state, the same for every dataset kind and on every rank."""


class GlobalWindowDataset(IterableDataset, Stateful):
    """Rank ``dp_rank``'s share of the global window stream: windows ``cursor + dp_rank + k * dp``.

    In a DataLoader worker ``i`` of ``n`` it yields only the windows of this rank's batches
    ``i, i + n, ...`` (``batch_size`` windows each), in the order the DataLoader hands batches out.
    """

    def __init__(
        self,
        dataset_name: str,
        dataset_path: str | None,
        tokenizer: Any,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        infinite: bool = True,
        batch_size: int = 1,
    ) -> None:
        path, loader, text_of = _validate_dataset(dataset_name.lower(), dataset_path)
        self.dataset_name = dataset_name.lower()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self._stream = TokenStream(Documents(loader(path), text_of, infinite, self.dataset_name), tokenizer, seq_len)
        self.cursor = 0
        """Windows consumed by the whole job (every DP rank's pulls in lockstep)."""
        self._start = Pos(0, 0, 0)
        """Stream position of window ``self._base``, where the current iteration began."""
        self._base = 0
        self._src: WindowSource | None = None

    def iter_windows(self) -> Iterator[tuple[int, dict[str, torch.Tensor], torch.Tensor]]:
        """``(global window id, inputs, labels)`` for this rank (this worker), from the current cursor."""
        base, d, r = self.cursor, self.dp_world_size, self.dp_rank
        info = get_worker_info()
        workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
        self._base, self._start = base, self._position_of(base)
        self._src = src = WindowSource(self._stream, base, self._start)
        j = -1
        while True:
            j += 1
            if workers > 1 and (j // self.batch_size) % workers != me:
                continue
            w = base + d * j + r
            got = src.take(w)
            if got is None:
                return
            _, (inp, lab, positions) = got
            self.cursor = base + d * (j + 1)
            yield w, {"input": torch.LongTensor(inp), "positions": torch.LongTensor(positions)}, torch.LongTensor(lab)

    def __iter__(self):
        """``(inputs, labels, state after this sample)``: the loader strips the state (see its collate)."""
        for _, inputs, labels in self.iter_windows():
            yield inputs, labels, self.state_dict()

    def _position_of(self, window: int) -> Pos:
        if window == self._base or self._src is None:
            return self._start
        pos = self._src.pos(window)
        return pos if pos is not None else Pos(-1, -1, 0)

    def state_dict(self) -> dict[str, Any]:
        pos = self._position_of(self.cursor)
        return {
            "version": STATE_VERSION,
            "cursor": self.cursor,
            "epoch": pos.epoch,
            "doc": pos.doc,
            "offset": pos.offset,
            "text_hash": pos.text_hash,
            "resume": pos.resume,
            "seq_len": self.seq_len,
            "dataset": self.dataset_name,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sources" in state:
            raise UCPError(
                f"the dataloader state is an interleaved loader's (sources {state['sources']}), this run reads "
                f"the one dataset {self.dataset_name!r}",
                atom="dataloader.dataset",
                saved=state.get("sources"),
                wanted=self.dataset_name,
                hint="resume with the saved interleaved sources, or skip the loader's "
                "state: checkpoint.exclude_from_loading=['dataloader']",
            )
        if state.get("version") != STATE_VERSION:
            raise UCPError(
                f"dataloader state version {state.get('version')} is not this loader's ({STATE_VERSION})",
                atom="dataloader.version",
                saved=state.get("version"),
                wanted=STATE_VERSION,
                hint="version 1 (ucp_dcp before streaming-exact resume) cannot say where a streaming epoch "
                "resumes; skip it with checkpoint.exclude_from_loading=['dataloader']",
            )
        if state.get("seq_len") != self.seq_len or state.get("dataset") != self.dataset_name:
            raise UCPError(
                f"dataloader state is for dataset {state.get('dataset')!r} with seq_len {state.get('seq_len')}, "
                f"this run uses {self.dataset_name!r} with seq_len {self.seq_len}",
                atom="dataloader",
                saved=(state.get("dataset"), state.get("seq_len")),
                wanted=(self.dataset_name, self.seq_len),
                hint="windows are cut at seq_len: resume with the same dataset and training.seq_len",
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
        self.cursor = self._base = cursor
        self._start = Pos(
            int(state["epoch"]), int(state["doc"]), int(state["offset"]), str(state["text_hash"]), str(state["resume"])
        )
        self._src = None


def _collate(samples: list[tuple[Any, Any, Any]]) -> tuple[Any, Any, Any]:
    """Collate ``(inputs, labels)`` as stock and pass on the state after the batch's last sample."""
    inputs, labels = default_collate([(i, lab) for i, lab, _ in samples])
    return inputs, labels, samples[-1][2]


class GlobalCursorTextDataLoader(ParallelAwareDataloader):
    """torchtitan text dataloader with a global cursor (see the module docstring).

    Its checkpoint state is the same on every rank (``dataloader.cursor`` ...), so it is saved
    once and loads at any data-parallel degree that divides the global batch.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "c4_test"
        """Dataset name (torchtitan's text dataset registry)."""
        infinite: bool = True
        """Loop over the dataset forever (map-style: each later epoch in a seeded shuffled order;
        streaming: each epoch in the order ``datasets`` gives after ``set_epoch``)."""

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
        ds = GlobalWindowDataset(
            config.dataset,
            config.dataset_path,
            tokenizer,
            seq_len,
            dp_rank,
            dp_world_size,
            config.infinite,
            batch_size=local_batch_size,
        )
        super().__init__(
            ds,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            collate_fn=_collate,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
        self._state: dict[str, Any] | None = None
        """The global state after the last batch handed out (None: none since the last load)."""

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        if self._state is not None:  # a new iterator continues where the last one stopped
            self.dataset.load_state_dict(self._state)
            self._state = None
        for inputs, labels, state in super().__iter__():
            self._state = state
            yield inputs, labels

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state) if self._state is not None else self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:  # empty: nothing saved, start from the beginning (as stock)
            self.dataset.load_state_dict(state_dict)
            self._state = None
