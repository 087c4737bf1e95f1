"""The data position of the global-cursor loader as stock torchtitan's per-rank loader state.

:func:`cursor_to_stock` turns the global cursor of :class:`~ucp_dcp.torchtitan.dataloader.GlobalCursorTextDataLoader`
(saved by a ucp_dcp torchtitan job) into the ``dataloader`` entries of ``dp`` stock
``HuggingFaceTextDataLoader`` ranks that continue the same token stream: each rank's map-style dataset is
positioned (and, for ``dp > 1``, given the rest of the epoch's windows in its token buffer, within
:data:`BUFFER_COPIES` / :data:`BUFFER_TOKENS`), and the next global batch of the written loaders is checked
against the cursor's. What cannot be reproduced (a later epoch, a cursor that does not split over ``dp``, a
loader that is not torchtitan's text loader) is refused with :data:`NO_DATA` as the way out. Used by
:mod:`ucp_dcp.torchtitan.to_stock` (``export --to torchtitan``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UCPError
from ._compat import text_dataset_parts

__all__ = ["cursor_to_stock", "NO_DATA", "BUFFER_COPIES", "BUFFER_TOKENS"]

NO_DATA = (
    "or export without the data position (--no-dataloader) and resume stock torchtitan with "
    "--checkpoint.exclude_from_loading dataloader (its data stream restarts from the beginning)"
)
"""The way out named by every refusal: no data position in the export."""

BUFFER_COPIES = 1 << 28
"""Per rank, a bound on the list copies a stock loader makes to drain an exported buffer (it
re-slices its token buffer after every window: ``tokens**2 / (2 * seq_len)`` copies in all; 2**28 is
a second or two of CPython, spread over the steps): about a million tokens per rank at seq_len 2048."""
BUFFER_TOKENS = 1 << 24
"""A bound on all ranks' buffered tokens together (three Python int lists each: about 1.5 GiB at
export, some 200 MB of pickles in the checkpoint)."""


def _stock_loader_config(cfg: Any) -> Any:
    """The job's dataloader config as torchtitan's own text loader's (the global-cursor loader's
    config is switched back)."""
    from torchtitan.config import derive
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from .dataloader import GlobalCursorTextDataLoader

    dl = cfg.dataloader
    if isinstance(dl, GlobalCursorTextDataLoader.Config):
        return derive(dl, HuggingFaceTextDataLoader.Config)
    if type(dl) is not HuggingFaceTextDataLoader.Config:
        raise UCPError(
            f"the job's dataloader ({type(dl).__qualname__}) is not torchtitan's text loader "
            "(HuggingFaceTextDataLoader): the export knows only that loader's state",
            hint=NO_DATA[3:],
        )
    return dl


def _stock_loader(cfg: Any, tokenizer: Any, dp: int, rank: int) -> Any:
    return _stock_loader_config(cfg).build(
        dp_world_size=dp,
        dp_rank=rank,
        tokenizer=tokenizer,
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        snapshot_every_n_steps=None,
    )


def _stock_entries(cfg: Any, tokenizer: Any, dp: int, state_of: Any) -> dict[str, Any]:
    """torchtitan's own per-rank entries (``dp_rank_<r>``: the pickled ``StatefulDataLoader`` state;
    ``world_size``) of ``dp`` stock loaders, rank ``r``'s dataset given ``state_of(r, dataset)``."""
    entries: dict[str, Any] = {}
    for rank in range(dp):
        loader = _stock_loader(cfg, tokenizer, dp, rank)
        loader.dataset.load_state_dict(state_of(rank, loader.dataset))
        entries.update(loader.state_dict())
    return entries


def _refuse_degree(dp: int, why: str) -> UCPError:
    return UCPError(
        f"the data position cannot be written for stock torchtitan at data-parallel degree {dp}: {why}",
        atom="dataloader",
        saved="global cursor",
        wanted=f"dp={dp}",
        hint="export with --dp 1 (the stock loader then continues the run's stream from the current document), "
        + NO_DATA,
    )


def _map_style(ds: Any, name: str) -> Any:
    from datasets import Dataset

    if not all(hasattr(ds, a) for a in ("_data", "_tokenizer", "_text_processor", "load_state_dict")):
        raise UCPError(
            f"the job's text dataset ({type(ds).__qualname__}) is not torchtitan 0.3's "
            "HuggingFaceTextDataset: the export knows only that dataset's state",
            hint=NO_DATA[3:],
        )
    data = text_dataset_parts(ds)[0]
    if not isinstance(data, Dataset):
        raise UCPError(
            f"dataset {name!r} is a streaming (iterable) dataset: the export writes the position of "
            "map-style datasets only",
            atom="dataloader",
            hint=NO_DATA[3:],
        )
    return data


def cursor_to_stock(cfg: Any, cursor: dict[str, Any], dp: int, tokenizer: Any) -> tuple[dict[str, Any], str]:
    """The entries of ``dp`` stock loaders that continue the global cursor exactly to the end of its
    epoch, and a line for the report; refuses what cannot be expressed. The next global batch of the
    stock loaders is checked against the global-cursor loader's.

    At ``dp = 1`` the stock loader reads the global stream itself: its state is the next document and
    the rest of the current one in its token buffers, as a stock save leaves it. At ``dp > 1`` each
    stock rank reads its own contiguous slice of the dataset, never the global stream, so each
    rank's windows of the rest of the epoch are written into its buffers and its slice is marked
    read; after the epoch every rank continues with its own slice, as stock torchtitan does."""
    dl = _stock_loader_config(cfg)
    seq_len, name = int(cfg.training.seq_len), str(dl.dataset).lower()
    if cursor["seq_len"] != seq_len or cursor["dataset"] != name:
        raise UCPError(
            f"the checkpoint's data position is for dataset {cursor['dataset']!r} with seq_len {cursor['seq_len']}, "
            f"the job's flags say {name!r} with seq_len {seq_len}",
            atom="dataloader",
            saved=(cursor["dataset"], cursor["seq_len"]),
            wanted=(name, seq_len),
            hint="give the job's own --dataloader.* and --training.seq_len flags",
        )
    epoch, doc, offset, at = int(cursor["epoch"]), int(cursor["doc"]), int(cursor["offset"]), int(cursor["cursor"])
    if epoch != 0:
        raise UCPError(
            f"the global cursor is in epoch {epoch}, whose document order (ucp_dcp's seeded permutation) stock "
            "torchtitan does not reproduce (its loader shuffles with datasets' Dataset.shuffle(seed=42 + epoch)): "
            "no data-parallel degree keeps the position",
            atom="dataloader.epoch",
            saved=epoch,
            wanted=0,
            hint=NO_DATA[3:],
        )
    if at % dp:
        raise _refuse_degree(
            dp,
            f"the global cursor ({at} windows) is not a multiple of {dp}: the ranks cannot split the next global batch",
        )
    first = _stock_loader(cfg, tokenizer, 1, 0).dataset
    data = _map_style(first, name)
    if doc >= len(data):
        raise UCPError(
            f"the global cursor is at document {doc}, past the dataset's {len(data)}",
            atom="dataloader.doc",
            saved=doc,
            wanted=len(data),
        )
    _, tokenizer_, text_processor = text_dataset_parts(first)
    encode = lambda i: tokenizer_.encode(text_processor(data[i]), add_bos=True, add_eos=True)  # noqa: E731
    if dp == 1:
        state: dict[str, Any] = {
            "inputs_buffer": [],
            "labels_buffer": [],
            "positions_buffer": [],
            "sample_idx": doc,
            "epoch": 0,
        }
        if offset:  # the rest of the current document waits in the loader's buffers
            toks = encode(doc)
            state.update(
                inputs_buffer=toks[offset:-1],
                labels_buffer=toks[offset + 1 :],
                positions_buffer=list(range(offset, len(toks) - 1)),
                sample_idx=doc + 1,
            )
        if not dl.infinite and state["sample_idx"] == len(data) and len(state["inputs_buffer"]) >= seq_len:
            raise _refuse_degree(
                dp,
                "the cursor is in the last document of a loader that is not infinite: a stock "
                "loader yields buffered windows only when it reads another document",
            )
        entries = _stock_entries(cfg, tokenizer, 1, lambda rank, ds: state)
        what = (
            f"document {doc}, token {offset} of epoch 0 (sample_idx {state['sample_idx']}, "
            f"{len(state['inputs_buffer'])} tokens buffered)"
        )
    else:
        if not dl.infinite:
            raise _refuse_degree(
                dp,
                "the job's loader is not infinite (--dataloader.infinite): a stock rank whose "
                "slice is read yields nothing more, not even its buffered windows",
            )
        buffers = _rest_of_epoch(encode, len(data), doc, offset, seq_len, dp)
        entries = _stock_entries(
            cfg,
            tokenizer,
            dp,
            lambda rank, ds: {
                "inputs_buffer": buffers[rank][0],
                "labels_buffer": buffers[rank][1],
                "positions_buffer": buffers[rank][2],
                "sample_idx": len(text_dataset_parts(ds)[0]),
                "epoch": 0,
            },
        )
        tokens = sum(len(b[0]) for b in buffers)
        what = (
            f"the rest of epoch 0 from document {doc}, token {offset} ({tokens} tokens, "
            f"{tokens // seq_len} windows) in the {dp} ranks' buffers, each rank's slice marked read"
        )
    checked = _check_next_batch(cfg, tokenizer, cursor, entries, dp)
    line = (
        f"{', '.join(k for k in entries if k.startswith('dp_rank_'))} (world_size {dp}): global window {at} = "
        f"{what}; the next {checked} windows checked equal to the global-cursor loader's"
    )
    return entries, line


def _rest_of_epoch(
    encode: Any, n_docs: int, doc: int, offset: int, seq_len: int, dp: int
) -> list[tuple[list, list, list]]:
    """Each rank's (inputs, labels, positions) buffers: window ``cursor + k`` goes to rank ``k mod dp``
    (the global-cursor loader's deal), every window of epoch 0 from ``(doc, offset)`` on; the partial
    window at the end goes to the next rank in turn (a stock rank completes it from its next epoch)."""
    cap = min(int((2 * BUFFER_COPIES * seq_len) ** 0.5), BUFFER_TOKENS // dp)
    out: list[tuple[list, list, list]] = [([], [], []) for _ in range(dp)]
    inp: list[int] = []
    lab: list[int] = []
    pos: list[int] = []
    w = 0
    for i in range(doc, n_docs):
        toks = encode(i)
        o = offset if i == doc else 0
        inp += toks[o:-1]
        lab += toks[o + 1 :]
        pos += range(o, len(toks) - 1)
        cut = 0
        while len(inp) - cut >= seq_len:
            b = out[w % dp]
            b[0].extend(inp[cut : cut + seq_len])
            b[1].extend(lab[cut : cut + seq_len])
            b[2].extend(pos[cut : cut + seq_len])
            cut += seq_len
            w += 1
            if len(b[0]) > cap:
                raise _refuse_degree(
                    dp,
                    (
                        f"each of the {dp} stock ranks reads its own slice of the dataset, never the global stream, so "
                        f"the export must write the rest of epoch 0 into the ranks' token buffers, and more than {dp} x "
                        f"{cap} tokens remain (bounded by ucp_dcp.torchtitan.stock_loader.BUFFER_COPIES, the list copies a stock "
                        f"loader makes to drain its buffer, and BUFFER_TOKENS); --dp 1 keeps the position at any dataset "
                        f"size"
                    ),
                )
        del inp[:cut], lab[:cut], pos[:cut]
    b = out[w % dp]  # the partial window at the end of the epoch: the next rank in turn
    b[0].extend(inp)
    b[1].extend(lab)
    b[2].extend(pos)
    return out


def _check_next_batch(cfg: Any, tokenizer: Any, cursor: dict[str, Any], entries: dict[str, Any], dp: int) -> int:
    """Fresh stock loaders given ``entries`` yield, rank by rank, the windows the global-cursor loader
    at ``cursor`` gives that rank over the next global batch (inputs, labels, positions); returns
    the windows compared."""
    from .dataloader import GlobalWindowDataset

    T = cfg.training
    dl = _stock_loader_config(cfg)
    per_rank = max((T.global_batch_size if T.global_batch_size > 0 else T.local_batch_size * dp) // dp, 1)
    seen = 0
    for rank in range(dp):
        ours = GlobalWindowDataset(dl.dataset, dl.dataset_path, tokenizer, T.seq_len, rank, dp, dl.infinite)
        ours.load_state_dict(cursor)
        want = ours.iter_windows()
        stock = _stock_loader(cfg, tokenizer, dp, rank)
        stock.load_state_dict(entries)
        got = iter(stock)
        done = 0
        while done < per_rank:
            inputs, labels = next(got)
            for i in range(min(labels.shape[0], per_rank - done)):
                w, inp, lab = next(want)
                if not (
                    torch.equal(inputs["input"][i], inp["input"])
                    and torch.equal(labels[i], lab)
                    and torch.equal(inputs["positions"][i], inp["positions"])
                ):
                    raise UCPError(
                        f"internal check failed: stock rank {rank}'s window {done} after the exported "
                        f"position differs from the global-cursor loader's window {w}",
                        atom="dataloader",
                    )
                done += 1
        seen += done
    return seen


# -- the export -----------------------------------------------------------------------------------------
