"""Real DeepSpeed and Megatron-Core checkpoints of the toy model, written on CPU, and those libraries' own
views of them: the fixtures of the foreign-source tests and ``recipes/foreign_demo.py``.

The writers run as programs (``python -m ucp_dev.testing.foreign.make_deepspeed ...``); importing this
package imports neither deepspeed nor megatron.
"""
