"""Other frameworks' checkpoints as source layouts of ``dcp.load`` (no conversion step).

* :mod:`.inert`: ``torch.save`` files parsed without running or importing anything they name;
* :mod:`.pieces`: flat partitions and fused/padded source rows as contiguous boxes of atoms;
* :mod:`.reader`: :class:`ForeignReader`, the base that presents such pieces to ``dcp.load`` with
  ucp_dcp's ranged, read-once reader; :func:`row_layout` describes a fused or padded source
  parameter with the target's own ``Fused``/``Padded`` rules.

See docs/migrating.md.
"""

from .base import ForeignReader, row_layout
from .deepspeed import DeepSpeedReader
from .megatron import MegatronReader

__all__ = ["ForeignReader", "DeepSpeedReader", "MegatronReader", "row_layout"]
