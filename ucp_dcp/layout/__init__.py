"""Layer 1, pure math on names and boxes: atom naming, placements and meshes, fragments, transforms, coverage,
pattern rules, index maps, dtypes and state-dict structure. Imports nothing above it (tests/test_architecture.py)."""
