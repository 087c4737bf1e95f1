"""Hugging Face safetensors in and out at any layout, through the same atoms and patterns.

* :class:`HFStorageReader`: an HF folder is one more source layout of ``dcp.load`` (with
  :class:`~ucp_dcp.UCPLoadPlanner`): names mapped by declared rules, fused targets assembled from
  separate HF tensors, rotary rows permuted, each rank reading only the byte ranges it needs.
* :func:`load_hf`: the same in one call; :func:`export_hf`: a ucp_dcp checkpoint of any layout
  to an HF folder (shards, index, ``config.json``), box by box, never assembling the model.
* :mod:`.mapping`: the rules (:class:`HFRule`, :class:`HFMapping`). Declared mappings: torchtitan's
  llama3 and qwen3 (:mod:`ucp_dcp.torchtitan.mappings`), and in a checkout the recipes' toy LLM
  (``ucp_dev.toy.hf_presets``, the development package, not shipped).

See docs/huggingface.md.
"""

from .load import load_hf
from .mapping import HFMapping, HFRule
from .publish import ExportStats, export_hf
from .source import HFStorageReader

__all__ = ["ExportStats", "HFMapping", "HFRule", "HFStorageReader", "export_hf", "load_hf"]
