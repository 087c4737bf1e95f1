"""The global token stream of a text dataset, and exact positions in it, for every dataset kind.

Documents are read epoch by epoch in the order training reads them:

* **map-style** (anything with ``__len__``, e.g. ``datasets.Dataset``): epoch 0 in index order, epoch
  ``e > 0`` in a seeded permutation (``torch.randperm``, seed ``42 + e``). Random access: a position
  is ``(epoch, document index in that epoch's order)``.
* **streaming** (``datasets.IterableDataset``, one or many shards): epoch ``e`` is exactly what
  ``datasets`` yields after ``set_epoch(e)``. For a multi-shard dataset that is a per-epoch shard
  order (and, after ``.shuffle()``, a per-epoch buffer order), which ``.skip(n)`` does not follow:
  ``skip`` counts in the original order. So a position is ``(epoch, n)`` -- the ``n``-th document of
  that epoch's *actual* stream -- and a resume either continues from ``datasets``' own state taken
  just before that document (when that state is known to resume exactly: no shuffle buffer, no
  ``map``), or reads the epoch again from its start and drops its first ``n`` documents.

Every position carries a fingerprint of its document's text; a resume checks that the document it
reaches is the saved one, so a changed dataset, or an order that cannot be reproduced (an unseeded
shuffle), is refused instead of resumed somewhere else.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import UCPError
from ._compat import datasets_iterable_kinds

__all__ = ["Pos", "Documents", "TokenStream", "WindowSource", "text_hash"]

logger = logging.getLogger(__name__)

EXACT_STATE_TYPES = frozenset(
    {
        "ExamplesIterable",
        "ArrowExamplesIterable",
        "RebatchedArrowExamplesIterable",
        "FormattedExamplesIterable",
        "SkipExamplesIterable",
        "TakeExamplesIterable",
        "StepExamplesIterable",
    }
)
"""``datasets`` example iterables whose ``state_dict`` resumes at exactly the next example (its docs
name the exceptions: shuffle buffers lose their contents, batched ``map`` may skip a batch). A dataset
built from any other kind is resumed by re-reading the epoch instead."""


@dataclass(frozen=True)
class Pos:
    """A point in the global token stream."""

    epoch: int
    doc: int
    """Index of the document in this epoch's actual order (-1: the data ended before this point)."""
    offset: int
    """Token entries of that document already consumed."""
    text_hash: str = ""
    """Fingerprint of the document's text ("" where unknown), checked on resume."""
    resume: str = ""
    """Streaming only: ``datasets``' state just before this document, as JSON ("" = re-read the epoch)."""


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


class Documents:
    """The documents of one dataset, epoch after epoch, in training order (see module doc)."""

    def __init__(self, data: Any, text_of: Callable[[Any], str], infinite: bool, name: str = "dataset") -> None:
        self.data, self.text_of, self.infinite, self.name = data, text_of, infinite, name
        self.mapstyle = hasattr(data, "__len__")
        if not self.mapstyle and not (hasattr(data, "set_epoch") and hasattr(data, "iter")):
            raise UCPError(
                f"dataset {name}: an iterable dataset needs set_epoch() and iter() (a datasets."
                f"IterableDataset) so each epoch's order can be reproduced; got {type(data).__name__}",
                hint="load it with datasets.load_dataset(..., streaming=True), or as a map-style dataset",
            )
        self._pid = os.getpid()
        kinds = None if self.mapstyle else datasets_iterable_kinds(data)
        self._exact = kinds is not None and kinds <= EXACT_STATE_TYPES
        """Does ``datasets``' own state resume this dataset exactly? (else a resume re-reads the epoch)"""
        if not self.mapstyle and not self._exact:
            logger.info(
                "dataset %s: datasets' state does not resume it exactly (%s); a resume re-reads the epoch "
                "up to its document",
                name,
                sorted((kinds or {"unknown"}) - EXACT_STATE_TYPES),
            )

    def _order(self, epoch: int) -> list[int] | None:
        if epoch == 0:
            return None
        g = torch.Generator().manual_seed(42 + epoch)
        return torch.randperm(len(self.data), generator=g).tolist()

    def read(self, pos: Pos) -> Iterator[tuple[Pos, str]]:
        """``(position, text)`` of every document from ``pos``'s document on (offsets 0)."""
        if pos.doc < 0:
            return
        epoch, doc, resume, expect = pos.epoch, pos.doc, pos.resume, pos.text_hash
        while True:
            if self.mapstyle:
                order, n = self._order(epoch), len(self.data)
                for i in range(doc, n):
                    text = self.text_of(self.data[order[i] if order else i])
                    h = text_hash(text)
                    if expect:
                        self._check(h, expect, epoch, i)
                        expect = ""
                    yield Pos(epoch, i, 0, h), text
            else:
                yield from self._stream_epoch(epoch, doc, resume, expect)
                expect = ""
            if not self.infinite:
                return
            epoch, doc, resume = epoch + 1, 0, ""

    def _check(self, got: str, expect: str, epoch: int, doc: int) -> None:
        if got != expect:
            raise UCPError(
                f"dataset {self.name}: document {doc} of epoch {epoch} is not the one the checkpoint was saved at "
                "(its text differs): the data changed, or its order cannot be reproduced (e.g. an unseeded "
                "shuffle); refusing to resume at another place",
                atom="dataloader.text_hash",
                saved=expect,
                wanted=got,
                hint="resume with the same data files in the same order (seeded shuffles only), or skip the "
                "dataloader state: checkpoint.exclude_from_loading=['dataloader']",
            )

    def _open(self, epoch: int, state: dict | None) -> Iterator[Any]:
        if self._pid != os.getpid():
            # a DataLoader worker: datasets keeps the epoch in shared memory, which the workers (at different
            # epochs) would set for each other; a deep copy has its own
            self.data, self._pid = copy.deepcopy(self.data), os.getpid()
        ds = self.data
        ds.set_epoch(epoch)
        ds.load_state_dict(state or {})  # {}: start of the epoch
        # iter() (not __iter__): in a DataLoader worker __iter__ would read only that worker's shards
        for batch in ds.iter(batch_size=1):
            yield {k: v[0] for k, v in batch.items()}

    def _stream_epoch(self, epoch: int, doc: int, resume: str, expect: str) -> Iterator[tuple[Pos, str]]:
        jumped = bool(doc and resume and self._exact)
        it = self._open(epoch, json.loads(resume) if jumped else None)
        if not jumped:
            if doc:
                logger.info("dataset %s: re-reading epoch %d up to document %d to resume there", self.name, epoch, doc)
            for n in range(doc):
                if next(it, None) is None:
                    raise UCPError(
                        f"dataset {self.name}: epoch {epoch} has {n} documents, the checkpoint is at document {doc}",
                        atom="dataloader.doc",
                        saved=doc,
                        wanted=n,
                        hint="resume with the data the checkpoint was trained on",
                    )
        before = resume if jumped else (self._state_json() if doc else "")  # datasets' state before `doc`
        i = doc
        for sample in it:
            text = self.text_of(sample)
            h = text_hash(text)
            if i == doc and expect and h != expect:
                if jumped:  # datasets' state did not land on the saved document: read the epoch instead
                    logger.warning(
                        "dataset %s: datasets' saved state resumed at another document; re-reading "
                        "epoch %d from its start",
                        self.name,
                        epoch,
                    )
                    self._exact = False
                    yield from self._stream_epoch(epoch, doc, "", expect)
                    return
                self._check(h, expect, epoch, i)
            yield Pos(epoch, i, 0, h, before), text
            i += 1
            before = self._state_json()

    def _state_json(self) -> str:
        """``datasets``' state now (after the last document read), as JSON; "" if it would not resume exactly."""
        return json.dumps(self.data.state_dict()) if self._exact else ""


class TokenStream:
    """The global token stream: documents in epoch order, each tokenized with BOS/EOS and shifted
    within itself (inputs ``t[:-1]``, labels ``t[1:]``, per-document positions), cut into windows."""

    def __init__(self, docs: Documents, tokenizer: Any, seq_len: int) -> None:
        self.docs, self.tokenizer, self.seq_len = docs, tokenizer, seq_len

    def windows(self, start: Pos) -> Iterator[tuple[Pos, tuple[list[int], list[int], list[int]], int]]:
        """``(start position, (inputs, labels, positions), epoch of its last token)`` of every window
        from ``start`` on."""
        inputs: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        head: Pos | None = None  # stream position of inputs[0]
        for dpos, text in self.docs.read(start):
            toks = self.tokenizer.encode(text, add_bos=True, add_eos=True)
            skip = start.offset if (dpos.epoch, dpos.doc) == (start.epoch, start.doc) else 0
            for j in range(skip, len(toks) - 1):
                if head is None:
                    head = replace(dpos, offset=j)
                inputs.append(toks[j])
                labels.append(toks[j + 1])
                positions.append(j)
                if len(inputs) == self.seq_len:
                    yield head, (inputs, labels, _normalize(positions)), dpos.epoch
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


class WindowSource:
    """Windows ``first, first + 1, ...`` of a stream read once, with a look-ahead buffer: ``take(w)``
    hands out window ``w`` (dropping those before it), ``pos(w)`` tells where ``w`` starts and
    ``end_epoch(w)`` the epoch its last token is in."""

    def __init__(self, stream: TokenStream, first: int, start: Pos) -> None:
        self._it = stream.windows(start)
        self._buf: deque[tuple[int, Pos, Any, int]] = deque()
        self._next = first
        self._start = (first, start)

    def _fill(self, w: int) -> bool:
        while self._next <= w:
            got = next(self._it, None)
            if got is None:
                return False
            self._buf.append((self._next, *got))
            self._next += 1
        return True

    def pos(self, w: int) -> Pos | None:
        """Where window ``w`` (not yet dropped) starts; None if the data ends before it."""
        if w == self._start[0]:
            return self._start[1]
        if not self._fill(w):
            return None
        return self._entry(w)[1]

    def end_epoch(self, w: int) -> int | None:
        """The epoch of window ``w``'s last token (not yet dropped); None if the data ends before it."""
        return self._entry(w)[3] if self._fill(w) else None

    def _entry(self, w: int) -> tuple[int, Pos, Any, int]:
        for entry in self._buf:
            if entry[0] == w:
                return entry
        raise AssertionError(f"window {w} was already dropped")

    def take(self, w: int) -> tuple[Pos, Any] | None:
        if not self._fill(w):
            return None
        while self._buf[0][0] < w:
            self._buf.popleft()
        _, p, win, _ = self._buf[0]
        return p, win
