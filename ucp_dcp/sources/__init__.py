"""Layer 4, other formats as source layouts of ``dcp.load``: Hugging Face safetensors (:mod:`.hf`) and other
frameworks' checkpoints (:mod:`.foreign`, DeepSpeed and Megatron-Core). Built on storage's reader."""
