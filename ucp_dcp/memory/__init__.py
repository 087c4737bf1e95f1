"""The memory tier: checkpoints in host memory that survive a crash, replicated to other hosts,
drained to disk in the background, and loaded at any layout (docs/memory.md)."""

from .load import load
from .locate import Source, locate
from .reader import MemoryReader
from .tier import GenerationStatus, MemoryTier, MemoryTierWarning

__all__ = ["MemoryTier", "GenerationStatus", "MemoryTierWarning", "MemoryReader", "Source", "locate", "load"]
