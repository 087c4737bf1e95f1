"""The requests each save and load makes on an S3-compatible store, ucp_dcp against DCP's FsspecWriter/Reader.

    python recipes/s3_requests.py

One process, moto's S3 server on 127.0.0.1 in a thread (``ucp_dev.testing.s3_server``, which counts the
requests it serves and the object bytes it sends). Two states: *small* (a 1 MiB matrix, a vector and a
counter) and *many items* (a 4 MiB matrix and 100 vectors of 4 KiB, like a model's norms and biases). Each is
saved twice into a prefix (the second save replaces the first) and loaded back whole, by each system; every
load is checked bitwise. Prints one line per operation: requests by kind and the object bytes sent.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch


def _states() -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    many = {f"n{i}": torch.randn(1024, generator=g) for i in range(100)}
    many["w"] = torch.randn(1024, 1024, generator=g)
    return {
        "small": {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(16, generator=g), "step": 3},
        "many items": many,
    }


def _empty(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def main() -> int:
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp

    import ucp_dcp
    from ucp_dcp._compat import fsspec_storage
    from ucp_dev.testing.s3_server import S3Server

    server = S3Server().start()
    server.create_bucket("requests")
    os.environ.update(server.env())
    FsspecWriter, FsspecReader = fsspec_storage()
    ops = {
        "ucp_dcp": (lambda sd, url: ucp_dcp.save(sd, url), lambda sd, url: ucp_dcp.load(sd, url)),
        "DCP": (
            lambda sd, url: dcp.save(sd, storage_writer=FsspecWriter(url)),
            lambda sd, url: dcp.load(sd, storage_reader=FsspecReader(url)),
        ),
    }
    ok = True
    try:
        for state, sd in _states().items():
            for system, (save, load) in ops.items():
                url = f"s3://requests/{system}-{state.replace(' ', '-')}"
                for op in ("save", "save over", "load"):
                    server.faults.clear()
                    got = None
                    if op == "load":
                        got = _empty(sd)
                        load(got, url)
                        ok &= all(
                            torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
                            for k, v in sd.items()
                        )
                    else:
                        save(sd, url)
                    reqs = server.faults.requests
                    kinds = ", ".join(f"{k} {v}" for k, v in sorted(reqs.items()))
                    print(
                        f"{state:>10} {system:>8} {op:>9}: {sum(reqs.values()):>4} requests ({kinds}); "
                        f"object bytes sent {server.faults.bytes_out['GET'] / 2**20:.2f} MiB",
                        flush=True,
                    )
    finally:
        server.stop()
    print("S3 REQUESTS OK" if ok else "S3 REQUESTS FAILED: a load was not bitwise")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
