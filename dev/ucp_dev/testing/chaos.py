"""One-rank failures during a save or a load, and what every rank must do about them (``recipes/chaos.py``).

A *case* is a fresh gloo job of 2 or 4 ranks on two simulated hosts (``UCP_DCP_HOST``): it saves a
checkpoint (a sharded DTensor, two replicated 1.2 MiB tensors every rank needs, an object), breaks
one thing on one rank, and loads with ``read_once`` on (``"hosts"``) or ``"off"`` -- or, for a fault
at a step of a save (:data:`SAVE_STEPS`), saves again over it with other values. The faults:

* ``checksum``: a flipped byte in the file holding a replicated tensor (found by whichever rank reads it);
* ``missing``: the file holding the other replicated tensor removed;
* ``dtype``: the last rank's targets for both replicated tensors are fp16, and the saved values overflow;
* ``raise@STEP``, ``exit@STEP``, ``hang@STEP``: the last rank raises, dies (SIGKILL), or freezes
  (SIGSTOP) at a step of ``read_data`` (:data:`ucp_dcp.storage.reader.READ_STEPS`) or outside it,
  inside DCP's own collectives (:data:`ucp_dcp.planning.faults.CALL_STEPS`: a save's planning, the
  start and end of its writes, a load's planning), through the fault hook (:func:`ucp_dev.testing.faults.inject`). After a save that
  failed, the folder must still load, bitwise, as the checkpoint saved before it (``previous``).

A case passes when every rank that was not killed or stopped on purpose ends within the bound
(twice ``UCP_DCP_PEER_TIMEOUT_S`` plus slack) with an error of the cause's class,
the failing rank with its own error and every other rank with one naming a failing rank. A rank
without a result is a *hang*; a rank that died by a signal (SIGABRT: "terminate called without an
active exception") is an *abort*.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .processes import free_port

PG_TIMEOUT_S = 300.0
"""The job's collective timeout: far above the bound, so an end within the bound is not the PG's doing."""
SLACK_S = 10.0
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "ucp_dcp"]
_CTX = None
EXPECTED = {"checksum": "ChecksumError", "missing": "MissingFileError", "dtype": "DtypeConversionError"}
SAVE_STEPS = ("save-plan", "write", "written")
"""Steps of a save a fault can be injected at (the case saves twice; the second save fails)."""


@dataclass(frozen=True)
class Case:
    world: int
    fault: str
    """``checksum``, ``missing``, ``dtype``, or ``ACTION@STEP``."""
    read_once: str = "hosts"
    peer_timeout: float = 8.0
    rank: int | None = None
    """The failing rank (None: the last one); 0 is DCP's coordinator and the gates' watcher."""
    agent_store: bool = False
    """The job's store in the parent process, as torchrun's agent hosts it (default: in rank 0's process, a
    plain launch: rank 0's death takes the store with it, and a freeze of rank 0 would freeze it)."""

    @property
    def name(self) -> str:
        where = f" rank={self.faulty}" if self.rank is not None else ""
        store = " store=agent" if self.agent_store else ""
        return f"{self.fault} world={self.world} read_once={self.read_once}{where}{store}"

    @property
    def step(self) -> str:
        return self.fault.split("@")[1] if "@" in self.fault else ""

    @property
    def in_save(self) -> bool:
        return self.step in SAVE_STEPS

    @property
    def faulty(self) -> int:
        return self.world - 1 if self.rank is None else self.rank

    @property
    def action(self) -> str:
        return self.fault.split("@")[0] if "@" in self.fault else "raise"

    @property
    def expected(self) -> str:
        if self.fault == "none":
            return ""
        if "@" not in self.fault:
            return EXPECTED[self.fault]
        return "FaultInjected" if self.action == "raise" else "PeerLostError"

    @property
    def bound(self) -> float:
        # a rank lost inside a collective: its peers' gloo ops end after the peer timeout at most, the
        # watchers see its beat stand still for as long again at the next gate
        return 2 * self.peer_timeout + SLACK_S


def cases(worlds: tuple[int, ...] = (2, 4), modes: tuple[str, ...] = ("hosts", "off")) -> list[Case]:
    """Every fault at every step it applies to, for each world size and read-once mode (faults
    outside ``read_data`` once per world size: the read-once mode does not reach them)."""
    from ucp_dcp.storage.reader import READ_STEPS

    out = []
    for world in worlds:
        for mode in modes:
            faults = ["checksum", "missing", "dtype"] + [f"raise@{s}" for s in READ_STEPS]
            faults += ["exit@read", "exit@deliver", "hang@read"]
            for f in faults:
                if mode == "off" and f.split("@")[-1] in ("deliver", "group"):
                    continue  # nothing is received, no group is made: the step does not happen
                out.append(Case(world, f, mode))
        outside = [f"{a}@{s}" for s in (*SAVE_STEPS, "load-plan") for a in ("raise", "exit")]
        outside += ["hang@save-plan", "hang@load-plan"] if world == max(worlds) else []
        out += [Case(world, f, modes[0]) for f in outside]
    # the coordinator (rank 0): DCP's planner and committer, the gates' watcher; killed under a plain launch (its
    # process hosts the store), frozen under an agent's store (a frozen store host is the launcher's to end)
    world = max(worlds)
    coordinator = [("raise@save-plan", False), ("raise@read", False)]
    coordinator += [(f"exit@{s}", False) for s in ("save-plan", "written", "load-plan", "read")]
    coordinator += [(f"exit@{s}", True) for s in ("written", "read")]
    coordinator += [(f"hang@{s}", True) for s in ("save-plan", "written", "load-plan", "read")]
    out += [Case(world, f, modes[0], rank=0, agent_store=agent) for f, agent in coordinator]
    return out


@dataclass
class Outcome:
    case: Case
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    previous: str = ""
    """For a failed save: what the folder loads as afterwards (``previous``: the checkpoint saved before,
    bitwise; anything else is a problem)."""
    hangs: list[int] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return max((r["seconds"] for r in self.results.values()), default=0.0)

    @property
    def ok(self) -> bool:
        return not (self.hangs or self.aborts or self.problems)


# -- one rank -----------------------------------------------------------------------------------------------


def _full(world: int, seed: int = 0) -> dict[str, Any]:
    """The saved values, whole (``seed`` 1: the values of the second save of a save case)."""
    import torch

    w = torch.randn(world * 64, 256, generator=torch.Generator().manual_seed(seed))
    rep = torch.full((300_000,), 1e6 + seed)  # 1.2 MB >= SOLO: each a message of its own; overflows fp16
    return {"w": w, "a": rep, "b": rep + 1, "step": 7 + seed}


def _state(rank: int, world: int, fp16: bool, seed: int = 0) -> dict[str, Any]:
    """The saved state, or (``fp16``) a target whose replicated tensors cannot hold the saved values."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = _full(world, seed)
    full["w"] = _shard(full["w"], mesh, rank, world)
    if fp16:
        full["a"], full["b"] = full["a"].half(), full["b"].half()
    return full


def previous(case: Case, root: str) -> str:
    """What the folder of a failed save loads as, in this process (no process group): ``previous`` when
    it is the checkpoint saved before, bitwise."""
    import torch

    from ucp_dcp.api import load

    want = _full(case.world)
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
    try:
        load(got, root)
    except Exception as e:
        return f"the folder does not load: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    same = all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())
    return "previous" if same else f"the folder loads other values (step {got['step']})"


def _shard(w: Any, mesh: Any, rank: int, world: int) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    rows = w.shape[0] // world
    return DTensor.from_local(w[rank * rows : (rank + 1) * rows].clone(), mesh, [Shard(0)], run_check=False)


def _damage(root: str, fault: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = dcp.FileSystemReader(root).read_metadata()
    if fault == "checksum":
        info = md.storage_data[MetadataIndex("a", (0,))]
        p = os.path.join(root, info.relative_path)
        raw = bytearray(open(p, "rb").read())
        raw[info.offset + info.length - 4096] ^= 1  # inside the tensor bytes, not the zip header
        open(p, "wb").write(bytes(raw))
    elif fault == "missing":
        os.remove(os.path.join(root, md.storage_data[MetadataIndex("b", (0,))].relative_path))


def one_rank(case: Case, rank: int, root: str) -> dict[str, Any]:
    """This rank's part of ``case`` in an initialized process group: save, break, load; how the load
    ended (``error``: None or the class name, ``classes``, ``message``, ``peer``, ``seconds``)."""
    import torch.distributed as dist

    from ucp_dcp.api import load, save

    from .faults import inject

    os.environ["UCP_DCP_PEER_TIMEOUT_S"] = str(case.peer_timeout)
    os.environ["UCP_DCP_HOST"] = f"node{rank * 2 // case.world}"
    inject(None)
    save(_state(rank, case.world, False), root)
    dist.barrier()
    if rank == 0:
        _damage(root, case.fault)
    dist.barrier()
    if "@" in case.fault:
        inject(f"{case.faulty}:{case.step}:{case.action}")
    t0 = time.monotonic()
    try:
        if case.in_save:  # over the checkpoint just saved, with other values
            save(_state(rank, case.world, False, seed=1), root)
        else:
            load(
                _state(rank, case.world, case.fault == "dtype" and rank == case.faulty), root, read_once=case.read_once
            )
        return {"error": None, "seconds": time.monotonic() - t0}
    except Exception as e:
        return {
            "error": type(e).__name__,
            "classes": [c.__name__ for c in type(e).__mro__],
            "message": str(e).splitlines()[0][:300],
            "peer": getattr(e, "rank", None),
            "seconds": time.monotonic() - t0,
            "trace": traceback.format_exc() if os.environ.get("UCP_CHAOS_TRACE") else "",
        }


def _rank_main(case: Case, rank: int, port: int, root: str, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    report: dict[str, Any]
    try:
        timeout = timedelta(seconds=PG_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout) if case.agent_store else None
        dist.init_process_group("gloo", rank=rank, world_size=case.world, timeout=timeout, store=store)
        report = one_rank(case, rank, root)
    except BaseException as e:  # setup failed: reported as such
        report = {"error": "setup", "classes": [], "message": repr(e)[:300], "peer": None, "seconds": 0.0}
    results.put((rank, report))
    results.close()
    results.join_thread()
    time.sleep(PG_TIMEOUT_S)  # rank 0 hosts the store: stay until the parent ends the job, as a launcher would
    os._exit(0)  # no teardown: a peer may be dead, and the interpreter's exit may wait on gloo


# -- a case ---------------------------------------------------------------------------------------------------


def _ctx() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def run_case(case: Case, setup_s: float = 120.0) -> Outcome:
    """Run one case in fresh processes; judge every rank's end (see the module doc)."""
    ctx = _ctx()
    root = tempfile.mkdtemp(prefix="ucp-chaos-")
    results = ctx.Queue()
    port = free_port()
    agent = None
    if case.agent_store:  # the launcher's store, in this process: it outlives any rank
        import torch.distributed as dist

        agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=_rank_main, args=(case, r, port, root, results)) for r in range(case.world)]
    for p in procs:
        p.start()
    out = Outcome(case)
    stopped = case.faulty if case.action in ("exit", "hang") else None
    want = {r for r in range(case.world) if r != stopped}
    deadline = time.monotonic() + setup_s + case.bound
    try:
        while want - set(out.results) and time.monotonic() < deadline:
            try:
                rank, report = results.get(timeout=0.5)
                out.results[rank] = report
            except queue_mod.Empty:
                if any(procs[r].exitcode not in (None, 0) for r in want - set(out.results)):
                    time.sleep(1.0)  # its report may still be in the pipe
                    while not results.empty():
                        rank, report = results.get()
                        out.results[rank] = report
                    break
    finally:
        codes = [p.exitcode for p in procs]  # before the kill below: who died by itself
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        del agent  # the job is over: its store with it
        try:
            if case.in_save:
                out.previous = previous(case, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    for r in sorted(want - set(out.results)):
        code = codes[r]
        if code is not None and code < 0:
            out.aborts.append(r)
        else:
            out.hangs.append(r)
    _judge(out)
    return out


def judge(case: Case, results: dict[int, dict[str, Any]], previous: str = "") -> list[str]:
    """What is wrong with how the ranks of ``case`` ended (nothing: the case passes); ``previous``: for a
    save case, what :func:`previous` found."""
    out = Outcome(case, results, previous=previous)
    _judge(out)
    return out.problems


def _judge(out: Outcome) -> None:
    case = out.case
    for r, rep in sorted(out.results.items()):
        if rep["error"] is None:
            out.problems.append(f"rank {r} loaded without an error")
            continue
        if rep["error"] == "setup":
            out.problems.append(f"rank {r} failed before the load: {rep['message']}")
            continue
        if case.expected not in rep["classes"]:
            out.problems.append(f"rank {r} raised {rep['error']}, not a {case.expected}: {rep['message']}")
        if rep["seconds"] > case.bound:
            out.problems.append(f"rank {r} took {rep['seconds']:.1f} s (bound {case.bound:.0f} s)")
        peer = "PeerFailedError" in rep["classes"]
        if peer and f"rank {rep['peer']}" not in rep["message"]:
            out.problems.append(f"rank {r}'s peer error does not name the rank: {rep['message']}")
        if r == case.faulty and "@" in case.fault and case.action == "raise" and peer:
            out.problems.append(f"the failing rank {r} raised a peer's error: {rep['message']}")
        if case.action in ("exit", "hang") and rep["peer"] != case.faulty:
            out.problems.append(f"rank {r} does not name the lost rank {case.faulty}: {rep['message']}")
    if case.in_save and out.results and out.previous != "previous":
        out.problems.append(f"after the failed save: {out.previous or 'not checked'}")
    own = [r for r, rep in out.results.items() if rep["error"] and "PeerFailedError" not in rep.get("classes", [])]
    if case.action == "raise" and out.results and not own:
        out.problems.append("no rank raised the cause as its own error")
