"""``make memory-demo``: train, kill a simulated host, resume at a smaller layout from host memory.

    python recipes/memory_demo.py [--out runs/memory_demo] [--kill-during replication]

1. A 4-rank job (``dp=2,tp=2``) on two simulated hosts (``node0``: ranks 0-1, ``node1``: ranks 2-3)
   trains the toy model and saves into the memory tier every step (k = 1 replica, drained to
   ``OUT/durable``; a save does not wait for the previous generation's replication and drain), keeping an
   oracle of the logical state (no ucp_dcp code) at each save.
2. After the last save completes, host ``node1`` dies: its ranks are SIGKILLed and its memory store is
   gone (its folder removed); the survivors exit (the job has failed). With ``--kill-during
   replication`` node1's ranks are SIGKILLed while the last generation replicates instead (in the tier's
   background replication step): the survivors' replication fails, that generation stays incomplete,
   and the resume must load the one before it.
3. A 2-rank job (``tp=2``: a smaller, other layout) on ``node0`` and a fresh, empty ``node2`` locates
   the freshest complete generation, loads it from memory (node0's pieces and its replica of node1's;
   node2's rank gets every fragment from node0 over gloo; no durable read), checks it bitwise against
   the oracle and trains on.

The last line is ``MEMORY OK: ...`` or the script exits non-zero.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys

import torch
import torch.distributed as dist

STEPS = 3


def _phase(rank: int, world: int, port: int, name: str, out: str, kill: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q.put((rank, _train(rank, out, kill) if name == "train" else _resume(rank, out)))
    except BaseException as e:
        q.put((rank, f"error: {type(e).__name__}: {e}"))
        raise


def _die(*args: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # the host dies mid-replication, no goodbye


def _train(rank: int, out: str, kill: str) -> str:
    import ucp_dcp.memory.tier as tier_module
    from ucp_dcp.memory import MemoryTier
    from ucp_dcp.planning.save_planner import UCPSavePlanner
    from ucp_dev.toy import ModelConfig, Topology, build_job, build_trainer, logical_state, train_step, trainer_options

    os.environ["UCP_DCP_HOST"] = f"node{rank // 2}"
    cfg = ModelConfig()
    tr = build_trainer(cfg, build_job(Topology.parse("dp=2,tp=2")), seed=0)
    tier = MemoryTier(f"{out}/shm", durable=f"{out}/durable", replicas=1)
    oracles = []
    for i in range(STEPS):
        train_step(tr)
        oracles.append(logical_state(tr))
        if kill == "replication" and i == STEPS - 1 and os.environ["UCP_DCP_HOST"] == "node1":
            real, last = tier_module.replicate, tier.next_gen

            def replicate_or_die(g, *args, **kwargs):  # the one before may still replicate: it completes
                return _die() if g.gen == last else real(g, *args, **kwargs)

            tier_module.replicate = replicate_or_die  # type: ignore[assignment]
        # no wait: the next step trains while this generation completes (two generations in flight)
        gen = tier.save(tr.state_dict(), planner=UCPSavePlanner(**trainer_options(cfg, tr)), step=tr.step)
    status = tier.wait()  # only the survivors get past it when node1 dies replicating
    assert status is not None and status.gen == gen
    assert all(s.complete for s in tier.statuses[:-1]), tier.statuses
    if kill == "replication":
        assert not status.complete, status
        if rank == 0:
            torch.save(oracles[-2], f"{out}/oracle.pt")
        return f"generation {gen} incomplete after node1 died replicating it ({type(status.error).__name__})"
    assert status.complete, status
    if rank == 0:
        torch.save(oracles[-1], f"{out}/oracle.pt")
    blocked = tier.blocked_s
    dist.barrier()
    if os.environ["UCP_DCP_HOST"] == "node1":
        os.kill(os.getpid(), signal.SIGKILL)  # the host dies, no goodbye
    return f"saved generation {gen} at step {tr.step} (blocked {blocked * 1e3:.0f} ms for the host copy)"


def _resume(rank: int, out: str) -> str:
    from ucp_dcp.memory import load
    from ucp_dcp.planning.load_planner import UCPLoadPlanner
    from ucp_dev.testing.checks import state_diffs
    from ucp_dev.toy import ModelConfig, Topology, build_job, build_trainer, logical_state, train_step, trainer_options

    os.environ["UCP_DCP_HOST"] = ["node0", "node2"][rank]
    cfg = ModelConfig()
    tr = build_trainer(cfg, build_job(Topology.parse("tp=2")), seed=1)  # every value must come from memory
    sd = tr.state_dict()
    if rank == 0:  # no durable copy to fall back on: the load must come from memory
        os.rename(f"{out}/durable", f"{out}/durable.hidden")
    dist.barrier()
    try:
        src = load(sd, f"{out}/shm", durable=f"{out}/durable", planner=UCPLoadPlanner(**trainer_options(cfg, tr)))
    finally:
        dist.barrier()
        if rank == 0:
            os.rename(f"{out}/durable.hidden", f"{out}/durable")
    tr.load_state_dict(sd)
    loaded = logical_state(tr)
    diffs = state_diffs(torch.load(f"{out}/oracle.pt", weights_only=False), loaded)
    step = tr.step
    loss = train_step(tr)
    if diffs:
        raise SystemExit(f"loaded state differs from the oracle: {diffs[:5]}")
    return (
        f"resumed at tp=2 from {src.tier} generation {src.generation} (step {step}) after losing node1: "
        f"{len(loaded)} logical entries bitwise the oracle, {src.stats.bytes_received} bytes from peers on this rank, "
        f"next loss {loss:.4f}"
    )


def _spawn(world: int, name: str, out: str, died: set[int], kill: str = "after-commit") -> dict[int, str]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps = [ctx.Process(target=_phase, args=(r, world, port, name, out, kill, q)) for r in range(world)]
    for p in ps:
        p.start()
    got: dict[int, str] = {}
    while len(got) < world - len(died):
        r, msg = q.get(timeout=600)
        got[r] = msg
    for r, p in enumerate(ps):
        p.join(timeout=60)
        if r not in died and p.exitcode:
            sys.exit(f"rank {r} of the {name} job failed (exit {p.exitcode}): {got.get(r)}")
    bad = [m for m in got.values() if m.startswith("error")]
    if bad:
        sys.exit(bad[0])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/memory_demo")
    ap.add_argument(
        "--kill-during",
        choices=("after-commit", "replication"),
        default="after-commit",
        help="when node1 dies: after the last generation completed, or while it replicates",
    )
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    print("train at dp=2,tp=2 on node0 (ranks 0-1) and node1 (ranks 2-3), a memory save every step ...", flush=True)
    print("  " + _spawn(4, "train", out, died={2, 3}, kill=args.kill_during)[0], flush=True)
    shutil.rmtree(f"{out}/shm/host-node1")  # the host's memory died with it
    print(
        f"node1 killed {'during replication' if args.kill_during == 'replication' else 'after the last commit'} "
        "(its ranks SIGKILLed, its memory gone); resume at tp=2 on node0 + a fresh node2 ...",
        flush=True,
    )
    got = _spawn(2, "resume", out, died=set())
    print(f"  node2's rank: {got[1]}")
    print(f"MEMORY OK: {got[0]}")


if __name__ == "__main__":
    main()
