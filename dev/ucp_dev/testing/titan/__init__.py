"""torchtitan's own Trainer on CPU, for the tests and recipes: the launcher and its CPU patches
(:mod:`.cpu_launch`), the CPU attention override (:mod:`.cpu_attention`), generated tokenizer and data
(:mod:`.assets`), and the jobs and their save -> resume check (:mod:`.jobs`).

Imports nothing: a stock torchtitan job runs :mod:`.cpu_launch` with ucp_dcp blocked
(tests/e2e/test_to_stock.py).
"""
