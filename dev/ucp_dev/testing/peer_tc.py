"""torch_checkpointing's ``CheckpointManager`` set up the way the comparison and the tests run it: with its
``DefaultResharder`` (stock) or ucp_dcp's :class:`~ucp_dcp.peers.torch_checkpointing.UCPResharder`, on a
CPU-only machine (two of its settings patched, see :func:`cpu_gather` and :func:`tc_manager`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["cpu_gather", "tc_manager"]


def cpu_gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
    """torch_checkpointing 0.1.1's metadata all-gather on gloo: its own puts the bytes on ``device="cuda"``
    (``DefaultMetadataManager._all_gather_pickled_data``), so any save with a resharder fails on a CPU-only
    machine with "Torch not compiled with CUDA enabled". The same exchange through ``all_gather_object``."""
    out: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, data, group=process_group)
    return dict(enumerate(out))


def tc_manager(resharder: Any = None, sync: bool = True, keys: tuple[str, ...] = ("model", "optim")) -> Any:
    """A ``CheckpointManager`` whose items ``keys`` reshard with ``resharder`` (default: a fresh
    ``DefaultResharder`` per item); ``sync``: a synchronous saver, else its async one (a writer process)."""
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.metadata_manager import DefaultMetadataManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    if not torch.cuda.is_available():
        DefaultMetadataManager._all_gather_pickled_data = cpu_gather  # type: ignore[method-assign]

    items = {k: ItemSpec(resharder=resharder if resharder is not None else DefaultResharder()) for k in keys}
    cfg = CheckpointManager.Config.with_sync_save() if sync else CheckpointManager.Config.with_async_save()
    cfg.items = items
    # its default opens data files with O_DIRECT and writes unaligned buffers: on this VM's ext4 the open
    # succeeds and the close fails (OSError EINVAL), so every save fails; buffered I/O, as DCP and ucp_dcp write
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(cfg)
