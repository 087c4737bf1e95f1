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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from ..errors import UCPError
from ._compat import validate_dataset as _validate_dataset

__all__ = ["GlobalWindowDataset", "GlobalCursorTextDataLoader", "STATE_VERSION"]

STATE_VERSION = 1


@dataclass(frozen=True)
class _Pos:
    """A point in the global token stream."""

    epoch: int
    doc: int
    """Index of the document in this epoch's order."""
    offset: int
    """Token entries of that document already consumed."""


class _Stream:
    """The global token stream: documents in epoch order, each tokenized with BOS/EOS and shifted
    within itself (inputs ``t[:-1]``, labels ``t[1:]``, per-document positions)."""

    def __init__(self, data: Any, tokenizer: Any, text_of: Any, seq_len: int, infinite: bool) -> None:
        self.data, self.tokenizer, self.text_of = data, tokenizer, text_of
        self.seq_len, self.infinite = seq_len, infinite
        self._n = len(data) if hasattr(data, "__len__") else None

    def _order(self, epoch: int):
        if epoch == 0 or self._n is None:
            return None
        g = torch.Generator().manual_seed(42 + epoch)
        return torch.randperm(self._n, generator=g).tolist()

    def _docs(self, pos: _Pos) -> Iterator[tuple[_Pos, list[int]]]:
        epoch, doc = pos.epoch, pos.doc
        while True:
            order = self._order(epoch)
            if self._n is not None:
                for i in range(doc, self._n):
                    sample = self.data[order[i] if order else i]
                    yield _Pos(epoch, i, 0), self.tokenizer.encode(self.text_of(sample), add_bos=True, add_eos=True)
            else:  # iterable datasets: no random access, skip forward
                src = self.data.skip(doc) if doc else self.data
                if hasattr(src, "set_epoch"):
                    src.set_epoch(epoch)
                for i, sample in enumerate(src, start=doc):
                    yield _Pos(epoch, i, 0), self.tokenizer.encode(self.text_of(sample), add_bos=True, add_eos=True)
            if not self.infinite:
                return
            epoch, doc = epoch + 1, 0

    def windows(self, start: _Pos) -> Iterator[tuple[_Pos, tuple[list[int], list[int], list[int]]]]:
        """``(start position, (inputs, labels, positions))`` of every window from ``start`` on."""
        inputs: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        head: _Pos | None = None  # stream position of inputs[0]
        for dpos, toks in self._docs(start):
            skip = start.offset if (dpos.epoch, dpos.doc) == (start.epoch, start.doc) else 0
            n = len(toks) - 1
            for j in range(skip, n):
                if head is None:
                    head = _Pos(dpos.epoch, dpos.doc, j)
                inputs.append(toks[j])
                labels.append(toks[j + 1])
                positions.append(j)
                if len(inputs) == self.seq_len:
                    yield head, (inputs, labels, _normalize(positions))
                    inputs, labels, positions, head = [], [], [], None


def _normalize(positions: list[int]) -> list[int]:
    """Positions of a window that starts mid-document restart from 0, as in torchtitan."""
    first = positions[0]
    if first > 0:
        for i, p in enumerate(positions):
            if p == 0:
                break
            positions[i] = p - first
    return positions


class GlobalWindowDataset(IterableDataset, Stateful):
    """Rank ``dp_rank``'s share of the global window stream: windows ``cursor + dp_rank + k * dp``."""

    def __init__(
        self,
        dataset_name: str,
        dataset_path: str | None,
        tokenizer: Any,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        infinite: bool = True,
    ) -> None:
        path, loader, text_of = _validate_dataset(dataset_name.lower(), dataset_path)
        self.dataset_name = dataset_name.lower()
        self.seq_len = seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self._stream = _Stream(loader(path), tokenizer, text_of, seq_len, infinite)
        self.cursor = 0
        """Windows consumed by the whole job (every DP rank's pulls in lockstep)."""
        self._start = _Pos(0, 0, 0)
        """Stream position of window ``self._base``."""
        self._base = 0
        self._yielded = 0
        self._last: tuple[int, _Pos] = (0, self._start)

    def iter_windows(self) -> Iterator[tuple[int, dict[str, torch.Tensor], torch.Tensor]]:
        """``(global window id, inputs, labels)`` for this rank, from the current cursor."""
        base, d, r = self.cursor, self.dp_world_size, self.dp_rank
        self._start = self._position_of(base)
        self._base, self._yielded = base, 0
        for w, (pos, (inp, lab, positions)) in enumerate(self._stream.windows(self._start), start=base):
            self._last = (w, pos)
            if (w - base) % d != r:
                continue
            self._yielded += 1
            self.cursor = base + d * self._yielded
            yield w, {"input": torch.LongTensor(inp), "positions": torch.LongTensor(positions)}, torch.LongTensor(lab)

    def __iter__(self):
        for _, inputs, labels in self.iter_windows():
            yield inputs, labels

    def _position_of(self, window: int) -> _Pos:
        """Stream position where ``window`` starts (scanning at most a few windows ahead)."""
        if window == self._base:
            return self._start
        w, pos = self._last
        if window == w:
            return pos
        for w2, (p, _) in enumerate(self._stream.windows(pos), start=w):
            if w2 == window:
                return p
        raise UCPError(f"dataset {self.dataset_name} ended before window {window}")

    def state_dict(self) -> dict[str, Any]:
        pos = self._position_of(self.cursor)
        return {"version": STATE_VERSION, "cursor": self.cursor, "epoch": pos.epoch, "doc": pos.doc,
                "offset": pos.offset, "seq_len": self.seq_len, "dataset": self.dataset_name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seq_len") != self.seq_len or state.get("dataset") != self.dataset_name:
            raise UCPError(
                f"dataloader state is for dataset {state.get('dataset')!r} with seq_len {state.get('seq_len')}, "
                f"this run uses {self.dataset_name!r} with seq_len {self.seq_len}",
                atom="dataloader", saved=(state.get("dataset"), state.get("seq_len")),
                wanted=(self.dataset_name, self.seq_len),
                hint="windows are cut at seq_len: resume with the same dataset and training.seq_len",
            )
        self.cursor = int(state["cursor"])
        if self.cursor % self.dp_world_size:
            raise UCPError(
                f"the saved global cursor ({self.cursor} windows) is not a multiple of the new data-parallel "
                f"degree {self.dp_world_size}: ranks cannot split the next global batch",
                atom="dataloader.cursor", saved=self.cursor, wanted=self.dp_world_size,
                hint="choose a data-parallel degree that divides the global batch size",
            )
        self._start = _Pos(int(state["epoch"]), int(state["doc"]), int(state["offset"]))
        self._base = self.cursor
        self._last = (self.cursor, self._start)


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
        """Loop over the dataset forever (each epoch in a seeded shuffled order)."""

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
        if config.num_workers:
            raise UCPError("GlobalCursorTextDataLoader needs num_workers=0 (its cursor lives in the main process)")
        ds = GlobalWindowDataset(config.dataset, config.dataset_path, tokenizer, seq_len, dp_rank, dp_world_size,
                                 config.infinite)
        super().__init__(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.dataset.load_state_dict(state_dict)
