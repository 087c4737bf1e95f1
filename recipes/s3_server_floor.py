"""What the local S3 server (moto, ``ucp_dev.testing.s3_server``) does alone: requests/s and MB/s by request kind.

    python recipes/s3_server_floor.py [--object-mib 32] [--range-mib 1] [--requests 64] [--in-flight 8]

The server runs in its own process, as in ``recipes/bench_s3.py``; one client process (s3fs, the client both
systems use there) sends ``--requests`` GETs, ``--in-flight`` at a time, of each kind: ranged GETs of
``--range-mib`` MiB from an object of ``--object-mib`` MiB, the same ranges from an object of ``--range-mib``
MiB (whole), and whole GETs of the large object. Prints each kind's requests/s, MB/s and the server's CPU
seconds per request: if a ranged GET costs in proportion to its *object's* size rather than the bytes it
sends, fewer bytes do not make a load faster against this server, whatever the client does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--object-mib", type=int, default=32)
    ap.add_argument("--range-mib", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=8)
    args = ap.parse_args()
    from ucp_dev.testing.s3_server import spawn_server

    proc, env = spawn_server("floor")
    os.environ.update(env)
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        big, small = "floor/big", "floor/small"
        MiB = 1 << 20
        fs.pipe(big, os.urandom(args.object_mib * MiB))
        fs.pipe(small, os.urandom(args.range_mib * MiB))
        n, r = args.requests, args.range_mib * MiB
        starts = [(i * r) % (args.object_mib * MiB - r + 1) for i in range(n)]
        kinds = {
            f"ranged {args.range_mib} MiB of a {args.object_mib} MiB object": [(big, s, s + r) for s in starts],
            f"whole {args.range_mib} MiB object": [(small, 0, r)] * n,
            f"whole {args.object_mib} MiB object": [(big, 0, args.object_mib * MiB)] * max(1, n // args.object_mib),
        }
        print(f"moto S3 server alone, {args.in_flight} GETs in flight, one s3fs client process")
        for name, reqs in kinds.items():

            async def run(reqs=reqs) -> int:
                sem = asyncio.Semaphore(args.in_flight)

                async def one(p: str, s: int, e: int) -> int:
                    async with sem:
                        return len(await fs._cat_file(p, start=s, end=e))

                return sum(await asyncio.gather(*(one(*q) for q in reqs)))

            c0, t0 = _cpu(proc.pid), time.perf_counter()
            got = fs.loop and __import__("fsspec").asyn.sync(fs.loop, run)
            dt, dc = time.perf_counter() - t0, _cpu(proc.pid) - c0
            print(
                f"  {name:>40}: {len(reqs):>4} GETs in {dt:.2f} s = {len(reqs) / dt:7.1f} GET/s, "
                f"{got / dt / 1e6:7.1f} MB/s; server CPU {dc / len(reqs) * 1e3:6.1f} ms per GET"
            )
    finally:
        proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
