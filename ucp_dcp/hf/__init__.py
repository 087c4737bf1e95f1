"""Hugging Face safetensors in and out at any layout, through the same atoms and patterns.

* :class:`HFStorageReader`: an HF folder is one more source layout of ``dcp.load`` (with
  :class:`~ucp_dcp.UCPLoadPlanner`): names mapped by declared rules, fused targets assembled from
  separate HF tensors, rotary rows permuted, each rank reading only the byte ranges it needs.
* :mod:`.mapping`: the rules (:class:`HFRule`, :class:`HFMapping`); :mod:`.presets`: the toy LLM,
  torchtitan's llama3 and qwen3.

See docs/huggingface.md.
"""

from .mapping import HFMapping, HFRule
from .reader import HFStorageReader

__all__ = ["HFMapping", "HFRule", "HFStorageReader"]
