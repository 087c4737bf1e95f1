"""Layer 2, the two planners and their pure steps: entries and their resolution, plan payloads, the save and load
steps, replica dedup and consistency checks, digests, averaging, the catalog, declarations, stock param groups,
device-aware read cutting and the few collectives planning needs. Imports layout, never storage."""
