"""The dataloader state an ``export --to torchtitan`` writes: read from the checkpoint, in stock torchtitan's format.

Which loader saved the checkpoint (:func:`saved_dataloader`: ucp_dcp's global cursor, torchtitan's
per-rank state, the interleaved loader's, none or another), and the ``dataloader`` entries of the stock
checkpoint (:func:`dataloader_entries`): per-rank state copied as saved at its own degree, the global
cursor turned into per-rank stock state by :func:`~ucp_dcp.torchtitan.stock_loader.cursor_to_stock`, the
rest refused before the model is built.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import UCPError
from .stock_loader import NO_DATA, cursor_to_stock

__all__ = ["CURSOR_KEYS", "Captured", "dataloader_entries", "saved_dataloader"]

CURSOR_KEYS = ("version", "cursor", "epoch", "doc", "offset", "text_hash", "resume", "seq_len", "dataset")
"""The global-cursor loader's state keys (``dataloader.STATE_KEYS``, without importing torchtitan here)."""
_TEXT_KEYS = ("dataset", "text_hash", "resume")


def saved_dataloader(keys: set[str]) -> tuple[str, list[str]]:
    """``("cursor" | "interleaved" | "per_rank" | "none" | "other", names)`` of the saved dataloader entries."""
    names = sorted(k[len("dataloader.") :] for k in keys if k.startswith("dataloader."))
    if not names:
        return "none", names
    if any(n.startswith("dp_rank_") for n in names):
        return "per_rank", names
    if "sources" in names:  # the interleaved loader's (it also has the single-source keys)
        return "interleaved", names
    if set(CURSOR_KEYS) <= set(names):
        return "cursor", names
    return "other", names


class Captured(Stateful):
    """A state entry read as it is (its template gives the names and types)."""

    def __init__(self, template: dict[str, Any]) -> None:
        self.value = dict(template)

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = dict(state_dict)


def dataloader_entries(cfg: Any, src: str, keys: set[str], dp: int) -> tuple[dict[str, Any], str]:
    """The ``dataloader`` entries of the export (torchtitan's per-rank format) and a line for the
    report, read from the checkpoint; refuses what cannot be written at ``dp``."""
    from ..planning.load_planner import UCPLoadPlanner
    from ..storage.reader import UCPFileSystemReader

    kind, names = saved_dataloader(keys)
    if kind == "none":
        raise UCPError(
            f"{src} holds no dataloader state",
            atom="dataloader",
            hint="export with --no-dataloader and resume with --checkpoint.exclude_from_loading dataloader",
        )
    if kind == "interleaved":
        raise UCPError(
            f"{src} holds the global-cursor interleaved loader's state: the export writes only the "
            "single-source loader's stock state",
            atom="dataloader",
            hint=NO_DATA[3:],
        )
    if kind == "other":
        raise UCPError(
            f"the checkpoint's dataloader state ({', '.join(names[:4])}) is neither ucp_dcp's global "
            "cursor nor torchtitan's per-rank state",
            atom="dataloader",
            hint=NO_DATA[3:],
        )
    if kind == "per_rank":
        ranks = [n for n in names if n.startswith("dp_rank_")]
        if len(ranks) != dp:
            raise UCPError(
                f"the checkpoint holds torchtitan's per-rank dataloader state for data-parallel degree {len(ranks)}, "
                f"which cannot be remapped to {dp}",
                atom="dataloader",
                saved=len(ranks),
                wanted=dp,
                hint=f"export with --dp {len(ranks)}, " + NO_DATA,
            )
        template = {**{n: b"" for n in ranks}, "world_size": 0}
    else:
        template = {k: ("" if k in _TEXT_KEYS else 0) for k in CURSOR_KEYS}
    got = Captured(template)
    dcp.load({"dataloader": got}, storage_reader=UCPFileSystemReader(src), planner=UCPLoadPlanner())
    value = got.value
    if kind == "per_rank":
        if value.get("world_size") != dp:
            raise UCPError(
                f"the per-rank dataloader state says world_size {value.get('world_size')}, not {dp}",
                atom="dataloader.world_size",
                saved=value.get("world_size"),
                wanted=dp,
            )
        return value, f"{dp} per-rank stock entries copied as saved (dp_rank_0..{dp - 1}, world_size {dp})"
    tokenizer = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path)
    return cursor_to_stock(cfg, value, dp, tokenizer)
