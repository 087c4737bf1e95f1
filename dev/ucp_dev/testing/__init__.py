"""Fixtures shared by the tests and the recipes: not the checkpointing library.

One importable home for what both ``tests/`` and ``recipes/`` need, so neither reaches into the other through
``sys.path``: real torchtitan jobs on CPU (:mod:`.titan`), real DeepSpeed / Megatron-Core checkpoints of the
toy model and those libraries' own views of them (:mod:`.foreign`), the toy trainer's elastic-resume check,
the mistake set, and the small shared helpers (tolerances, page-cache eviction). It is part of the checkout's
development package (``dev/``, installed by ``make setup``; not in the ``ucp-dcp`` wheel), so that
``python -m ucp_dev.testing...``, torchrun jobs and the recipes import it from any folder; no library module
imports it (tests/test_architecture.py), and its API may change without notice.
"""
