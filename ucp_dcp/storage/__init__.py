"""Layer 3, bytes on disk: the on-disk format, sidecar, atomic commit and opening, block checksums, file ranges,
the writer and reader, read jobs, staging and transport. Imports layout and planning (payloads), never sources."""
